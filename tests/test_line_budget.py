"""The line budget of product code (style anchors): no file under compiler/, runtime/,
integrations/ or pdc/ (the command line, its verification and serving-demo rooms included)
is over 600 lines, so each stays small enough to read in one sitting. A file that grows past
it is split by concept (as runtime/endpoints/, runtime/wire_*.py, compiler/model*.py and
pdc/commands/ are), not trimmed of comments. generated/ is the compiler's output, not
written by hand, and is not counted."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 600

# folder -> at least this many .py files: the walk found the folder, not an empty one.
PRODUCT = {"compiler": 20, "runtime": 20, "integrations": 10, "pdc": 20}


def over_budget(root: Path, max_lines: int) -> list[str]:
    """'path: N lines' of every .py file under root with more than max_lines lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > max_lines:
            out.append(f"{path.relative_to(root.parent)}: {n} lines")
    return out


@pytest.mark.parametrize("folder", sorted(PRODUCT))
def test_no_product_file_is_over_600_lines(folder):
    root = REPO / folder
    assert len(list(root.rglob("*.py"))) >= PRODUCT[folder]
    over = over_budget(root, MAX_LINES)
    assert not over, f"{folder}/ files over {MAX_LINES} lines (split them by concept): " + \
        "; ".join(over)


def test_the_budget_names_the_file_and_its_count(tmp_path):
    root = tmp_path / "runtime"
    (root / "engines").mkdir(parents=True)
    (root / "small.py").write_text("x = 1\n" * 600)
    (root / "engines" / "big.py").write_text("x = 1\n" * 601)
    assert over_budget(root, MAX_LINES) == ["runtime/engines/big.py: 601 lines"]
