"""A registration's sections (Register.sections): what the wire knows of a family's
components, and the checks that a rank's sections match them (runtime/wire.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .wire_messages import _U8, _U32, MAX_SECTION_ENTRIES, RegEntry, Section, WireError


@dataclass(frozen=True, slots=True)
class WireComponent:
    """What the wire knows of one component of a family (generated modules build these)."""

    name: str
    tensors: tuple[str, ...]  # tensor names; a RegEntry's tensor index points into these
    layer_ids: tuple[int, ...]  # ids an entry may carry: global layer ids, or (sentinel,)
    _tensor_index: dict[str, int] = field(init=False, repr=False, compare=False)
    _layer_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tensors or len(self.tensors) > _U8 + 1:
            raise ValueError(f"component {self.name!r}: 1..256 tensors, got {len(self.tensors)}")
        if len(set(self.tensors)) != len(self.tensors):
            raise ValueError(f"component {self.name!r} names a tensor twice")
        # no layer ids: a draft component of an engine that does not speculate (Note [Draft
        # components] in runtime/binding.py), which registers nothing
        if len(set(self.layer_ids)) != len(self.layer_ids) or not all(
                0 <= i <= _U32 for i in self.layer_ids):
            raise ValueError(f"component {self.name!r}: layer ids must be distinct u32s")
        object.__setattr__(self, "_tensor_index", {t: i for i, t in enumerate(self.tensors)})
        object.__setattr__(self, "_layer_set", frozenset(self.layer_ids))

    def entry_order(self, e: RegEntry) -> tuple[int, int]:
        """Where `e` goes in a section of this component: tensor-major, then by layer id."""
        return self._tensor_index[e.tensor], e.layer_id

    @property
    def max_entries(self) -> int:
        """Entries one rank can register: every (tensor, layer) at most once."""
        return min(len(self.tensors) * len(self.layer_ids), MAX_SECTION_ENTRIES)


# ~~~ registration sections ~~~


def _check_sections(sections: tuple[Section, ...], components: Sequence[WireComponent],
                    where: str) -> None:
    """Sections match the family: one per component in spec order, valid tensor names and
    layer ids, entries in layout order (tensor-major, then ascending layer id) without repeats.

    Layout order is the order `ComponentLayout.entries_for` gives and plan positions
    (LinkEntry.src_pos / dst_pos) index, so a registration can be paired by position."""
    if len(sections) != len(components):
        raise WireError(where, f"{len(sections)} sections, but the family has "
                               f"{len(components)} components ({_names(components)}): both "
                               f"sides must compile the same spec")
    for i, (sec, comp) in enumerate(zip(sections, components, strict=True)):
        at = f"{where}[{i}]"
        if sec.component != comp.name:
            raise WireError(f"{at}.component", f"is {sec.component!r}, but section {i} "
                                                f"belongs to component {comp.name!r}")
        if len(sec.entries) > comp.max_entries:
            raise WireError(f"{at}.entries", f"{len(sec.entries)} entries exceed the maximum "
                                             f"of {comp.max_entries} for {comp.name!r}")
        prev: tuple[int, int] | None = None
        for j, e in enumerate(sec.entries):
            t = comp._tensor_index.get(e.tensor)
            if t is None:
                raise WireError(f"{at}.entries[{j}].tensor",
                                f"{e.tensor!r} is not a tensor of {comp.name!r} "
                                f"({', '.join(comp.tensors)})")
            prev = _check_entry_order(f"{at}.entries[{j}]", comp, t, e.layer_id, prev)


def _check_entry_order(at: str, comp: WireComponent, tensor: int, layer_id: int,
                       prev: tuple[int, int] | None) -> tuple[int, int]:
    if layer_id not in comp._layer_set:
        raise WireError(f"{at}.layer_id", f"{layer_id} is not a layer of {comp.name!r}")
    key = (tensor, layer_id)
    if prev is not None and key <= prev:
        what = "repeats" if key == prev else "comes after"
        raise WireError(at, f"(tensor {comp.tensors[tensor]!r}, layer {layer_id}) {what} "
                            f"(tensor {comp.tensors[prev[0]]!r}, layer {prev[1]}): entries go "
                            f"tensor-major, then by ascending layer id, each once")
    return key


def _names(components: Sequence[WireComponent]) -> str:
    return ", ".join(c.name for c in components)


def registration_sections(components: Sequence[WireComponent],
                          buffers: Mapping[str, Iterable[RegEntry]]) -> tuple[Section, ...]:
    """Register.sections for a rank that registered `buffers` (component name -> entries).

    Components missing from `buffers` get an empty section (the rank holds none of their
    layers), entries are put in layout order (tensor-major, then layer id: the order plan
    positions refer to), and everything is checked as `encode` would: unknown component or
    tensor names, layer ids outside the component and repeated entries raise WireError.
    """
    known = {c.name for c in components}
    unknown = sorted(set(buffers) - known)
    if unknown:
        raise WireError("sections", f"unknown component(s) {', '.join(map(repr, unknown))}; "
                                    f"the family has {_names(components)}")
    sections = []
    for i, comp in enumerate(components):
        entries = tuple(buffers.get(comp.name, ()))
        for j, e in enumerate(entries):
            if not isinstance(e, RegEntry):
                raise WireError(f"sections[{i}].entries[{j}]",
                                f"must be a RegEntry, got {type(e).__name__}")
            if e.tensor not in comp._tensor_index:
                raise WireError(f"sections[{i}].entries[{j}].tensor",
                                f"{e.tensor!r} is not a tensor of {comp.name!r} "
                                f"({', '.join(comp.tensors)})")
        ordered = tuple(sorted(entries, key=comp.entry_order))
        sections.append(Section(component=comp.name, entries=ordered))
    out = tuple(sections)
    _check_sections(out, components, "sections")
    return out
