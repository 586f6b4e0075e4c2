"""Argument checks, exit codes, --json and pictures of the command line (issue 18).

Exit codes: 0 success, 1 a spec error or a failed run, 2 a usage error (a malformed or
out-of-range argument). With --json every command prints one JSON object on stdout, errors
included (Note [JSON output] in pdc/commands/common.py).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from .test_cli import QWEN, REPO, run

GLM = REPO / "specs" / "glm52.yaml"
SVG = "{http://www.w3.org/2000/svg}"


def _classes(root, cls: str) -> list:
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == cls]


def test_plan_draws_qwen38_tp4_to_tp1(capsys, tmp_path):
    svg = tmp_path / "plan.svg"
    code, out, err = run(capsys, "plan", str(QWEN), "--prefill", "tp=4", "--decode", "tp=1",
                         "--svg", str(svg))
    assert code == 0 and f"pdc plan: drew {svg}" in err
    assert "coverage: proven" in out  # the table is still printed
    root = ET.parse(svg).getroot()
    assert [g.get("data-rank") for g in _classes(root, "rank prefill")] == [
        "pp0.tp0", "pp0.tp1", "pp0.tp2", "pp0.tp3"]
    assert [g.get("data-rank") for g in _classes(root, "rank decode")] == ["pp0.tp0"]
    links = _classes(root, "link")
    assert [(g.get("data-prefill"), g.get("data-decode"), g.get("data-path")) for g in links] == [
        ("pp0.tp0", "pp0.tp0", "mixed"), ("pp0.tp1", "pp0.tp0", "staged"),
        ("pp0.tp2", "pp0.tp0", "staged"), ("pp0.tp3", "pp0.tp0", "staged")]
    texts = ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]
    assert "★ elected" in texts and "sends 146.48 MiB" in texts


def test_plan_draws_glm52_tp8_pp2_to_tp4(capsys, tmp_path):
    svg = tmp_path / "glm.svg"
    code, _, _ = run(capsys, "plan", str(GLM), "--prefill", "tp=8,pp=2", "--decode", "tp=4",
                     "--svg", str(svg))
    assert code == 0
    root = ET.parse(svg).getroot()
    assert len(_classes(root, "rank prefill")) == 16 and len(_classes(root, "rank decode")) == 4
    assert [g.get("data-layers") for g in _classes(root, "stage prefill")] == ["0-38", "39-77"]
    links = _classes(root, "link")
    assert len(links) == 8 and all(g.get("data-bytes") for g in links)
    assert sum(g.get("data-elected") == "true" for g in _classes(root, "rank prefill")) == 8


def test_plan_refuses_a_drawing_too_large_to_read(capsys, tmp_path):
    code, _, err = run(capsys, "plan", str(REPO / "specs" / "llama3-70b.yaml"), "--prefill",
                       "tp=8,pp=16", "--decode", "tp=8", "--svg", str(tmp_path / "x.svg"))
    assert code == 1
    assert err == ("pdc plan: error: cannot draw this plan: prefill has 128 ranks; a drawing "
                   "shows at most 64 per side\n")
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill", "tp=0", "--decode", "tp=1"], "tp in --prefill must be a positive integer"),
    (["--prefill", "tp=4", "--decode", "dp=999999"], "dp=999999 in --decode is beyond the limit"),
    (["--prefill", "", "--decode", "tp=1"], "--prefill is empty"),
    (["--prefill", "tp=4", "--decode", "tp=1", "--tokens", "-5"], "--tokens is -5"),
])
def test_plan_usage_errors_exit_2_with_a_json_error(capsys, argv, message):
    code, out, err = run(capsys, "plan", str(QWEN), *argv, "--json")
    assert code == 2 and message in err
    obj = json.loads(out)
    assert (obj["command"], obj["ok"], obj["exit"]) == ("plan", False, 2)
    assert message in obj["errors"][0]["message"] and obj["errors"][0]["hint"]


def test_plan_success_json_carries_the_common_keys(capsys):
    code, out, err = run(capsys, "plan", str(QWEN), "--prefill", "tp=4", "--decode", "tp=1",
                         "--json")
    obj = json.loads(out)
    assert (code, err) == (0, "")
    assert (obj["command"], obj["ok"], obj["exit"], obj["errors"]) == ("plan", True, 0, [])
    assert obj["coverage"] == "proven" and obj["plan"]["links"]


def test_plan_rejection_is_exit_1_with_the_rule_located(capsys):
    code, out, _ = run(capsys, "plan", str(QWEN), "--prefill", "tp=4", "--decode", "tp=1",
                       "--backend", "nixl", "--json")
    obj = json.loads(out)
    assert code == 1 and obj["exit"] == 1 and not obj["ok"]
    assert "hetero_attention_tp" in obj["errors"][0]["message"]
    assert (obj["errors"][0]["line"], obj["errors"][0]["col"]) == (114, 3)  # the rule's line


def test_validate_json(capsys, bad_spec):
    code, out, err = run(capsys, "validate", str(QWEN), "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == {"command": "validate", "ok": True, "exit": 0,
                               "specs": [str(QWEN)], "failed": [], "errors": []}
    code, out, _ = run(capsys, "validate", bad_spec("limit_param_bad_name"), "--json")
    obj = json.loads(out)
    assert code == 1 and obj["failed"] == ["bad_specs/limit_param_bad_name.yaml"]
    assert obj["errors"] == [{
        "file": "bad_specs/limit_param_bad_name.yaml", "line": 11, "col": 3,
        "message": "key 'kv-heads' in 'params' is not a valid name",
        "hint": "names match ^[A-Za-z_][A-Za-z0-9_]*$"}]


def test_compile_and_check_json(capsys, tmp_path):
    code, out, _ = run(capsys, "compile", str(QWEN), "--out", str(tmp_path), "--json")
    obj = json.loads(out)
    assert code == 0 and obj["ok"] and obj["specs"] == 1
    assert sorted(p.rsplit("/", 1)[-1] for p in obj["written"]) == [
        "__init__.py", "kernels.py", "layout.py", "plans.py"]
    code, out, _ = run(capsys, "check", "--json")
    obj = json.loads(out)
    assert code == 0 and obj["ok"] and obj["stale"] == [] and obj["orphans"] == []


@pytest.mark.parametrize(("argv", "message"), [
    (["--decode", "tp=1,dp=999999"], "dp=999999 in --decode is beyond the limit of 1024"),
    (["--decode", "tp=1,dp=100"], "need 102 rank processes, more than the 64 a demo starts"),
    (["--timeout", "0"], "--timeout 0.0 is not a deadline"),
    (["--prefill", ""], "--prefill is empty"),
    (["--requests", "1000000"], "--requests is 1000000\n  hint: give --requests from 1 to 100000"),
    (["--concurrency", "0"], "--concurrency is 0\n  hint: give --concurrency from 1 to 256"),
])
def test_demo_refuses_arguments_before_starting_any_process(capsys, argv, message):
    code, out, err = run(capsys, "demo", *argv)
    assert code == 2 and out == "" and message in err and "hint:" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--tokens", "0"], "--tokens is 0"), (["--steps", "5000"], "--steps is 5000"),
    (["--prefill", "tp=0"], "tp in --prefill must be a positive integer"),
    (["--timeout", "-1"], "--timeout -1.0 is not a deadline"),
])
def test_parity_usage_errors_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "parity", str(REPO / "specs" / "hf-llama.yaml"), *argv)
    assert code == 2 and out == "" and message in err
