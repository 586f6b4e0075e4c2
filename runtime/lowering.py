"""Lowering: `lower(layout, topology, backends) -> Plan`, a pure function (no I/O).

It lives in the runtime because topology is only known when a serving process starts: the
runtime makes plans itself from the family (pdc.runtime.family.Family.plan), and the
compiler proves this same lowering (pdc.compiler.coverage) for every declared deployment.

For every decode rank and every entry it registers, lowering finds the prefill rank(s) that
hold those bytes and the byte segments to copy. The rules, each a small function below so
that tests can break one and watch the coverage proof fail:

- attention TP (`tp_sources`): D == P pairs r with r; D > P reads from r // (D/P);
  D < P gathers from r*(P/D) .. (r+1)*(P/D)-1.
- sharded state: per unit (head) of the decode rank's slice, the first source candidate that
  holds it (Note [Shard ownership] in pdc.runtime.layout_types), merged into strided segments.
- replicated state (`replicated_writer`): P > D elects the first rank of each group as the
  only writer; P < D every source writes its own targets (broadcast); never two writers.
- Note [Pair by layer id]: pipeline stages pair entries by global layer id (or sentinel),
  never by position, so uneven splits, draft layers and empty stages cannot shift the
  layout. A stage holding no layer of a component registers an empty entry list that keeps
  the component's place on the wire.
- request-wide state is registered only on the stages that own it (`owning_stages`) and
  written by the lowest owning prefill stage (`request_writer_stage`).
"""

from __future__ import annotations

from .diagnostics import Diagnostic, Location, SpecErrors
from .layout_types import BackendRule, ComponentLayout, FamilyLayout, ShardGeometry
from .limits import MAX_LOWERING_STEPS
from .plan_types import Link, LinkEntry, Plan, RankId, Registration, Segment, Side, Topology

# ~~~ mapping rules ~~~


def tp_sources(p: int, d: int, decode_tp_rank: int) -> tuple[int, ...]:
    """Prefill attention-TP ranks a decode rank receives from, in election order."""
    if p == d:
        return (decode_tp_rank,)
    if d > p:
        return (decode_tp_rank // (d // p),)
    k = p // d
    return tuple(range(decode_tp_rank * k, (decode_tp_rank + 1) * k))


def replicated_writers(p: int, d: int, decode_tp_rank: int) -> tuple[int, ...]:
    """Prefill ranks that write replicated state to this decode rank: exactly one, the first
    source (for P > D that is rank r*(P/D), the elected writer of its group)."""
    return tp_sources(p, d, decode_tp_rank)[:1]


def _geometry(comp: ComponentLayout) -> ShardGeometry:
    if comp.shard is None:
        raise ValueError(f"component '{comp.name}' is replicated: it has no shard units")
    return comp.shard


def local_units(comp: ComponentLayout, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
    return _geometry(comp).local_units(tp, rank)


def owning_stages(comp: ComponentLayout, side: Side, kind_of: dict[int, str]) -> tuple[int, ...]:
    """Stages that register a component (request-wide: by its `stages` rule)."""
    if not comp.request_wide:
        held = set(comp.layer_ids)
        return tuple(s for s, ids in enumerate(side.stages) if held & set(ids))
    rule = comp.stages
    if rule == "none":  # Note [Present components] in runtime/binding.py
        return ()
    if rule == "all":
        return tuple(range(side.pp))
    if rule == "first":
        return (0,)
    if rule == "last":
        return (side.pp - 1,)
    kind = rule.removeprefix("kind:")
    return tuple(s for s, ids in enumerate(side.stages) if any(kind_of[i] == kind for i in ids))


def request_writer_stages(owners: tuple[int, ...]) -> tuple[int, ...]:
    """Prefill stages that write a request-wide component: only the lowest owner."""
    return (min(owners),) if owners else ()


def source_stages(comp: ComponentLayout, layer_id: int, stage_of: dict[int, int],
                  owners: tuple[int, ...]) -> tuple[int, ...]:
    """`stage_of`: prefill stage of each layer id (`stages_by_layer`)."""
    if comp.request_wide:
        return request_writer_stages(owners)
    s = stage_of.get(layer_id)
    return () if s is None else (s,)


def stages_by_layer(side: Side) -> dict[int, int]:
    return {i: s for s, ids in enumerate(side.stages) for i in ids}


def source_position(src_positions: dict, key: tuple[str, int], dst_pos: int) -> int:
    """Position of the paired entry on the source rank: by global layer id (Note [Pair by
    layer id]), never `dst_pos`. `src_positions` maps the source rank's entries of the
    component to their positions (a dict, not `tuple.index`: lowering stays linear)."""
    return src_positions[key]


# ~~~ static rules ~~~


def check_topology(layout: FamilyLayout, topo: Topology, backends: tuple[BackendRule, ...],
                   loc: Location) -> list[Diagnostic]:
    errs = []
    p, d = topo.prefill, topo.decode
    rule = next((b for b in backends if b.name == topo.backend), None)
    if backends and rule is None:
        errs.append(Diagnostic(loc, f"backend '{topo.backend}' is not in the backend matrix of "
                               f"{layout.family}", "use one of: "
                               + ", ".join(b.name for b in backends)))
    if rule is not None and not rule.hetero_attention_tp and p.tp != d.tp:
        ok = [b.name for b in backends if b.hetero_attention_tp]
        errs.append(Diagnostic(
            rule.loc, f"backend '{rule.name}' does not support heterogeneous attention TP "
            f"(prefill tp={p.tp}, decode tp={d.tp}): rule `hetero_attention_tp: false`"
            + (f" ({rule.why})" if rule.why else ""),
            "use equal attention TP on both sides"
            + (f", or a backend that allows it: {', '.join(ok)}" if ok else "")))
    if rule is not None and rule.max_pp is not None and max(p.pp, d.pp) > rule.max_pp:
        errs.append(Diagnostic(
            rule.loc, f"backend '{rule.name}' supports pp <= {rule.max_pp} (prefill "
            f"pp={p.pp}, decode pp={d.pp}): rule `max_pp: {rule.max_pp}`"
            + (f" ({rule.why})" if rule.why else ""),
            f"use pp <= {rule.max_pp} on both sides, or another backend"))
    if p.page_size != d.page_size:
        errs.append(Diagnostic(loc, f"page size differs: prefill {p.page_size}, decode "
                               f"{d.page_size}", "run both sides with the same page size"))
    if max(p.tp, d.tp) % min(p.tp, d.tp):
        errs.append(Diagnostic(loc, f"attention TP sizes {p.tp} and {d.tp} do not divide each "
                               "other", "one side's attention TP must be a multiple of the "
                               "other's"))
    for c in layout.components:
        if c.shard is None:
            continue
        for what, tp in (("prefill", p.tp), ("decode", d.tp)):
            if not c.shard.divisible(tp):
                errs.append(Diagnostic(
                    component_location(c), f"component '{c.name}' cannot be sharded over "
                    f"{what} tp={tp}: its "
                    f"sub-blocks hold {', '.join(map(str, c.shard.group_units))} units",
                    "each sub-block's unit count must be a multiple or a divisor of tp"))
    steps = lowering_steps(layout, topo)
    if steps > MAX_LOWERING_STEPS:
        errs.append(Diagnostic(loc, f"this plan takes {steps} lowering steps (entries x units "
                               f"or ranks), more than the limit of {MAX_LOWERING_STEPS}",
                               "use fewer ranks; Note [Spec limits] in compiler/limits.py"))
    for what, side in (("prefill", p), ("decode", d)):
        for c in layout.components:
            if c.request_wide and c.stages.startswith("kind:"):
                kind_of = dict(layout.kind_of)
                if not owning_stages(c, side, kind_of):
                    errs.append(Diagnostic(loc, f"no {what} stage owns request-wide component "
                                           f"'{c.name}'", "check its `stages` rule"))
    return errs


def component_location(c: ComponentLayout) -> Location:
    """Where the spec declares component `c` (its `loc` is "file:line:col"), so a rejected
    topology points at the rule it breaks."""
    file, _, rest = c.loc.rpartition(":")
    file, _, line = file.rpartition(":")
    if line.isdigit() and rest.isdigit():
        return Location(file, int(line), int(rest))
    return Location(c.loc)


def lowering_steps(layout: FamilyLayout, topo: Topology) -> int:
    """An upper bound of the work `lower` does: every entry of every component is paired on
    every decode rank, per unit (head) of the rank's slice or per writing source rank."""
    p, d = topo.prefill, topo.decode
    ranks = max(p.tp, d.tp) * max(p.pp, d.pp)
    steps = 0
    for c in layout.components:
        entries = len(c.tensors) * max(1, len(c.layer_ids))
        units = sum(c.shard.group_units) if c.shard is not None else 1
        steps += entries * max(units, ranks)
    return steps


# ~~~ lowering ~~~


def _registrations(layout: FamilyLayout, side: Side) -> tuple[Registration, ...]:
    kind_of = dict(layout.kind_of)
    owners = {c.name: owning_stages(c, side, kind_of) for c in layout.components}
    regs = []
    for rank in side.ranks():
        comps = []
        for c in layout.components:
            if c.request_wide:
                ents = c.entries_for(()) if rank.pp in owners[c.name] else ()
            else:
                ents = c.entries_for(side.stages[rank.pp])
            comps.append((c.name, tuple((e.tensor, e.layer_id) for e in ents),
                          c.item_bytes_at(side.tp)))
        regs.append(Registration(rank, tuple(comps)))
    return tuple(regs)


def _shard_segments(comp: ComponentLayout, p_tp: int, d_tp: int, pairs: list[tuple[int, int]],
                    src_units: tuple, dst_units: tuple) -> tuple[Segment, ...]:
    """Strided segments for (source unit position, destination unit position) pairs; a unit
    position indexes `src_units` / `dst_units`, the (sub-block, unit) lists of either rank."""
    s = _geometry(comp)
    sizes = s.unit_sizes

    def offsets(units) -> list[int]:  # element offset of each local unit on its rank
        out = [0]
        for g, _ in units:
            out.append(out[-1] + sizes[g])
        return out

    src_off, dst_off = offsets(src_units), offsets(dst_units)
    axis_p = s.local_axis(p_tp) * s.inner_bytes
    axis_d = s.local_axis(d_tp) * s.inner_bytes
    runs: list[list[int]] = []  # [src element, dst element, elements]
    for i_p, i_d in pairs:
        e_p, e_d, n = src_off[i_p], dst_off[i_d], sizes[src_units[i_p][0]]
        if runs and runs[-1][0] + runs[-1][2] == e_p and runs[-1][1] + runs[-1][2] == e_d:
            runs[-1][2] += n
        else:
            runs.append([e_p, e_d, n])
    segs = []
    inner = s.inner_bytes
    for e_p, e_d, n in runs:
        nbytes = n * inner
        if s.outer == 1 or (nbytes == axis_p == axis_d):
            segs.append(Segment(e_p * inner, e_d * inner, nbytes * s.outer))
        else:
            segs.append(Segment(e_p * inner, e_d * inner, nbytes, s.outer, axis_p, axis_d))
    return tuple(segs)


def _lower_entry(c, P: Side, D: Side, dst: RankId, s_p: int, pos_d: int, key, positions,
                 links: dict, elected: dict) -> None:
    """`positions(src, component)`: that source rank's entry -> position dict."""
    tensor, layer_id = key
    if c.shard is None:
        for t_p in replicated_writers(P.tp, D.tp, dst.tp):
            src = RankId(s_p, t_p)
            pos_p = source_position(positions(src, c.name), key, pos_d)
            seg = (Segment(0, 0, c.item_bytes),)
            links.setdefault((src, dst), []).append(LinkEntry(
                c.name, tensor, layer_id, pos_p, pos_d, c.item_bytes, c.item_bytes, seg))
            if P.tp > D.tp and c.name not in elected.setdefault((src, dst), []):
                elected[(src, dst)].append(c.name)
        return
    by_src: dict[int, list[tuple[int, int]]] = {}
    cands = tp_sources(P.tp, D.tp, dst.tp)
    held = {t: local_units(c, P.tp, t) for t in cands}
    held_at = {t: {unit: i for i, unit in enumerate(units)} for t, units in held.items()}
    dst_units = local_units(c, D.tp, dst.tp)
    for i_d, unit in enumerate(dst_units):
        # The first source holding the unit writes it; with GQA replication several do.
        holder = next((t for t in cands if unit in held_at[t]), None)
        if holder is None:
            continue  # no source holds it: the coverage proof reports the gap
        by_src.setdefault(holder, []).append((held_at[holder][unit], i_d))
    for t_p, pairs in sorted(by_src.items()):
        src = RankId(s_p, t_p)
        pos_p = source_position(positions(src, c.name), key, pos_d)
        links.setdefault((src, dst), []).append(LinkEntry(
            c.name, tensor, layer_id, pos_p, pos_d, c.item_bytes_at(P.tp),
            c.item_bytes_at(D.tp), _shard_segments(c, P.tp, D.tp, pairs, held[t_p], dst_units)))


def lower(layout: FamilyLayout, topo: Topology, backends: tuple[BackendRule, ...] = (),
          loc: Location | None = None) -> Plan:
    """Build the plan or raise SpecErrors naming every rule the topology breaks."""
    loc = loc or Location(layout.spec_path)
    errs = check_topology(layout, topo, backends, loc)
    if errs:
        raise SpecErrors(errs)
    P, D = topo.prefill, topo.decode
    pre, dec = _registrations(layout, P), _registrations(layout, D)
    pre_by_rank = {r.rank: r for r in pre}
    position_maps: dict[tuple[RankId, str], dict] = {}

    def positions(src: RankId, component: str) -> dict:
        key = (src, component)
        if key not in position_maps:
            ents = pre_by_rank[src].entries(component)
            position_maps[key] = {e: i for i, e in enumerate(ents)}
        return position_maps[key]

    stage_of = stages_by_layer(P)
    kind_of = dict(layout.kind_of)
    links: dict[tuple[RankId, RankId], list[LinkEntry]] = {}
    elected: dict[tuple[RankId, RankId], list[str]] = {}

    for c in layout.components:
        owners = owning_stages(c, P, kind_of)
        for reg in dec:
            for pos_d, key in enumerate(reg.entries(c.name)):
                tensor, layer_id = key
                stages = source_stages(c, layer_id, stage_of, owners)
                if not stages:
                    raise SpecErrors([Diagnostic(loc, f"no prefill stage holds layer {layer_id} "
                                                 f"of component '{c.name}'",
                                                 "both sides must hold the same layers")])
                for s_p in stages:
                    _lower_entry(c, P, D, reg.rank, s_p, pos_d, key, positions, links, elected)

    out = tuple(
        Link(src, dst, tuple(entries), tuple(elected.get((src, dst), ())))
        for (src, dst), entries in sorted(links.items())
    )
    return Plan(layout.family, topo, pre, dec, out,
                tuple((c.name, c.dtype) for c in layout.components), layout.bound)
