"""Fault injection for pdc's SGLang tests: an explicit hook, off unless the variable is set.

`PDC_SGLANG_FAULTS="KIND@ROOM,..."` makes the prefill sender of that bootstrap room send a
wrong page list to pdc's runtime, past SGLang's own bookkeeping, so that the test sees
pdc's checks catch it (the request fails with pdc's reason; other rooms are untouched):
- `page_out_of_range`: the last chunk names a page beyond the registered KV capacity.
- `extra_page`: the last chunk carries one page more than decode allocated.
"""

from __future__ import annotations

import os

ENV = "PDC_SGLANG_FAULTS"
KINDS = ("page_out_of_range", "extra_page")
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
    return pages + [pages[-1]]
