"""Fault injection for pdc's SGLang tests: an explicit hook, off unless the variable is set.

`PDC_SGLANG_FAULTS="KIND@ROOM,..."` makes the prefill sender of that bootstrap room send a
wrong page list or slot to pdc's runtime, past SGLang's own bookkeeping. Two kinds break a
rule pdc checks, so the test sees pdc's checks catch it (the request fails with pdc's reason;
other rooms are untouched):
- `page_out_of_range`: the last chunk names a page beyond the registered KV capacity.
- `extra_page`: the last chunk carries one page more than decode allocated.
Two are well-formed but wrong, negative controls that the served tokens depend on what pdc
moves (they must change that request's tokens):
- `wrong_page`: the last chunk's first page is read from the pool page before it (another
  request's, a free page, or the request's own previous page twice; never a permutation of
  the request's own pages, which attention would not notice).
- `wrong_slot`: the request's state is read from the slot before its own (Note [SGLang mamba
  state] in family.py): decode's slot, the one its next step reads, gets another slot's state.
- `wrong_ring`: the request's QSA pending ring is read from the request-pool row before its
  own (Note [SGLang QSA state] in qsa.py).
- `wrong_window_page`: the first page of the request's sliding-window list is read from the
  SWA pool page before it (Note [SGLang SWA pools] in swa.py).
The neighbour is the one before, not after: SGLang hands out its highest free slot first
(mem_cache/memory_pool.py, `free_slots[-need_size:]`), whose next one is past the pool; page
and slot 0 are SGLang's padding, so the one before a 0 is the one after it.
"""

from __future__ import annotations

import os

ENV = "PDC_SGLANG_FAULTS"
KINDS = ("page_out_of_range", "extra_page", "wrong_page", "wrong_slot", "wrong_ring",
         "wrong_window_page")
OUT_OF_RANGE_PAGE = 1 << 40


def planned() -> dict[int, str]:
    out = {}
    for part in filter(None, (p.strip() for p in os.environ.get(ENV, "").split(","))):
        kind, _, room = part.partition("@")
        if kind not in KINDS or not room.isdigit():
            raise ValueError(f"{ENV}: {part!r} is not KIND@ROOM with KIND one of "
                             f"{', '.join(KINDS)}")
        out[int(room)] = kind
    return out


_PLANNED = planned()


def apply(room: int, pages: list[int], last: bool) -> list[int]:
    kind = _PLANNED.get(room)
    if kind is None or not last or not pages:
        return pages
    if kind == "page_out_of_range":
        return pages[:-1] + [OUT_OF_RANGE_PAGE]
    if kind == "extra_page":
        return pages + [pages[-1]]
    if kind == "wrong_page":
        return [_neighbour(pages[0])] + pages[1:]
    return pages


def apply_slot(room: int, slot: int, kind: str = "wrong_slot") -> int:
    """The prefill slot (or, for `wrong_ring`, QSA ring slot) the request's state is read
    from (-1: it has none)."""
    if slot < 0 or _PLANNED.get(room) != kind:
        return slot
    return _neighbour(slot)


def apply_window(room: int, pages: list[int] | None) -> list[int] | None:
    """The SWA pages the request's window is read from (None: it has none)."""
    if not pages or _PLANNED.get(room) != "wrong_window_page":
        return pages
    return [_neighbour(pages[0])] + pages[1:]


def _neighbour(index: int) -> int:
    return index - 1 if index > 0 else index + 1
