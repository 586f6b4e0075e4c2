"""What a module emitter receives and returns (Note [Family modules] in families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdc.runtime.layout_types import FamilyLayout

from ..model import Spec

if TYPE_CHECKING:
    from ..deployments import DeclaredPlan


@dataclass(frozen=True, slots=True)
class FamilyContext:
    """Everything known about one family when its modules are emitted."""

    spec: Spec  # the validated spec
    layout: FamilyLayout  # build_layout(spec)
    header: str  # the @generated header; compile_specs puts it on top of every module
    # the declared deployments' plans when the caller lowered them already (driver.build);
    # None: the plans emitter lowers them itself
    declared: tuple[DeclaredPlan, ...] | None = None


@dataclass(frozen=True, slots=True)
class GeneratedModule:
    name: str  # module name inside the family package, e.g. "layout" -> <family>/layout.py
    body: str  # module text without the header (a docstring may open it)
