"""The runtime's line budget (style anchors): no file under runtime/ is over 600 lines, so each
stays small enough to read in one sitting. A file that grows past it is split by concept (as
runtime/endpoints/ and runtime/wire_*.py are), not trimmed of comments."""

from __future__ import annotations

from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
MAX_LINES = 600


def over_budget(root: Path, max_lines: int) -> list[str]:
    """'path: N lines' of every .py file under root with more than max_lines lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > max_lines:
            out.append(f"{path.relative_to(root.parent)}: {n} lines")
    return out


def test_no_runtime_file_is_over_600_lines():
    files = sorted(RUNTIME.rglob("*.py"))
    assert len(files) > 20  # the walk found the runtime, not an empty folder
    over = over_budget(RUNTIME, MAX_LINES)
    assert not over, f"runtime files over {MAX_LINES} lines (split them by concept): " + \
        "; ".join(over)


def test_the_budget_names_the_file_and_its_count(tmp_path):
    root = tmp_path / "runtime"
    (root / "engines").mkdir(parents=True)
    (root / "small.py").write_text("x = 1\n" * 600)
    (root / "engines" / "big.py").write_text("x = 1\n" * 601)
    assert over_budget(root, MAX_LINES) == ["runtime/engines/big.py: 601 lines"]
