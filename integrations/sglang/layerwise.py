"""Per-layer sends inside SGLang's prefill forward ("lever A") and the cached-prefix early send
("lever B"), through two HookRegistry hooks; no SGLang file changes.

Note [SGLang per-layer sends]: SGLang's prefill scheduler hands a request's pages to the
backend after the forward (`send_kv_chunk` in process_batch_result or, for a chunk that is
not the last, before the next batch), so the transfer follows the whole forward. With the
knob `sglang_layer_send` on, an AROUND hook on `Scheduler.run_batch` queues, before the
forward, the pages that the forward completes for each request of the batch as a pdc
streaming chunk (`PrefillSender.send(stream=True)`, never the last chunk), and an AFTER hook
on `RadixAttention.forward` reports each attention layer to the endpoint (`layer_done`): pdc's
transfer thread sends that layer's pages while the forward computes the next layers. The hook
reports the forward done when `run_batch` returns. With `sglang_cached_send` on, the pages of
the batch's requests that are final before the forward (prefill's radix-cache hit, and earlier
chunks of a chunked request) go first, as a complete chunk (Note [Cached-prefix early send] in
pdc.runtime.endpoints.prefill).

The pages are computed as `send_kv_chunk` will compute them (req_to_token rows, the
allocator's translation, `kv_to_page_indices`; a chunk that is not the request's last ends on
a page boundary, its partial page going with the next chunk), and the sender remembers them
(`PdcKVSender.ahead`). When SGLang then calls `send()` with its pages, the sender checks that
they start with the remembered ones, sends only what is past them, and always sends the last
chunk itself: the aux row (the first output token, sampled after the forward) and the request
state go with it as before; pages SGLang swapped meanwhile: Note [SGLang swapped pages].

On a GPU a hook runs when the forward's thread has queued the layer's kernels, not when they
ran: the hook records a CUDA event on the current (forward) stream and the endpoint issues
the layer's writes once it completed (Note [Forward events] of the vLLM integration); the
forward-done and early-send events are recorded on the scheduler's forward stream, so under
the overlap scheduler an early send of an earlier chunk waits for the forward still writing
it.

Note [SGLang swapped pages]: SGLang may name other pages for tokens after the forward than
before it: inserting a request into the radix cache, it keeps the cache's own pages for tokens
the cache already held (the last page of a prompt whose cached prefix stopped one token short
of its end, or a prefix another request inserted meanwhile), points the request's row at them
and frees the pages the forward wrote. Those hold the same tokens' KV, written by this
request's own forward: the sender keeps what it sent (a position is written once, Note [Exact
page coverage]), and since a freed page may be handed to the next forward while its writes are
still reading it, the next `run_batch` first waits until those writes completed
(`drain_swapped`). Prefill writes KV pages only in a forward, so that wait closes the window.

Where it applies (otherwise the request takes the after-forward path, logged once at start):
families whose KV is paged only (no request state: MHA, MLA), no speculative decoding (a draft
forward reuses layer ids), no two-batch overlap (a layer runs twice per forward), a prefill
rank with links (Note [SGLang idle prefill rank]), and a request past its bootstrap (SGLang's
`finalize_bootstrap` set where its sends start) with no test fault planned for its room.
"""

from __future__ import annotations

import logging
import time

from pdc.runtime import knobs

logger = logging.getLogger(__name__)

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
ATTENTION = "sglang.srt.layers.radix_attention.RadixAttention.forward"

_live = None  # the _Forward of the run_batch in progress on this process, if it streams


class _Forward:
    """One run_batch that queued streaming chunks: the layers to report and how."""

    def __init__(self, ep, layers: frozenset, cuda: bool, stream):
        self.ep = ep
        self.layers = layers
        self.cuda = cuda
        self.stream = stream  # the scheduler's forward stream (CUDA), or None
        self.reported: set[int] = set()

    def event(self, stream=None):
        if not self.cuda:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream())
        return ev


def eligibility(mgr) -> str:
    """Why per-layer sends stay off for this prefill scheduler ("" when they apply)."""
    if not mgr.writes:
        return "this prefill rank writes nothing (Note [SGLang idle prefill rank])"
    if getattr(mgr.kv_args, "state_types", None):
        return "the model keeps request state beside its pages (hybrid, DSA, SWA families)"
    sa = mgr.server_args
    if getattr(sa, "speculative_algorithm", None):
        return "the server speculates (the draft forward reuses layer ids)"
    if getattr(sa, "enable_two_batch_overlap", False):
        return "two-batch overlap runs each layer twice per forward"
    return ""


def page_layers(layout) -> frozenset:
    """The layer ids of the family's page components that are not the draft's."""
    draft = set(layout.draft_ids)
    return frozenset(i for c in layout.components if c.index == "page"
                     for i in c.layer_ids if i not in draft)


def around_run_batch(original, sched, batch, *args, **kwargs):
    global _live
    fwd = None
    mgr = getattr(getattr(sched, "disagg_prefill_bootstrap_queue", None), "kv_manager", None)
    if getattr(mgr, "swapped", None):
        drain_swapped(mgr)
    try:
        fwd = _begin(sched, batch)
    except Exception:  # noqa: BLE001 - the batch's other pages take the after-forward path
        logger.exception("pdc: per-layer sends: queueing the batch's pages failed")
        if getattr(mgr, "endpoint", None) is not None:  # what was queued ends with the forward
            cuda = str(mgr.family.device or "").startswith("cuda")
            fwd = _Forward(mgr.endpoint, frozenset(), cuda, getattr(sched, "forward_stream",
                                                                    None) if cuda else None)
    if fwd is None:
        return original(sched, batch, *args, **kwargs)
    _live = fwd
    try:
        return original(sched, batch, *args, **kwargs)
    finally:
        _live = None
        fwd.ep.forward_done(event=fwd.event(fwd.stream))


def after_attention(result, attn, *args, **kwargs):
    fwd = _live
    if fwd is not None:
        layer = getattr(attn, "layer_id", None)
        if layer in fwd.layers and layer not in fwd.reported:
            fwd.reported.add(layer)
            fwd.ep.layer_done(layer, event=fwd.event())
    return None


def _begin(sched, batch):
    """Queue the batch's pages ahead of SGLang's sends; a _Forward when any streams."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if getattr(sched, "disaggregation_mode", None) != DisaggregationMode.PREFILL or \
            not batch.forward_mode.is_extend():
        return None
    queue = getattr(sched, "disagg_prefill_bootstrap_queue", None)
    mgr = getattr(queue, "kv_manager", None)
    layerwise = getattr(mgr, "layerwise", None)
    if layerwise is None or mgr.endpoint is None:
        return None
    lever_a, lever_b = layerwise
    if not (lever_a or lever_b):
        return None
    from .faults import planned as planned_faults

    page = sched.token_to_kv_pool_allocator.page_size
    allocator = sched.token_to_kv_pool_allocator
    rows = sched.req_to_token_pool.req_to_token
    cuda = str(mgr.family.device or "").startswith("cuda")
    stream = getattr(sched, "forward_stream", None) if cuda else None
    fwd = _Forward(mgr.endpoint, mgr.layer_ids, cuda, stream)
    # a HiCache load-back of this batch may still write pages it matched (SGLang's own
    # early send skips such a batch too)
    loading = getattr(batch, "hicache_consumer_index", -1) >= 0
    planned = planned_faults()
    streams = False
    for req in batch.reqs:
        s = req.disagg_kv_sender
        if not getattr(s, "can_send_ahead", lambda: False)() or s.bootstrap_room in planned \
                or getattr(req, "pending_bootstrap", False):
            continue
        input_len = len(req.origin_input_ids)
        start = max(int(req.start_send_idx), s.queued_until)
        end = min(int(req.extend_end), input_len)
        if req.extend_end < input_len:  # not the last chunk: whole pages only
            end -= end % page
        if end <= start:
            continue
        cached = start
        if lever_b and not loading:
            final = int(req.prefix_len) - int(getattr(req, "host_hit_length", 0) or 0)
            cached = min(max(start, final - final % page), end)

        row = rows[req.kv.req_pool_idx]
        if cached > start:
            s.send_ahead(_pages(allocator, row, start, cached, page), start, cached,
                         stream=cuda)
            if cuda:  # written by an earlier forward that may still run on the stream
                fwd.ep.forward_done(event=fwd.event(stream))
        if end > cached and lever_a:
            s.send_ahead(_pages(allocator, row, cached, end, page), cached, end, stream=True)
            streams = True
    return fwd if streams else None


def _pages(allocator, row, start: int, end: int, page: int) -> list[int]:
    """The page ids of tokens start..end as send_kv_chunk computes them."""
    from sglang.srt.mem_cache.common import kv_to_page_indices

    idx = allocator.translate_kv_indices_for_transfer(row[start:end])
    return [int(x) for x in kv_to_page_indices(idx, page)]


class SendsAhead:
    """PdcKVSender's side of Note [SGLang per-layer sends]: the pages it queued before
    SGLang's send, and where they end (tokens); and of Note [SGLang held chunks]: the pages it
    keeps until the last chunk."""

    ahead: tuple[int, ...] = ()
    queued_until = 0
    held: tuple[int, ...] = ()  # Note [SGLang held chunks]
    held_from = 0  # the first held page's position in the request

    def can_send_ahead(self) -> bool:
        """Past bootstrap (init() gave the page count), attached, not failed, writing."""
        return self.sender is not None and self.num_pages is not None and not self.error \
            and not self.idle

    def send_ahead(self, pages: list[int], start: int, end: int, stream: bool) -> None:
        """Queue tokens start..end (start on a page boundary) before SGLang sends them."""
        self.sender.send(pages, start // self.kv_mgr.page_size, False, end, stream=stream)
        self.ahead += tuple(pages)
        self.queued_until = end
        self.kv_mgr.sent_ahead += len(pages)

    def hold(self, pages: list[int], first: int, last: bool) -> tuple[list[int], int] | None:
        """Note [SGLang held chunks]: SGLang hands prefill's backend each chunk of a chunked
        request once its forward ends, and pdc's side of that chunk's transfer (the transfer
        worker, the engine's threads) then computes while the next chunks' forwards do. Where
        they share the server's cores (a CPU host, or the engine's TCP threads beside the
        scheduler) every chunk's transfer lengthens the rest of the prefill, and with the
        first token from prefill (Note [SGLang first token from prefill]) the client's first
        token too. With the knob sglang_hold_chunks on, a chunk that is not the last is kept
        here, and the last chunk goes with every kept page (positions from the first kept
        one: the chunks are consecutive); the first token still goes before the transfer
        wakes. The transfer then follows the whole forward, as for an unchunked request.
        "auto" (the default) holds where the KV cache is in host memory: there the forward
        computes on the cores the writes use, and each chunk's writes cost the server a
        batch's fixed work (the transfer worker, the engine's status call that spins while
        the batch is written). Measured on the 2-core box under a steady load at 4 in flight
        (BENCHMARKS.md (x)): SGLang's own transfer metric 30-44 -> 9-10 ms a request, TTFT
        p50 130 -> 88 ms behind SGLang's router. On a GPU the forward does not compute on
        those cores, and a long prompt's transfer overlaps its later chunks' forwards
        instead of following them, so "auto" sends each chunk there.
        Per-layer and cached-prefix sends (the knobs sglang_layer_send, sglang_cached_send)
        send pages before SGLang does and are left as they are, and so are families with
        request state beside their pages (hybrid, DSA, SWA: SGLang may free a sliding
        window's pages before the last chunk). Returns None while holding, else the pages to
        send and the first one's position."""
        hold = str(knobs.get("sglang_hold_chunks"))
        if hold == "auto":
            hold = "0" if self.kv_mgr.family.device else "1"  # on a GPU / in host memory
        if hold == "0" or knobs.get("sglang_layer_send") or \
                knobs.get("sglang_cached_send") or \
                getattr(self.kv_mgr.kv_args, "state_types", None):
            return pages, first
        if not last:
            if not self.held:
                self.held_from = first
            self.held += tuple(pages)
            return None
        if not self.held:
            return pages, first
        pages, first, self.held = list(self.held) + pages, self.held_from, ()
        return pages, first

    def match_ahead(self, pages: list[int]) -> list[int]:
        """SGLang's pages past those sent ahead (Note [SGLang swapped pages])."""
        n = min(len(pages), len(self.ahead))
        if tuple(pages[:n]) != self.ahead[:n]:
            mgr = self.kv_mgr
            mgr.swapped_pages += sum(a != b for a, b in zip(pages[:n], self.ahead, strict=False))
            mgr.swapped.append(self.sender)
        self.ahead = self.ahead[n:]
        return pages[n:]


def drain_swapped(mgr) -> None:
    """Note [SGLang swapped pages]: before a forward that may write a page SGLang freed,
    wait until the writes that read it completed (bounded: transfer_timeout_s, then the
    request is aborted)."""
    deadline = time.monotonic() + knobs.get("transfer_timeout_s")
    while mgr.swapped:
        sender = mgr.swapped[0]
        if not sender.writes_pending():
            mgr.swapped.pop(0)
        elif time.monotonic() > deadline:
            logger.error("pdc: room %d: writes of pages SGLang freed still pending after %.0f "
                         "s; aborting it", sender.room, knobs.get("transfer_timeout_s"))
            sender.abort()
            mgr.swapped.pop(0)
        else:
            time.sleep(knobs.get("poll_sleep_s"))


def register_hooks() -> None:
    """Called by the plugin's register() only in a process whose knobs turn a lever on: the
    attention hook would otherwise cost every server a call per layer and forward."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RUN_BATCH, around_run_batch, HookType.AROUND)
    HookRegistry.register(ATTENTION, after_attention, HookType.AFTER)


def setup(mgr) -> tuple[tuple[bool, bool] | None, frozenset]:
    """A prefill manager's (per-layer sends, cached-prefix early send) as the knobs say, None
    when they do not apply (logged with the reason), and the layer ids to report."""
    want = bool(knobs.get("sglang_layer_send")), bool(knobs.get("sglang_cached_send"))
    if not any(want):
        return None, frozenset()
    why = eligibility(mgr)
    if why:
        logger.info("pdc: per-layer and early sends off: %s", why)
        return None, frozenset()
    logger.info("pdc: per-layer sends %s, cached-prefix early send %s",
                *("on" if w else "off" for w in want))
    return want, page_layers(mgr.family.layout)
