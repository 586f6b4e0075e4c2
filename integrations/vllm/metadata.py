"""What the scheduler-side connector tells the worker-side connector each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class SendReq:
    """Prefill: the request's prompt is complete after this step's forward; send its blocks."""

    req_id: str
    room: int
    block_ids: tuple[int, ...]  # every block of the prompt, absolute positions 0..
    seq_len: int  # prompt tokens
    slot: int = -1  # the state group's block (hybrid families), else -1
    # Note [Sends at the first layer] (worker.py): queue the sends after the forward
    # instead (`pdc_send_at: "after_forward"` in kv_transfer_params), to measure the two
    after_forward: bool = False
    # with several state groups: (state layer id, its group's block); Note [Layer slots]
    layer_slots: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class RecvReq:
    """Decode: load the prompt into these blocks; the first `prefix_tokens` are cached here."""

    req_id: str
    room: int
    block_ids: tuple[int, ...]  # every block of the prompt, absolute positions 0..
    prefix_tokens: int  # decode's own prefix-cache hit: prefill sends nothing for them
    bootstrap: str  # the prefill engine's bootstrap service
    prefill_tp: int
    slot: int = -1  # the state group's block (hybrid families), else -1
    layer_slots: tuple[tuple[int, int], ...] = ()  # as SendReq.layer_slots
    # the scheduler first saw the request (Note [Timeline stamps]); a stamp, not an identity
    t_arrived: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class CancelReq:
    """Decode: a request that ended before its load started, or one whose prefix hit holds
    every token prefill sends (Note [Hybrid prefix caching]); prefill may hold its KV."""

    req_id: str
    room: int
    bootstrap: str
    prefill_tp: int
    cached_tokens: int = -1  # decode's hit when it holds every sent token, else -1


@dataclass
class PdcConnectorMetadata(KVConnectorMetadata):
    bootstrap: str = ""  # prefill: this engine's bootstrap service
    send: list[SendReq] = field(default_factory=list)
    recv: list[RecvReq] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)  # requests whose transfer must end now
    cancel: list[CancelReq] = field(default_factory=list)  # decode: tell prefill, no blocks
