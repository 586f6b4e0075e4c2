"""`pdc parity` on the seed systems' toys (pdc/verify): qwen38 and glm52 through pdc over
real engines, bit for bit.

Each spec runs at the sizes its binding scales it to (pdc/hf_adapter.py BINDINGS: qwen38 with
8 layers on 8-token pages, compress ratio 4), with prompts whose length is neither a multiple
of the page size nor of the compress ratio. Tokens and logits (target and draft) of every step
must equal single-process generation, every rebuilt state tensor the prefill's export. The
negative controls drop each component of the spec in turn: parity must fail at the first
decode step and the report must name that component.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pdc.runtime.plan_types import Plan, RankId  # noqa: E402

from pdc.cli import main  # noqa: E402
from pdc.parity import ParityError, ParityWorkers, judge, prepare  # noqa: E402

pytestmark = pytest.mark.engines

SPECS = Path(__file__).resolve().parents[2] / "specs"
QWEN38 = str(SPECS / "qwen38.yaml")
OK = "parity   OK: tokens and logits of all 10 steps bitwise equal to single-process generation"
QWEN38_COMPONENTS = ["kv", "qsa_compressed", "qsa_pending", "qsa_rope", "gdn_conv",
                     "gdn_temporal", "ple_short_conv", "ple_ngram", "aux_first_token",
                     "aux_draft_hidden"]
QWEN38_REPLICATED = {"qsa_compressed", "qsa_pending", "qsa_rope", "ple_short_conv",
                     "ple_ngram", "aux_first_token", "aux_draft_hidden"}


@pytest.fixture(scope="module")
def workers():
    with ParityWorkers() as w:
        w.ensure(4)
        yield w


def run_case(workers, spec, prefill, decode, engine, **options):
    case = prepare(spec, prefill, decode, engine, None, workers, **options)
    outcome = workers.run(case)
    return case, outcome, judge(case, outcome)


def _check_ok(outcome, verdict, chunks):
    text = "\n".join(verdict.lines)
    assert verdict.ok, text
    assert verdict.lines[-1] == OK
    assert "every rebuilt tensor equals the prefill export" in text
    assert outcome.prefill[(0, 0)]["chunks"] == chunks
    assert outcome.model["tokens"] == outcome.model["reference"]["tokens"][1:]


def _replicated_writers(plan: Plan) -> dict[RankId, set[str]]:
    """Prefill rank -> the replicated components it writes to some decode rank."""
    out: dict[RankId, set[str]] = {}
    for lk in plan.links:
        out.setdefault(lk.prefill, set()).update(
            e.component for e in lk.entries if e.component in QWEN38_REPLICATED)
    return out


# ~~~ qwen38 ~~~

def test_qwen38_tp2_to_tp1_elects_one_writer_of_replicated_state(workers):
    case, outcome, verdict = run_case(workers, QWEN38, "tp=2", "tp=1", "mooncake", tokens=22)
    _check_ok(outcome, verdict, [8, 8, 6])
    writers = _replicated_writers(Plan.from_json(case.plan_json))
    assert writers == {RankId(0, 0): QWEN38_REPLICATED, RankId(0, 1): set()}


def test_qwen38_tp1_to_tp2_broadcasts_replicated_state(workers):
    case, outcome, verdict = run_case(workers, QWEN38, "tp=1", "tp=2", "mooncake", tokens=19)
    _check_ok(outcome, verdict, [8, 8, 3])
    plan = Plan.from_json(case.plan_json)
    for d in (RankId(0, 0), RankId(0, 1)):
        (lk,) = plan.links_to(d)
        assert {e.component for e in lk.entries} == set(QWEN38_COMPONENTS)
    assert len(outcome.decode) == 2


@pytest.mark.parametrize("prefill,decode,tokens", [("tp=2", "tp=2", 21), ("tp=1", "tp=1", 22)])
def test_qwen38_over_nixl(workers, prefill, decode, tokens):
    _, outcome, verdict = run_case(workers, QWEN38, prefill, decode, "nixl", tokens=tokens)
    _check_ok(outcome, verdict, [8, 8, tokens - 16])


def test_qwen38_nixl_refuses_heterogeneous_attention_tp(workers):
    """seed 000: NIXL fails fast on heterogeneous Qwen3.8 attention TP; the spec says so."""
    with pytest.raises(ParityError, match="backend 'nixl' does not support heterogeneous "
                                          "attention TP"):
        prepare(QWEN38, "tp=2", "tp=1", "nixl", None, workers, tokens=22)


@pytest.mark.parametrize("engine,prefill,decode", [
    ("mooncake", "tp=2,stages=0-2/3-7", "tp=1"),
    ("nixl", "tp=1,stages=0-2/3-7", "tp=1"),
    ("mooncake", "tp=1", "tp=1,stages=0-2/3-7"),
])
def test_qwen38_pp_stage_without_qsa_layer(workers, engine, prefill, decode):
    """Stage 0 holds GDN layers 0-2 only: it registers no QSA RoPE ring and no KV, yet keeps
    both sections on the wire (empty), and stage 1 sends the ring."""
    case, outcome, verdict = run_case(workers, QWEN38, prefill, decode, engine, tokens=22)
    _check_ok(outcome, verdict, [8, 8, 6])
    plan = Plan.from_json(case.plan_json)
    side = "prefill" if "stages" in prefill else "decode"
    reg0 = plan.registration(side, RankId(0, 0))
    reg1 = plan.registration(side, RankId(1, 0))
    assert [name for name, _, _ in reg0.components] == QWEN38_COMPONENTS
    assert reg0.entries("qsa_rope") == () and reg0.entries("kv") == ()
    assert reg1.entries("qsa_rope") == (("data", 0xFFFFFFFE),)
    assert reg0.entries("ple_ngram") == reg1.entries("ple_ngram") == (("data", 0xFFFFFFFF),)


@pytest.mark.parametrize("component", QWEN38_COMPONENTS)
def test_qwen38_dropping_a_component_fails_and_names_it(workers, component):
    """Negative control, one per component (local engine, TP1 -> TP1): decode keeps the
    poison, the first decode step's logits differ, and every differing tensor is the
    component's."""
    _, _, verdict = run_case(workers, QWEN38, "tp=1", "tp=1", "local", tokens=22,
                             drop=(component,))
    assert not verdict.ok
    differs = [line for line in verdict.lines if line.startswith("  differs: ")]
    assert differs and all(f"component {component} " in d for d in differs), differs
    failed = next(line for line in verdict.lines if line.startswith("parity   "))
    assert failed.startswith("parity   FAILED at step 1 (decode step 1): "), failed
    assert verdict.lines[-1].startswith("cause    ") and \
        f"component {component} " in verdict.lines[-1]


# ~~~ the command line ~~~

def _cli(capsys, *argv):
    rc = main(["parity", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def test_cli_qwen38_at_its_scaled_sizes(capsys):
    rc, out, _ = _cli(capsys, QWEN38, "--tokens", "22", "--prefill", "tp=2",
                      "--param", "num_layers=12")
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[:3] == [  # within 100 columns: the topology on a line of its own
        "pdc parity: qwen38 (seed_qwen38, float32)",
        "  prefill tp=2,pp=1,dp=1,page_size=8 -> decode tp=1,pp=1,dp=1,page_size=8 over mooncake",
        "  prompt   22 tokens in 3 chunks (8+8+6), 10 steps"]
    # 12 layers: 9 GDN (conv + temporal), 3 QSA (k, v, compressed, pending), MTP (k, v) and
    # five request-wide tensors.
    assert lines[4].startswith("  state    37 tensors, ")
    assert f"  {OK}" in lines


@pytest.mark.parametrize("argv,rc,message", [
    (["--param", "num_layers"], 2, "pdc parity: error: cannot read --param num_layers"),
    (["--param", "experts=4"], 1, "cannot override param 'experts'"),
    (["--param", "qsa_compress_ratio=3"], 1, "page_size % qsa_compress_ratio == 0"),
])
def test_cli_param_errors(capsys, argv, rc, message):
    got, _, err = _cli(capsys, QWEN38, *argv)
    assert got == rc
    assert message in err


def test_layout_of_a_scaled_run_travels_with_the_case(workers):
    case = prepare(QWEN38, "tp=1", "tp=1", "mooncake", None, workers, tokens=22)
    assert case.layout is not None and case.layout.num_layers == 8
    assert json.loads(case.plan_json)["topology"]["prefill"]["page_size"] == 8
