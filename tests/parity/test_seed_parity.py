"""`pdc parity` on the seed systems' toys (pdc/verify): qwen38 and glm52 through pdc over
real engines, bit for bit.

Each spec runs at the sizes its `parity.params` scale it to (qwen38 with
8 layers on 8-token pages, compress ratio 4, in 8-token chunks; glm52 with 4 layers on its
64-token pages, top-k 8, in 64-token chunks), with prompts whose length is neither a multiple
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
from pdc.verify.parity import prepare  # noqa: E402
from pdc.verify.parity_case import ParityError  # noqa: E402
from pdc.verify.parity_judge import judge  # noqa: E402
from pdc.verify.parity_workers import ParityWorkers  # noqa: E402

pytestmark = pytest.mark.engines

SPECS = Path(__file__).resolve().parents[2] / "specs"
QWEN38 = str(SPECS / "qwen38.yaml")
GLM52 = str(SPECS / "glm52.yaml")
CHUNK = {QWEN38: 8, GLM52: 64}
OK = "parity   OK: tokens and logits of all 10 steps bitwise equal to single-process generation"
QWEN38_COMPONENTS = ["kv", "qsa_compressed", "qsa_pending", "qsa_rope", "gdn_conv",
                     "gdn_temporal", "ple_short_conv", "ple_ngram", "aux_first_token",
                     "aux_draft_hidden"]
QWEN38_REPLICATED = {"qsa_compressed", "qsa_pending", "qsa_rope", "ple_short_conv",
                     "ple_ngram", "aux_first_token", "aux_draft_hidden"}
GLM52_COMPONENTS = ["mla_kv", "draft_mla_kv", "dsa_index_k", "aux_first_token",
                    "aux_draft_hidden", "aux_dsa_topk"]  # all replicated


@pytest.fixture(scope="module")
def workers():
    with ParityWorkers() as w:
        w.ensure(4)
        yield w


def run_case(workers, spec, prefill, decode, engine, **options):
    options.setdefault("chunk_tokens", CHUNK[spec])
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


def _replicated_writers(plan: Plan, replicated) -> dict[RankId, set[str]]:
    """Prefill rank -> the replicated components it writes to some decode rank."""
    out: dict[RankId, set[str]] = {}
    for lk in plan.links:
        out.setdefault(lk.prefill, set()).update(
            e.component for e in lk.entries if e.component in replicated)
    return out


# ~~~ qwen38 ~~~

def test_qwen38_tp2_to_tp1_elects_one_writer_of_replicated_state(workers):
    case, outcome, verdict = run_case(workers, QWEN38, "tp=2", "tp=1", "mooncake", tokens=22)
    _check_ok(outcome, verdict, [8, 8, 6])
    writers = _replicated_writers(Plan.from_json(case.plan_json), QWEN38_REPLICATED)
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


# ~~~ glm52 ~~~

@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_glm52_tp2_to_tp1_elects_one_writer(workers, engine):
    case, outcome, verdict = run_case(workers, GLM52, "tp=2", "tp=1", engine, tokens=100)
    _check_ok(outcome, verdict, [64, 36])
    # every component is replicated: prefill tp1 writes nothing and has no link at all
    writers = _replicated_writers(Plan.from_json(case.plan_json), set(GLM52_COMPONENTS))
    assert writers == {RankId(0, 0): set(GLM52_COMPONENTS)}
    assert outcome.prefill[(0, 1)]["status"] == "Success"


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_glm52_tp1_to_tp2_broadcasts(workers, engine):
    case, outcome, verdict = run_case(workers, GLM52, "tp=1", "tp=2", engine, tokens=90)
    _check_ok(outcome, verdict, [64, 26])
    plan = Plan.from_json(case.plan_json)
    assert [len(plan.links_to(RankId(0, t))) for t in (0, 1)] == [1, 1]


@pytest.mark.parametrize("engine,prefill", [("mooncake", "tp=1"), ("nixl", "tp=2")])
def test_glm52_dp_attention_on_decode(workers, engine, prefill):
    """Decode dp=2 (DP attention, tp=1 per DP rank): the request (room 1001) lives on DP
    group 1, whose rank receives it and decodes it in a batch padded with group 0's idle
    row; group 0's rank registers and connects too, and none of its pool bytes is written."""
    case, outcome, verdict = run_case(workers, GLM52, prefill, "tp=1,dp=2", engine,
                                      tokens=101)
    _check_ok(outcome, verdict, [64, 37])
    assert case.decode_group == 1
    assert list(outcome.decode) == [(0, 0)]
    assert [(k, r["written"]) for k, r in outcome.idle.items()] == [((0, 0, 0), 0)]
    assert ("dp       the request on decode DP group 1, padded with idle group(s) 0 whose "
            "pools stayed untouched") in verdict.lines
    # had a byte of the idle group's pools been written, the judge would fail the case
    outcome.idle[(0, 0, 0)]["written"] = 5
    bad = judge(case, outcome)
    assert not bad.ok
    assert ("  differs: idle decode rank dp0.pp0.tp0: 5 of its "
            f"{outcome.idle[(0, 0, 0)]['bytes']} pool bytes were written (the request is on DP "
            "group 1)") in bad.lines


def test_glm52_pp2_prefill(workers):
    """The aux rows are owned by the last stage (`stages: last`); stage 0 sends pages only."""
    case, outcome, verdict = run_case(workers, GLM52, "tp=1,pp=2", "tp=1", "nixl", tokens=100)
    _check_ok(outcome, verdict, [64, 36])
    plan = Plan.from_json(case.plan_json)
    assert plan.registration("prefill", RankId(0, 0)).entries("aux_dsa_topk") == ()
    assert plan.registration("prefill", RankId(1, 0)).entries("aux_dsa_topk") == \
        (("data", 0xFFFFFFFD),)


@pytest.mark.parametrize("component", GLM52_COMPONENTS)
def test_glm52_dropping_a_component_fails_and_names_it(workers, component):
    _, _, verdict = run_case(workers, GLM52, "tp=1", "tp=1", "local", tokens=100,
                             drop=(component,))
    assert not verdict.ok
    differs = [line for line in verdict.lines if line.startswith("  differs: ")]
    assert differs and all(f"component {component} " in d for d in differs), differs
    failed = next(line for line in verdict.lines if line.startswith("parity   "))
    assert failed.startswith("parity   FAILED at step 1 (decode step 1): "), failed
    assert f"component {component} " in verdict.lines[-1]


def test_decode_dp_needs_a_model_that_pads(workers):
    with pytest.raises(ParityError, match="decode dp=2 needs a model with DP attention "
                                          "padding; the seed_qwen38 model has none"):
        prepare(QWEN38, "tp=1", "tp=1,dp=2", "mooncake", None, workers, tokens=22)


# ~~~ the command line ~~~

def _cli(capsys, *argv):
    rc = main(["parity", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def test_cli_both_seed_specs_at_their_scaled_sizes(capsys):
    """One call, one set of processes; --param num_layers=12 applies to both specs."""
    rc, out, _ = _cli(capsys, QWEN38, GLM52, "--tokens", "101", "--chunk", "64",
                      "--prefill", "tp=2", "--param", "num_layers=12")
    assert rc == 0, out
    qwen, glm = (part.splitlines() for part in out.split("pdc parity: ")[1:])
    assert qwen[:3] == [  # within 100 columns: the topology on a line of its own
        "qwen38 (seed_qwen38, float32)",
        "  prefill tp=2,pp=1,dp=1,page_size=8 -> decode tp=1,pp=1,dp=1,page_size=8 over mooncake",
        "  prompt   101 tokens in 2 chunks (64+37), 10 steps"]
    # 12 layers: 9 GDN (conv + temporal), 3 QSA (k, v, compressed, pending), MTP (k, v) and
    # five request-wide tensors.
    assert qwen[4].startswith("  state    37 tensors, ")
    assert glm[:2] == [
        "glm52 (seed_glm52, float32)",
        "  prefill tp=2,pp=1,dp=1,page_size=64 -> decode tp=1,pp=1,dp=1,page_size=64 over "
        "mooncake"]
    # 12 MLA layers and the draft layer (latent and index keys each), three aux rows
    assert glm[4].startswith("  state    29 tensors, ")
    assert f"  {OK}" in qwen and f"  {OK}" in glm


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
