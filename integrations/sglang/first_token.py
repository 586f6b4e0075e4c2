"""The first token from prefill, streamed as soon as prefill's forward has sampled it.

Note [SGLang first token from prefill]: SGLang's prefill server streams a request's output
only once its KV transfer has finished (disaggregation/prefill.py,
`process_disagg_prefill_inflight_queue`), and decode's first token (the one prefill sampled,
which it receives in the metadata row) leaves decode after the transfer, decode's poll and a
scheduler turn. So a client's TTFT through SGLang's router is prefill's forward plus the
transfer's tail plus decode's turn. A router that asks for it (`pdc_first_token` in the
request's `sampling_params.custom_params`, as pdc's router, pdc/serving/sglang_router.py,
does) gets that token in prefill's stream right after the forward that sampled it: this AFTER
hook on `process_batch_result_disagg_prefill` streams each such request whose first output
token was just appended, on a prefill server of the pdc backend only. The router forwards it
to the client, then decode's stream from its second token on; decode's first token must equal
it (the router checks), so the tokens are the ones SGLang's own flow gives under any sampling.
The transfer, prefill's final (empty) chunk and decode are unchanged. Requests with logprobs
are left alone (their stream carries per-token logprobs the router would have to merge).
"""

from __future__ import annotations

HOOKED = ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
          "process_batch_result_disagg_prefill")
FLAG = "pdc_first_token"


def wants_first_token(req) -> bool:
    """Whether `req` asked for its first token from prefill and can have it streamed now."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    return (bool(params.get(FLAG)) and bool(getattr(req, "stream", False))
            and not getattr(req, "return_logprob", False) and len(req.output_ids) == 1
            and getattr(req, "send_token_offset", 0) == 0 and not req.finished())


def after_prefill_result(result, scheduler, batch, *args, **kwargs):
    """Stream the first token of every request of `batch` that asked for it."""
    if getattr(getattr(scheduler, "transfer_backend", None), "value", None) != "pdc":
        return None
    early = [req for req in batch.reqs if wants_first_token(req)]
    if early:
        scheduler.output_streamer.stream_output(early, False)
    return None


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOKED, after_prefill_result, HookType.AFTER)
