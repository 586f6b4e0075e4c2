"""The first token from prefill, streamed as soon as prefill's forward has sampled it.

Note [SGLang first token from prefill]: SGLang's prefill server streams a request's output
only once its KV transfer has finished (disaggregation/prefill.py,
`process_disagg_prefill_inflight_queue`), and decode's first token (the one prefill sampled,
which it receives in the metadata row) leaves decode after the transfer, decode's poll and a
scheduler turn. So a client's TTFT through SGLang's router is prefill's forward plus the
transfer's tail plus decode's turn. A router that asks for it (`pdc_first_token` in the
request's `sampling_params.custom_params`, as pdc's router, pdc/serving/sglang_router.py,
does) gets that token in prefill's stream right after the forward that sampled it, on a
prefill server of the pdc backend only. A BEFORE hook on `send_kv_chunk` streams it as the
last chunk is handed to pdc, before the chunk wakes pdc's transfer worker: queued after it,
the token's way out (scheduler -> detokenizer -> HTTP) waited for the GIL and the core that
the worker's descriptor building and writes then held. The AFTER hook on
`process_batch_result_disagg_prefill` streams every other such request whose first output
token was just appended (one whose decode had not asked yet under SGLang's optimistic
prefill: its last chunk is sent later), and with the knob sglang_first_token_early=0 every
one, as before 2026-12-05. The router forwards it
to the client, then decode's stream from its second token on; decode's first token must equal
it (the router checks), so the tokens are the ones SGLang's own flow gives under any sampling.
The transfer, prefill's final (empty) chunk and decode are unchanged. Requests with logprobs
are left alone (their stream carries per-token logprobs the router would have to merge). With
the transfer_log knob on, each streamed token is stamped (`token_out`), and the router stamps
the request's arrival and the token's way on (Note [Timeline stamps]): the demos' timelines
then say where a first token's time goes after the forward.
"""

from __future__ import annotations

from pdc.runtime import knobs
from pdc.runtime.metrics import mark

_MIXIN = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
HOOKED = _MIXIN + "process_batch_result_disagg_prefill"
HOOKED_SEND = _MIXIN + "send_kv_chunk"
FLAG = "pdc_first_token"


def wants_first_token(req) -> bool:
    """Whether `req` asked for its first token from prefill and can have it streamed now."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    return (bool(params.get(FLAG)) and bool(getattr(req, "stream", False))
            and not getattr(req, "return_logprob", False) and len(req.output_ids) == 1
            and getattr(req, "send_token_offset", 0) == 0 and not req.finished())


def _streamed(reqs) -> None:
    """The timeline's stamp that prefill's scheduler streamed these requests' first token
    (`token_out`, Note [Timeline stamps]; generation 0: the rooms of pdc's router are fresh
    random ids, each used once)."""
    if knobs.get("transfer_log"):
        for req in reqs:
            room = getattr(req, "bootstrap_room", None)
            if room is not None:
                mark("token_out", "prefill", int(room))


def _pdc_backend(scheduler) -> bool:
    return getattr(getattr(scheduler, "transfer_backend", None), "value", None) == "pdc"


def before_send_kv_chunk(scheduler, req, last_chunk: bool = False, *args, **kwargs):
    """Stream `req`'s first token before its last chunk goes to pdc, if it asked."""
    if last_chunk and _pdc_backend(scheduler) and wants_first_token(req) and \
            knobs.get("sglang_first_token_early"):
        scheduler.output_streamer.stream_output([req], False)
        _streamed([req])
    return None


def after_prefill_result(result, scheduler, batch, *args, **kwargs):
    """Stream the first token of every request of `batch` that asked for it and has not
    had it yet."""
    if not _pdc_backend(scheduler):
        return None
    early = [req for req in batch.reqs if wants_first_token(req)]
    if early:
        scheduler.output_streamer.stream_output(early, False)
        _streamed(early)
    return None


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOKED_SEND, before_send_kv_chunk, HookType.BEFORE)
    HookRegistry.register(HOOKED, after_prefill_result, HookType.AFTER)
