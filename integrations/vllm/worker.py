"""Worker side of PdcConnector: vLLM's cache tensors registered in place, pdc endpoints.

Note [vLLM cache layout]: vLLM's attention backends on CPU (and FlashAttention on GPU) keep
one tensor per attention layer, [num_blocks, 2, block_size, kv_heads * head_dim]: block b is
its K rows then its V rows, contiguous. The family spec describes that block as one item of
a component with the single tensor `kv` (specs/vllm-llama.yaml), so a block moves as one
descriptor and TP shards the heads inside both halves. `register_kv_caches` hands the
tensors to pdc's EnginePools (Note [Engine-owned memory]) which checks them against the plan
and refuses a mismatch naming the vLLM layer and the spec component.

Per-layer streaming: a request whose prompt completes in this step is queued as a streaming
chunk at the step's first `save_kv_layer` (Note [Sends at the first layer]); each
`save_kv_layer` reports its layer to pdc
(`layer_done`), whose transfer thread sends that layer's blocks while the forward goes on;
`wait_for_save` reports the forward done. On a GPU the layer's KV is only queued when the hook
runs, so the hook records a CUDA event on the forward's stream and pdc issues the layer's writes
once it completed, off the forward's thread (Note [Forward events] in events.py).

Note [vLLM hybrid cache]: under vLLM's hybrid KV cache manager (PdcConnector declares
SupportsHMA) a model with attention and state (GDN, Mamba) layers gets one KV cache group per
layer type, all drawing blocks from one pool: vLLM allocates one byte range per "layer
position" and lays layer i of every group over it, so attention layer 1 and GDN layer 0 view
the same bytes, and a block id names the same bytes in both groups (a live block belongs to
one group only). Attention layers get `[blocks, kv_heads, block_size, K|V * head_dim]`
tensors (one item per block, as in the spec's page component); a state layer gets an int8
`[blocks, 1, 1, state bytes]` view whose blocks are one attention page apart, holding its
states (conv, then SSM) packed from the block's start. The worker views each state in place
(`CacheGroups.state_views`, no copy) and registers it as the spec's slot component of that
layer, whose pitch is the page (Note [Item pitch]); EnginePools merges the overlapping views
into one region per storage range. A request's slot is its one block in the state group (with
prefix caching, the block its tokens end in: Note [Hybrid prefix caching] in scheduler.py);
with several state groups (3 GDN layers per attention layer) each state layer's slot is its
group's block (CacheGroups.layer_slots_of, Note [Layer slots] in runtime/indices.py).
Load failures go to vLLM as failed requests (`failed_recving`): with several groups block ids
are not unique, and vLLM refuses `invalid_block_ids`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch
from pdc.runtime import knobs
from pdc.runtime.cpus import on_endpoint_cpus
from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PageState, PrefillEndpoint
from pdc.runtime.engines import make_engine
from pdc.runtime.plan_types import RankId
from pdc.runtime.pools import EnginePools, RegistrationMismatch, engine_device
from vllm.model_executor.models.utils import extract_layer_index

from .events import ForwardEvents
from .groups import CacheGroups
from .links import DecodeLinks, SharedRegistrations
from .metadata import PdcConnectorMetadata, RecvReq
from .plans import make_plan, served_family
from .settings import PdcSettings
from .stats import PdcConnectorStats

LOG = logging.getLogger("pdc.vllm")
_TERMINAL = (KVPoll.Success, KVPoll.Failed)
DECODE_GAVE_UP = "aborted by decode"  # a prefill sender's reason when decode sent Abort

# What each finished request moved, by vLLM request id, for a driver that runs the engine in
# its own process (pdc.serving.vllm_engine reports it with the request's output). Bounded.
TRANSFERS: OrderedDict[str, dict] = OrderedDict()
_MAX_TRANSFERS = 4096


def _note(req_id: str, **info) -> None:
    TRANSFERS[req_id] = info
    while len(TRANSFERS) > _MAX_TRANSFERS:
        TRANSFERS.popitem(last=False)


class PdcWorker:
    def __init__(self, settings: PdcSettings, vllm_config, kv_cache_config=None):
        if settings.knobs:
            knobs.override(**settings.knobs)
        self.settings = settings
        self.groups = CacheGroups.of(kv_cache_config, vllm_config)
        self.block_size = self.groups.tokens_per_block(vllm_config)
        self.family = served_family(settings, vllm_config, self.block_size,
                                    self.groups.ssm_dtype)
        self.layout = self.family.layout
        self.wire = self.family  # the codec of its control messages
        par = vllm_config.parallel_config
        self.tp = par.tensor_parallel_size
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.rank = RankId(0, get_tensor_model_parallel_rank() if self.tp > 1 else 0)
        self.engine = None
        self.tensors: dict = {}
        self.prefill_ep: PrefillEndpoint | None = None
        self.links = DecodeLinks(self._open_link)  # decode: by prefill engine
        self.senders: dict[str, object] = {}  # req_id -> PrefillSender
        self.aborting: set[str] = set()
        self.receivers: dict[str, tuple] = {}  # req_id -> (receiver, RecvReq, t0)
        self.load_errors: set[int] = set()
        self.failed_requests: set[str] = set()  # hybrid: failed loads, by request
        self.failed_early: set[str] = set()  # load errors reported, blocks still pending
        self.sched_finished: set[str] = set()
        self.stats = PdcConnectorStats()
        self.events = ForwardEvents()  # for the cache's device, once registered
        self._streaming = False
        self._started_recv: PdcConnectorMetadata | None = None  # bind() started its loads
        self._queued: PdcConnectorMetadata | None = None  # the step whose sends are queued
        self._queued_ids: set[str] = set()  # and which of them
        self._lock = threading.Lock()

    # ~~~ registration ~~~

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        comps = [c for c in self.layout.components if c.index == "page"]
        slots = [c for c in self.layout.components if c.index == "slot"]
        others = len(self.layout.components) - len(comps) - len(slots)
        if self.groups.slot is None and (len(self.layout.components) != 1 or len(comps) != 1
                                         or comps[0].tensors != ("kv",)):
            raise RegistrationMismatch(
                f"{self.layout.spec_path}: error: family {self.layout.family!r} does not "
                f"describe vLLM's cache layout\n  hint: vLLM keeps one [blocks, 2, block_size, "
                f"heads * head_dim] tensor per layer: give the family one page component with "
                f"the single tensor 'kv' (Note [vLLM cache layout])")
        if self.groups.slot is not None and (len(comps) != 1 or comps[0].tensors != ("kv",)
                                             or others):
            raise RegistrationMismatch(
                f"{self.layout.spec_path}: error: family {self.layout.family!r} does not "
                f"describe vLLM's hybrid cache layout\n  hint: vLLM keeps attention blocks and "
                f"a state block per request: give the family one page component with the "
                f"single tensor 'kv' and one slot component per state of a state layer "
                f"(Note [vLLM hybrid cache])")
        comp = comps[0]
        self.names = {}
        for name, t in kv_caches.items():
            layer = extract_layer_index(name)
            self.names[layer] = name
            if name not in self.groups.states:
                self.tensors[(comp.name, "kv", layer)] = t
                continue
            views = self.groups.state_views(name, t)
            mine = [c for c in slots if layer in c.layer_ids]
            if len(mine) != len(views):
                raise self._state_mismatch(name, layer, views, mine, comp)
            for c, v in zip(mine, views, strict=True):
                self.tensors[(c.name, c.tensors[0], layer)] = v
        with on_endpoint_cpus():  # Note [Endpoint CPUs]: the engine's threads start there
            self.engine = make_engine(self.settings.engine,
                                      **engine_device(self.tensors, self.layout.spec_path))
        self.events = ForwardEvents.of(self.tensors)
        if not self.settings.is_prefill:  # one endpoint per prefill engine, one registration
            self.engine = SharedRegistrations(self.engine)
        # Decode opens its endpoint at the first request; the engine's transport report
        # (Mooncake: ~1 s) is asked now, at start, not then.
        self.engine.transport()
        peer = self.settings.peer_tp or self.tp
        prefill_tp, decode_tp = (self.tp, peer) if self.settings.is_prefill else (peer, self.tp)
        self.pools = self._pools(self._plan(prefill_tp, decode_tp))

    def _state_mismatch(self, name: str, layer: int, views, mine, page) -> RegistrationMismatch:
        """vLLM keeps states for layer `name` that the spec does not describe (a layer kind
        the served model contradicts, or a state too many or too few): both sides named."""
        states = ", ".join(f"{list(v.shape[1:])} {str(v.dtype).removeprefix('torch.')}"
                           for v in views)
        kind = dict(self.layout.kind_of).get(layer, "none")
        held = ", ".join(c.name for c in mine) or \
            ", ".join(c.name for c in self.layout.components if layer in c.layer_ids) or "none"
        what = "slot components" if mine else "components"
        loc = (mine or [page])[0].loc
        return RegistrationMismatch(
            f"{loc}: error: vLLM layer {name!r} keeps {len(views)} states ({states}); the "
            f"spec's layer {layer} is of kind {kind!r} with {what} {held}\n  hint: describe "
            f"each state of a state layer as a slot component, in vLLM's order (conv, then "
            f"SSM), or serve the model with a family that does (Note [vLLM hybrid cache])")

    def _plan(self, prefill_tp: int, decode_tp: int):
        return make_plan(self.family, prefill_tp, decode_tp, self.settings.engine,
                         self.settings.decode_engines)

    def _pools(self, plan) -> EnginePools:
        side = "prefill" if self.settings.is_prefill else "decode"
        return EnginePools(self.layout, plan.registration(side, self.rank), self.tp,
                           self.tensors, label=lambda key: f"vLLM layer {self.names[key[2]]!r} "
                                                           f"cache")

    # ~~~ per step ~~~

    def bind(self, meta: PdcConnectorMetadata) -> None:
        """Note [Loads before the forward]: vLLM binds a step's metadata before its forward
        and, when the step has no synchronous load, calls start_load_kv after it. On a GPU
        the forward is only launched by then; on a CPU it has run, so decode would ask
        prefill for a request's KV one whole forward (of the other requests) after its
        scheduler allocated the blocks. Decode therefore starts its loads here: a receiver's
        init() only queues a TransferRequest on the control thread."""
        if not self.settings.is_prefill:
            for r in meta.recv:
                self._start_recv(r)
            self._started_recv = meta

    def _queue_sends(self, meta: PdcConnectorMetadata, first_layer: bool) -> None:
        """Note [Sends at the first layer]: vLLM binds the step's metadata before the forward
        but (with no synchronous load) calls start_load_kv after it; the step's sends are
        queued at the first `save_kv_layer` instead, so each layer's writes may leave while
        the forward computes the next. Whichever comes first queues them, once a request.
        A request whose proxy asked for `pdc_send_at: "after_forward"` is queued at
        start_load_kv, after the forward, as before this Note: the switch that measures the
        two in one run (BENCHMARKS.md (o))."""
        if meta is not self._queued:
            self._queued, self._queued_ids = meta, set()
        if self.prefill_ep is None and meta.bootstrap:
            plan = self._plan(self.tp, self.settings.peer_tp or self.tp)
            with on_endpoint_cpus():
                self.prefill_ep = PrefillEndpoint(self.layout, self.wire, plan, self.rank, 0,
                                                  self.engine, self.pools, meta.bootstrap)
        for s in meta.send:
            if s.req_id in self._queued_ids or (first_layer and s.after_forward):
                continue
            self._queued_ids.add(s.req_id)
            sender = self.prefill_ep.sender(s.room)
            sender.send(list(s.block_ids), 0, True, s.seq_len, slot=s.slot, stream=True,
                        layer_slots=dict(s.layer_slots))
            self.senders[s.req_id] = sender
            self._streaming = True

    def start_load_kv(self, meta: PdcConnectorMetadata) -> None:
        if self.settings.is_prefill:
            self._queue_sends(meta, first_layer=False)
            for req_id in meta.abort:
                if req_id in self.senders:
                    self.senders[req_id].abort()
                    self.aborting.add(req_id)
            return
        if self._started_recv is not meta:  # bind() did (Note [Loads before the forward])
            for r in meta.recv:
                self._start_recv(r)
        for req_id in meta.abort:
            entry = self.receivers.get(req_id)
            if entry is not None:
                entry[0].abort(wait=False)
                self.aborting.add(req_id)
        for c in meta.cancel:
            if c.cached_tokens >= 0:  # Note [Hybrid prefix caching]: nothing to load
                _note(c.req_id, ok=True, bytes=0, descriptors=0, reason="",
                      prefix_tokens=c.cached_tokens, cached=True)
            try:
                rv = self.links.get(c.bootstrap, c.prefill_tp).receiver(c.room)
                rv.cancel()
                rv.release()
            except Exception as e:  # noqa: BLE001 - prefill then frees it at its room timeout
                LOG.warning("pdc: request %s: could not tell prefill at %s it was cancelled: "
                            "%s", c.req_id, c.bootstrap, e)

    def _start_recv(self, r: RecvReq) -> None:
        try:
            ep = self.links.get(r.bootstrap, r.prefill_tp)
            rv = ep.receiver(r.room, arrived=r.t_arrived)
            rv.init(list(r.block_ids), r.prefix_tokens, slot=r.slot,
                    layer_slots=dict(r.layer_slots))
        except Exception as e:  # noqa: BLE001 - a request that cannot start fails alone
            LOG.error("pdc: request %s cannot load from %s: %s", r.req_id, r.bootstrap, e)
            self._load_failed(r)
            self.receivers[r.req_id] = (None, r, time.monotonic())
            return
        self.receivers[r.req_id] = (rv, r, time.monotonic())

    def _open_link(self, bootstrap: str, prefill_tp: int) -> DecodeEndpoint:
        """This decode rank's endpoint to the prefill engine at `bootstrap`, registered as
        decode group `decode_index` (Note [Many engines] in links.py)."""
        plan = self._plan(prefill_tp, self.tp)
        pools = self._pools(plan) if prefill_tp != (self.settings.peer_tp or self.tp) else \
            self.pools
        with on_endpoint_cpus():
            ep = DecodeEndpoint(self.layout, self.wire, plan, self.rank,
                                self.settings.decode_index, self.engine, pools, bootstrap)
        try:
            ep.wait_ready(knobs.get("bootstrap_timeout_s"))
        except Exception:
            ep.close()
            raise
        return ep

    def _load_failed(self, r: RecvReq) -> None:
        """Note [Failed load]: blocks past decode's own prefix were not (all) written; they
        go to vLLM's load-error hook (get_block_ids_with_load_errors), and vLLM fails the
        request or recomputes them by its kv_load_failure_policy, never decodes from them.
        The hook is reported as soon as pdc says the load failed (a silent prefill: after
        peer_dead_after_s), but the request appears in finished_recving only once its blocks
        are safe to reuse (every prefill rank acked the abort, or abort_ack_timeout_s
        passed): until then vLLM keeps them, a failed request's blocks being freed only on
        finished_recving while it waits for remote KV."""
        if self.groups.slot is not None:
            self.failed_requests.add(r.req_id)  # Note [vLLM hybrid cache]
        else:
            first = r.prefix_tokens // self.block_size
            self.load_errors.update(r.block_ids[first:])
        self.stats.failed()

    def save_kv_layer(self, layer_name: str, meta: PdcConnectorMetadata | None = None) -> None:
        if meta is not None and self.settings.is_prefill:
            self._queue_sends(meta, first_layer=True)
        if self._streaming and self.prefill_ep is not None:
            self.prefill_ep.layer_done(extract_layer_index(layer_name),
                                       event=self.events.record())

    def wait_for_save(self) -> None:
        if self._streaming and self.prefill_ep is not None:
            self.prefill_ep.forward_done(event=self.events.record())
        self._streaming = False

    def get_finished(self, finished_req_ids: set[str]):
        self.sched_finished |= finished_req_ids
        if self.settings.is_prefill:
            sending = set()
            for req_id, sender in list(self.senders.items()):
                if req_id not in self.sched_finished:
                    continue
                state = sender.poll()
                if state not in _TERMINAL:
                    continue
                del self.senders[req_id]
                self.sched_finished.discard(req_id)
                self.aborting.discard(req_id)
                st = sender.stats
                _note(req_id, ok=state == KVPoll.Success, bytes=st.bytes,
                      descriptors=st.descriptors, reason=sender.reason)
                if state == KVPoll.Success:
                    self.stats.record(st.bytes, st.descriptors, st.batches, st.t_init, st.t_done)
                elif sender.reason == DECODE_GAVE_UP:
                    # decode's client went away, or its prefix cache held every token (Note
                    # [Hybrid prefix caching]): not a failed transfer
                    LOG.info("pdc: request %s: decode cancelled its load", req_id)
                elif req_id not in self.aborting:
                    LOG.warning("pdc: request %s: transfer failed: %s", req_id, sender.reason)
                    self.stats.failed()
                sending.add(req_id)
            return sending or None, None
        recving, freed = set(), set()
        for req_id, (rv, r, t0) in list(self.receivers.items()):
            if rv is None:
                del self.receivers[req_id]
                recving.add(req_id)
                _note(req_id, ok=False, bytes=0, reason="the load could not start")
                continue
            state = rv.poll()
            if state not in _TERMINAL:
                continue
            if state == KVPoll.Failed and rv.page_state == PageState.PENDING:
                # A prefill rank may still write: the blocks stay until it acked (or the ack
                # timed out), but vLLM learns of the failure now (Note [Failed load]).
                if req_id not in self.aborting and req_id not in self.failed_early:
                    LOG.error("pdc: request %s: load failed: %s", req_id, rv.reason)
                    self._load_failed(r)
                    self.failed_early.add(req_id)
                    _note(req_id, ok=False, bytes=rv.bytes, reason=rv.reason,
                          prefix_tokens=r.prefix_tokens, aborted=False)
                continue
            if req_id not in self.failed_early:
                _note(req_id, ok=state == KVPoll.Success, bytes=rv.bytes, reason=rv.reason,
                      descriptors=rv.descriptors, prefix_tokens=r.prefix_tokens,
                      aborted=req_id in self.aborting)
            if req_id in self.aborting:
                if req_id not in self.sched_finished:
                    continue
                self.aborting.discard(req_id)
                self.sched_finished.discard(req_id)
                freed.add(req_id)
            elif state == KVPoll.Success:
                self.stats.record(rv.bytes, rv.descriptors, 0, t0, time.monotonic())
                recving.add(req_id)
            elif req_id in self.failed_early:
                self.failed_early.discard(req_id)
                recving.add(req_id)  # reported failed already; now its blocks may go
            else:
                LOG.error("pdc: request %s: load failed: %s", req_id, rv.reason)
                self._load_failed(r)
                recving.add(req_id)
            if rv.page_state == PageState.QUARANTINED:
                LOG.error("pdc: request %s: blocks %s quarantined (a prefill rank never "
                          "acked the abort); vLLM will reuse them", req_id, list(r.block_ids))
            rv.release()
            del self.receivers[req_id]
        self.sched_finished -= recving
        self.links.sweep({r.bootstrap for _, r, _ in self.receivers.values()})
        return freed or None, recving or None

    def take_failed_requests(self) -> set[str]:
        out, self.failed_requests = self.failed_requests, set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def take_stats(self) -> PdcConnectorStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, PdcConnectorStats()
        return out

    def shutdown(self) -> None:
        if self.prefill_ep is not None:
            self.prefill_ep.close()
        self.links.close()
