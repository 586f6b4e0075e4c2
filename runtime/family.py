"""A family as one runtime object: all a serving process needs to know of a model family.

`Family.load("qwen38")` reads the family's generated module (pdc.generated.qwen38.layout):
its layout, spec hash and fingerprint, and backend matrix. From those it makes the plan for
any live topology with the same pure lowering the compiler proves (pdc.runtime.lowering),
and encodes and decodes the family's control-plane messages. Nothing here imports the
compiler, yaml, jsonschema or jinja2 (tests/runtime/test_family.py proves it in a
subprocess that blocks them).

The compiler builds the same object from a spec (pdc.compiler.family.family_of) for
specs evaluated with overrides (another page size or dtype), which have no generated module.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

from . import plan_codec
from . import wire as _wire
from .binding import Bound, Template
from .binding import bind as _bind
from .diagnostics import Location, SpecErrors
from .layout_types import BackendRule, FamilyLayout
from .lowering import lower
from .plan_types import Plan, Topology
from .topology import topology_from_args
from .wire import Message, RegEntry, Section, WireComponent


class FamilyNotFound(LookupError):
    """No generated module for the family (not compiled, or a name that is no family)."""


@dataclass(frozen=True, slots=True)
class Family:
    layout: FamilyLayout
    spec_sha256: str
    # First 8 bytes of the spec's sha256 as a little-endian u64: every message header carries
    # it, and a decoder rejects a peer whose spec differs.
    fingerprint: int
    backends: tuple[BackendRule, ...]  # empty: every known backend, no restrictions
    # Note [Bound families] in runtime/binding.py: the spec's formulas when it takes params
    # from the served model (None: a concrete spec), and (engine, architectures) it serves.
    template: Template | None = field(default=None, compare=False, repr=False)
    serves: tuple[str, tuple[str, ...]] | None = field(default=None, compare=False)
    bound: Bound | None = field(default=None, compare=False, repr=False)
    # The spec's declared deployments, lowered by `pdc compile` (generated/<family>/plans.py,
    # Note [Compact plans] in runtime/plan_codec.py): topology -> compact plan. A bound family
    # has none: its declared plans were lowered at the spec's example values.
    declared: Mapping[Topology, dict] = field(default_factory=dict, compare=False, repr=False)
    # What the wire decoder checks Register sections against, in spec order.
    wire_components: tuple[WireComponent, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire_components", tuple(
            WireComponent(c.name, c.tensors, (c.sentinel,)
                          if c.request_wide and c.sentinel is not None else c.layer_ids)
            for c in self.layout.components))

    @property
    def name(self) -> str:
        return self.layout.family

    @property
    def py_name(self) -> str:
        return self.layout.py_name

    # ~~~ loading ~~~

    @classmethod
    def load(cls, py_name: str) -> Family:
        """The family compiled under generated/<py_name>/ (e.g. "qwen38", "llama3_70b")."""
        if not py_name.isidentifier():
            raise FamilyNotFound(f"'{py_name}' is not a family module name (a Python "
                                 "identifier such as qwen38 or llama3_70b)")
        try:
            module = importlib.import_module(f"pdc.generated.{py_name}.layout")
        except ModuleNotFoundError as e:
            if e.name not in (f"pdc.generated.{py_name}", f"pdc.generated.{py_name}.layout"):
                raise
            raise FamilyNotFound(f"generated/{py_name}/layout.py is missing; run `pdc "
                                 "compile` on the family's spec") from None
        try:
            plans = importlib.import_module(f"pdc.generated.{py_name}.plans")
        except ModuleNotFoundError as e:
            if e.name != f"pdc.generated.{py_name}.plans":
                raise
            plans = None  # the spec declares no deployment
        return cls.from_module(module, plans)

    @classmethod
    def from_module(cls, module: ModuleType, plans: ModuleType | None = None) -> Family:
        declared = {plan_codec.topology_of(data): data
                    for _, data in getattr(plans, "PLANS", ())}
        return cls(module.LAYOUT, module.SPEC_SHA256, module.FINGERPRINT, module.BACKENDS,
                   getattr(module, "TEMPLATE", None), getattr(module, "SERVES", None),
                   declared=declared)

    # ~~~ binding ~~~

    @property
    def bindable(self) -> bool:
        return self.template is not None

    def bind(self, config: Mapping | None, engine: Mapping | None = None) -> Family:
        """This family bound to a served model's config and the engine's settings
        (`page_size`, `kv_dtype`); raises BindError naming the spec line, config key and
        value of every rule they break. A concrete family binds to itself."""
        if self.template is None:
            return self
        b = _bind(self.template, config, engine)
        return Family(b.layout, self.spec_sha256, b.fingerprint, self.backends, self.template,
                      self.serves, b)

    # ~~~ plans ~~~

    def topology(self, prefill: str, decode: str, backend: str) -> Topology:
        """Both sides from `tp=4,pp=2,dp=1,page_size=64` strings; raises SpecErrors naming
        the flag (--prefill, --decode, --backend) and the fix."""
        topo, errors = topology_from_args(self.layout, prefill, decode, backend)
        if errors or topo is None:
            raise SpecErrors(errors)
        return topo

    def plan(self, topology: Topology, loc: Location | None = None) -> Plan:
        """The plan for `topology`: a declared deployment's plan as `pdc compile` lowered it,
        else lowered now; SpecErrors names every rule it breaks (the backend matrix with its
        spec line, page sizes, TP divisibility)."""
        data = self.declared.get(topology)
        if data is not None:
            return plan_codec.decode(data)
        return lower(self.layout, topology, self.backends, loc)

    def is_declared(self, topology: Topology) -> bool:
        """Whether `plan(topology)` loads a plan `pdc compile` made (no lowering at start)."""
        return topology in self.declared

    def plan_for(self, prefill: str, decode: str, backend: str) -> Plan:
        return self.plan(self.topology(prefill, decode, backend))

    # ~~~ wire ~~~

    def encode(self, msg: Message) -> bytes:
        """`msg` as one complete message of this family; raises WireError if it does not fit."""
        return _wire.encode(msg, self.fingerprint, self.wire_components)

    def decode(self, buf: bytes | bytearray | memoryview) -> Message:
        """The one message in `buf`; raises WireError, naming the field, on anything malformed."""
        return _wire.decode(buf, self.fingerprint, self.wire_components)

    def registration_sections(self, buffers: Mapping[str, Iterable[RegEntry]]
                              ) -> tuple[Section, ...]:
        """Register.sections from component name -> registered entries (see
        pdc.runtime.wire.registration_sections)."""
        return _wire.registration_sections(self.wire_components, buffers)
