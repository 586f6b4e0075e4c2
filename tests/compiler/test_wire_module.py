"""The wire module generator (compiler/emit/wire_module.py + templates/wire.py.j2).

Every spec in specs/ is rendered in memory and exec'd; its constants must equal what the
compiler computes, its codecs must round-trip, and its registration helper must put entries
in exactly the order the lowered plan's positions refer to. When generated/<family>/wire.py
is checked in, it must equal the rendering byte for byte.
"""

from __future__ import annotations

import ast
import re
import types
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from pdc.compiler.diagnostics import SpecErrors
from pdc.compiler.emit.context import FamilyContext
from pdc.compiler.emit.header import generated_header, spec_fingerprint
from pdc.compiler.emit.templates import TEMPLATE_DIR
from pdc.compiler.emit.wire_module import TEMPLATE, emit, wire_module, wire_view
from pdc.compiler.frontend import parse_spec_text
from pdc.compiler.layout import build_layout
from pdc.compiler.lower import lower
from pdc.runtime import wire
from pdc.runtime.plan_types import RankId, Topology

from .planning import side

REPO = Path(__file__).resolve().parents[2]
SPECS = sorted((REPO / "specs").glob("*.yaml"))
MINI = REPO / "tests" / "compiler" / "good_specs" / "mini.yaml"


@cache
def spec_layout(path: Path):
    # Named by repository path, as the compiler names specs in headers.
    spec = parse_spec_text(path.read_text(), path.relative_to(REPO).as_posix())
    return spec, build_layout(spec)


def exec_module(relpath: str, text: str) -> types.ModuleType:
    module = types.ModuleType(f"rendered_{relpath.replace('/', '_')[:-3]}")
    exec(compile(text, relpath, "exec"), module.__dict__)
    return module


@pytest.fixture(params=SPECS, ids=lambda p: p.stem)
def rendered(request):
    spec, layout = spec_layout(request.param)
    relpath, text = wire_module(spec, layout)
    return spec, layout, relpath, text, exec_module(relpath, text)


def test_path_header_and_syntax(rendered):
    spec, layout, relpath, text, _ = rendered
    assert relpath == f"{spec.py_name}/wire.py"
    assert text.startswith(generated_header(spec))
    ast.parse(text)
    assert all(len(line) <= 100 for line in text.splitlines())
    assert str(REPO) not in text


def test_emitter_body_is_the_module_without_its_header(rendered):
    spec, layout, relpath, text, _ = rendered
    ctx = FamilyContext(spec, layout, generated_header(spec))
    module = emit(ctx)
    assert module.name == "wire"
    assert ctx.header + module.body == text
    assert wire_module(spec, layout)[1] == text  # deterministic


def test_constants_equal_what_the_compiler_computes(rendered):
    spec, layout, _, _, m = rendered
    assert m.FAMILY == spec.family
    assert m.FINGERPRINT == spec_fingerprint(spec)
    assert m.COMPONENTS == tuple(c.name for c in layout.components)
    assert len(m.WIRE_COMPONENTS) == len(layout.components)
    for wc, cl in zip(m.WIRE_COMPONENTS, layout.components, strict=True):
        assert wc.name == cl.name
        assert wc.tensors == cl.tensors
        assert getattr(m, f"{re.sub(r'(?<=[a-z0-9])(?=[A-Z])', '_', cl.name).upper()}_TENSORS") \
            is wc.tensors
        assert wc.layer_ids == ((cl.sentinel,) if cl.request_wide else cl.layer_ids)


def test_the_module_imports_only_the_runtime_codec(rendered):
    *_, text, _ = rendered
    tree = ast.parse(text)
    imports = [(type(n).__name__, getattr(n, "module", None))
               for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert imports == [("ImportFrom", "__future__"), ("ImportFrom", "collections.abc"),
                       ("ImportFrom", "pdc.runtime"), ("ImportFrom", "pdc.runtime.wire")]


def test_codecs_are_bound_to_the_family(rendered):
    spec, _, _, _, m = rendered
    msg = wire.Abort(room=7, generation=1, decode_rank=RankId(0, 0))
    buf = m.encode(msg)
    assert m.decode(buf) == msg
    assert buf == wire.encode(msg, spec_fingerprint(spec), m.WIRE_COMPONENTS)
    with pytest.raises(wire.WireError, match="both sides must compile the same spec"):
        m.decode(wire.encode(msg, spec_fingerprint(spec) ^ 1, m.WIRE_COMPONENTS))


def test_checked_in_module_is_fresh(rendered):
    spec, _, relpath, text, _ = rendered
    path = REPO / "generated" / relpath
    if not path.exists():
        pytest.skip(f"generated/{relpath} is not generated yet")
    assert path.read_text() == text, f"generated/{relpath} is stale: run pdc compile {spec.path}"


# ~~~ registration sections agree with the lowered plan ~~~

# Topologies whose ranks register different subsets: a stage with no QSA layer (so no QSA
# RoPE ring, an empty section that keeps its place), uneven PP, and plain TP.
PLAN_CASES = [
    ("qwen38", {"tp": 2, "pp": 2, "stages": [[0, 1, 2], list(range(3, 48))]}, {"tp": 1}),
    ("qwen38", {"tp": 2, "pp": 2}, {"tp": 2, "pp": 2}),
    ("llama3-70b", {"tp": 2, "pp": 3, "stages": [list(range(0, 20)), list(range(20, 60)),
                                                 list(range(60, 80))]}, {"tp": 4, "pp": 2}),
    ("deepseek-v32", {"tp": 2, "pp": 2}, {"tp": 4}),
    ("glm52", {"tp": 2}, {"tp": 1}),
]


@pytest.mark.parametrize("stem,prefill,decode", PLAN_CASES)
def test_registration_sections_follow_the_plan_positions(stem, prefill, decode):
    spec, layout = spec_layout(REPO / "specs" / f"{stem}.yaml")
    m = exec_module(*wire_module(spec, layout))
    topo = Topology(side(layout, **prefill), side(layout, **decode), "mooncake")
    plan = lower(layout, topo, spec.backends)
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
            sections = m.registration_sections(buffers)
            assert [s.component for s in sections] == list(m.COMPONENTS)
            for sec, (name, entries, _) in zip(sections, reg.components, strict=True):
                assert sec.component == name
                # Position j on the wire is position j in the plan (LinkEntry.src_pos/dst_pos).
                assert [(e.tensor, e.layer_id) for e in sec.entries] == list(entries)
                empty_sections += not sec.entries
            msg = wire.Register(
                side=wire.PeerSide.PREFILL if side_name == "prefill" else wire.PeerSide.DECODE,
                dp_group=0, rank=reg.rank, page_size=topo.prefill.page_size,
                plan_digest=bytes.fromhex(plan.digest()), agent_info=b"127.0.0.1:17001",
                control_endpoint="tcp://127.0.0.1:5757", sections=sections)
            assert m.decode(m.encode(msg)) == msg
    if stem == "qwen38" and "stages" in prefill:
        assert empty_sections > 0  # stage 0 has no QSA layer: its sections are empty, not gone


def test_a_transfer_request_for_every_family_round_trips(rendered):
    *_, m = rendered
    req = wire.TransferRequest(room=2**64 - 1, generation=5, decode_rank=RankId(1, 3),
                               decode_prefix_tokens=128, slot=0, ring_slot=4, aux_row=-1,
                               dst_page_ids=np.arange(100, 140), window_page_ids=[7, 8])
    assert m.decode(m.encode(req)) == req


# ~~~ names ~~~


def test_component_names_that_collide_as_constants_are_spec_errors():
    text = MINI.read_text().replace("  ngram:\n", "  Conv:\n")
    spec = parse_spec_text(text, "tests/compiler/good_specs/clash.yaml")
    with pytest.raises(SpecErrors) as e:
        wire_view(spec, build_layout(spec))
    (d,) = e.value.diagnostics
    assert d.message == ("component 'Conv' would be generated as CONV, which is already the "
                         "name of component 'conv'")


def test_mini_spec_renders_sentinels_in_hex():
    spec = parse_spec_text(MINI.read_text(), "tests/compiler/good_specs/mini.yaml")
    _, text = wire_module(spec, build_layout(spec))
    assert "layer_ids=(0xFFFFFFFF,)," in text
    assert "NGRAM_TENSORS = (\"data\",)" in text
    assert 'KV_TENSORS = ("k", "v")' in text


# ~~~ template discipline ~~~


def test_template_is_thin():
    """Loops over view fields and substitutions of view fields: no filters, arithmetic,
    conditionals, calls or literals in the template (they belong in the view model)."""
    source = (TEMPLATE_DIR / TEMPLATE).read_text()
    outputs = re.findall(r"{{(.*?)}}", source)
    statements = re.findall(r"{%(.*?)%}", source)
    assert outputs and statements
    for expr in outputs:
        assert re.fullmatch(r" (view|c)\.\w+ | line ", expr), expr
    for stmt in statements:
        assert re.fullmatch(r" (for \w+ in (view|c)\.\w+|endfor) ", stmt), stmt
    assert "{#" not in source
