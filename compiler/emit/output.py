"""OutputSet: every generated file passes through one in-memory set before touching disk.

Invariants:
- a path is produced once (`add` rejects a second text for the same path, which would mean
  two emitters, or two specs, claim one file);
- `commit` writes only files whose bytes changed, each through a temp file in the same folder
  and `os.replace`, so a reader never sees half a file and unchanged files keep their mtime;
- `diff` compares without writing: it is what `pdc check` runs.

Paths are relative to the output root (`generated/`), POSIX style, and always end in a file
name. Text is written as UTF-8 with `\\n` line ends whatever the platform.

Note [Orphans]: a `.py` file under the root that the set does not produce is an orphan (a
renamed family, a removed module): left alone it would still import and mislead. The root's
own `__init__.py` is the `pdc.generated` package marker, produced by no spec, so it is never
an orphan; neither is anything under `__pycache__`.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from .header import is_generated


class OutputConflict(ValueError):
    """Two producers claimed the same output path."""


class OutputSet:
    def __init__(self) -> None:
        self._files: dict[str, str] = {}

    def add(self, relpath: str, text: str) -> None:
        p = PurePosixPath(relpath)
        if p.is_absolute() or ".." in p.parts or not p.name:
            raise ValueError(f"output path {relpath!r} must be relative and inside the root")
        key = p.as_posix()
        if key in self._files:
            raise OutputConflict(f"output {key} is produced twice")
        self._files[key] = text

    def __contains__(self, relpath: str) -> bool:
        return relpath in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._files))

    def __len__(self) -> int:
        return len(self._files)

    def text(self, relpath: str) -> str:
        return self._files[relpath]

    # ~~~ comparing with disk ~~~

    def stale(self, root: Path) -> list[str]:
        """Paths whose file is missing under `root` or holds other bytes, sorted."""
        return [p for p in self if _read(root / p) != self._files[p].encode()]

    def orphans(self, root: Path) -> list[str]:
        """`.py` files under `root` that the set does not produce (Note [Orphans]), sorted."""
        if not root.is_dir():
            return []
        out = []
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).as_posix()
            if "__pycache__" in f.relative_to(root).parts or rel == "__init__.py":
                continue
            if rel not in self._files and f.is_file():
                out.append(rel)
        return sorted(out)

    def diff(self, root: Path, label: str | None = None) -> tuple[str, list[str], list[str]]:
        """(unified diff of disk -> set, stale paths, orphan paths); writes nothing.

        File names in the diff are `label/<path>` (default: `root` as given), with the
        usual a/ and b/ prefixes; a missing file diffs against /dev/null. Orphans are listed,
        not diffed.
        """
        prefix = str(root) if label is None else label
        chunks = []
        stale = self.stale(root)
        for p in stale:
            old = _read(root / p)
            old_lines = [] if old is None else old.decode("utf-8", "replace").splitlines(True)
            new_lines = self._files[p].splitlines(True)
            chunks.append("".join(difflib.unified_diff(
                old_lines, new_lines,
                fromfile="/dev/null" if old is None else f"a/{prefix}/{p}",
                tofile=f"b/{prefix}/{p}",
            )))
        return "".join(c if c.endswith("\n") else c + "\n" for c in chunks), stale, \
            self.orphans(root)

    # ~~~ writing ~~~

    def commit(self, root: Path) -> list[str]:
        """Write the files that changed under `root`; returns their paths, sorted."""
        changed = self.stale(root)
        for p in changed:
            _write_atomic(root / p, self._files[p].encode())
        return changed

    def remove_orphans(self, root: Path) -> tuple[list[str], list[str]]:
        """Delete orphans that carry pdc's @generated header; keep (and return) the others.

        Returns (removed, kept). A folder left empty (but for `__pycache__`) is removed too.
        """
        removed, kept = [], []
        for p in self.orphans(root):
            f = root / p
            data = _read(f) or b""
            if is_generated(data.decode("utf-8", "replace")):
                f.unlink()
                removed.append(p)
                _prune_empty_dirs(f.parent, root)
            else:
                kept.append(p)
        return removed, kept


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _prune_empty_dirs(folder: Path, root: Path) -> None:
    while folder != root and root in folder.parents:
        entries = [e for e in folder.iterdir() if e.name != "__pycache__"]
        if entries:
            return
        cache = folder / "__pycache__"
        if cache.is_dir():
            for f in cache.iterdir():
                f.unlink()
            cache.rmdir()
        folder.rmdir()
        folder = folder.parent
