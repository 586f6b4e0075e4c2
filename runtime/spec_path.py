"""Which family serves a model: the user's specs first (PDC_SPEC_PATH), then pdc's own.

Note [Spec path]: an integration asks for the family of an (engine, architecture) pair,
e.g. ("sglang", "LlamaForCausalLM"). Folders named by the integration's setting and by the
environment variable PDC_SPEC_PATH (os.pathsep-separated) are searched first, in order, for
`*.yaml` specs; then the families compiled into pdc's package (generated/). A spec matches
when its `serves` names the engine and the architecture. A user spec is compiled on first
use by `pdc compile SPEC --out DIR`, run as a subprocess (the runtime never imports the
compiler), into a cache folder outside the package keyed by the sha256 of the spec's bytes
and pdc's version (PDC_SPEC_CACHE, default ~/.cache/pdc/specs); a spec compiled ahead of time
with `pdc compile --out DIR` is found by naming DIR in PDC_SPEC_PATH: every folder under it
with a generated layout.py is a family. Several processes of one server (prefill, decode, TP
workers) may compile the same spec at once: each writes its own temporary folder and renames
it into place, and the loser of the race uses the winner's. An architecture found nowhere is
refused naming every place pdc looked.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pkgutil
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType

from .family import Family, FamilyNotFound

ENV = "PDC_SPEC_PATH"
CACHE_ENV = "PDC_SPEC_CACHE"
_PDC_VERSION = "0.1.0"  # part of the cache key: another pdc compiles into another folder


class SpecPathError(FamilyNotFound):
    """A user spec could not be compiled or loaded; the message carries the compiler's
    located errors."""


def search_folders(extra: Iterable[str] = ()) -> list[Path]:
    """The folders to search: the integration's setting, then PDC_SPEC_PATH."""
    env = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    return [Path(p).expanduser() for p in [*extra, *env]]


def cache_root() -> Path:
    given = os.environ.get(CACHE_ENV)
    return Path(given).expanduser() if given else Path.home() / ".cache" / "pdc" / "specs"


def _load_layout(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SpecPathError(f"{path}: cannot be imported as a generated layout module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _families_under(root: Path, key: str) -> list[Family]:
    """Every generated family package directly under `root` (`<py_name>/layout.py`)."""
    out = []
    for layout in sorted(root.glob("*/layout.py")):
        name = f"pdc_user_{key}_{layout.parent.name}"
        plans = layout.with_name("plans.py")  # the spec's declared deployments, if any
        out.append(Family.from_module(_load_layout(layout, f"{name}.layout"),
                                      _load_layout(plans, f"{name}.plans")
                                      if plans.exists() else None))
    return out


def compile_user_spec(path: Path, cache: Path | None = None) -> list[Family]:
    """The families of one user spec, compiled into the cache on first use."""
    data = path.read_bytes()
    key = hashlib.sha256(data + _PDC_VERSION.encode()).hexdigest()[:20]
    root = (cache or cache_root()) / key
    if not (root / ".complete").exists():
        tmp = root.with_name(f"{key}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        r = subprocess.run([sys.executable, "-m", "pdc", "compile", str(path), "--out",
                            str(tmp)], capture_output=True, text=True, check=False)
        if r.returncode:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SpecPathError(f"pdc: the spec {path} (from {ENV}) does not compile:\n"
                                + (r.stderr or r.stdout).rstrip())
        (tmp / ".complete").write_text(str(path) + "\n")
        try:
            tmp.rename(root)
        except OSError:  # another process of this server won the race: use its folder
            shutil.rmtree(tmp, ignore_errors=True)
    return _families_under(root, key)


def package_families() -> list[Family]:
    """The families compiled into pdc's package (generated/) that say what they serve."""
    pkg = importlib.import_module("pdc.generated")
    out = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.ispkg:
            try:
                out.append(Family.load(info.name))
            except FamilyNotFound:
                continue
    return [f for f in out if f.serves is not None]


def find_family(engine: str, architecture: str, folders: Sequence[Path] | None = None,
                cache: Path | None = None) -> Family:
    """The family that serves `architecture` on `engine` (Note [Spec path]); raises
    FamilyNotFound naming where pdc looked and what it found there."""
    folders = search_folders() if folders is None else list(folders)
    seen: list[str] = []
    for folder in folders:
        if not folder.is_dir():
            seen.append(f"{folder} (not a folder)")
            continue
        found = []
        for path in sorted(folder.glob("*.yaml")):
            found.extend(compile_user_spec(path, cache))
        key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
        found.extend(_families_under(folder, key))
        for fam in found:
            if _serves(fam, engine, architecture):
                return fam
        seen.append(f"{folder} ({_list(found, engine)})")
    own = package_families()
    for fam in own:
        if _serves(fam, engine, architecture):
            return fam
    where = "; ".join(seen) if seen else f"{ENV} is not set"
    raise FamilyNotFound(
        f"pdc has no spec for architecture {architecture} served by {engine}; looked in: "
        f"{where}; pdc's package ({_list(own, engine)})\n  hint: write a spec with "
        f"`serves: {{engine: {engine}, architectures: [{architecture}]}}` (docs/"
        f"adding-a-family.md) into a folder and name it in {ENV}")


def _serves(fam: Family, engine: str, architecture: str) -> bool:
    return fam.serves is not None and fam.serves[0] == engine and architecture in fam.serves[1]


def _list(families: list[Family], engine: str) -> str:
    archs = sorted({a for f in families if f.serves and f.serves[0] == engine
                    for a in f.serves[1]})
    return f"{engine} specs for {', '.join(archs)}" if archs else f"no {engine} spec"
