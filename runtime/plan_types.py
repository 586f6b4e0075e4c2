"""Plan types: what moves from which prefill rank to which decode rank.

Built by the lowering (pdc.runtime.lowering), executed by the runtime. They live
in the runtime package because the runtime never imports the compiler; a plan travels
between processes as JSON (`Plan.to_json` / `Plan.from_json`) and both sides of a
handshake compare `Plan.digest()`.

Ranks are named within one attention-DP group: `RankId(pp, tp)`. All DP groups of a side
have the same layout, so one plan serves every (prefill group, decode group) pair; the
group of a request follows its room id (`dp_group_of_room`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True, order=True)
class RankId:
    pp: int  # pipeline stage
    tp: int  # attention-TP rank within the stage

    def __str__(self) -> str:
        return f"pp{self.pp}.tp{self.tp}"


@dataclass(frozen=True, slots=True)
class Side:
    """One side's parallel layout, resolved: `stages[s]` lists the global layer ids of stage s."""

    tp: int
    pp: int
    dp: int
    page_size: int
    stages: tuple[tuple[int, ...], ...]

    def stage_of(self, layer_id: int) -> int | None:
        for s, ids in enumerate(self.stages):
            if layer_id in ids:
                return s
        return None

    def ranks(self) -> tuple[RankId, ...]:
        return tuple(RankId(s, t) for s in range(self.pp) for t in range(self.tp))


@dataclass(frozen=True, slots=True)
class Topology:
    prefill: Side
    decode: Side
    backend: str

    def describe(self) -> str:
        def one(s: Side) -> str:
            return f"tp={s.tp},pp={s.pp},dp={s.dp},page_size={s.page_size}"

        return f"prefill {one(self.prefill)} -> decode {one(self.decode)} over {self.backend}"


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes copied from one source item to one destination item.

    `repeat` pieces of `nbytes` each; piece k starts at src_offset + k*src_stride in the
    source item and dst_offset + k*dst_stride in the destination item (strides are 0 when
    repeat == 1). A head slice of a [page, heads, dim] page is repeat=page pieces.
    """

    src_offset: int
    dst_offset: int
    nbytes: int
    repeat: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.repeat


@dataclass(frozen=True, slots=True)
class LinkEntry:
    component: str
    tensor: str
    layer_id: int  # global layer id, or the component's sentinel for request-wide state
    src_pos: int  # position in the prefill rank's registered entries of this component
    dst_pos: int  # position in the decode rank's registered entries of this component
    src_item_bytes: int
    dst_item_bytes: int
    segments: tuple[Segment, ...]

    @property
    def whole_item(self) -> bool:
        s = self.segments
        return (len(s) == 1 and s[0].repeat == 1 and s[0].src_offset == 0
                and s[0].dst_offset == 0 and s[0].nbytes == self.src_item_bytes
                == self.dst_item_bytes)


@dataclass(frozen=True, slots=True)
class Link:
    prefill: RankId
    decode: RankId
    entries: tuple[LinkEntry, ...]
    elected_for: tuple[str, ...]  # replicated components this prefill rank writes as elected writer


@dataclass(frozen=True, slots=True)
class Registration:
    """What one rank registers: per component (spec order), its entries (tensor, layer id)."""

    rank: RankId
    components: tuple[tuple[str, tuple[tuple[str, int], ...], int], ...]  # (name, entries, item_bytes)

    def entries(self, component: str) -> tuple[tuple[str, int], ...]:
        for name, entries, _ in self.components:
            if name == component:
                return entries
        raise KeyError(component)

    def item_bytes(self, component: str) -> int:
        for name, _, nbytes in self.components:
            if name == component:
                return nbytes
        raise KeyError(component)


@dataclass(frozen=True, slots=True)
class Plan:
    family: str
    topology: Topology
    prefill: tuple[Registration, ...]
    decode: tuple[Registration, ...]
    links: tuple[Link, ...]
    # (component, dtype) in spec order: item bytes alone would let a bf16 side and an fp16
    # side of equal sizes pass the handshake, and the plan digest is what the handshake checks.
    dtypes: tuple[tuple[str, str], ...] = ()
    # The family's binding digest (Note [Bound families] in runtime/binding.py): two sides
    # that bound one spec to different models lower different plans. "" for a compiled layout,
    # left out of the JSON then, so that the digests of compiled families stay what they were.
    bound: str = ""
    _index: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def links_to(self, decode: RankId) -> tuple[Link, ...]:
        return tuple(lk for lk in self.links if lk.decode == decode)

    def links_from(self, prefill: RankId) -> tuple[Link, ...]:
        return tuple(lk for lk in self.links if lk.prefill == prefill)

    def responses_expected(self, decode: RankId) -> int:
        """Status messages a decode rank waits for per request: one per linked prefill rank."""
        return len(self.links_to(decode))

    def registration(self, side: str, rank: RankId) -> Registration:
        regs = self.prefill if side == "prefill" else self.decode
        for r in regs:
            if r.rank == rank:
                return r
        raise KeyError(f"{side} {rank}")

    # ~~~ serialisation ~~~

    def to_json(self) -> str:
        # Written out by hand: dataclasses.asdict deep-copies every field and took 150 ms for
        # a 2576-entry plan; the keys and values are the same, so the JSON (and the digest
        # both sides of a handshake compare) is too.
        def seg(s: Segment) -> dict:
            return {"src_offset": s.src_offset, "dst_offset": s.dst_offset, "nbytes": s.nbytes,
                    "repeat": s.repeat, "src_stride": s.src_stride, "dst_stride": s.dst_stride}

        def entry(e: LinkEntry) -> dict:
            return {"component": e.component, "tensor": e.tensor, "layer_id": e.layer_id,
                    "src_pos": e.src_pos, "dst_pos": e.dst_pos,
                    "src_item_bytes": e.src_item_bytes, "dst_item_bytes": e.dst_item_bytes,
                    "segments": [seg(s) for s in e.segments]}

        def rank(r: RankId) -> dict:
            return {"pp": r.pp, "tp": r.tp}

        def reg(r: Registration) -> dict:
            return {"rank": rank(r.rank), "components": r.components}

        d = {"family": self.family, "topology": asdict(self.topology),
             "prefill": [reg(r) for r in self.prefill],
             "decode": [reg(r) for r in self.decode],
             "links": [{"prefill": rank(lk.prefill), "decode": rank(lk.decode),
                        "entries": [entry(e) for e in lk.entries],
                        "elected_for": lk.elected_for} for lk in self.links],
             "dtypes": self.dtypes}
        if self.bound:
            d["bound"] = self.bound
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        # A plan is immutable: its digest is computed once (the handshake asks for it often).
        cached = self._index.get("digest")
        if cached is None:
            cached = self._index["digest"] = hashlib.sha256(self.to_json().encode()).hexdigest()
        return cached

    @staticmethod
    def from_json(text: str) -> Plan:
        d = json.loads(text)

        def side(s):
            return Side(s["tp"], s["pp"], s["dp"], s["page_size"],
                        tuple(tuple(x) for x in s["stages"]))

        def rank(r):
            return RankId(r["pp"], r["tp"])

        def reg(r):
            return Registration(rank(r["rank"]), tuple(
                (n, tuple((t, i) for t, i in ents), b) for n, ents, b in r["components"]))

        topo = Topology(side(d["topology"]["prefill"]), side(d["topology"]["decode"]),
                        d["topology"]["backend"])
        links = tuple(
            Link(rank(lk["prefill"]), rank(lk["decode"]), tuple(
                LinkEntry(e["component"], e["tensor"], e["layer_id"], e["src_pos"], e["dst_pos"],
                          e["src_item_bytes"], e["dst_item_bytes"],
                          tuple(Segment(**s) for s in e["segments"]))
                for e in lk["entries"]), tuple(lk["elected_for"]))
            for lk in d["links"])
        return Plan(d["family"], topo, tuple(reg(r) for r in d["prefill"]),
                    tuple(reg(r) for r in d["decode"]), links,
                    tuple((n, t) for n, t in d.get("dtypes", ())), d.get("bound", ""))


def dp_group_of_room(room: int, dp: int) -> int:
    """Attention-DP group serving a request: follows the room id (bootstrap room) by default."""
    return room % dp
