"""pdc as an SGLang disaggregation transfer backend: Manager, Sender, Receiver, bootstrap server.

SGLang's scheduler drives these through the `BaseKVManager` / `BaseKVSender` /
`BaseKVReceiver` contract of `sglang.srt.disaggregation.base.conn` (0.5.23); every byte and
every control message goes through pdc's runtime (`pdc.runtime.endpoints`): the family's plan
and registration check, bounds-checked indices, drain-acked aborts, heartbeats.

One `PdcKVManager` per scheduler process (one TP rank):
- prefill: one `PrefillEndpoint`, whose control endpoint is put into the bootstrap table that
  `PdcKVBootstrapServer` (pdc's table, bound on `--disaggregation-bootstrap-port`) holds. The
  scheduler processes start before the HTTP process that runs the table, so the endpoint
  opens on a background thread once the table answers; senders poll Bootstrapping until then.
- decode: one `DecodeEndpoint` per prefill server (bootstrap address), opened on a background
  thread the first time SGLang asks for that server's parallel info
  (`try_ensure_parallel_info`), which SGLang retries until it is ready. It registers under
  the decode server's instance name (`decode_instance`: advertised address and HTTP port), so
  that a prefill server serves many decode servers (xPyD) with no numbering to configure.

Note [SGLang plan]: prefill knows its own TP/PP/DP and page size from its server args (TP and
DP being SGLang's attention TP and attention-DP groups, Note [SGLang DP attention] in
family.py), and the decode side's from `PDC_SGLANG_DECODE` ("tp=N,dp=M", default: its own TP
and DP, PP 1); decode reads the prefill side off the bootstrap table (which ranks registered).
Both lower the same plan; when they disagree pdc's registration check rejects decode with
both digests, and the requests fail at bootstrap with that reason instead of writing wrong
bytes.

Note [SGLang decode prefix]: with `--disaggregation-decode-enable-radix-cache` SGLang's decode
matches the prompt against its own radix cache, allocates pages for the rest only, and hands
the receiver those pages with `decode_prefix_len` (tokens it holds, a whole number of pages).
pdc's DecodeReceiver wants one page id per absolute page position (Note [Prefix skip] in
pdc.runtime.layout_types): the receiver puts SGLang's padding page 0 (never a request's page:
its paged allocator hands out pages from 1, `mem_cache/allocator/paged.py`)
at the prefix positions, which no chunk writes. Prefill's scheduler asks the sender for the
prefix (`pop_decode_prefix_len`, once decode's request arrived), sends pages from there, and
counts `init()`'s pages from there: the sender adds the prefix pages to each chunk's position
and the prefix tokens to its sequence length.

Note [SGLang abort]: SGLang 0.5.23 holds a failed request's decode pages until the backend
says prefill's writes drained (`enable_deferred_decode_kv_release`,
`is_abort_release_safe(room, acks)`), or until its own timeout
(`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`). pdc answers from the
receiver's page state: REUSABLE once every prefill rank is quiet (Note [Failure semantics] in
pdc.runtime.endpoints). A request pdc QUARANTINED (a prefill rank could not confirm) is
counted and logged; SGLang's own timeout then frees the pages, which pdc cannot prevent.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from pdc.runtime import knobs
from pdc.runtime.control import (
    BootstrapServer,
    ControlError,
    HostSettings,
    bootstrap_call,
    fetch_table,
)
from pdc.runtime.cpus import on_endpoint_cpus, place_this_thread
from pdc.runtime.endpoints import DecodeEndpoint, PageState, PrefillEndpoint
from pdc.runtime.engines import make_engine
from pdc.runtime.engines.base import SharedRegistrations
from pdc.runtime.plan_types import RankId
from pdc.runtime.wire import KVPoll as PdcPoll
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from .family import (
    decode_instance,
    draft_model,
    engine_pools,
    make_plan,
    parallel_layout_of,
    served_family,
    side,
)
from .faults import apply as apply_faults
from .faults import apply_slot as apply_slot_fault
from .faults import apply_window as apply_window_fault
from .idle_wait import Signal
from .layerwise import SendsAhead
from .layerwise import setup as layerwise_setup
from .qsa import ring_slot, state_pages_error
from .regions import mamba_slot as _slot
from .settings import DECODE_ENV, bootstrap_host, bootstrap_zmq, engine_name, parse_side
from .swa import window_pages

logger = logging.getLogger(__name__)

OPEN_WAIT_S = 0.25  # try_ensure_parallel_info waits this long for an endpoint to open

# pdc's KVPoll is numbered in progress order, SGLang's puts Failed at 0: map by name.
_POLL = {s: getattr(KVPoll, s.name) for s in PdcPoll}


class PdcTransferError(Exception):
    """A request's transfer failed in pdc; the message is pdc's reason."""

    def __init__(self, room: int, reason: str):
        super().__init__(f"pdc: room {room}: {reason}")
        self.failure_reason = reason


def parallel_layout(server_args):
    """This scheduler's place in SGLang's parallel layout (Note [SGLang DP attention])."""
    from sglang.srt.runtime_context import get_parallel

    return parallel_layout_of(get_parallel(), server_args)


class _PrefillServerInfo:
    """What SGLang's decode scheduler reads about a prefill server (prefill_info_table)."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.follow_bootstrap_room = True


class PdcKVBootstrapServer(BaseKVBootstrapServer):
    """pdc's bootstrap table (ZeroMQ, JSON) on SGLang's bootstrap port."""

    def __init__(self, host: str, port: int):
        self.table = BootstrapServer(None, port=int(port))
        logger.info("pdc bootstrap table on %s", self.table.address)

    def close(self) -> None:
        self.table.close()


class PdcKVManager(BaseKVManager):
    enable_deferred_decode_kv_release = True  # Note [SGLang abort]
    supports_deferred_decode_kv_release = True
    supports_host_destination = False

    def __init__(self, args, disaggregation_mode: DisaggregationMode, server_args,
                 is_mla_backend: bool | None = False):
        self.kv_args = args
        self.mode = disaggregation_mode
        self.server_args = server_args
        # An MLA pool registers one latent buffer per layer instead of K and V: the served
        # family's spec says which (Note [SGLang KV buffers] in family.py).
        self.is_mla = bool(is_mla_backend)
        # Note [SGLang DP attention]: ranks within this scheduler's attention-DP group
        par = parallel_layout(server_args)
        self.tp, self.dp, self.dp_group = par.attn_tp, par.attn_dp, par.attn_dp_rank
        self.rank = RankId(0, par.attn_tp_rank)
        self.page_size = int(args.page_size)
        dtype = str(getattr(server_args, "dtype", "") or "")
        # Note [SGLang draft state] in family.py: a speculating server's draft model
        self.family = served_family(server_args.model_path, args, self.tp, self.rank.tp, dtype,
                                    draft_model(server_args, server_args.model_path, dtype))
        self.engine_name = engine_name()
        kwargs = {"hostname": bootstrap_host()} if self.engine_name == "mooncake" else {}
        # for the memory SGLang's buffers live in: host, or their GPU (Note [SGLang memory
        # kinds] in family.py); Mooncake moves a GPU's memory over TCP (its CUDA wheel)
        kwargs.update(self.family.engine_kwargs)
        # A decode server opens one endpoint per prefill server, each registering the same
        # KV and aux buffers: the engine registers them once (Mooncake refuses a second).
        with on_endpoint_cpus():  # Note [Endpoint CPUs]: the engine's threads start there
            self.engine = SharedRegistrations(make_engine(self.engine_name, **kwargs))
            # Decode opens its endpoint at the first request for a prefill server; the
            # engine's transport report (Mooncake: ~1 s) is asked now, at start, not then.
            self.engine.transport()
        self.lock = threading.Lock()
        self.prefill_info_table: dict[str, _PrefillServerInfo] = {}
        self.failures = 0
        self.quarantined = 0
        self.changed = Signal()  # a request's state changed (Note [SGLang idle wait])
        if self.mode == DisaggregationMode.PREFILL:
            decode = {"tp": self.tp, "pp": 1, "dp": self.dp}
            decode.update(parse_side(os.environ.get(DECODE_ENV, ""), DECODE_ENV))
            layout = self.family.layout
            self.plan = make_plan(self.family.family, side(self.tp, 1, self.dp, self.page_size),
                                  side(decode["tp"], decode["pp"], decode["dp"], self.page_size),
                                  self.engine_name)
            self.pools = engine_pools(layout, self.plan, "prefill", self.rank, args,
                                      self.family.kv_dtype)
            # Note [SGLang idle prefill rank]
            self.writes = bool(self.plan.links_from(self.rank))
            self.sent_ahead = self.swapped_pages = 0  # Note [SGLang per-layer sends]
            self.swapped: list = []  # Note [SGLang swapped pages]
            self.layerwise, self.layer_ids = layerwise_setup(self)
            self.endpoint: PrefillEndpoint | None = None
            self.endpoint_error = ""
            port = int(server_args.disaggregation_bootstrap_port)
            self.bootstrap = f"tcp://{bootstrap_host()}:{port}"
            threading.Thread(target=self._open_prefill, name="pdc-sglang-open",
                             daemon=True).start()
        else:
            self.endpoints: dict[str, DecodeEndpoint] = {}
            self.endpoint_errors: dict[str, str] = {}
            self.opening: dict[str, threading.Event] = {}  # set once open or failed
            self.generations: dict[int, int] = {}
            self.receivers: dict[int, PdcKVReceiver] = {}
            self.pools_by_plan: dict[str, object] = {}
        kv = next((c for c in self.family.layout.components if c.index == "page"), None)
        logger.info("pdc SGLang backend: %s %s rank %s, family %s (%s) bound to %d layers, "
                    "pages of %d tokens, KV %s, engine %s on %s, attention-DP group %d of %d",
                    self.mode.value, self.family.architecture, self.rank,
                    self.family.layout.family,
                    self.family.layout.spec_path, self.family.layout.num_layers,
                    self.family.layout.default_page_size, kv.dtype if kv else "-",
                    self.engine_name, self.family.device or "host memory", self.dp_group,
                    self.dp)

    # ~~~ prefill ~~~

    def _open_prefill(self) -> None:
        place_this_thread()  # Note [Endpoint CPUs]: the endpoint's threads start from here
        deadline = time.monotonic() + max(knobs.get("bootstrap_timeout_s"), 300.0)
        while True:
            try:
                bootstrap_call(self.bootstrap, {"op": "get"}, 2.0)
                break
            except ControlError as e:
                if time.monotonic() > deadline:
                    self.endpoint_error = f"the bootstrap table never answered: {e}"
                    logger.error("pdc: %s", self.endpoint_error)
                    return
        try:
            ep = PrefillEndpoint(self.family.layout, self.family.wire, self.plan, self.rank,
                                 self.dp_group, self.engine, self.pools, self.bootstrap)
        except Exception as e:  # noqa: BLE001 - every request then fails with this reason
            self.endpoint_error = f"the prefill endpoint did not open: {e}"
            logger.error("pdc: %s", self.endpoint_error)
            return
        ep.on_change = self.changed.set  # Note [State-change signal]
        with self.lock:
            self.endpoint = ep
        self.changed.set()  # senders waiting for the endpoint may attach now

    def register_to_bootstrap(self):
        """The prefill endpoint registers itself once the table answers (_open_prefill)."""

    # ~~~ decode ~~~

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """True once the decode endpoint for that prefill server is open (or failed: its
        requests then fail with the reason).

        SGLang asks again only a second later (decode.py `_ensure_retry_interval`), so a
        False costs every waiting request that second: the endpoint opens on a thread, and
        the first call waits up to OPEN_WAIT_S for it (tens of ms on the CPU box), so that
        the usual answer is True at once while an unreachable prefill server cannot hold
        SGLang's scheduler longer than that."""
        with self.lock:
            if bootstrap_addr in self.endpoints or bootstrap_addr in self.endpoint_errors:
                return True
            opened = self.opening.get(bootstrap_addr)
            if opened is None:
                opened = self.opening[bootstrap_addr] = threading.Event()
                threading.Thread(target=self._open_decode, args=(bootstrap_addr, opened),
                                 name="pdc-sglang-open", daemon=True).start()
        return opened.wait(OPEN_WAIT_S)

    def _open_decode(self, bootstrap_addr: str, opened: threading.Event) -> None:
        place_this_thread()  # Note [Endpoint CPUs]
        t_open = time.monotonic()
        addr = bootstrap_zmq(bootstrap_addr)
        layout = self.family.layout
        try:
            table = fetch_table(addr, knobs.get("bootstrap_timeout_s"))
            prefill_dp = 1 + max(dp for dp, _, _ in table)
            prefill = side(1 + max(tp for _, _, tp in table), 1 + max(pp for _, pp, _ in table),
                           prefill_dp, self.page_size)
            own = side(self.tp, 1, self.dp, self.page_size)
            plan = make_plan(self.family.family, prefill, own, self.engine_name)
            key = plan.digest()
            pools = self.pools_by_plan.get(key)
            if pools is None:
                pools = self.pools_by_plan[key] = engine_pools(
                    layout, plan, "decode", self.rank, self.kv_args, self.family.kv_dtype)
            # Each decode scheduler registers under its attention-DP group (Note [SGLang DP
            # attention]); prefill tells decode servers apart by this name (Note [Decode
            # instances] in pdc.runtime.endpoints.handshake).
            instance = decode_instance(HostSettings.from_knobs().advertise,
                                       self.server_args.port)
            ep = DecodeEndpoint(layout, self.family.wire, plan, self.rank, self.dp_group,
                                self.engine, pools, addr, instance=instance)
            ep.wait_ready()
            logger.info("pdc: decode endpoint for prefill server %s open in %.0f ms (prefill "
                        "ranks: %d; this decode instance: %s)", bootstrap_addr,
                        (time.monotonic() - t_open) * 1e3, len(ep.sources), instance)
        except Exception as e:  # noqa: BLE001 - the requests for that server fail with it
            with self.lock:
                self.endpoint_errors[bootstrap_addr] = f"cannot reach prefill server " \
                    f"{bootstrap_addr}: {e}"
                # SGLang reads the server's DP size from this table once we answer True;
                # without an entry it asks the bootstrap port over HTTP (which pdc's table
                # does not speak) and its requests hang instead of failing with the reason.
                self.prefill_info_table[bootstrap_addr] = _PrefillServerInfo(1)
                self.opening.pop(bootstrap_addr, None)
            opened.set()
            self.changed.set()
            logger.error("pdc: %s", self.endpoint_errors[bootstrap_addr])
            return
        with self.lock:
            self.endpoints[bootstrap_addr] = ep
            self.prefill_info_table[bootstrap_addr] = _PrefillServerInfo(prefill_dp)
            self.opening.pop(bootstrap_addr, None)
        ep.on_change = self.changed.set  # Note [State-change signal]
        opened.set()
        self.changed.set()  # receivers of that server may ask now

    def next_generation(self, room: int) -> int:
        with self.lock:
            g = self.generations[room] = self.generations.get(room, -1) + 1
            if len(self.generations) > 65536:  # bounded: rooms are random 63-bit ids
                self.generations.pop(next(iter(self.generations)))
            return g

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        rv = self.receivers.get(bootstrap_room)
        return rv is None or rv.pages_resolved()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self.receivers.pop(bootstrap_room, None)

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return False  # pdc checks its own link digests (knob `checksum`)


class PdcKVSender(SendsAhead, BaseKVSender):
    """Prefill's side of one request: SGLang's chunks become pdc chunks with absolute page
    positions (Note [Absolute page positions] in pdc.runtime.indices).

    Note [SGLang idle prefill rank]: SGLang's prefill scheduler moves a request on only when
    every TP rank's sender agrees (it all-reduces their polls to the least advanced state), but
    a plan may give a prefill rank nothing to write: with a replicated component only (the MLA
    latent and the aux row) at prefill TP 2 -> decode TP 1, one rank is the elected writer and
    the other has no link, so no decode rank ever asks it for the request and its sender would
    stay Bootstrapping. A rank without links therefore answers WaitingForInput until the last
    chunk and Success after it, and the elected rank's state decides (Failed is the least
    state, so its failure fails the request on every rank). It reads decode's prefix as 0: its
    sends are bookkeeping only, and SGLang uses the prefix for the pages to send, not for the
    forward."""

    def __init__(self, mgr: PdcKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.sender = None
        self.num_pages: int | None = None
        self.aux_index = -1
        self.pages_sent = 0
        self.page_list: list[int] = []  # every page sent, for the DSA page check
        self.tokens_sent = 0
        self.prefix_tokens = 0  # decode's prefix (Note [SGLang decode prefix])
        self.error = ""
        self.t_start = time.monotonic()
        self.idle = not mgr.writes  # Note [SGLang idle prefill rank]
        self.done = False
        self._attach()

    def _attach(self) -> bool:
        if self.sender is not None:
            return True
        if self.idle:
            if self.kv_mgr.endpoint_error:
                self.error = self.kv_mgr.endpoint_error
            return False
        ep = self.kv_mgr.endpoint
        if ep is None:
            if self.kv_mgr.endpoint_error:
                self.error = self.kv_mgr.endpoint_error
            return False
        try:
            self.sender = ep.sender(self.bootstrap_room)
        except ValueError as e:
            self.error = str(e)
            return False
        return True

    def pop_decode_prefix_len(self) -> int:
        """Tokens decode holds already; SGLang sends from there (Note [SGLang decode
        prefix]). Asked once, after poll() said WaitingForInput (decode's request arrived)."""
        if self.sender is None:
            return 0
        self.prefix_tokens = int(self.sender.decode_prefix_tokens)
        return self.prefix_tokens

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # The last chunk goes even without pages (decode's prefix may cover them all): it
        # carries the aux row and ends the request.
        return num_pages > 0 or last_chunk

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        self.num_pages = int(num_kv_indices)
        self.aux_index = -1 if aux_index is None else int(aux_index)

    def send(self, kv_indices, state_indices=None, num_kv_tokens: int | None = None, **_):
        if self.idle and not self.error:
            self.pages_sent += len(kv_indices)
            self.done = self.num_pages is not None and self.pages_sent >= self.num_pages
            return
        if self.error or not self._attach():
            self.error = self.error or "send() before the prefill endpoint opened"
            return
        pages = [int(x) for x in kv_indices]
        start = self.pages_sent
        self.pages_sent += len(pages)
        self.page_list += pages
        self.tokens_sent += int(num_kv_tokens or 0)
        types = getattr(self.kv_mgr.kv_args, "state_types", None)
        last = self.num_pages is not None and self.pages_sent == self.num_pages
        if self.num_pages is None:
            self.error = "send() before init(): SGLang gave no page count"
        elif self.pages_sent > self.num_pages:
            self.error = (f"SGLang sent pages {start}..{self.pages_sent - 1}, but init() said "
                          f"the request has {self.num_pages}")
        elif last:  # Notes [SGLang DSA indexer keys], [SGLang QSA state]
            self.error = state_pages_error(state_indices, types, self.page_list,
                                           self.prefix_tokens // self.kv_mgr.page_size)
        if self.error:
            self.sender.abort()
            return
        pages = apply_faults(self.bootstrap_room, pages, last)
        rest = self.match_ahead(pages)  # Note [SGLang per-layer sends]
        if not rest and not last:
            return
        prefix_pages = self.prefix_tokens // self.kv_mgr.page_size
        sent = self.hold(rest, prefix_pages + start + len(pages) - len(rest), last)
        if sent is None:
            return  # Note [SGLang held chunks]
        room = self.bootstrap_room
        slot, ring = (apply_slot_fault(room, _slot(state_indices, types)), apply_slot_fault(
            room, ring_slot(state_indices, types), "wrong_ring")) if last else (-1, -1)
        window = window_pages(state_indices, types) if last else None  # Note [SGLang SWA pools]
        self.sender.send(sent[0], sent[1], last,
                         self.prefix_tokens + self.tokens_sent, slot=slot, ring_slot=ring,
                         aux_row=self.aux_index if last else -1,
                         window_page_ids=apply_window_fault(room, window))

    def poll(self) -> KVPoll:
        if self.error:
            return KVPoll.Failed
        if self.idle:
            return KVPoll.Success if self.done else KVPoll.WaitingForInput
        if not self._attach():
            return KVPoll.Bootstrapping
        state = self.sender.poll()
        if state == PdcPoll.Failed and self.sender.reason:
            self.error = self.sender.reason
        return _POLL[state]

    def failure_exception(self):
        reason = self.error or (self.sender.reason if self.sender is not None else "") or \
            "failed"
        raise PdcTransferError(self.bootstrap_room, reason)

    def get_transfer_metric(self) -> KVTransferMetric:
        if self.sender is None:
            return KVTransferMetric()
        st = self.sender.stats
        latency = st.t_done - st.t_init if st.t_done and st.t_init else None
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=st.bytes)

    def abort(self):
        if self.sender is not None:
            self.sender.abort()
        self.error = self.error or "aborted by prefill"

    def clear(self):
        pass


class PdcKVReceiver(BaseKVReceiver):
    """Decode's side of one request."""

    require_staging = False

    def __init__(self, mgr: PdcKVManager, bootstrap_addr: str, bootstrap_room: int | None = None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.receiver = None
        self.error = ""
        self.conclude_state = None
        self.abort_notified = False
        self.bootstrap_infos: list = []
        self._released = False
        self.t_arrived = time.monotonic()  # the request reached decode (Note [Timeline stamps])

    def init(self, prefill_dp_rank: int):
        mgr = self.kv_mgr
        with mgr.lock:
            ep = mgr.endpoints.get(self.bootstrap_addr)
            err = mgr.endpoint_errors.get(self.bootstrap_addr, "")
        if ep is None:
            self.error = err or f"no pdc endpoint for prefill server {self.bootstrap_addr}"
            self.conclude_state = KVPoll.Failed
            return
        try:
            # Note [SGLang DP attention]: the prefill group SGLang resolved for this request
            # (the router's disagg_prefill_dp_rank, else room % prefill's DP size)
            self.receiver = ep.receiver(self.bootstrap_room,
                                        mgr.next_generation(self.bootstrap_room),
                                        prefill_dp_group=int(prefill_dp_rank),
                                        arrived=self.t_arrived)
        except ValueError as e:
            self.error = str(e)
            self.conclude_state = KVPoll.Failed
            return
        self.bootstrap_infos = sorted(ep.sources)
        mgr.receivers[self.bootstrap_room] = self

    def send_metadata(self, kv_indices, aux_index: int | None = None, state_indices=None,
                      decode_prefix_len: int | None = None,
                      destination=KVTransferDestination.DEVICE):
        if self.receiver is None:
            self.error = self.error or "send_metadata() before init()"
            return
        prefix = int(decode_prefix_len or 0)
        page_size = self.kv_mgr.page_size
        if prefix % page_size:
            self.error = (f"decode's prefix of {prefix} tokens is not a whole number of "
                          f"{page_size}-token pages (Note [SGLang decode prefix])")
            self.receiver.abort(wait=False)
            return
        types = getattr(self.kv_mgr.kv_args, "state_types", None)
        own = [int(x) for x in kv_indices]
        wrong = state_pages_error(state_indices, types, own, prefix // page_size)
        if wrong:  # Notes [SGLang DSA indexer keys], [SGLang QSA state]
            self.error = wrong
            self.receiver.abort(wait=False)
            return
        # Note [SGLang decode prefix]: page 0 at the positions decode holds already
        pages = [0] * (prefix // page_size) + own
        self.receiver.init(pages, prefix, slot=_slot(state_indices, types),
                           ring_slot=ring_slot(state_indices, types),
                           aux_row=-1 if aux_index is None else int(aux_index),
                           window_page_ids=window_pages(state_indices, types))

    def poll(self) -> KVPoll:
        if self.error:
            return KVPoll.Failed
        if self.receiver is None:
            return KVPoll.Bootstrapping
        state = self.receiver.poll()
        if state == PdcPoll.Bootstrapping:
            # The endpoint's handshake with every prefill rank is done (init() found it
            # open): SGLang may allocate and send the metadata now.
            return KVPoll.WaitingForInput
        return _POLL[state]

    def pages_resolved(self) -> bool:
        """May SGLang reuse this request's pages? Note [SGLang abort]."""
        if self.receiver is None:
            return True
        state = self.receiver.page_state
        if state == PageState.QUARANTINED and not self._released:
            self._released = True
            self.kv_mgr.quarantined += 1
            logger.warning("pdc: room %d: pages quarantined (a prefill rank did not confirm "
                           "its writes drained); SGLang frees them after its own timeout",
                           self.bootstrap_room)
        return state == PageState.REUSABLE

    def failure_exception(self):
        reason = self.error or (self.receiver.reason if self.receiver is not None else "") or \
            "failed"
        raise PdcTransferError(self.bootstrap_room, reason)

    def abort(self):
        self.abort_notified = True
        if self.receiver is not None:
            self.receiver.abort(wait=False)
        else:
            self.error = self.error or "aborted by decode"

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """A failed request already told every prefill rank that may still write to stop
        (Note [Failure semantics]); only an unfinished one needs the abort."""
        self.abort()

    def clear(self):
        if self.receiver is not None:
            self.receiver.release()
        if self.kv_mgr.receivers.get(self.bootstrap_room) is self:
            self.kv_mgr.receivers.pop(self.bootstrap_room, None)
