"""`pdc parity`: five transformers families through pdc over real engines, bit for bit.

Every case runs a tiny random-weight model's prompt as chunked prefill (20 tokens in chunks of
8 + 8 + 4 on 4-token pages) in prefill rank processes, moves the cache through the lowered
plan and real Mooncake (TCP) or NIXL (UCX) into decode rank processes, rebuilds it in the
decode-model process and generates 10 tokens. Tokens and logits of every step must be
bitwise equal to single-process generation, and every rebuilt state tensor to the prefill's
export (pdc.verify.parity.judge). One set of worker processes serves every case of this module
(ParityWorkers), which keeps the whole matrix to seconds after the ~10 s start.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pdc.cli import main  # noqa: E402
from pdc.verify.parity import prepare  # noqa: E402
from pdc.verify.parity_case import ParityError  # noqa: E402
from pdc.verify.parity_judge import judge  # noqa: E402
from pdc.verify.parity_workers import ParityWorkers  # noqa: E402

pytestmark = pytest.mark.engines

SPECS = Path(__file__).resolve().parents[2] / "specs"
FAMILIES = ["hf-llama", "hf-qwen3-next", "hf-mamba2", "hf-mistral-sw", "hf-deepseek-v3"]
TOPOLOGIES = {"tp1-tp1": ("tp=1", "tp=1"), "tp2-tp1": ("tp=2", "tp=1"),
              "tp1-tp2": ("tp=1", "tp=2")}
ENGINES = ["mooncake", "nixl"]
# bfloat16 for a third of the matrix (one topology per engine), float32 for the rest.
BF16 = {("tp2-tp1", "mooncake"), ("tp1-tp2", "nixl")}
OK = "parity   OK: tokens and logits of all 10 steps bitwise equal to single-process generation"


def spec(family: str) -> str:
    return str(SPECS / f"{family}.yaml")


@pytest.fixture(scope="module")
def workers():
    with ParityWorkers() as w:
        w.ensure(3)  # the most any case below needs; they start (import torch) in parallel
        yield w


def run_case(workers, family, prefill, decode, engine, dtype=None, **options):
    case = prepare(spec(family), prefill, decode, engine, dtype, workers, **options)
    outcome = workers.run(case)
    return case, outcome, judge(case, outcome)


def _check_ok(case, outcome, verdict, *, decode_ranks: int):
    text = "\n".join(verdict.lines)
    assert verdict.ok, text
    assert verdict.lines[-1] == OK
    assert "every rebuilt tensor equals the prefill export" in text
    leader = outcome.prefill[(0, 0)]
    assert leader["chunks"] == [8, 8, 4]  # chunked prefill: three sends per request
    assert all(r["status"] == "Success" for r in outcome.prefill.values())
    assert all(r["status"] == "Success" for r in outcome.decode.values())
    assert len(outcome.decode) == decode_ranks
    assert outcome.model["tokens"] == outcome.model["reference"]["tokens"][1:]


MATRIX = [(f, t, e) for t in TOPOLOGIES for e in ENGINES for f in FAMILIES]


@pytest.mark.parametrize("family,topology,engine", MATRIX,
                         ids=[f"{f}-{t}-{e}" for f, t, e in MATRIX])
def test_parity(workers, family, topology, engine):
    prefill, decode = TOPOLOGIES[topology]
    dtype = "bfloat16" if (topology, engine) in BF16 else "float32"
    case, outcome, verdict = run_case(workers, family, prefill, decode, engine, dtype)
    assert case.dtype == dtype
    _check_ok(case, outcome, verdict, decode_ranks=int(decode[-1]))


PP = [(f, ENGINES[i % 2]) for i, f in enumerate(FAMILIES)]


@pytest.mark.parametrize("family,engine", PP, ids=[f"{f}-{e}" for f, e in PP])
def test_parity_pp2_to_pp1(workers, family, engine):
    """Two prefill stages, each placing only its own layers' state; decode pairs entries by
    global layer id. qwen3-next's first stage holds no attention layer: an empty KV entry
    list that still keeps its place on the wire."""
    case, outcome, verdict = run_case(workers, family, "tp=1,pp=2", "tp=1", engine)
    assert set(outcome.prefill) == {(0, 0), (1, 0)}
    _check_ok(case, outcome, verdict, decode_ranks=1)


def test_dropping_conv_state_from_the_plan_fails_and_names_it(workers):
    """Negative control: qwen3-next without its GDN conv state in the plan's links. The
    decode conv slots keep their poison; the greedy tokens may even stay the same, the
    logits do not, and the report names the component and its layers."""
    case, outcome, verdict = run_case(workers, "hf-qwen3-next", "tp=2", "tp=1", "mooncake",
                                      drop=("gdn_conv",))
    links = json.loads(case.plan_json)["links"]
    assert not any(e["component"] == "gdn_conv" for lk in links for e in lk["entries"])
    assert not verdict.ok
    differs = [line for line in verdict.lines if line.startswith("  differs: ")]
    assert [d.split(":")[1].strip() for d in differs] == [
        "layer 0 component gdn_conv (L0.conv)", "layer 1 component gdn_conv (L1.conv)",
        "layer 2 component gdn_conv (L2.conv)"]
    failed = next(line for line in verdict.lines if line.startswith("parity   FAILED"))
    assert failed.startswith("parity   FAILED at step 1 (decode step 1): ")
    assert verdict.lines[-1].startswith("cause    layer 0 component gdn_conv (L0.conv): ")
    # the prefill row is untouched: step 0 is the prefill's own logits
    assert outcome.prefill[(0, 0)]["first_token"] == outcome.model["reference"]["tokens"][0]


def test_page_size_override_ships_its_own_layout(workers):
    """8-token pages instead of the spec's 4: the parent lowers a layout of its own and the
    ranks use it instead of generated/."""
    case, outcome, verdict = run_case(workers, "hf-mistral-sw", "tp=1,page_size=8",
                                      "tp=2,page_size=8", "mooncake", chunk_tokens=16,
                                      tokens=30)
    assert case.layout is not None and case.layout.components[0].shape == (8, 2, 16)
    assert verdict.ok, "\n".join(verdict.lines)
    assert outcome.prefill[(0, 0)]["chunks"] == [16, 14]


def test_one_chunk_reference_is_hf_state_aggregate_generate(workers):
    """Note [Parity reference]: with one chunk the single-process reference is exactly
    pdc.verify.hf_state.aggregate_generate."""
    import torch

    from pdc.verify import hf_state as H
    from pdc.verify.parity_judge import parse_state
    from pdc.verify.recipe import family_recipe

    case, outcome, verdict = run_case(workers, "hf-llama", "tp=1", "tp=1", "nixl",
                                      chunk_tokens=20)
    assert verdict.ok and outcome.prefill[(0, 0)]["chunks"] == [20]
    tokens, logits = H.aggregate_generate(H.build_model(family_recipe(case.binding)),
                                          torch.tensor(case.prompt), case.steps)
    ref = outcome.model["reference"]
    assert ref["tokens"] == tokens.tolist()
    assert bytes(parse_state(ref["logits"])["t"][2]) == \
        logits.contiguous().view(torch.uint8).numpy().tobytes()


# ~~~ user errors: a message, exit 1, no traceback ~~~


def _cli(capsys, *argv):
    rc = main(["parity", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


@pytest.mark.parametrize("argv,message", [
    ([spec("hf-llama"), "--chunk", "6"],
     "--chunk 6 is not a multiple of the page size 4: chunks end on page boundaries"),
    ([str(SPECS / "llama3-70b.yaml")], "llama3-70b.yaml has no `parity` block: pdc parity needs "
     "the tiny model to run the family on"),
    ([spec("hf-llama"), "--prefill", "tp=4", "--decode", "tp=3"],
     "error: attention TP sizes 4 and 3 do not divide each other"),
    ([spec("hf-llama"), "--decode", "tp=1,dp=2"],
     "decode dp=2 needs a model with DP attention padding; the LlamaForCausalLM model has "
     "none"),
    ([spec("hf-llama"), "--drop", "gdn_conv"], "--drop names no component of "),
    ([str(SPECS / "nope.yaml")], "cannot read spec"),
])
def test_user_errors_exit_1_with_a_message(capsys, argv, message):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 1
    assert err.startswith("pdc parity: error: ") or err.startswith(f"{argv[0]}: error: ")
    assert message in err


@pytest.mark.parametrize("argv,message", [
    (["--prefill", "tp=1,dp=2"], "pdc parity: error: --prefill tp=1,dp=2: pdc parity runs one "
     "request, so one DP group\n  hint: use dp=1 (or leave dp out)\n"),
    (["--steps", "1"], "pdc parity: error: --steps is 1\n  hint: give --steps from 2 to 1000\n"),
])
def test_out_of_range_options_exit_2_before_any_process(capsys, argv, message):
    assert _cli(capsys, spec("hf-llama"), *argv) == (2, "", message)


def test_usage_errors_exit_2(capsys):
    assert main(["parity", spec("hf-llama"), "--engine", "rdma"]) == 2
    assert main(["parity", spec("hf-llama"), "--dtype", "float8"]) == 2
    assert main(["parity"]) == 2
    capsys.readouterr()


def test_cli_runs_several_specs_and_fails_when_one_fails(capsys):
    """One call, one set of processes: mistral passes, qwen3-next without its conv state in
    the plan fails (--drop applies to the specs that have the component); exit status 1."""
    rc, out, err = _cli(capsys, spec("hf-mistral-sw"), spec("hf-qwen3-next"), "--engine", "nixl",
                        "--dtype", "bfloat16", "--drop", "gdn_conv")
    assert rc == 1  # stderr holds only progress, one plain line per phase (not a terminal)
    assert err and all(re.match(r"pdc parity: +\d+\.\d s  \S", line) for line in err.splitlines())
    mistral, qwen = out.split("pdc parity: ")[1:]
    assert mistral.splitlines()[:3] == [  # within 100 columns: the topology on its own line
        "hf-mistral-sw (MistralForCausalLM, bfloat16)",
        "  prefill tp=1,pp=1,dp=1,page_size=4 -> decode tp=1,pp=1,dp=1,page_size=4 over nixl",
        "  prompt   20 tokens in 3 chunks (8+8+4), 10 steps"]
    assert max(map(len, out.splitlines())) <= 100
    assert f"  {OK}\n" in mistral
    assert qwen.startswith("hf-qwen3-next (Qwen3NextForCausalLM, bfloat16)\n  prefill ")
    assert "  parity   FAILED at step 1 (decode step 1): " in qwen
    assert "  cause    layer 0 component gdn_conv (L0.conv): " in qwen


def test_prepare_rejects_before_starting_processes():
    w = ParityWorkers()
    with pytest.raises(ParityError, match="llama3-70b.yaml has no `parity` block: pdc parity "
                       "needs the tiny model"):
        prepare(str(SPECS / "llama3-70b.yaml"), "tp=1", "tp=1", "mooncake", None, w)
    assert len(w) == 0  # nothing was spawned


def test_progress_names_every_phase_of_a_case(workers):
    """`pdc parity` shows where a run is (ParityWorkers.progress): ranks ready, each rank's
    prefill or decode done, the decode model at work."""
    seen: list[str] = []
    workers.progress = seen.append
    try:
        _, _, verdict = run_case(workers, "hf-llama", "tp=2", "tp=1", "mooncake")
    finally:
        workers.progress = lambda text: None
    assert verdict.ok
    phases = [s for s in seen if not s.startswith(("starting", "worker"))]
    assert phases[0] == "3 ranks ready; chunked prefill and transfer"
    assert sorted(phases[1:4]) == ["decode rank pp0.tp0 done", "prefill rank pp0.tp0 done",
                                   "prefill rank pp0.tp1 done"]
    assert phases[4:] == ["decode model: rebuilding the cache and generating"]
