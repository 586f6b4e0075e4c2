"""Emit: validated specs -> generated Python modules under generated/<family>/.

Stage invariants:
- rendering is a pure function of the spec and the compiler's own sources: no clock, no
  absolute paths, no dict/set iteration order leaks into the text (`pdc check` compares
  bytes);
- templates are thin (compiler/templates/*.py.j2), fed by view models of ready-made strings;
  every name comes from naming.py, every literal from pysrc.py;
- every file starts with the @generated header (header.py) and parses as Python
  (templates.render checks it);
- all writes go through OutputSet (output.py): no duplicate paths, write-if-changed, atomic.

To add a module to every family, see Note [Family modules] in families.py.
"""

from .families import FAMILY_MODULES, ModuleEmitter, compile_specs
from .header import spec_fingerprint, spec_sha256
from .output import OutputSet

__all__ = [
    "FAMILY_MODULES",
    "ModuleEmitter",
    "OutputSet",
    "compile_specs",
    "spec_fingerprint",
    "spec_sha256",
]
