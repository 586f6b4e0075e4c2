"""Plot BENCHMARKS.md's main tables from the JSON results under bench/results/.

    python bench/plot_results.py [--results bench/results] [--out docs/plots]

One PNG per table, read from the run the table cites (the newest run that has the file when
several do, e.g. run 3 for the kernels):

- `kernels.png` (a): gather and scatter GB/s as a ratio of a contiguous copy, per page size
  and dtype, with the 0.95 goal;
- `p2p_request.png` (b): GB/s of one 8K-token request GPU0 -> GPU1 per path, with the
  contiguous P2P limit and the 0.90 goal;
- `hetero_tp.png` (c): GB/s of TP2 -> TP1 merge and TP1 -> TP2 split per path, 0.85 goal;
- `control_cost.png` (d): per-descriptor speedup of pdc's descriptor path over SGLang's
  `send_kvcache` per request size, page size and page layout (log scale, 20x goal);
- `endpoints.png` (f): GB/s of the staged and the direct path over Mooncake and NIXL on CPU.

Every number is read from the JSON; nothing is typed in here. matplotlib (in the test extra)
draws with the Agg backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)

REPO = Path(__file__).resolve().parent.parent
DIRECT, STAGED, LIMIT = "#1f6fb4", "#d9730d", "#7b8794"


def newest(results: Path, name: str, pattern: str = "*") -> Path:
    """The file `name` of the newest run (by folder name) matching `pattern` that has it."""
    found = sorted(p for p in results.glob(f"{pattern}/{name}"))
    if not found:
        raise SystemExit(f"plot_results: error: no {pattern}/{name} under {results}")
    return found[-1]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def _finish(fig, ax, title: str, source: Path, out: Path) -> Path:
    ax.set_title(title, fontsize=11, loc="left")
    fig.text(0.01, 0.005, f"from {source.relative_to(REPO) if source.is_relative_to(REPO) else source}",
             fontsize=7, color="#52606d")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_kernels(results: Path, out: Path) -> Path:
    src = newest(results, "kernels.json", "*h200*")
    rows = [r for r in load(src)["rows"] if r["tiling"] == "default"]
    cases = sorted({(r["page"], r["dtype"]) for r in rows})
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.38
    for k, (op, color) in enumerate((("gather", DIRECT), ("scatter", STAGED))):
        ratios = [next(r["ratio_to_copy"] for r in rows if (r["page"], r["dtype"]) == c
                       and r["op"] == op) for c in cases]
        xs = [i + (k - 0.5) * width for i in range(len(cases))]
        bars = ax.bar(xs, ratios, width, label=op, color=color)
        ax.bar_label(bars, fmt="%.3f", fontsize=7, padding=2)
    ax.axhline(0.95, color="#c62828", linestyle="--", linewidth=1, label="goal 0.95")
    ax.set_xticks(range(len(cases)), [f"page {p}\n{d}" for p, d in cases], fontsize=8)
    ax.set_ylim(0.85, 1.01)
    ax.set_ylabel("GB/s / contiguous copy GB/s")
    ax.legend(fontsize=8, loc="lower right")
    return _finish(fig, ax, "(a) gather/scatter kernels vs a contiguous D2D copy (H200)",
                   src, out / "kernels.png")


def _hbars(ax, labels, values, colors, limit: float, goal: float, goal_label: str):
    ys = range(len(labels))
    bars = ax.barh(ys, values, color=colors)
    ax.bar_label(bars, [f"{v:,.1f}  ({v / limit:.3f})" for v in values], fontsize=7,
                 padding=3)
    ax.axvline(goal * limit, color="#c62828", linestyle="--", linewidth=1, label=goal_label)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (ratio to the contiguous P2P copy)")
    ax.set_xlim(0, limit * 1.25)
    ax.legend(fontsize=8, loc="lower right")


def _color(path_text: str) -> str:
    text = path_text.lower()
    if "contiguous p2p" in text or "torch copy_" in text:
        return LIMIT
    return STAGED if "staged" in text else DIRECT


def plot_p2p(results: Path, out: Path) -> Path:
    src = newest(results, "p2p_request.json", "*h200x2-run2*")
    rows = [r for r in load(src)["rows"] if "tiling" not in r["case"]]
    limit = next(r["gbps"] for r in rows if "contiguous P2P" in r["case"])
    fig, ax = plt.subplots(figsize=(8, 3.8))
    _hbars(ax, [r["case"] for r in rows], [r["gbps"] for r in rows],
           [_color(r["case"]) for r in rows], limit, 0.90, "goal 0.90")
    return _finish(fig, ax, "(b) one 8K-token request GPU0 -> GPU1 through the runtime",
                   src, out / "p2p_request.png")


def plot_hetero(results: Path, out: Path) -> Path:
    src = newest(results, "hetero_tp.json", "*h200x2-run2*")
    rows = load(src)["rows"]
    limit = max(r["gbps"] for r in rows if r["path"] == "torch copy_")
    fig, ax = plt.subplots(figsize=(8, 3.4))
    _hbars(ax, [r["case"] for r in rows], [r["gbps"] for r in rows],
           [_color(r["case"] + r["path"]) for r in rows], limit, 0.85, "goal 0.85")
    return _finish(fig, ax, "(c) heterogeneous TP over NVLink (H200)", src, out / "hetero_tp.png")


def plot_control_cost(results: Path, out: Path) -> Path:
    src = newest(results, "control_cost.json", "*cpu-run2*")
    rows = [r for r in load(src)["rows"] if r["system"] == "pdc"
            and r["path"] == "descriptors (build_descriptors)"
            and r.get("per_desc_speedup_vs_sglang")]
    rows.sort(key=lambda r: (r["tokens"], r["page"], r["layout"]))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = [f"{r['tokens'] // 1024}K p{r['page']}\n{r['layout'][:4]}" for r in rows]
    values = [r["per_desc_speedup_vs_sglang"] for r in rows]
    colors = [STAGED if r["layout"] == "fragmented" else DIRECT for r in rows]
    bars = ax.bar(range(len(rows)), values, color=colors)
    ax.bar_label(bars, [f"{v:.1f}x" if v < 10 else f"{v:.0f}x" for v in values], fontsize=7,
                 padding=2)
    ax.axhline(20, color="#c62828", linestyle="--", linewidth=1, label="goal 20x")
    ax.axhline(1, color=LIMIT, linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("per-descriptor speedup vs SGLang (log)")
    from matplotlib.patches import Patch

    handles = [Patch(color=DIRECT, label="contiguous pages"),
               Patch(color=STAGED, label="fragmented pages"),
               *ax.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    return _finish(fig, ax, "(d) CPU cost per descriptor: pdc vs SGLang 0.5.23 send_kvcache",
                   src, out / "control_cost.png")


def plot_endpoints(results: Path, out: Path) -> Path:
    src = newest(results, "endpoints.json", "*cpu-endpoints*")
    rows = load(src)["rows"]
    cases = list(dict.fromkeys(r["case"].rsplit(" ", 1)[0] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.38
    for k, (path, color) in enumerate((("direct", DIRECT), ("staged", STAGED))):
        vals = [next(r["gbps"] for r in rows if r["case"] == f"{c} {path}") for c in cases]
        xs = [i + (k - 0.5) * width for i in range(len(cases))]
        bars = ax.bar(xs, vals, width, label=path, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(range(len(cases)), [c.replace(" ", "\n", 1) for c in cases], fontsize=7)
    ax.set_ylabel("GB/s (2-core CPU VM)")
    ax.legend(fontsize=8)
    return _finish(fig, ax, "(f) endpoints on CPU: staged vs direct path over real engines",
                   src, out / "endpoints.png")


PLOTS = (plot_kernels, plot_p2p, plot_hetero, plot_control_cost, plot_endpoints)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "plots")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for plot in PLOTS:
        print(f"plot_results: wrote {plot(args.results, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
