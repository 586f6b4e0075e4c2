"""`pdc plan`: the acceptance cases of the lowering issue, in-process."""

from __future__ import annotations

import json
import re

from pdc.cli import main

from .test_cli import QWEN, REPO

GLM = REPO / "specs" / "glm52.yaml"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_the_table(capsys):
    code, out, err = run(capsys, "plan", str(QWEN), "--prefill", "tp=4", "--decode", "tp=1",
                         "--tokens", "4096")
    assert (code, err) == (0, "")
    assert "request of 4096 tokens = 64 pages\ndeclared: deployment 0 at specs/qwen38.yaml:118:5; " \
        "its plan is generated (plans.py)\n" in out
    assert re.search(r"^pp0.tp0 -> pp0.tp0 +127 ", out, re.M)
    assert "responses expected per decode rank: pp0.tp0: 4" in out
    assert "coverage: proven" in out


def test_plan_says_when_engines_lower_the_plan_at_start(capsys):
    code, out, _ = run(capsys, "plan", str(QWEN), "--prefill", "tp=2", "--decode", "tp=1",
                       "--json")
    assert (code, json.loads(out)["declared"]) == (0, "")
    code, out, _ = run(capsys, "plan", str(QWEN), "--prefill", "tp=2", "--decode", "tp=1")
    assert out.splitlines()[2] == "not declared by the spec: engines lower this plan at start"


def test_plan_into_a_closed_pipe_leaves_no_traceback():
    import subprocess

    r = subprocess.run(f"pdc plan {QWEN} --prefill tp=4 --decode tp=1 | head -1", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert (r.stdout.count("\n"), r.stderr) == (1, "")


def test_plan_rejection_names_the_rule(capsys):
    code, out, err = run(capsys, "plan", str(QWEN), "--prefill", "tp=4", "--decode", "tp=1",
                         "--backend", "nixl")
    assert (code, out) == (1, "")
    assert err.startswith("specs/qwen38.yaml:114:3: error: backend 'nixl' does not support "
                          "heterogeneous attention TP (prefill tp=4, decode tp=1): rule "
                          "`hetero_attention_tp: false` (seed: NIXL fails fast on heterogeneous "
                          "Qwen3.8 attention TP)\n"
                          "    nixl: {hetero_attention_tp: false, why:")
    assert "Traceback" not in err


def test_plan_glm_pp_to_smaller_tp(capsys):
    code, out, _ = run(capsys, "plan", str(GLM), "--prefill", "tp=8,pp=2", "--decode", "tp=4")
    assert code == 0
    assert "pp0.tp0: 2, pp0.tp1: 2, pp0.tp2: 2, pp0.tp3: 2" in out


def test_plan_json_holds_the_plan(capsys):
    code, out, _ = run(capsys, "plan", str(GLM), "--prefill", "tp=2", "--decode", "tp=1,dp=2",
                       "--json")
    report = json.loads(out)
    assert code == 0 and report["coverage"] == "proven"
    assert report["plan"]["topology"]["decode"]["dp"] == 2
    assert {lk["prefill"] for lk in report["links"]} == {"pp0.tp0"}


def test_plan_bad_side_is_a_located_error(capsys):
    code, _, err = run(capsys, "plan", str(QWEN), "--prefill", "tp=four", "--decode", "tp=1")
    assert code == 2  # a usage error
    assert err.startswith("--prefill: error: tp in --prefill must be a positive integer, "
                          "got 'four'")


def test_plan_explicit_stages_from_the_command_line(capsys):
    # Stage 0 holds only GDN layers: the QSA RoPE ring is registered on stage 1 only.
    code, out, _ = run(capsys, "plan", str(QWEN), "--prefill", "tp=2,stages=0-2/3-47",
                       "--decode", "tp=1", "--json")
    report = json.loads(out)
    assert code == 0 and report["coverage"] == "proven"
    reg0 = report["plan"]["prefill"][0]
    assert reg0["rank"] == {"pp": 0, "tp": 0}
    assert dict((n, e) for n, e, _ in reg0["components"])["qsa_rope"] == []
    code, _, err = run(capsys, "plan", str(QWEN), "--prefill", "tp=2,stages=0-2/4-47",
                       "--decode", "tp=1")
    assert code == 2  # a flag's mistake is a usage error
    assert "--prefill stages must give pp lists that hold every real layer 0..47" in err
