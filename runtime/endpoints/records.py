"""The records the endpoints keep. Prefill: a use of a room, its chunks and decode targets, a
linked decode peer, the outcome of a retired use (Note [Room uses]). Decode: one request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .. import knobs, staging
from ..datapath import DescriptorTemplate
from ..indices import (
    DecodeTarget,
    PrefillChunk,
)
from ..plan_types import RankId
from .common import (
    KVPoll,
    RequestStats,
)
from .states import TERMINAL


@dataclass
class _Chunk:
    chunk: PrefillChunk
    chunk_id: int
    stream: bool
    ready_layers: set = field(default_factory=set)
    all_ready: bool = False
    coverage_checked: bool = False
    # Note [Indices once per chunk]: a streamed chunk is submitted once per layer, and its
    # index pairs (and staging positions) depend only on the chunk and the decode target, so
    # they are computed on the first submit and reused by every later layer and the digest.
    pairs: dict = field(default_factory=dict)  # decode RankId -> component_pairs(...)
    positions: dict = field(default_factory=dict)  # decode RankId -> chunk_positions(...)
    sent_layers: set = field(default_factory=set)
    sent_all: bool = False


class _Peer:
    """One incarnation of a registered decode rank."""

    def __init__(self, name: str, identity: bytes, agent_info: bytes, engine_peer: str,
                 remote: dict, dp: int, rank: RankId, staging_arena: tuple[int, int] = (0, 0),
                 instance: str = ""):
        self.name = name
        self.instance = instance  # its decode instance (Note [Decode instances])
        self.staging_arena = staging_arena  # (address, bytes) decode registered for staging
        self.identity = identity
        self.agent_info = agent_info
        self.engine_peer = engine_peer
        self.remote = remote  # component -> [RemoteBuffer]
        # component -> the smallest capacity of its buffers, what every request's ids are
        # checked against (once per registration, not per request: 160 buffers at 80 layers)
        self.capacities = {name: min(b.capacity for b in bufs)
                           for name, bufs in remote.items() if bufs}
        self.dp = dp
        self.rank = rank
        self.rooms_created = 0  # live rooms its requests created (max_pending_rooms_per_peer)
        # whole_only -> the link's DescriptorTemplate (Note [Descriptor templates]); worker only
        self.templates: dict[bool, DescriptorTemplate] = {}


@dataclass
class _Staged:
    """The staged part of one link of a request (Note [Staging layout])."""

    remote_addr: int  # decode's region
    nbytes: int
    blocks: tuple[staging.Block, ...]
    local: Any = None  # this rank's gather buffer (numpy or torch bytes), region layout
    arena_offset: int | None = None  # where `local` sits in the arena; None: its own buffer
    ring: Any = None  # staging_ring.PrefillRing when decode's region is a ring (Note [Staging ring])


@dataclass
class _Target:
    target: DecodeTarget
    peer: _Peer  # the incarnation that asked: writes go to its memory only
    identity: bytes
    staged: _Staged | None = None


@dataclass
class _Room:
    room: int
    generation: int | None = None  # from the first TransferRequest (Note [Room uses])
    chunks: list = field(default_factory=list)
    targets: dict = field(default_factory=dict)  # decode RankId -> _Target
    inflight: list = field(default_factory=list)  # engine Batches
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    aborted_by: dict = field(default_factory=dict)  # decode RankId -> (identity, generation)
    last_seen: bool = False
    has_sender: bool = False
    created: float = field(default_factory=time.monotonic)
    failed_at: float = 0.0
    successor: _Room | None = None
    parked: list = field(default_factory=list)  # (identity, TransferRequest) for this use
    checksum: bool = field(default_factory=lambda: bool(knobs.get("checksum")))
    digests: dict = field(default_factory=dict)  # decode RankId -> running link digest
    bytes_to: dict = field(default_factory=dict)  # decode RankId -> bytes written
    descriptors_to: dict = field(default_factory=dict)  # decode RankId -> descriptors submitted
    last_range: tuple = (0, 0)  # (page_start, page_count) of the last chunk
    # Note [Success by event]: each decode target's last batch, and whether its written
    # event went out
    last_batch: dict = field(default_factory=dict)  # decode RankId -> Batch
    written_sent: bool = False
    retired: bool = False
    created_by: _Peer | None = None  # the peer whose request created the room
    decode_dp: int | None = None  # decode DP group serving it (Note [DP routing]); None: unknown
    decode_instance: str | None = None  # the decode instance serving it (Note [Decode instances])
    t_requested: float = 0.0  # every linked decode rank's TransferRequest arrived
    t_forward_done: float = 0.0  # the forward wrote the last chunk (Note [Timeline stamps])
    remap_saved: list = field(default_factory=list)  # (row view, original bytes), Note [Slot-valued state]
    remapped: set = field(default_factory=set)  # components whose rows remap_saved holds
    stats: RequestStats = field(default_factory=RequestStats)

    def fail(self, reason: str) -> bool:
        """Failed, unless already terminal; returns whether it changed."""
        if self.state in TERMINAL:
            return False
        self.state, self.reason, self.failed_at = KVPoll.Failed, reason, time.monotonic()
        return True


@dataclass
class _Final:
    """What a prefill rank remembers of a retired use of a room."""

    state: KVPoll
    reason: str
    generation: int | None
    had_sender: bool


@dataclass
class _Recv:
    room: int
    generation: int
    expected: set  # prefill peer names
    target: DecodeTarget | None = None
    requested: bool = False  # init() sent the TransferRequests
    succeeded: dict = field(default_factory=dict)  # name -> Success Status
    quiet: set = field(default_factory=set)  # sources that will not write any more
    loud: set = field(default_factory=set)  # sources that said their writes may still land
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    deadline: float = 0.0
    abort_deadline: float = 0.0
    quarantined: bool = False
    released: bool = False
    suspect: bool = False  # in flight while this process was frozen (Note [Frozen decode])
    bytes: int = 0
    staged: dict = field(default_factory=dict)  # source name -> (arena offset, bytes, blocks)
    staged_links: int = 0  # links init() sent through the staged path
    rings: dict = field(default_factory=dict)  # source name -> staging_ring.DecodeRing
    t_start: float = field(default_factory=time.monotonic)  # receiver() made
    t_requested: float = 0.0  # init() sent the TransferRequests
    t_arrived: float = 0.0  # the serving engine first saw the request (receiver(arrived=))
    seen: bool = False  # the serving engine's poll() saw the terminal state
    descriptors: int = 0  # what the prefill ranks submitted for it (their Success statuses)
    # The staged scatter's CUDA event while it runs (Note [Scatter by event]); None after
    scatter: Any = None
    # source name -> (its Transferring Status, the opened event after its last write), until
    # the event completes (Note [Success by event])
    written: dict = field(default_factory=dict)
