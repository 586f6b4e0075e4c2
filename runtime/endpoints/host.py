"""What the parts of an endpoint see of it (Note [Typed mixins] in __init__.py): `PrefillHost`
is PrefillEndpoint's state and the methods one of its parts calls on another, `DecodeHost`
the same of DecodeEndpoint. Only the type checker reads this module: each part names its host
as its base under TYPE_CHECKING and has `object` as its base when it runs."""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from .. import staging
from .. import wire as W
from ..datapath import LocalBuffer
from ..engines.base import TransferEngine
from ..hub import Hub
from ..indices import DecodeTarget
from ..layout_types import ComponentLayout, FamilyLayout
from ..metrics import RecordBuffer, TransferMetrics
from ..plan_types import Link, Plan, RankId
from ..pools import RankPools
from .common import REG_ROOM, KVPoll, PageState
from .faults import Faults
from .liveness_model import Liveness
from .records import _Chunk, _Final, _Peer, _Recv, _Room, _Staged, _Target


class PrefillHost:
    """PrefillEndpoint as its parts (handshake, control, liveness, worker, staging) use it.
    The attributes are set in PrefillEndpoint.__init__ (prefill.py), whose comments say what
    each holds."""

    faults: Faults
    metrics: TransferMetrics | RecordBuffer | None
    rank_label: str
    layout: FamilyLayout
    wire: ModuleType  # the family's generated wire module
    plan: Plan
    digest: bytes
    rank: RankId
    engine: TransferEngine
    pools: RankPools
    page_size: int
    _has_pages: bool
    _slot_valued: list[ComponentLayout]
    links: dict[RankId, Link]
    local: dict[str, list[LocalBuffer]]
    arena: staging.Arena | None
    launches: staging.Launches | None
    lock: threading.Lock
    rooms: dict[int, _Room]
    finished: OrderedDict[int, _Final]
    _all_ids: set[int]
    _waiting_events: list
    peers: dict[tuple[str, int, RankId], _Peer]
    by_identity: dict[bytes, _Peer]
    superseded: OrderedDict[bytes, _Peer]
    engine_peers: set[bytes]
    counters: Counter[str]
    _stop: threading.Event
    wake: threading.Event
    advancing: threading.Lock  # Note [Advance on the waking thread]
    _inline: bool
    _polled: bool
    _by_event: bool
    on_change: Callable[[], None]  # Note [State-change signal]
    _engine_wakes: bool
    _hb_seq: int
    _last_hb: float
    liveness: Liveness
    hub: Hub

    # PrefillEndpoint (prefill.py)
    @abstractmethod
    def _new_room(self, room: int) -> _Room: ...
    @abstractmethod
    def _poll_events(self) -> None: ...

    # PrefillWorker (prefill_worker.py)
    @abstractmethod
    def advance_here(self) -> None: ...
    @abstractmethod
    def _send_written(self, r: _Room) -> None: ...

    # PrefillControl (prefill_control.py)
    @abstractmethod
    def _reply(self, identity: bytes, msg: Any) -> None: ...
    @abstractmethod
    def _status(self, room: int, generation: int, state: KVPoll, reason: str = "",
                **kw: Any) -> W.Status: ...
    @abstractmethod
    def _reject(self, identity: bytes, what: str, why: str, room: int = REG_ROOM,
                generation: int = 0) -> None: ...
    @abstractmethod
    def _decode_group(self, r: _Room) -> int: ...
    @abstractmethod
    def _waits_on(self, r: _Room, instance: str, dp: int) -> bool: ...
    @abstractmethod
    def _on_request(self, identity: bytes, msg: Any) -> None: ...

    # PrefillHandshake (handshake.py)
    @abstractmethod
    def _on_register(self, identity: bytes, msg: Any) -> None: ...
    @abstractmethod
    def _requester(self, identity: bytes, room: int, rank: RankId) -> _Peer | str: ...

    # PrefillWorker (prefill_worker.py)
    @abstractmethod
    def _remember(self, room: int, fin: _Final) -> None: ...

    # PrefillStaging (staged.py)
    @abstractmethod
    def _check_staging(self, peer: _Peer, rank: RankId, target: DecodeTarget,
                       msg: Any) -> tuple[str, _Staged | None]: ...
    @abstractmethod
    def _gather(self, c: _Chunk, t: _Target, link: Link, layers: set[int] | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    @abstractmethod
    def _free_gather_buffers(self, r: _Room, drained: bool) -> None: ...
    @abstractmethod
    def _pump_rings(self, r: _Room) -> None: ...
    @abstractmethod
    def _ring_written(self, r: _Room, batch: Any) -> None: ...
    @abstractmethod
    def _ring_pending(self, r: _Room) -> bool: ...
    @abstractmethod
    def _ring_waits(self, r: _Room) -> int: ...
    @abstractmethod
    def _on_ring_freed(self, identity: bytes, msg: Any) -> None: ...


class DecodeHost:
    """DecodeEndpoint as its parts (handshake, liveness, staging) use it. The attributes are
    set in DecodeEndpoint.__init__ (decode.py), whose comments say what each holds."""

    layout: FamilyLayout
    wire: ModuleType  # the family's generated wire module
    rank: RankId
    pools: RankPools
    page_size: int
    bootstrap: str
    arena: staging.Arena | None
    launches: staging.Launches | None
    lock: threading.Lock
    recvs: dict[tuple[int, int], _Recv]
    reg_state: dict[str, tuple[KVPoll, str]]
    addresses: dict[str, str]
    source_rank: dict[str, RankId]
    links: dict[RankId, Link]
    counters: Counter[str]
    _last_hb: float
    _hb_seq: int
    _last_refresh: float
    _refreshing: bool
    liveness: Liveness
    on_change: Callable[[], None]  # Note [State-change signal]
    _reg_payload: bytes
    hub: Hub

    # DecodeEndpoint (decode.py)
    @abstractmethod
    def _fail(self, rv: _Recv, reason: str) -> None: ...
    @abstractmethod
    def _succeed(self, rv: _Recv) -> None: ...
    @abstractmethod
    def _page_state(self, rv: _Recv) -> PageState: ...
    @abstractmethod
    def _quarantine(self, rv: _Recv) -> None: ...

    # DecodeHandshake (handshake.py)
    @abstractmethod
    def _refresh(self, names: list[str]) -> None: ...

    # DecodeStaging (staged.py)
    @abstractmethod
    def _free_staging(self, rv: _Recv) -> None: ...
    @abstractmethod
    def _settle(self, rv: _Recv, wait: bool = False, finish: bool = True) -> bool: ...
    @abstractmethod
    def _on_ring_filled(self, name: str, msg: Any) -> None: ...
