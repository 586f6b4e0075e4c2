"""A picture of a plan: `draw_plan(layout, plan, report) -> str`, an SVG document.

What an operator wants to see of a plan, drawn from the plan and `report.plan_report`:
prefill ranks (left) and decode ranks (right), grouped by pipeline stage with the stage's
layers; one arrow per link, its width growing with the bytes it carries; the link's path
(whole items go direct, one descriptor per run of pages; head slices and sub-blocks go
staged: gathered, one bulk write, scattered) as its colour and dash; elected writers (the one
prefill rank of a group that writes replicated state, P > D) with a star; broadcasts (one
prefill rank writing replicated state to several decode ranks, P < D) tagged on the rank;
and a numbered table of the links with entries, MiB per request and descriptor counts.

Plain SVG written here (no drawing library): every element carries a `class` and `data-*`
attributes (rank, bytes, descriptors, path) so tests and tools can read the drawing back.
Text is monospace so its width is known without font metrics. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from pdc.runtime.plan_types import Link, Plan, RankId

from .layout import FamilyLayout

# Beyond these a drawing is no longer readable; the CLI refuses with a hint instead.
MAX_DRAWN_RANKS = 64  # per side
MAX_DRAWN_LINKS = 256

FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
CHAR_W = 7.2  # px per character at 12 px monospace
NODE_W, NODE_H, NODE_GAP = 220, 44, 12
STAGE_PAD, STAGE_HEAD = 12, 26
MARGIN, TOP = 24, 96
COLUMN_GAP = 420

# Note [Link paths in the drawing]: a link whose entries are all whole items is "direct";
# one whose entries are all partial (head slices, sub-blocks) is "staged"; "mixed" has both
# (its partial entries go staged, its whole items direct). Colours differ by more than hue
# (dash patterns) so the picture survives grey-scale printing.
PATH_STYLE = {
    "direct": ("#1f6fb4", ""),
    "staged": ("#d9730d", "9 5"),
    "mixed": ("#7b3fa0", "3 4"),
}
PATH_WORDS = {
    "direct": "direct: whole items, a descriptor per run of pages",
    "staged": "staged: slices gathered, one bulk write, scattered",
    "mixed": "mixed: slices staged, whole items direct",
}


@dataclass(frozen=True)
class _Box:
    x: float
    y: float
    w: float
    h: float


def link_path(link: Link) -> str:
    """"direct", "staged" or "mixed" (Note [Link paths in the drawing])."""
    whole = [e.whole_item for e in link.entries]
    if all(whole):
        return "direct"
    return "staged" if not any(whole) else "mixed"


def broadcasts(layout: FamilyLayout, plan: Plan) -> dict[RankId, tuple[str, ...]]:
    """Prefill ranks that write a replicated component to more than one decode rank."""
    replicated = {c.name for c in layout.components if c.shard is None}
    targets: dict[tuple[RankId, str], set[RankId]] = {}
    for lk in plan.links:
        for e in lk.entries:
            if e.component in replicated:
                targets.setdefault((lk.prefill, e.component), set()).add(lk.decode)
    out: dict[RankId, list[str]] = {}
    for (src, comp), dsts in sorted(targets.items()):
        if len(dsts) > 1:
            out.setdefault(src, []).append(comp)
    return {k: tuple(v) for k, v in out.items()}


def _ranges(ids: tuple[int, ...]) -> str:
    out, start = [], None
    ordered = sorted(ids)
    for i, x in enumerate(ordered):
        start = x if start is None else start
        if i + 1 == len(ordered) or ordered[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out) or "none"


def _text(x: float, y: float, s: str, size: int = 12, weight: str = "normal",
          anchor: str = "start", fill: str = "#222", cls: str = "") -> str:
    c = f" class={quoteattr(cls)}" if cls else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" font-weight="{weight}" '
            f'text-anchor="{anchor}" fill="{fill}"{c}>{escape(s)}</text>')


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def draw_plan(layout: FamilyLayout, plan: Plan, report: dict) -> str:
    topo = plan.topology
    stats = {(lk["prefill"], lk["decode"]): lk for lk in report["links"]}
    links = list(plan.links)
    elected_ranks = {lk.prefill for lk in links if lk.elected_for}
    casts = broadcasts(layout, plan)
    max_bytes = max((s["bytes"] for s in stats.values()), default=1) or 1

    # ~~~ rank columns ~~~
    draft = set(layout.draft_ids)

    def column(side, x: float, what: str) -> tuple[list[str], dict[RankId, _Box], float]:
        parts, boxes, y = [], {}, TOP
        parts.append(_text(x, y - 10, f"{what.upper()}  {_side(side)}", 13, "bold",
                           fill="#52606d", cls="column-label"))
        by_stage: dict[int, list[RankId]] = {}
        for r in side.ranks():
            by_stage.setdefault(r.pp, []).append(r)
        for stage, ranks in sorted(by_stage.items()):
            h = STAGE_HEAD + len(ranks) * (NODE_H + NODE_GAP) - NODE_GAP + STAGE_PAD
            ids = side.stages[stage]
            layers = _ranges(tuple(i for i in ids if i not in draft))
            extra = [i for i in ids if i in draft]
            parts.append(f'<g class="stage {what}" data-stage="{stage}" '
                         f'data-layers="{layers}">')
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W + 2 * STAGE_PAD}" '
                         f'height="{h:.1f}" rx="8" fill="#f4f6f8" stroke="#9aa5b1"/>')
            label = f"stage {stage}: layers {layers}" + (
                f" + draft {_ranges(tuple(extra))}" if extra else "")
            if len(label) * CHAR_W > NODE_W + 2 * STAGE_PAD - 8:
                label = label[: int((NODE_W + 2 * STAGE_PAD - 8) / CHAR_W) - 1] + "…"
            parts.append(_text(x + 8, y + 17, label, 12, "bold", cls="stage-label"))
            ny = y + STAGE_HEAD
            for r in ranks:
                box = _Box(x + STAGE_PAD, ny, NODE_W, NODE_H)
                boxes[r] = box
                ny += NODE_H + NODE_GAP
            parts.append("</g>")
            y += h + 16
        return parts, boxes, y

    px, dx = MARGIN, MARGIN + NODE_W + 2 * STAGE_PAD + COLUMN_GAP
    p_parts, p_boxes, p_end = column(topo.prefill, px, "prefill")
    d_parts, d_boxes, d_end = column(topo.decode, dx, "decode")
    width: float = dx + NODE_W + 2 * STAGE_PAD + MARGIN

    out_bytes: dict[RankId, int] = {}
    in_bytes: dict[RankId, int] = {}
    for lk in links:
        b = stats[(str(lk.prefill), str(lk.decode))]["bytes"]
        out_bytes[lk.prefill] = out_bytes.get(lk.prefill, 0) + b
        in_bytes[lk.decode] = in_bytes.get(lk.decode, 0) + b

    def node(r: RankId, box: _Box, what: str, flow: int) -> str:
        elected = what == "prefill" and r in elected_ranks
        cast = casts.get(r, ()) if what == "prefill" else ()
        stroke = "#b8860b" if elected else ("#52606d" if flow else "#c3cad3")
        attrs = (f'class="rank {what}" data-rank="{r}" data-bytes="{flow}" '
                 f'data-elected="{str(elected).lower()}" data-broadcast={quoteattr(",".join(cast))}')
        s = [f"<g {attrs}>",
             f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w}" height="{box.h}" rx="6" '
             f'fill="#ffffff" stroke="{stroke}" stroke-width="{2.5 if elected else 1.2}"/>',
             _text(box.x + 8, box.y + 17, f"{what} {r}", 12, "bold",
                   fill="#222" if flow else "#9aa5b1"),
             _text(box.x + 8, box.y + 34, (f"{'sends' if what == 'prefill' else 'receives'} "
                   f"{_mib(flow)}") if flow else "no link (a replica writes)", 11,
                   fill="#3e4c59" if flow else "#9aa5b1")]
        if elected:
            s.append(_text(box.x + box.w - 8, box.y + 17, "★ elected", 11, "bold", "end",
                           "#b8860b", "elected-mark"))
        if cast:
            s.append(_text(box.x + box.w - 8, box.y + 34, "⇉ broadcast", 11, "bold", "end",
                           "#2f7d32", "broadcast-mark"))
        s.append("</g>")
        return "\n".join(s)

    # ~~~ links ~~~
    edge_parts, badge_parts = [], []
    # Each rank's links leave and arrive at points spread over its side, in link order.
    outs: dict[RankId, list[int]] = {}
    ins: dict[RankId, list[int]] = {}
    for i, lk in enumerate(links):
        outs.setdefault(lk.prefill, []).append(i)
        ins.setdefault(lk.decode, []).append(i)

    def spread(box: _Box, order: list[int], i: int) -> float:
        k = order.index(i)
        return box.y + box.h * (k + 1) / (len(order) + 1)

    for i, lk in enumerate(links, 1):
        st = stats[(str(lk.prefill), str(lk.decode))]
        path = link_path(lk)
        color, dash = PATH_STYLE[path]
        a, b = p_boxes[lk.prefill], d_boxes[lk.decode]
        x1, y1 = a.x + a.w, spread(a, outs[lk.prefill], i - 1)
        x2, y2 = b.x - 4, spread(b, ins[lk.decode], i - 1)
        c1, c2 = x1 + COLUMN_GAP * 0.45, x2 - COLUMN_GAP * 0.45
        w = 1.5 + 5.5 * st["bytes"] / max_bytes
        d = st["descriptors"]
        title = (f"link {i}: {lk.prefill} -> {lk.decode}, {st['entries']} entries, "
                 f"{_mib(st['bytes'])} per request, descriptors {d['direct_contiguous']} "
                 f"contiguous / {d['direct_fragmented']} fragmented / "
                 f"{d['staged_fragmented']} staged, {PATH_WORDS[path]}")
        if lk.elected_for:
            title += f", elected writer of {', '.join(lk.elected_for)}"
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        edge_parts.append(
            f'<g class="link" data-link="{i}" data-prefill="{lk.prefill}" '
            f'data-decode="{lk.decode}" data-path="{path}" data-bytes="{st["bytes"]}" '
            f'data-entries="{st["entries"]}" data-descriptors="{d["direct_contiguous"]},'
            f'{d["direct_fragmented"]},{d["staged_fragmented"]}" '
            f'data-elected={quoteattr(",".join(lk.elected_for))}>'
            f"<title>{escape(title)}</title>"
            f'<path d="M{x1:.1f},{y1:.1f} C{c1:.1f},{y1:.1f} {c2:.1f},{y2:.1f} {x2:.1f},{y2:.1f}" '
            f'fill="none" stroke="{color}" stroke-width="{w:.1f}"{dash_attr} '
            f'marker-end="url(#arrow-{path})" opacity="0.9"/></g>')
        # The badge sits on the curve; staggered along it so neighbours do not cover each other.
        t = 0.3 + 0.4 * ((i - 1) % 5) / 4
        bx = ((1 - t) ** 3 * x1 + 3 * (1 - t) ** 2 * t * c1 + 3 * (1 - t) * t ** 2 * c2
              + t ** 3 * x2)
        by = ((1 - t) ** 3 * y1 + 3 * (1 - t) ** 2 * t * y1 + 3 * (1 - t) * t ** 2 * y2
              + t ** 3 * y2)
        badge_parts.append(
            f'<g class="badge" data-link="{i}"><circle cx="{bx:.1f}" cy="{by:.1f}" r="10" '
            f'fill="#ffffff" stroke="{color}" stroke-width="2"/>'
            + _text(bx, by + 4, str(i), 11, "bold", "middle", color) + "</g>")

    # ~~~ table of links ~~~
    cols = ("#", "link", "path", "entries", "MiB/req", "desc contig", "desc frag",
            "staged frag", "elected writer of")
    rows = []
    for i, lk in enumerate(links, 1):
        st = stats[(str(lk.prefill), str(lk.decode))]
        d = st["descriptors"]
        rows.append((str(i), f"{lk.prefill} -> {lk.decode}", link_path(lk), str(st["entries"]),
                     f"{st['bytes'] / 2**20:.2f}", f"{d['direct_contiguous']:,}",
                     f"{d['direct_fragmented']:,}", f"{d['staged_fragmented']:,}",
                     ", ".join(lk.elected_for) or "-"))
    widths = [max(len(c), *(len(r[k]) for r in rows)) if rows else len(c)
              for k, c in enumerate(cols)]
    table_y = max(p_end, d_end) + 40
    # One <text> per cell at a computed column (SVG collapses runs of spaces); numbers
    # right-aligned.
    xs: list[float] = []
    x: float = MARGIN
    for wd in widths:
        xs.append(x)
        x += (wd + 2) * CHAR_W
    numeric = {3, 4, 5, 6, 7}

    def cells(values, y: float, weight: str) -> list[str]:
        return [_text(xs[k] + (widths[k] * CHAR_W if k in numeric else 0), y, v, 12, weight,
                      "end" if k in numeric else "start") for k, v in enumerate(values)]

    line_w = x - MARGIN - 2 * CHAR_W
    table = [f'<g class="link-table" font-family="{FONT}">', *cells(cols, table_y, "bold"),
             f'<line x1="{MARGIN}" y1="{table_y + 6}" x2="{MARGIN + line_w:.1f}" '
             f'y2="{table_y + 6}" stroke="#9aa5b1"/>']
    for k, r in enumerate(rows):
        ty = table_y + 24 + 18 * k
        table.append(f'<g class="link-row" data-link="{r[0]}">'
                     + "".join(cells(r, ty, "normal")) + "</g>")
    table.append("</g>")
    table_end = table_y + 24 + 18 * len(rows)
    width = max(width, MARGIN * 2 + line_w)

    # ~~~ header, legend, footer ~~~
    total = sum(s["bytes"] for s in stats.values())
    cov = report["coverage"]
    head = [_text(MARGIN, 30, f"{plan.family}: prefill {_side(topo.prefill)} -> decode "
                  f"{_side(topo.decode)} over {topo.backend}", 16, "bold", cls="title"),
            _text(MARGIN, 52, f"request of {report['tokens']} tokens = {report['pages']} pages; "
                  f"{_mib(total)} over {len(links)} links; coverage: "
                  f"{'proven' if cov == 'proven' else 'FAILED'}", 12, cls="subtitle")]
    legend_y = table_end + 28
    legend = ['<g class="legend">']
    lx = MARGIN
    for path in ("direct", "staged", "mixed"):
        color, dash = PATH_STYLE[path]
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        legend.append(f'<line x1="{lx}" y1="{legend_y - 4}" x2="{lx + 36}" y2="{legend_y - 4}" '
                      f'stroke="{color}" stroke-width="3"{dash_attr}/>')
        legend.append(_text(lx + 44, legend_y, PATH_WORDS[path], 11))
        legend_y += 18
    legend.append(_text(lx, legend_y, "★ elected: the one prefill rank of its group that writes "
                        "replicated state (prefill tp > decode tp)", 11, fill="#b8860b"))
    legend.append(_text(lx, legend_y + 18, "⇉ broadcast: one prefill rank writes replicated "
                        "state to several decode ranks (prefill tp < decode tp)", 11,
                        fill="#2f7d32"))
    legend.append(_text(lx, legend_y + 36, "arrow width grows with the bytes of the link; "
                        "numbers refer to the table", 11, fill="#3e4c59"))
    legend.append("</g>")
    height = legend_y + 56
    width = max(width, MARGIN * 2 + 100 * CHAR_W)

    markers = "".join(
        f'<marker id="arrow-{p}" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="11" '
        f'markerHeight="11" markerUnits="userSpaceOnUse" orient="auto">'
        f'<path d="M0,0 L10,5 L0,10 z" '
        f'fill="{c}"/></marker>' for p, (c, _) in PATH_STYLE.items())
    body = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{FONT}" class="pdc-plan" '
        f'data-family="{escape(plan.family)}" data-digest="{report["plan_digest"]}">',
        f"<defs>{markers}</defs>",
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
        *head, *p_parts, *d_parts, *edge_parts,
        *(node(r, b, "prefill", out_bytes.get(r, 0)) for r, b in p_boxes.items()),
        *(node(r, b, "decode", in_bytes.get(r, 0)) for r, b in d_boxes.items()),
        *badge_parts, *table, *legend, "</svg>",
    ]
    return "\n".join(body) + "\n"


def _side(s) -> str:
    return f"tp={s.tp},pp={s.pp}" + (f",dp={s.dp}" if s.dp > 1 else "") + \
        f",page_size={s.page_size}"


def drawable(plan: Plan) -> str:
    """Why `plan` is too large to draw readably, or "" when it is not."""
    for what, side in (("prefill", plan.topology.prefill), ("decode", plan.topology.decode)):
        if side.tp * side.pp > MAX_DRAWN_RANKS:
            return (f"{what} has {side.tp * side.pp} ranks; a drawing shows at most "
                    f"{MAX_DRAWN_RANKS} per side")
    if len(plan.links) > MAX_DRAWN_LINKS:
        return f"the plan has {len(plan.links)} links; a drawing shows at most {MAX_DRAWN_LINKS}"
    return ""
