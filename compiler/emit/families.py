"""compile_specs: validated specs -> every generated file, in one OutputSet.

Note [Family modules]: each family gets a package generated/<py_name>/ whose modules are
produced by the emitters in FAMILY_MODULES, one function per module, each taking a
FamilyContext and returning a GeneratedModule (name + body). Adding a module to every
family (kernels.py, ...) means writing one such function and appending it to the
list; compile_specs puts the @generated header on top and the file into the OutputSet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ..deployments import DeclaredPlan
from ..diagnostics import Diagnostic, SpecErrors
from ..layout import build_layout
from ..model import Spec
from .context import FamilyContext, GeneratedModule
from .header import generated_header
from .kernels_module import emit as emit_kernels
from .layout_module import emit as emit_layout
from .naming import family_import, family_module, family_package
from .output import OutputSet
from .plans_module import emit as emit_plans
from .pysrc import docstring_text, wrap


def package_init(ctx: FamilyContext) -> GeneratedModule:
    """generated/<family>/__init__.py: only a docstring; modules are imported one by one."""
    spec = ctx.spec
    lines = [f'"""Generated code of the {spec.family} family.']
    if spec.description:
        lines += ["", *wrap(docstring_text(spec.description))]
    lines += ["", f"Modules are imported one by one, e.g. {family_import(spec, 'layout')}.", '"""']
    return GeneratedModule("__init__", "\n".join(lines) + "\n")


# An emitter returns None for a module the family does not have (plans.py without declared
# deployments).
ModuleEmitter = Callable[[FamilyContext], GeneratedModule | None]

# One entry per generated module of every family (Note [Family modules]).
FAMILY_MODULES: list[ModuleEmitter] = [
    package_init,
    emit_layout,
    emit_kernels,
    emit_plans,
]


def compile_specs(specs: Iterable[Spec],
                  declared: Mapping[str, tuple[DeclaredPlan, ...]] | None = None) -> OutputSet:
    """Render every module of every family in memory. Raises SpecErrors (all of them) when a
    spec cannot be emitted, e.g. two specs claim one package or a name clashes. `declared`:
    the declared deployments' plans by spec path, where the caller lowered them already."""
    out = OutputSet()
    errors: list[Diagnostic] = []
    owner: dict[str, Spec] = {}
    for spec in specs:
        pkg = family_package(spec)
        if pkg in owner:
            other = owner[pkg]
            errors.append(Diagnostic(
                spec.loc, f"family '{spec.family}' would be generated into generated/{pkg}/, "
                f"which family '{other.family}' of {other.path} already uses",
                "give every spec its own family name"))
            continue
        owner[pkg] = spec
        ctx = FamilyContext(spec, build_layout(spec), generated_header(spec),
                            (declared or {}).get(spec.path))
        for emit in FAMILY_MODULES:
            try:
                module = emit(ctx)
            except SpecErrors as e:
                errors.extend(e.diagnostics)
                continue
            if module is None:
                continue
            out.add(family_module(spec, module.name), ctx.header + module.body)
    if errors:
        raise SpecErrors(errors)
    return out
