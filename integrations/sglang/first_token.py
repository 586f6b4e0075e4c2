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

Note [First token straight to the router]: SGLang's way out for a streamed token is three
processes (scheduler -> detokenizer -> the HTTP server's tokenizer manager), then the router;
on a busy prefill host each is a wake-up on a core shared with the next forwards and with
pdc's writes of the same request (BENCHMARKS.md (x), a steady load). pdc's router therefore
names a UDP socket of its own (`pdc_first_token_to`, "HOST:PORT") beside the flag, and the
hooks send the first token there as one datagram (room, the token id, the text SGLang's
detokenizer would stream for it, a meta_info with id, finish reason and token counts)
instead of streaming it; the request is marked so that it is not streamed again, and its
prefill stream then carries the token only with its end. A datagram that cannot leave (a bad
address, a full buffer) falls back to the streamer; one that is lost costs only time: the
client gets the token from prefill's or decode's stream, and decode's must equal it as
before. The knob sglang_first_token_direct=0 keeps SGLang's way out.
"""

from __future__ import annotations

import json
import socket

from pdc.runtime import knobs
from pdc.runtime.metrics import mark

_MIXIN = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
HOOKED = _MIXIN + "process_batch_result_disagg_prefill"
HOOKED_SEND = _MIXIN + "send_kv_chunk"
FLAG = "pdc_first_token"
FLAG_TO = "pdc_first_token_to"  # "HOST:PORT" of the router's token socket
_SENT = "_pdc_first_token_sent"  # set on a request whose token went to the router directly
PROMPT_CONTEXT = 5  # prompt tokens decoded before the first token (SGLang's detokenizer's)
_socks: dict[int, socket.socket] = {}  # by address family: the scheduler's one thread sends


def wants_first_token(req) -> bool:
    """Whether `req` asked for its first token from prefill and can have it streamed now."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    return (bool(params.get(FLAG)) and bool(getattr(req, "stream", False))
            and not getattr(req, "return_logprob", False) and len(req.output_ids) == 1
            and getattr(req, "send_token_offset", 0) == 0 and not req.finished()
            and not getattr(req, _SENT, False))


def first_text(tokenizer, req) -> str | None:
    """The text SGLang's detokenizer streams for `req`'s first token: the token decoded
    after the prompt's last PROMPT_CONTEXT tokens, less their own text, and only its
    printable part while it ends in an incomplete character. None without a tokenizer (a
    server that skips it streams ids only)."""
    if tokenizer is None:
        return None
    prompt = list(getattr(req, "origin_input_ids_unpadded", None) or req.origin_input_ids)
    context = prompt[max(len(prompt) - PROMPT_CONTEXT, 0):]
    sp = req.sampling_params
    kw = {"skip_special_tokens": getattr(sp, "skip_special_tokens", True),
          "spaces_between_special_tokens": getattr(sp, "spaces_between_special_tokens", True)}
    text = tokenizer.decode(context + [req.output_ids[0]], **kw)[
        len(tokenizer.decode(context, **kw)):]
    if text.endswith("\ufffd"):
        from sglang.utils import find_printable_text

        text = find_printable_text(text)
    return text


def send_direct(scheduler, req) -> bool:
    """Send `req`'s first token straight to the router's token socket (Note [First token
    straight to the router]) when the router gave one and the knob allows; False when it was
    not sent (the caller streams it through SGLang's way out instead)."""
    to = (req.sampling_params.custom_params or {}).get(FLAG_TO)
    if not to or not knobs.get("sglang_first_token_direct"):
        return False
    # One rank of a TP group talks to the detokenizer; the others' streamers send nothing.
    detok = getattr(getattr(scheduler, "output_streamer", None), "send_to_detokenizer", None)
    if detok is not None and getattr(detok, "socket", True) is None:
        return False
    try:
        host, port = str(to).rsplit(":", 1)
        msg = {"room": int(req.bootstrap_room), "output_ids": [int(req.output_ids[0])],
               "meta_info": {"id": req.rid, "finish_reason": None,
                             "prompt_tokens": len(req.origin_input_ids),
                             "completion_tokens": 1}}
        text = first_text(getattr(scheduler, "tokenizer", None), req)
        if text is not None:
            msg["text"] = text
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = _socks.get(family)
        if sock is None:
            sock = _socks[family] = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
        setattr(req, _SENT, True)
        sock.sendto(json.dumps(msg).encode(), (host.strip("[]"), int(port)))
    except Exception:  # noqa: BLE001 - a bad address, a full buffer, a tokenizer that fails:
        # never the scheduler's end; SGLang's own way out serves
        if getattr(req, _SENT, False):
            setattr(req, _SENT, False)
        return False
    return True


def _out(scheduler, reqs) -> None:
    """The first token of `reqs` on its way: straight to the router where it can, the rest
    through SGLang's output streamer; each stamped."""
    rest = [req for req in reqs if not send_direct(scheduler, req)]
    if rest:
        scheduler.output_streamer.stream_output(rest, False)
    _streamed(reqs)


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
        _out(scheduler, [req])
    return None


def after_prefill_result(result, scheduler, batch, *args, **kwargs):
    """Stream the first token of every request of `batch` that asked for it and has not
    had it yet."""
    if not _pdc_backend(scheduler):
        return None
    early = [req for req in batch.reqs if wants_first_token(req)]
    if early:
        _out(scheduler, early)
    return None


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOKED_SEND, before_send_kv_chunk, HookType.BEFORE)
    HookRegistry.register(HOOKED, after_prefill_result, HookType.AFTER)
