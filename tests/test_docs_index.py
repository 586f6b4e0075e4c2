"""docs/index.md lists every page of docs/ and links the known limits."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _linked() -> set[str]:
    return set(re.findall(r"\]\(([\w.-]+\.md)\)", (DOCS / "index.md").read_text()))


def test_every_doc_is_listed():
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    missing = sorted(pages - _linked())
    assert not missing, f"list {', '.join(missing)} in docs/index.md"
    assert not sorted(_linked() - pages), "docs/index.md links pages that do not exist"


def test_open_questions_are_linked_as_known_limits():
    text = (DOCS / "index.md").read_text()
    assert "## Known limits\n- [open-questions.md](open-questions.md)" in text


def test_readme_says_how_a_cpu_only_user_avoids_cuda_wheels():
    readme = (DOCS.parent / "README.md").read_text()
    assert "**On a CPU-only machine with plain PyPI**" in readme
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
