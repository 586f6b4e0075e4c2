"""No document cites a file the repository lacks.

Every repository path that README.md, the other top-level *.md files and docs/*.md mention (in
prose, code, or a link) must exist. A path counts as a repository path when its first part is
a top-level entry of the repository (`compiler/lower.py`, `specs/qwen38.yaml`), when it is a
link target (resolved from the document's folder, as a Markdown viewer does), or when it is a
bare Markdown file name (`DESIGN.md`). Left alone: `../shared/...` (the shared folder beside
the repository), URLs and absolute paths, what a command or the reader makes (MADE), and
templates (`generated/<family>/layout.py`,
`specs/hf-*.yaml`, `bad_specs/NAME.patch`). A line suffix (`compiler/lower.py:22-35`), pytest
node id (`tests/x.py::test_y`) or anchor (`docs/x.md#part`) is not part of the path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted(REPO.glob("*.md")) + sorted((REPO / "docs").glob("*.md"))
# Top-level entries a path may start with: whatever the repository holds, plus the places
# that documents may name before they exist in a checkout (built or made by a command).
TOP = {p.name for p in REPO.iterdir()}
# What a command makes (scripts/install.sh makes .venv/; a GPU run carries the wheels it
# gathers in the ignored .whl/, bench/run_gpu*.sh, and the older trees it compares against in
# the ignored build/gpurun/, bench/results/*/run.sh) and what docs/adding-a-family.md has the
# reader write, as its worked example: cited, but no file of a checkout.
MADE = {".venv", ".whl", "build", "specs/hf-qwen2.yaml", "generated/hf_qwen2"}
# A run of path characters with at least one slash, or a bare *.md name.
_PATH = re.compile(r"(?<![\w./<>*{}-])((?:\.\.?/)?[\w.-]+(?:/[\w.<>*{}-]*)+|[\w.-]+\.md)"
                   r"(?![\w<>*{}(-])")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_TEMPLATE = re.compile(r"[<>*{}]|\bNAME\b|\bN\b|\.\.\.")


def _cut(path: str) -> str:
    path = path.split("::", 1)[0].split("#", 1)[0]
    path = re.sub(r":\d[\d:,-]*$", "", path)
    return path.rstrip(".,;:")


def _cited(doc: Path) -> list[tuple[int, str, Path]]:
    """(line number, path as written, where it must exist) for every path `doc` cites."""
    out = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        links = {m.group(1) for m in _LINK.finditer(line)}
        for m in _LINK.finditer(line):
            target = _cut(m.group(1))
            if not target or "://" in target or target.startswith(("/", "mailto:", "../shared")):
                continue
            if not _TEMPLATE.search(target):
                out.append((n, m.group(1), doc.parent / target))
        for m in _PATH.finditer(line):
            written = m.group(1)
            path = _cut(written)
            if written in links or not path or _TEMPLATE.search(path):
                continue
            if path.startswith("../shared/") or path == "../shared":
                continue
            first = path.split("/", 1)[0]
            if first in MADE or path.rstrip("/") in MADE:
                continue
            if "/" in path and first in TOP:
                out.append((n, written, REPO / path))
            elif "/" not in path and path.endswith(".md"):
                # a bare Markdown name: beside the document or at the top
                here = doc.parent / path
                out.append((n, written, here if here.exists() else REPO / path))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_cited_path_exists(doc):
    missing = [f"{doc.relative_to(REPO)}:{n}: {written}" for n, written, path in _cited(doc)
               if not path.exists()]
    assert missing == []


def test_the_checker_sees_paths_in_prose_code_and_links(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("See `compiler/lower.py:22-35` and [the spec](../specs/qwen38.yaml);\n"
                   "run tests/parity/test_parity.py::test_one, read DESIGN.md and\n"
                   "../shared/reference/x.md, not generated/<family>/layout.py or\n"
                   "https://example.org/a/b.md.\n")
    cited = _cited(doc)
    assert [(n, w) for n, w, _ in cited] == [
        (1, "../specs/qwen38.yaml"), (1, "compiler/lower.py"),
        (2, "tests/parity/test_parity.py"), (2, "DESIGN.md")]
    assert cited[1][2] == REPO / "compiler" / "lower.py"
    assert cited[3][2] == REPO / "DESIGN.md"
