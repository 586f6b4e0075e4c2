"""The runtime's Family: loaded from the generated module, it plans any topology without the
compiler, and equals the family the compiler builds from the spec."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pdc.compiler.family import family_of, plan_spec
from pdc.compiler.frontend import load_spec
from pdc.runtime.diagnostics import SpecErrors
from pdc.runtime.family import Family, FamilyNotFound

REPO = Path(__file__).resolve().parents[2]
SPECS = sorted((REPO / "specs").glob("*.yaml"))


def _spec(path: Path):
    return load_spec(path.relative_to(REPO).as_posix())


# A fresh interpreter in which yaml, jsonschema, jinja2 and the compiler cannot be imported
# at all: importing the runtime and every generated module and planning two topologies must
# still work.
_BLOCKED_RUN = """
import importlib, importlib.abc, json, pkgutil, sys

BLOCKED = ("yaml", "jsonschema", "jinja2", "pdc.compiler")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Block())
import pdc.generated
import pdc.runtime
from pdc.runtime.family import Family

modules = []
for fam in pkgutil.iter_modules(pdc.generated.__path__):
    for mod in pkgutil.iter_modules([f"{pdc.generated.__path__[0]}/{fam.name}"]):
        name = f"pdc.generated.{fam.name}.{mod.name}"
        importlib.import_module(name)
        modules.append(name)
    Family.load(fam.name)
plans = {}
for name, prefill, decode in [("qwen38", "tp=4", "tp=1"), ("glm52", "tp=8,pp=2", "tp=4")]:
    plan = Family.load(name).plan_for(prefill, decode, "mooncake")
    plans[name] = [len(plan.prefill), len(plan.decode), len(plan.links), plan.digest()]
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("yaml", "jsonschema", "jinja2")
                or m.startswith("pdc.compiler"))
print(json.dumps({"modules": modules, "plans": plans, "leaked": leaked}))
"""


def test_runtime_plans_without_the_compiler_yaml_jsonschema_or_jinja2():
    result = subprocess.run([sys.executable, "-c", _BLOCKED_RUN], capture_output=True,
                            text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["leaked"] == []
    families = sorted({m.split(".")[2] for m in got["modules"]})
    assert families == sorted(_spec(s).py_name for s in SPECS)
    assert "pdc.generated.qwen38.layout" in got["modules"]
    # The same plans as the compiler's front end makes from the YAML.
    for name, stem, prefill, decode, counts in [
            ("qwen38", "qwen38", "tp=4", "tp=1", [4, 1, 4]),
            ("glm52", "glm52", "tp=8,pp=2", "tp=4", [16, 4, 8])]:
        _, plan = plan_spec(_spec(REPO / "specs" / f"{stem}.yaml"), prefill, decode, "mooncake")
        assert got["plans"][name] == [*counts, plan.digest()], name
        assert [len(plan.prefill), len(plan.decode), len(plan.links)] == counts


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_loaded_family_equals_the_family_of_the_spec(path):
    spec = _spec(path)
    family = Family.load(spec.py_name)
    assert family == family_of(spec)
    assert family.name == spec.family and family.py_name == spec.py_name
    wire = importlib.import_module(f"pdc.generated.{spec.py_name}.wire")
    assert family.wire_components == wire.WIRE_COMPONENTS
    assert family.fingerprint == wire.FINGERPRINT


def test_family_plan_rejects_a_topology_naming_the_backend_rule():
    family = Family.load("qwen38")
    with pytest.raises(SpecErrors) as e:
        family.plan_for("tp=4", "tp=1", "nixl")
    [d] = e.value.diagnostics
    assert d.message == (
        "backend 'nixl' does not support heterogeneous attention TP (prefill tp=4, decode "
        "tp=1): rule `hetero_attention_tp: false` at specs/qwen38.yaml:114:3 (seed: NIXL fails "
        "fast on heterogeneous Qwen3.8 attention TP)")
    assert d.hint == "use equal attention TP on both sides, or a backend that allows it: mooncake, local"


def test_family_topology_errors_name_the_flag():
    with pytest.raises(SpecErrors) as e:
        Family.load("qwen38").plan_for("tp=four", "tp=1", "mooncake")
    assert str(e.value.diagnostics[0].loc) == "--prefill"
    assert e.value.diagnostics[0].message == "tp in --prefill must be a positive integer, got 'four'"


@pytest.mark.parametrize("name,message", [
    ("no_such_family", "generated/no_such_family/layout.py is missing; run `pdc compile` on "
                       "the family's spec"),
    ("qwen38.layout", "'qwen38.layout' is not a family module name (a Python identifier such "
                      "as qwen38 or llama3_70b)"),
])
def test_loading_an_unknown_family_is_a_clear_error(name, message):
    with pytest.raises(FamilyNotFound) as e:
        Family.load(name)
    assert str(e.value) == message


def test_family_codec_round_trips_a_register_message():
    from pdc.runtime.plan_types import RankId
    from pdc.runtime.wire import PeerSide, RegEntry, Register

    family = Family.load("llama3_70b")
    wire = importlib.import_module("pdc.generated.llama3_70b.wire")
    kv = family.layout.component("kv")
    entries = [RegEntry(layer_id=kv.layer_ids[0], tensor="k", base_addr=0x1000, item_bytes=4096,
                        capacity_items=8)]
    sections = family.registration_sections({"kv": entries})
    assert sections == wire.registration_sections({"kv": entries})
    msg = Register(side=PeerSide.DECODE, dp_group=0, rank=RankId(0, 0), page_size=16,
                   plan_digest=bytes(32), agent_info=b"agent", control_endpoint="tcp://h:1",
                   sections=sections)
    assert family.encode(msg) == wire.encode(msg)
    assert family.decode(family.encode(msg)) == msg
