"""A plan in compact form: what generated/<family>/plans.py holds for a declared deployment.

Note [Compact plans]: `Plan.to_json` spells every link entry out (a Llama-70B TP 2 -> 16
plan is 2576 entries, 600 KB), which is right for the wire's digest but too big to keep
in generated/ for every declared deployment. Entries of one link differ from their
neighbours by a constant step (layer id +1, positions +1, the same component, sizes and
segments), so `encode` stores each link's entries as runs of rows of integers: the first
row, a count and a step row. Strings and segment lists go to tables and rows refer to them
by index. `decode(encode(p)) == p` for every plan (tests/runtime/test_plan_codec.py), and
the generated module records the plan's digest so the runtime checks what it loaded.
Version 1; a reader refuses any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from .plan_types import Link, LinkEntry, Plan, RankId, Registration, Segment, Side, Topology

CODEC_VERSION = 1

Row = tuple[int, ...]


class PlanCodecError(ValueError):
    """A compact plan that does not decode (another codec version, a bad index)."""


def _step(a: Row, b: Row) -> Row:
    return tuple(y - x for x, y in zip(a, b, strict=True))


def runs(rows: Sequence[Row]) -> list[list[int]]:
    """Rows as runs `[*first, count, *step]`: row k of a run is first + k*step."""
    out: list[list[int]] = []
    i = 0
    while i < len(rows):
        first = rows[i]
        step = _step(first, rows[i + 1]) if i + 1 < len(rows) else (0,) * len(first)
        n = 1
        while i + n < len(rows) and _step(rows[i + n - 1], rows[i + n]) == step:
            n += 1
        if n == 1:
            step = (0,) * len(first)
        out.append([*first, n, *step])
        i += n
    return out


def expand(encoded: Sequence[Sequence[int]], width: int) -> list[Row]:
    rows: list[Row] = []
    for r in encoded:
        if len(r) != 2 * width + 1:
            raise PlanCodecError(f"a run has {len(r)} numbers, expected {2 * width + 1}")
        first, n, step = r[:width], r[width], r[width + 1:]
        rows.extend(tuple(f + k * s for f, s in zip(first, step, strict=True)) for k in range(n))
    return rows


class _Table:
    """Values in first-seen order, each with its index."""

    def __init__(self) -> None:
        self.index: dict = {}

    def __call__(self, value) -> int:
        return self.index.setdefault(value, len(self.index))

    def values(self) -> list:
        return list(self.index)


def encode(plan: Plan) -> dict:
    """`plan` as plain lists and ints (Note [Compact plans])."""
    names, seglists = _Table(), _Table()

    def reg(r: Registration) -> list:
        return [r.rank.pp, r.rank.tp, [
            [names(name), item_bytes, runs([(names(t), layer) for t, layer in entries])]
            for name, entries, item_bytes in r.components]]

    def segs(e: LinkEntry) -> int:
        return seglists(tuple(
            (s.src_offset, s.dst_offset, s.nbytes, s.repeat, s.src_stride, s.dst_stride)
            for s in e.segments))

    links = [[lk.prefill.pp, lk.prefill.tp, lk.decode.pp, lk.decode.tp,
              [names(c) for c in lk.elected_for],
              runs([(names(e.component), names(e.tensor), e.layer_id, e.src_pos, e.dst_pos,
                     e.src_item_bytes, e.dst_item_bytes, segs(e)) for e in lk.entries])]
             for lk in plan.links]
    return {"version": CODEC_VERSION, "family": plan.family,
            "topology": asdict(plan.topology), "dtypes": [list(d) for d in plan.dtypes],
            "bound": plan.bound, "prefill": [reg(r) for r in plan.prefill],
            "decode": [reg(r) for r in plan.decode], "links": links,
            "names": names.values(), "segments": [[list(s) for s in sl]
                                                  for sl in seglists.values()]}


def topology_of(data: dict) -> Topology:
    def side(s: dict) -> Side:
        return Side(s["tp"], s["pp"], s["dp"], s["page_size"],
                    tuple(tuple(x) for x in s["stages"]))

    t = data["topology"]
    return Topology(side(t["prefill"]), side(t["decode"]), t["backend"])


def decode(data: dict) -> Plan:
    """The Plan `encode` was given; PlanCodecError on another version or a bad index."""
    if data.get("version") != CODEC_VERSION:
        raise PlanCodecError(f"compact plan version {data.get('version')!r}; this pdc reads "
                             f"{CODEC_VERSION}: run `pdc compile` to regenerate it")
    try:
        names = data["names"]
        seglists = [tuple(Segment(*s) for s in sl) for sl in data["segments"]]

        def reg(r: list) -> Registration:
            return Registration(RankId(r[0], r[1]), tuple(
                (names[n], tuple((names[t], layer) for t, layer in expand(rows, 2)), nbytes)
                for n, nbytes, rows in r[2]))

        links = tuple(
            Link(RankId(p_pp, p_tp), RankId(d_pp, d_tp), tuple(
                LinkEntry(names[c], names[t], layer, sp, dp, sb, db, seglists[sl])
                for c, t, layer, sp, dp, sb, db, sl in expand(rows, 8)),
                tuple(names[c] for c in elected))
            for p_pp, p_tp, d_pp, d_tp, elected, rows in data["links"])
        return Plan(data["family"], topology_of(data), tuple(reg(r) for r in data["prefill"]),
                    tuple(reg(r) for r in data["decode"]), links,
                    tuple((n, t) for n, t in data["dtypes"]), data["bound"])
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise PlanCodecError(f"compact plan of {data.get('family')!r} does not decode: "
                             f"{type(e).__name__}: {e}; run `pdc compile` to regenerate "
                             "it") from None
