"""What `pdc plan` prints: per link, entries, bytes and descriptors for an N-token request.

Descriptor counts are what the data path would submit for one request in one chunk:
direct with contiguous pages (one descriptor per entry and run of pages), direct with
fragmented pages (one per page), and staged (partial entries packed into one bulk write per
link, whole-item entries still direct, fragmented). Partial entries (head slices, sub-blocks)
cost one descriptor per item and piece on the direct path whatever the page order.
"""

from __future__ import annotations

import json

from pdc.runtime.indices import pages_of, window_first_page
from pdc.runtime.plan_types import Link, Plan

from .layout import FamilyLayout


def request_items(layout: FamilyLayout, tokens: int, page_size: int) -> dict[str, int]:
    pages = pages_of(tokens, page_size)
    out = {}
    for c in layout.components:
        if c.index == "page":
            out[c.name] = pages
        elif c.index == "window":
            out[c.name] = pages - window_first_page(tokens, c.window_tokens, page_size)
        elif c.index == "ring":
            out[c.name] = c.ring_rows
        else:
            out[c.name] = 1
    return out


def link_stats(layout: FamilyLayout, link: Link, items: dict[str, int]) -> dict:
    kinds = {c.name: c.index for c in layout.components}
    nbytes = contiguous = fragmented = whole_frag = 0
    partial = False
    for e in link.entries:
        n = items[e.component]
        nbytes += n * sum(s.total_bytes for s in e.segments)
        if e.whole_item:
            runs_frag = 1 if kinds[e.component] == "ring" else n
            contiguous += 1
            fragmented += runs_frag
            whole_frag += runs_frag
        else:
            partial = True
            pieces = n * sum(s.repeat for s in e.segments)
            contiguous += pieces
            fragmented += pieces
    return {"prefill": str(link.prefill), "decode": str(link.decode),
            "entries": len(link.entries), "bytes": nbytes,
            "descriptors": {"direct_contiguous": contiguous, "direct_fragmented": fragmented,
                            "staged_fragmented": whole_frag + (1 if partial else 0)},
            "elected_for": list(link.elected_for)}


def plan_report(layout: FamilyLayout, plan: Plan, tokens: int, coverage: list,
                declared: str = "") -> dict:
    """`declared`: the spec deployment this topology is (compiler/family.py declared_as)."""
    page = plan.topology.prefill.page_size
    items = request_items(layout, tokens, page)
    return {
        "family": plan.family,
        "topology": plan.topology.describe(),
        "tokens": tokens,
        "pages": pages_of(tokens, page),
        "links": [link_stats(layout, lk, items) for lk in plan.links],
        "responses_expected": {str(r.rank): plan.responses_expected(r.rank)
                               for r in plan.decode},
        "coverage": "proven" if not coverage else [str(p) for p in coverage],
        "plan_digest": plan.digest(),
        "declared": declared,
    }


TABLE_COLUMNS = 100  # the report fits a 100-column terminal or log (pdc.console prints it)


def table_rows(report: dict) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The per-link table as columns and rows of text (`pdc plan` prints it with rich)."""
    cols = ("link", "entries", "MiB/request", "desc contig", "desc frag", "staged frag",
            "elected")
    rows: list[tuple[str, ...]] = []
    for lk in report["links"]:
        d = lk["descriptors"]
        rows.append((f"{lk['prefill']} -> {lk['decode']}", str(lk["entries"]),
                     f"{lk['bytes'] / 2**20:.2f}", f"{d['direct_contiguous']:,}",
                     f"{d['direct_fragmented']:,}", f"{d['staged_fragmented']:,}",
                     str(len(lk["elected_for"])) if lk["elected_for"] else "-"))
    return cols, rows


def report_head(report: dict) -> list[str]:
    head = f"{report['family']}: {report['topology']}"
    if len(head) > TABLE_COLUMNS:  # break before "-> decode", then after the family
        first, arrow, rest = report["topology"].partition(" -> ")
        head = f"{report['family']}: {first}\n  {arrow.strip()} {rest}"
        if max(map(len, head.splitlines())) > TABLE_COLUMNS:
            head = f"{report['family']}:\n  {first}\n  {arrow.strip()} {rest}"
    declared = report.get("declared")
    how = (f"declared: {declared}; its plan is generated (plans.py)" if declared
           else "not declared by the spec: engines lower this plan at start")
    return [head, f"request of {report['tokens']} tokens = {report['pages']} pages", how]


def report_tail(report: dict) -> list[str]:
    """Elected writers (wrapped to TABLE_COLUMNS), totals, responses and the coverage verdict."""
    import textwrap

    out = []
    elected = [lk for lk in report["links"] if lk["elected_for"]]
    if elected:
        out.append("elected writer of (replicated state, one writer per decode rank):")
        for lk in elected:
            out += textwrap.wrap(", ".join(lk["elected_for"]), TABLE_COLUMNS,
                                 initial_indent=f"  {lk['prefill']} -> {lk['decode']}: ",
                                 subsequent_indent="      ")
    total = sum(lk["bytes"] for lk in report["links"])
    out.append(f"total {total / 2**20:.2f} MiB per request over {len(report['links'])} links")
    out += textwrap.wrap("responses expected per decode rank: " + ", ".join(
        f"{k}: {v}" for k, v in report["responses_expected"].items()), TABLE_COLUMNS,
        subsequent_indent="  ")
    cov = report["coverage"]
    out.append("coverage: proven (every decode byte written exactly once, with the "
               "aggregate's byte)" if cov == "proven" else "coverage: FAILED\n  "
               + "\n  ".join(cov))
    return out


def render_json(report: dict, plan: Plan, code: int, errors: list[dict]) -> str:
    """`pdc plan --json`: the keys every command's JSON carries (`command`, `ok`, `exit`,
    `errors`; Note [JSON output] in the CLI), the report and the whole plan."""
    out = dict(report)
    out.update(command="plan", ok=code == 0, exit=code, errors=errors,
               plan=json.loads(plan.to_json()))
    return json.dumps(out, indent=1, sort_keys=True) + "\n"
