"""The runtime's Family: loaded from the generated module, it plans any topology without the
compiler, and equals the family the compiler builds from the spec."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pdc.compiler.family import family_of, plan_spec
from pdc.compiler.frontend import load_spec
from pdc.runtime import wire
from pdc.runtime.diagnostics import Location, SpecErrors
from pdc.runtime.family import Family, FamilyNotFound
from pdc.runtime.plan_types import RankId
from pdc.runtime.topology import resolve_side

REPO = Path(__file__).resolve().parents[2]
SPECS = sorted((REPO / "specs").glob("*.yaml"))


def _spec(path: Path):
    return load_spec(path.relative_to(REPO).as_posix())


# A fresh interpreter in which yaml, jsonschema, jinja2, the compiler and the verification
# harnesses (pdc.verify) cannot be imported at all: importing the runtime and every generated
# module and planning two topologies must still work. tests/test_dependency_direction.py
# checks the same from the source, function-level imports included.
_BLOCKED_RUN = """
import importlib, importlib.abc, json, pkgutil, sys

BLOCKED = ("yaml", "jsonschema", "jinja2", "pdc.compiler", "pdc.verify")

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
                or m.startswith(("pdc.compiler", "pdc.verify")))
print(json.dumps({"modules": modules, "plans": plans, "leaked": leaked}))
"""


def test_runtime_plans_without_the_compiler_the_harnesses_yaml_jsonschema_or_jinja2():
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
    # What the decoder checks Register sections against: one per component in spec order,
    # with the ids its entries may carry (the layer ids, or the request-wide sentinel).
    assert [(w.name, w.tensors, w.layer_ids) for w in family.wire_components] == [
        (c.name, c.tensors, (c.sentinel,) if c.request_wide else c.layer_ids)
        for c in spec.components]


def test_family_plan_rejects_a_topology_naming_the_backend_rule():
    family = Family.load("qwen38")
    with pytest.raises(SpecErrors) as e:
        family.plan_for("tp=4", "tp=1", "nixl")
    [d] = e.value.diagnostics
    assert d.message == (
        "backend 'nixl' does not support heterogeneous attention TP (prefill tp=4, decode "
        "tp=1): rule `hetero_attention_tp: false` (seed: NIXL fails "
        "fast on heterogeneous Qwen3.8 attention TP)")
    assert str(d.loc) == "specs/qwen38.yaml:114:3"  # the rule's own line
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


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_the_codec_is_bound_to_the_family(path):
    family = Family.load(_spec(path).py_name)
    req = wire.TransferRequest(room=2**64 - 1, generation=5, decode_rank=RankId(1, 3),
                               decode_prefix_tokens=128, slot=0, ring_slot=4, aux_row=-1,
                               dst_page_ids=np.arange(100, 140), window_page_ids=[7, 8])
    buf = family.encode(req)
    assert family.decode(buf) == req
    assert buf == wire.encode(req, family.fingerprint, family.wire_components)
    with pytest.raises(wire.WireError, match="both sides must compile the same spec"):
        family.decode(wire.encode(req, family.fingerprint ^ 1, family.wire_components))


# Topologies whose ranks register different subsets: a stage with no QSA layer (so no QSA
# RoPE ring, an empty section that keeps its place), uneven PP, and plain TP.
PLAN_CASES = [
    ("qwen38", "tp=2,pp=2", "tp=1", [[0, 1, 2], list(range(3, 48))]),
    ("qwen38", "tp=2,pp=2", "tp=2,pp=2", None),
    ("llama3_70b", "tp=2,pp=3", "tp=4,pp=2", [list(range(0, 20)), list(range(20, 60)),
                                                list(range(60, 80))]),
    ("deepseek_v32", "tp=2,pp=2", "tp=4", None),
    ("glm52", "tp=2", "tp=1", None),
]


@pytest.mark.parametrize("py_name,prefill,decode,stages", PLAN_CASES)
def test_registration_sections_follow_the_plan_positions(py_name, prefill, decode, stages):
    family = Family.load(py_name)
    topo = family.topology(prefill, decode, "mooncake")
    if stages is not None:
        topo = dataclasses.replace(topo, prefill=resolve_side(
            family.layout, topo.prefill.tp, len(stages), stages=stages, what="prefill",
            loc=Location("--prefill"))[0])
    plan = family.plan(topo)
    empty_sections = 0
    for side_name, regs in (("prefill", plan.prefill), ("decode", plan.decode)):
        for reg in regs:
            # What a rank registers, handed over in an arbitrary order.
            buffers = {
                name: [wire.RegEntry(layer_id=layer_id, tensor=tensor,
                                     base_addr=0x10000 * (1 + k), item_bytes=nbytes,
                                     capacity_items=128)
                       for k, (tensor, layer_id) in enumerate(entries)][::-1]
                for name, entries, nbytes in reg.components if entries
            }
            sections = family.registration_sections(buffers)
            assert [s.component for s in sections] == [c.name for c in family.layout.components]
            for sec, (name, entries, _) in zip(sections, reg.components, strict=True):
                assert sec.component == name
                # Position j on the wire is position j in the plan (LinkEntry.src_pos/dst_pos).
                assert [(e.tensor, e.layer_id) for e in sec.entries] == list(entries)
                empty_sections += not sec.entries
            msg = wire.Register(
                side=wire.PeerSide.PREFILL if side_name == "prefill" else wire.PeerSide.DECODE,
                dp_group=0, rank=reg.rank, page_size=topo.prefill.page_size,
                plan_digest=bytes.fromhex(plan.digest()), agent_info=b"127.0.0.1:17001",
                instance="127.0.0.1:30000", sections=sections)
            assert family.decode(family.encode(msg)) == msg
    if stages is not None and py_name == "qwen38":
        assert empty_sections > 0  # stage 0 has no QSA layer: its sections are empty, not gone
