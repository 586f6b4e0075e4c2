#!/usr/bin/env python3
"""mypy on pdc.compiler and pdc.runtime, with the configuration in pyproject.toml ([tool.mypy]).

Note [Type checking through a link tree]: the source tree keeps compiler/, runtime/ and
generated/ at the top level and setup.py maps them onto pdc.compiler, pdc.runtime and
pdc.generated (Note [Package layout]). The editable install resolves that mapping with an
import hook, which mypy cannot follow, and mypy has no setting that maps a package name onto
another folder. So this script builds the `pdc` package as mypy must see it, a folder of
symbolic links in a temporary directory, runs mypy on it, and prints mypy's report with the
repository's own paths (runtime/wire.py, not <tmp>/pdc/runtime/wire.py).

    python scripts/typecheck.py            # what CI (.ci/run) runs
    python scripts/typecheck.py -- --strict  # extra mypy flags after `--`

Exit status: mypy's (0 clean, 1 type errors, 2 a usage or configuration error).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Package -> folder, as setup.py's ROOTS; the CLI package `pdc` itself is ROOT/pdc.
SUBPACKAGES = {"compiler": "compiler", "runtime": "runtime", "generated": "generated",
               "integrations": "integrations"}
CHECKED = ("pdc.compiler", "pdc.runtime")


def link_tree(tmp: Path) -> Path:
    pkg = tmp / "pdc"
    pkg.mkdir()
    for f in (ROOT / "pdc").iterdir():
        if f.suffix == ".py" or (f / "__init__.py").is_file():  # modules and pdc.verify
            (pkg / f.name).symlink_to(f)
    for name, folder in SUBPACKAGES.items():
        (pkg / name).symlink_to(ROOT / folder, target_is_directory=True)
    return pkg


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    with tempfile.TemporaryDirectory(prefix="pdc-mypy-") as tmp_dir:
        tmp = Path(tmp_dir)
        pkg = link_tree(tmp)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(tmp / "cache"), *extra]
        for name in CHECKED:
            cmd += ["-p", name]
        env = dict(os.environ, MYPYPATH=str(tmp))
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        prefixes = [(f"{pkg}/{name}/", f"{folder}/") for name, folder in SUBPACKAGES.items()]
        prefixes.append((f"{pkg}/", "pdc/"))
        for stream, text in ((sys.stdout, run.stdout), (sys.stderr, run.stderr)):
            for old, new in prefixes:
                text = text.replace(old, new)
            stream.write(text)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
