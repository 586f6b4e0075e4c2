"""What the commands print: `--json` of demo and parity (Note [JSON output] in
pdc/commands/common.py), usage errors as JSON objects, and tables and progress from rich that are plain lines without
carriage returns when not on a terminal and fit 100 columns (Note [Console output] in
pdc/console.py)."""

from __future__ import annotations

import io
import json
import re
import time

import pytest

from pdc.console import Counter, phase_printer, print_table
from pdc.demo import ROLE_DECODE, ROLE_PREFILL, _report
from pdc.verify.ranks import Req

from .test_cli import QWEN, REPO, run

HF_LLAMA = REPO / "specs" / "hf-llama.yaml"
PARITY_OK = ("parity   OK: tokens and logits of all 10 steps bitwise equal to single-process "
             "generation")


def fits(text: str) -> None:
    """Plain lines for a log: no carriage return, no escape code, none over 100 columns."""
    assert "\r" not in text and "\x1b" not in text
    assert max(len(line) for line in text.splitlines()) <= 100, text


# ~~~ pdc demo --json ~~~

DEMO_KEYS = {"command", "ok", "exit", "errors", "spec", "prefill", "decode", "engine", "seed",
             "stream", "family", "topology", "rank_processes", "ran", "requests",
             "bytes_verified", "descriptors", "batches", "links", "staged_links", "transfer_s",
             "wall_s", "transfer_gb_s", "latency_ms", "transports", "failures", "faults",
             "metrics_port", "hosts"}


def test_demo_json_is_the_only_thing_on_stdout(capsys):
    code, out, err = run(capsys, "demo", "--engine", "local", "--requests", "3",
                         "--concurrency", "2", "--json")
    obj = json.loads(out)
    assert code == 0 and set(obj) == DEMO_KEYS
    assert {k: obj[k] for k in ("command", "ok", "exit", "errors", "spec", "prefill", "decode",
                                "engine", "family", "topology", "rank_processes", "ran",
                                "requests", "failures", "faults", "metrics_port", "hosts")} == {
        "command": "demo", "ok": True, "exit": 0, "errors": [], "spec": "specs/qwen38.yaml",
        "prefill": "tp=2", "decode": "tp=1", "engine": "local", "family": "qwen38",
        "topology": "prefill tp=2,pp=1,dp=1,page_size=64 -> decode tp=1,pp=1,dp=1,"
                    "page_size=64 over local",
        "rank_processes": 3, "ran": True, "requests": {"total": 3, "ok": 3, "failed": 0},
        "failures": [], "faults": [], "metrics_port": None, "hosts": []}
    assert obj["bytes_verified"] > 0 and obj["descriptors"] >= obj["links"] > 0
    assert obj["transports"] == ["local: process_vm_writev (same host, host memory)"]
    assert 0 < obj["latency_ms"]["p50"] <= obj["latency_ms"]["p99"]
    # the report and the progress went to stderr, as plain lines
    assert f"  bytes moved      {obj['bytes_verified'] / 2**20:.1f} MiB (every byte verified)\n" \
        in err
    assert re.findall(r"^  requests: (\d/3) \(\d+\.\d s\)$", err, re.M) == ["2/3", "3/3"]
    fits(err)


def test_demo_json_names_the_rejected_topology(capsys):
    code, out, err = run(capsys, "demo", "--prefill", "tp=4", "--decode", "tp=1", "--engine",
                         "nixl", "--json")
    obj = json.loads(out)
    assert (code, obj["exit"], obj["ok"], obj["ran"]) == (1, 1, False, False)
    assert obj["requests"] == {"total": 20, "ok": 0, "failed": 0}
    assert obj["bytes_verified"] == 0 and obj["latency_ms"] == {"p50": None, "p99": None}
    [e] = obj["errors"]
    assert (e["file"], e["line"], e["col"]) == ("specs/qwen38.yaml", 114, 3)  # the rule's line
    assert e["hint"] == (
        "use equal attention TP on both sides, or a backend that allows it: mooncake, local")
    assert e["message"].startswith(
        "backend 'nixl' does not support heterogeneous attention TP (prefill tp=4, decode tp=1): "
        "rule `hetero_attention_tp: false` (seed:")


# ~~~ usage errors: exit 2, one JSON object ~~~


@pytest.mark.parametrize(("argv", "message", "hint"), [
    (["demo", "--requests", "0"], "--requests is 0", "give --requests from 1 to 100000"),
    (["demo", "--requests", "x"], "argument --requests: invalid int value: 'x'",
     "see `pdc demo --help`"),
    (["demo", "--decode", "tp=1,dp=100"], "--prefill tp=2 and --decode tp=1,dp=100 need 102 "
     "rank processes, more than the 64 a demo starts", "use smaller tp, pp or dp"),
    (["demo", "--metrics-port", "70000"], "--metrics-port 70000 is not a TCP port",
     "give 0-65535; 0 picks a free one"),
    (["parity", str(HF_LLAMA), "--steps", "1"], "--steps is 1", "give --steps from 2 to 1000"),
    (["parity", str(HF_LLAMA), "--prefill", "tp=1,dp=2"],
     "--prefill tp=1,dp=2: pdc parity runs one request, so one DP group",
     "use dp=1 (or leave dp out)"),
    (["parity"], "the following arguments are required: SPEC", "see `pdc parity --help`"),
    (["plan", str(QWEN)], "the following arguments are required: --prefill, --decode",
     "see `pdc plan --help`"),
    (["validate", "--bogus"], "unrecognized arguments: --bogus", "see `pdc validate --help`"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate' (choose from 'validate', "
     "'compile', 'check', 'plan', 'vllm-demo', 'demo', 'sglang-demo', 'parity', 'bind')",
     "see `pdc --help`"),
])
def test_usage_errors_are_exit_2_and_a_json_error_object(capsys, argv, message, hint):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 2 and message in err
    assert json.loads(out) == {
        "command": argv[0] if argv[0] != "frobnicate" else None, "ok": False, "exit": 2,
        "errors": [{"file": "<command line>", "line": 0, "col": 0, "message": message,
                    "hint": hint}]}


@pytest.mark.parametrize(("argv", "message"), [
    (["vllm-demo", "--prompts", "0"], "pdc vllm-demo: error: --prompts is 0\n"
     "  hint: give --prompts from 1 to 10000\n"),
    (["vllm-demo", "--tokens", "5000"], "pdc vllm-demo: error: --tokens is 5000\n"
     "  hint: give --tokens from 1 to 1024\n"),
    (["sglang-demo", "--in-flight", "1000"], "pdc sglang-demo: error: --in-flight is 1000\n"
     "  hint: give --in-flight from 1 to 256\n"),
    (["sglang-demo", "--prompts", "-5"], "pdc sglang-demo: error: --prompts is -5\n"
     "  hint: give --prompts from 1 to 10000\n"),
    (["vllm-demo", "--in-flight", "0"], "pdc vllm-demo: error: --in-flight is 0\n"
     "  hint: give --in-flight from 1 to 256\n"),
    (["vllm-demo", "--compare", "--repeat", "0"], "pdc vllm-demo: error: --repeat is 0\n"
     "  hint: give --repeat from 1 to 20\n"),
    (["sglang-demo", "--repeat", "21"], "pdc sglang-demo: error: --repeat is 21\n"
     "  hint: give --repeat from 1 to 20\n"),
    (["sglang-demo", "--warmup", "-1"], "pdc sglang-demo: error: --warmup is -1\n"
     "  hint: give --warmup from 0 to 10000\n"),
    (["sglang-demo", "--load", "-1"], "pdc sglang-demo: error: --load is -1\n"
     "  hint: give --load from 0 to 64\n"),
    (["vllm-demo", "--load", "65"], "pdc vllm-demo: error: --load is 65\n"
     "  hint: give --load from 0 to 64\n"),
    (["vllm-demo", "--tie-tolerance", "-1"], "pdc vllm-demo: error: --tie-tolerance -1.0 is "
     "not a logprob gap\n  hint: give a value from 0 (identity) to 10\n"),
    (["vllm-demo", "--tie-tolerance", "nan"], "pdc vllm-demo: error: --tie-tolerance nan is "
     "not a logprob gap\n  hint: give a value from 0 (identity) to 10\n"),
])
def test_server_demos_cap_their_arguments_with_exit_2(capsys, argv, message):
    assert run(capsys, *argv) == (2, "", message)


def test_vllm_demo_spec_error_is_exit_1(capsys, bad_spec):
    bad = bad_spec("limit_param_bad_name")
    code, out, err = run(capsys, "vllm-demo", "--spec", bad)
    assert (code, out) == (1, "")
    assert err.startswith(f"{bad}:11:3: error: key 'kv-heads' in 'params' is not a valid name")


# ~~~ pdc parity --json ~~~


def test_parity_json_refusal_is_the_located_spec_error(capsys, bad_spec):
    bad = bad_spec("limit_param_bad_name")
    code, out, err = run(capsys, "parity", bad, "--json")
    assert code == 1 and err.startswith(f"{bad}:11:3: error: ")
    assert json.loads(out) == {
        "command": "parity", "ok": False, "exit": 1, "prefill": "tp=1", "decode": "tp=1",
        "engine": "mooncake", "dtype": None, "threads": 1,
        "specs": [{"spec": bad, "ok": False, "ran": False}],
        "errors": [{"file": bad, "line": 11, "col": 3,
                    "message": "key 'kv-heads' in 'params' is not a valid name",
                    "hint": "names match ^[A-Za-z_][A-Za-z0-9_]*$"}]}


def test_parity_json_unknown_drop(capsys):
    code, out, _ = run(capsys, "parity", str(HF_LLAMA), "--drop", "gdn_conv", "--json")
    obj = json.loads(out)
    assert (code, obj["exit"], obj["specs"]) == (1, 1, [])
    assert obj["errors"] == [{"file": "--drop", "line": 0, "col": 0,
                              "message": f"--drop names no component of {HF_LLAMA}: gdn_conv",
                              "hint": "name a component of a SPEC's `components`"}]


def test_parity_json_reports_each_spec(capsys):
    code, out, err = run(capsys, "parity", str(HF_LLAMA), "--engine", "local", "--json")
    obj = json.loads(out)
    assert (code, obj["ok"], obj["exit"], obj["errors"]) == (0, True, 0, [])
    [r] = obj["specs"]
    assert set(r) == {"spec", "ok", "ran", "family", "model", "dtype", "topology",
                      "prompt_tokens", "chunks", "steps", "tokens", "report", "wall_s"}
    assert {k: r[k] for k in ("spec", "ok", "ran", "family", "model", "dtype", "topology",
                              "prompt_tokens", "chunks", "steps")} == {
        "spec": str(HF_LLAMA), "ok": True, "ran": True, "family": "hf-llama",
        "model": "LlamaForCausalLM", "dtype": "float32",
        "topology": "prefill tp=1,pp=1,dp=1,page_size=4 -> decode tp=1,pp=1,dp=1,page_size=4 "
                    "over local",
        "prompt_tokens": 20, "chunks": [8, 8, 4], "steps": 10}
    assert len(r["tokens"]) == 10 and r["report"][0] == f"tokens   {r['tokens']}"
    assert r["report"][-1] == PARITY_OK and r["wall_s"] > 0
    # stderr: progress lines and the report, plain and within 100 columns
    assert f"  {PARITY_OK}\n" in err and "pdc parity: hf-llama (LlamaForCausalLM, float32)\n" in err
    fits(err)


# ~~~ tables and progress ~~~


def test_plan_table_fits_100_columns_with_a_long_family_and_spec_name(capsys, tmp_path):
    family = "q" + "-long" * 12 + "-name"  # 66 characters, over the schema's 64 ...
    family = family[:64]  # ... so the longest a family name can be
    spec = tmp_path / ("a-spec-with-a-long-file-name-" * 4 + "qwen38.yaml")
    spec.write_text(QWEN.read_text().replace("family: qwen38", f"family: {family}", 1))
    code, out, err = run(capsys, "plan", str(spec), "--prefill", "tp=4,pp=2", "--decode",
                         "tp=1")
    assert (code, err) == (0, "")
    fits(out)
    assert out.splitlines()[:3] == [f"{family}:", "  prefill tp=4,pp=2,dp=1,page_size=64",
                                    "  -> decode tp=1,pp=1,dp=1,page_size=64 over mooncake"]
    assert out.splitlines()[6:8] == [
        "link                entries  MiB/request  desc contig  desc frag  staged frag  elected",
        "------------------- -------- ------------ ------------ ---------- ------------ -------"]


@pytest.mark.parametrize(("spec", "prefill", "decode"), [
    ("qwen38.yaml", "tp=4", "tp=1"), ("glm52.yaml", "tp=8,pp=2", "tp=4"),
    ("deepseek-v32.yaml", "tp=8", "tp=1"), ("llama3-70b.yaml", "tp=2", "tp=8,pp=2"),
])
def test_the_plan_report_fits_100_columns(capsys, spec, prefill, decode):
    code, out, _ = run(capsys, "plan", str(REPO / "specs" / spec), "--prefill", prefill,
                       "--decode", decode)
    assert code == 0
    fits(out)
    report = json.loads(run(capsys, "plan", str(REPO / "specs" / spec), "--prefill", prefill,
                            "--decode", decode, "--json")[1])
    elected = {c for lk in report["links"] for c in lk["elected_for"]}
    assert all(c in out for c in elected)  # listed, wrapped, under the table
    assert out.splitlines()[-1].startswith("coverage: proven")


def _ok(room: int) -> list:
    # demo results: decode (room, status, why, bytes, seconds, staged links, links),
    # prefill (room, status, why, bytes, descriptors, transfer seconds, batches); 3 = Success
    return [(ROLE_DECODE, (room, 3, "", 2**20, 0.010, 1, 2)),
            (ROLE_PREFILL, (room, 3, "", 0, 5, 0.004, 2))]


def _failed(room: int) -> list:
    return [(ROLE_DECODE, (room, 4, "transfer deadline of 30 s passed", 0, 0.0, 0, 2)),
            (ROLE_PREFILL, (room, 4, "", 0, 0, 0.0, 0))]


@pytest.mark.parametrize(("outcome", "code", "moved"), [
    ({1000: _ok(1000), 1001: _ok(1001)}, 0, "2.0 MiB (every byte verified)"),
    ({1000: _ok(1000), 1001: _failed(1001)}, 1, "1.0 MiB (every byte of the 1 verified request)"),
    ({1000: _failed(1000), 1001: _failed(1001)}, 1,
     "0.0 MiB (nothing verified: no request succeeded)"),
])
def test_demo_report_says_what_was_verified(outcome, code, moved):
    reqs = [Req(1000, 10, 64, 0), Req(1001, 10, 64, 0)]
    out, summary = io.StringIO(), {}
    assert _report(outcome, reqs, 2.5, out, summary, ["local: process_vm_writev"]) == code
    lines = out.getvalue().splitlines()
    assert lines[2] == f"  bytes moved      {moved}"
    failed = [room for room in (1000, 1001) if outcome[room] == _failed(room)]
    assert [line for line in lines if "FAILED" in line] == [
        f"  FAILED room {room}: transfer deadline of 30 s passed" for room in failed]
    assert summary["errors"] == [
        {"file": "<demo>", "line": 0, "col": 0, "hint": "",
         "message": f"request room {room} failed: transfer deadline of 30 s passed"}
        for room in failed]


def test_demo_report_wraps_a_long_value_within_100_columns():
    out = io.StringIO()
    _report({1000: _ok(1000)}, [Req(1000, 10, 64, 0)], 1.0, out, {},
            ["mooncake: tcp on 127.0.0.1 " * 6])
    fits(out.getvalue())
    assert out.getvalue().splitlines()[-2:] == [
        "  transport        mooncake: tcp on 127.0.0.1 mooncake: tcp on 127.0.0.1 mooncake: "
        "tcp on 127.0.0.1",
        "                   mooncake: tcp on 127.0.0.1 mooncake: tcp on 127.0.0.1 mooncake: "
        "tcp on 127.0.0.1"]


def test_counter_prints_a_plain_line_per_tenth_when_not_a_terminal():
    err = io.StringIO()
    c = Counter("requests", 1000, err=err)
    for i in range(1000):
        c.tick(failed=int(i == 0))
    c.close()
    assert re.findall(r"^  requests: (\d+)/1000, 1 failed \(\d+\.\d s\)$", err.getvalue(),
                      re.M) == [str(n) for n in range(100, 1001, 100)]
    fits(err.getvalue())


def test_phase_printer_plain_lines():
    err = io.StringIO()
    show = phase_printer("parity", err)
    show("worker 1 of 2 up")
    show("decode model: generating")
    assert re.fullmatch(r"pdc parity: +\d+\.\d s  worker 1 of 2 up\n"
                        r"pdc parity: +\d+\.\d s  decode model: generating\n", err.getvalue())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_table_on_a_terminal_has_rich_styles_and_in_a_log_plain_lines(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a: __import__("os").terminal_size(
        (200, 50)))
    rows = [("pp0.tp0 -> pp0.tp0", "127", "x " * 80)]
    log, tty = io.StringIO(), _Terminal()
    for out in (log, tty):
        print_table(("link", "entries", "note"), rows, out, right=(1,))
    fits(log.getvalue())
    assert log.getvalue().splitlines()[:2] == [
        "  link                entries  note",
        "  ------------------- -------- " + "-" * 69]  # 100 columns in all
    assert "\x1b[" in tty.getvalue()  # bold header, rules: rich on a terminal
    plain = re.sub(r"\x1b\[[0-9;]*m", "", tty.getvalue())
    assert max(len(line.rstrip()) for line in plain.splitlines()) <= 100  # capped at 100


def test_sglang_demo_table(capsys):
    from pdc.serving.sglang_demo import Row, print_rows

    rows = [Row("pdc", "mooncake", 16, 0, 0, 12.345, 16, 1.23, 120, 340, 12.3, []),
            Row("mooncake", "mooncake", 15, 1, 1, 12.3, 16, 2.5, 150, 400, 13.0,
                ["prompt 3: tokens differ from the plain server"])]
    out = io.StringIO()
    print_rows(rows, 16, 4, out)
    assert out.getvalue() == (
        "pdc sglang-demo: 16 prompts, 4 in flight, tokens checked against a plain SGLang server "
        "(transfer ms:\n"
        "  mean per request, from SGLang's sglang:kv_transfer_latency_ms)\n"
        "  backend   engine    ok  failed  MB moved  transfers  transfer ms  TTFT p50 ms  "
        "TTFT p99 ms  wall s\n"
        "  --------- --------- --- ------- --------- ---------- ------------ ------------ "
        "------------ ------\n"
        "  pdc       mooncake  16       0    12.345         16         1.23          120"
        "          340    12.3\n"
        "  mooncake  mooncake  15       1    12.300         16         2.50          150"
        "          400    13.0\n"
        "  FAILED mooncake/mooncake prompt 3: tokens differ from the plain server\n")
    fits(out.getvalue())


def test_sglang_demo_table_of_repetitions_has_their_medians_and_the_load():
    from pdc.serving.sglang_demo import Row, print_rows

    rows = [Row("pdc", "mooncake", 16, 0, 0, 0.5, 16, 1.0, p50, p99, 1.0, [], rep)
            for rep, (p50, p99) in enumerate(((100, 300), (140, 500), (120, 200)))]
    out = io.StringIO()
    print_rows(rows, 16, 1, out, load="; load average 0.50, 0.40, 0.30 before, 0.60, 0.50, "
                                      "0.40 after")
    text = out.getvalue()
    assert "load average 0.50, 0.40, 0.30 before, 0.60, 0.50, 0.40 after" in text.replace(
        "\n  ", " ")
    assert text.splitlines()[-3:] == [
        "  backend  engine    runs  TTFT p50 ms  TTFT p99 ms  over one engine p50 / p99 ms",
        "  -------- --------- ----- ------------ ------------ ----------------------------",
        "  pdc      mooncake     3          120          300                             -"]
    fits(text)


def test_vllm_demo_table_wraps_a_long_failure():
    from pdc.serving.vllm_demo import Outcome, print_outcomes

    outcomes = [Outcome(0, 17, [1], [1], {"ok": True, "bytes": 123456, "prefix_tokens": 0}, 0.1),
                Outcome(1, 300, [1], [2], {"ok": True, "bytes": 5, "prefix_tokens": 16}, 0.2,
                        "decode [rank 0] says: " + "no such block " * 12)]
    out = io.StringIO()
    print_outcomes(outcomes, "mooncake", out)
    fits(out.getvalue())
    lines = out.getvalue().splitlines()
    assert lines[:4] == [
        "pdc vllm-demo (mooncake)",
        "  #  prompt  decode prefix    bytes  TTFT ms  tokens",
        "  -- ------- -------------- -------- -------- " + "-" * 54,
        "  0      17              0  123,456      100  identical"]
    assert lines[4].startswith("  1     300             16        5      200  decode [rank 0] "
                               "says: no such block")


def test_vllm_demo_names_a_near_tie_and_a_drift_beyond_the_tolerance():
    # Note [Logprob tolerance] (pdc/serving/drift.py): an MLA prompt whose tokens part at a
    # near tie is ok and says where; one beyond the tolerance fails with why
    from pdc.serving.drift import Drift
    from pdc.serving.vllm_demo import Outcome, print_outcomes

    sent = {"ok": True, "bytes": 9, "prefix_tokens": 0}
    tie = Outcome(0, 17, [1, 2, 3], [1, 2, 4], sent, 0.1, drift=Drift(2, 0.001, tie_nats=0.03))
    far = Outcome(1, 17, [1, 2], [5, 2], sent, 0.1, drift=Drift(0, 0.0, "token 0: far"))
    assert (tie.ok, far.ok) == (True, False)
    out = io.StringIO()
    print_outcomes([tie, far], "nixl", out)
    lines = out.getvalue().splitlines()
    assert lines[3].endswith("near tie at token 2") and lines[4].endswith("token 0: far")


def test_vllm_compare_table_is_medians_over_repetitions_and_overhead_over_one_engine():
    from pathlib import Path

    from pdc.serving import vllm_compare as C
    from pdc.serving.vllm_compare import Run, print_rows, rows_of

    def run(backend, rep, ttfts, identical=4):
        if backend == "alone":  # its TTFT is the engine's own
            return Run(backend, rep, Path("."), ttfts, identical, decode_ms=ttfts)
        return Run(backend, rep, Path("."), ttfts, identical, prefill_ms=[10] * 4,
                   decode_ms=[t / 2 for t in ttfts], second_ms=[t + 5 for t in ttfts],
                   hops_ms=[t / 2 - 10 for t in ttfts])

    runs = [run("alone", 0, [20, 22, 24, 80]), run("pdc", 0, [60, 70, 75, 300]),
            run("nixl", 0, [50, 55, 60, 200]), run("alone", 1, [30, 32, 34, 90]),
            run("pdc", 1, [40, 42, 44, 100], identical=3), run("nixl", 1, [45, 50, 55, 150])]
    rows = {r.backend: r for r in rows_of(runs, "mooncake", 4)}
    assert (rows["one engine"].p50_ms, rows["one engine"].p99_ms) == (29.0, 85.0)
    pdc = rows["pdc (mooncake)"]
    assert (pdc.runs, pdc.identical, pdc.p50_ms, pdc.p99_ms) == (2, "7/8", 59.5, 200.0)
    assert (pdc.over_p50_ms, pdc.over_p99_ms) == (30.5, 115.0)
    assert rows["vLLM NixlConnector"].over_p50_ms == 28.5
    assert rows["one engine"].over_p50_ms is None
    out = io.StringIO()
    print_rows(list(rows.values()), out, "title")
    line = next(x for x in out.getvalue().splitlines() if x.startswith("  pdc (mooncake)"))
    assert line.split() == ["pdc", "(mooncake)", "2", "7/8", "60", "200", "+30", "+115"]
    # TTFT's parts: pdc's decode half of each TTFT, prefill 10 ms, the rest hops
    assert (pdc.prefill_p50_ms, pdc.decode_p50_ms, pdc.hops_p50_ms) == (10.0, 29.75, 19.75)
    assert (rows["one engine"].prefill_p50_ms, rows["one engine"].decode_p50_ms) == (None, 29.0)
    parts = out.getvalue().split("TTFT's parts")[1].splitlines()
    assert [x.split() for x in parts if x.startswith("  pdc")] == [
        ["pdc", "(mooncake)", "10.0", "19.8", "29.8", "64.5"]]
    assert [x.split() for x in parts if x.startswith("  one engine")] == [
        ["one", "engine", "-", "-", "29.0", "-"]]
    assert C.label("pdc-first", "nixl") == "pdc, first token from prefill (nixl)"
    fits(out.getvalue())


def test_vllm_compare_knob_rows_are_pdc_backends_with_their_knobs(tmp_path, monkeypatch):
    from pdc.serving import vllm_compare as C

    made = []

    class FakeEngine:  # records how run_backend starts the engines; serves nothing
        def __init__(self, python, logs, role, model, family, engine_name, core, connector="pdc",
                     env=None, engine_id=None):
            made.append((role, connector, env))

        def wait_up(self):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(C, "Engine", FakeEngine)
    monkeypatch.setattr(C, "stop_engines", lambda engines: [e.stop() for e in engines])
    def fake_run_pd(*a, replies, **k):
        replies["prefill", 0] = {"ttft_s": 0.02}
        replies["decode", 0] = {"ttft_s": 0.025}
        return [[1]], None, [0.05], [""], None

    monkeypatch.setattr(C, "run_pd", fake_run_pd)
    env = {"PDC_WORKER_POLL": "1"}
    run = C.run_backend("python", tmp_path, "model", "fam", "mooncake",
                        "pdc[worker_poll=1]", 0, [[5]], [[1]], 4, 1, env)
    assert [(role, conn, e) for role, conn, e in made] == [
        ("prefill", "pdc", env), ("decode", "pdc", env)]
    assert (run.identical, run.ttft_ms, run.logs.name) == (1, [50.0],
                                                            "rep0-pdc-worker_poll-1-")
    assert (run.prefill_ms, run.decode_ms, run.hops_ms) == ([20.0], [25.0], [5.0])
    # the first token from prefill: its proxy's flow, and TTFT is prefill's answer and hops
    flows = []

    def first_run_pd(*a, replies, flow, **k):
        flows.append(flow)
        replies["prefill", 0] = {"ttft_s": 0.02}
        replies["decode", 0] = {"ttft_s": 0.025}
        return [[1]], None, [0.024], [""], None

    monkeypatch.setattr(C, "run_pd", first_run_pd)
    run = C.run_backend("python", tmp_path, "model", "fam", "mooncake", "pdc-first", 0, [[5]],
                        [[1]], 4, 1)
    assert flows[0].first_token and [round(h, 6) for h in run.hops_ms] == [4.0]
    assert C.label("pdc[worker_poll=1]", "nixl") == "pdc[worker_poll=1] (nixl)"


def test_vllm_compare_warm_up_requests_go_first_one_at_a_time_outside_the_figures(
        tmp_path, monkeypatch):
    from pdc.serving import vllm_compare as C

    class FakeEngine:  # serves nothing
        def __init__(self, *a, **k):
            pass

        def wait_up(self):
            pass

        def stop(self):
            pass

    calls = []

    def fake_run_pd(pre, dec, prompts, max_tokens, concurrency, flow, replies=None, **k):
        calls.append((prompts, concurrency, flow.tag))
        if replies is not None:
            replies["prefill", 0] = {"ttft_s": 0.02}
            replies["decode", 0] = {"ttft_s": 0.025}
        return [[1]] * len(prompts), None, [0.05] * len(prompts), [""] * len(prompts), None

    def fake_run_alone(engine, prompts, max_tokens, concurrency, replies=None):
        calls.append((prompts, concurrency, "alone"))
        if replies is not None:
            replies[0] = {"second_s": 0.03}
        return [[1]] * len(prompts), [0.01] * len(prompts)

    monkeypatch.setattr(C, "Engine", FakeEngine)
    monkeypatch.setattr(C, "stop_engines", lambda engines: [e.stop() for e in engines])
    monkeypatch.setattr(C, "run_pd", fake_run_pd)
    monkeypatch.setattr(C, "run_alone", fake_run_alone)
    run = C.run_backend("python", tmp_path, "model", "fam", "mooncake", "mooncake", 2, [[5]],
                        [[1]], 4, 3, warmup=[[7, 8], [9]])
    assert calls == [([[7, 8], [9]], 1, "r2w"), ([[5]], 3, "r2")]
    assert (run.identical, run.ttft_ms) == (1, [50.0])
    calls.clear()
    run = C.run_backend("python", tmp_path, "model", "fam", "mooncake", "alone", 3, [[5]],
                        [[1]], 4, 3, warmup=[[7]])
    assert calls == [([[7]], 1, "alone"), ([[5]], 3, "alone")]
    assert (run.identical, run.ttft_ms) == (1, [10.0])


def test_vllm_proxy_flows_of_the_connectors():
    from pdc.serving.vllm_proxy import Flow

    assert Flow().to_prefill(3) == {"do_remote_decode": True}
    assert Flow().to_decode(3, {"pdc_room": 7}) == {"pdc_room": 7}
    moon = Flow("prefill-0", "http://127.0.0.1:9000", "r0")
    assert moon.to_prefill(3) == {"do_remote_decode": True, "transfer_id": "r0t3"}
    assert moon.to_decode(3, None) == {
        "do_remote_prefill": True, "remote_engine_id": "prefill-0",
        "remote_bootstrap_addr": "http://127.0.0.1:9000", "transfer_id": "r0t3"}


def test_sglang_demo_medians_show_each_pd_backends_overhead_over_one_engine():
    from pdc.serving.sglang_demo import ONE_ENGINE, Row, print_rows

    rows = [Row(b, e, 8, 0, 0, 0.3, 8, 1.0, p50, p99, 1.0, [], rep)
            for rep, (b, e, p50, p99) in enumerate((
                ("pdc", "mooncake", 40, 90), ("mooncake", "mooncake", 38, 94),
                (ONE_ENGINE, "-", 25, 60), ("pdc[staging_ring_slots=0]", "mooncake", 54, 83)))]
    out = io.StringIO()
    print_rows(rows, 8, 1, out)
    assert out.getvalue().splitlines()[-7:] == [
        "median over 4 repetition(s)",
        "  backend                    engine    runs  TTFT p50 ms  TTFT p99 ms  over one engine "
        "p50 / p99 ms",
        "  -------------------------- --------- ----- ------------ ------------ "
        "----------------------------",
        "  pdc                        mooncake     1           40           90"
        "                     +15 / +30",
        "  mooncake                   mooncake     1           38           94"
        "                     +13 / +34",
        "  one engine                 -            1           25           60"
        "                             -",
        "  pdc[staging_ring_slots=0]  mooncake     1           54           83"
        "                     +29 / +23"]
    fits(out.getvalue())


def test_sglang_demo_knob_rows_are_checked_against_the_runtime_knobs():
    from pdc.serving.knob_rows import knob_env, knob_label

    env = knob_env("worker_poll=1, poll_sleep_s=0.001")
    assert env == {"PDC_WORKER_POLL": "1", "PDC_POLL_SLEEP_S": "0.001"}
    assert knob_label(env) == "pdc[worker_poll=1,poll_sleep_s=0.001]"
    with pytest.raises(ValueError) as e:
        knob_env("poll_sleep_s=fast")
    assert str(e.value) == "'poll_sleep_s=fast': 'fast' is not a s value (default 0.0002)"
    with pytest.raises(ValueError, match="^'nosuch=1' is not NAME=VALUE of a runtime knob; "
                                         "known: abort_ack_timeout_s, "):
        knob_env("nosuch=1")
    with pytest.raises(ValueError, match="^' , ' names no knob$"):
        knob_env(" , ")


def test_sglang_demo_knob_rows_come_in_both_pdc_flows_with_compare():
    from pdc.serving.sglang_demo import OPTIMISTIC, backend_rows

    knobs = ({"PDC_SGLANG_FIRST_TOKEN_EARLY": "0"},)
    rows = backend_rows("nixl", True, knobs)
    assert [(label, backend, engine, env, args) for label, backend, engine, env, args in rows] == [
        ("pdc", "pdc", "nixl", {}, ()),
        ("pdc[sglang_first_token_early=0]", "pdc", "nixl", knobs[0], ()),
        ("pdc, first token from prefill", "pdc", "nixl", {}, OPTIMISTIC),
        ("pdc, first token from prefill[sglang_first_token_early=0]", "pdc", "nixl", knobs[0],
         OPTIMISTIC),
        ("mooncake", "mooncake", "mooncake", {}, ()),
        ("mooncake, optimistic prefill", "mooncake", "mooncake", {}, OPTIMISTIC),
        ("one engine", None, "-", {}, ())]
    assert [r[0] for r in backend_rows("mooncake", False, knobs)] == [
        "pdc", "pdc[sglang_first_token_early=0]"]


def test_a_vllm_engine_that_outlives_its_sigkill_is_named_not_a_traceback(capsys):
    # A multi-GB engine on busy cores once took over 10 s to go after SIGKILL; the demo
    # then ended in a TimeoutExpired traceback. A real child is killed and reaped; one that
    # stays past the wait (a stand-in) is named and left to the system.
    import subprocess
    import sys

    from pdc.serving.vllm_proxy import Engine

    engine = object.__new__(Engine)
    engine.name, engine.proc = "prefill", subprocess.Popen([sys.executable, "-c",
                                                            "import time; time.sleep(60)"])
    engine._kill(wait_s=10)
    assert engine.proc.returncode == -9 and capsys.readouterr().err == ""

    class Stuck:
        pid = 4242

        def kill(self):
            pass

        def wait(self, timeout):
            raise subprocess.TimeoutExpired("engine", timeout)

    engine.proc = Stuck()
    engine._kill(wait_s=0.1)
    assert capsys.readouterr().err == ("pdc vllm-demo: the prefill engine (pid 4242) had not "
                                       "exited 0 s after SIGKILL; left to the system\n")


_STOPPABLE = """\
import os, resource, sys, time
import zmq
sock = zmq.Context.instance().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
with open(sys.argv[1] + ".port", "w") as f:
    f.write(f"tcp://127.0.0.1:{port}")
ident, raw = sock.recv_multipart()
sock.send_multipart([ident, b'{"ok": true}'])
with open(sys.argv[1] + ".asked", "w") as f:
    f.write(str(time.monotonic()))
time.sleep(0.5)  # a teardown that takes a while, as a vLLM engine's does
with open(sys.argv[1] + ".gone", "w") as f:
    f.write(str(time.monotonic()))
if sys.argv[2] == "crash":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()
"""


def test_vllm_engines_stop_together_and_a_crash_on_the_way_out_is_named(tmp_path, capsys):
    # Every engine is asked before any is waited for (one after another, a vLLM engine's
    # 5-6 s exit cost each backend's repetition twice that); one that dies by a signal while
    # stopping is named with its log.
    import subprocess
    import sys

    import zmq

    from pdc.serving.vllm_proxy import Engine, stop_engines

    engines = []
    for name, how in (("prefill", "clean"), ("decode", "crash")):
        engine = object.__new__(Engine)
        engine.name, engine.log_path = name, tmp_path / f"{name}.log"
        engine._log = open(engine.log_path, "w")  # noqa: SIM115 - closed by stop_engines
        engine.proc = subprocess.Popen([sys.executable, "-c", _STOPPABLE,
                                        str(tmp_path / name), how])
        port_file = tmp_path / f"{name}.port"
        while not (port_file.exists() and port_file.read_text()):
            assert engine.proc.poll() is None, f"the stand-in {name} engine did not start"
            time.sleep(0.05)
        engine.address = port_file.read_text()
        engine.sock = zmq.Context.instance().socket(zmq.DEALER)
        engine.sock.setsockopt(zmq.LINGER, 0)
        engine.sock.connect(engine.address)
        engines.append(engine)
    stop_engines(engines)
    assert [e.proc.returncode for e in engines] == [0, -6]
    gone = float((tmp_path / "prefill.gone").read_text())
    assert float((tmp_path / "decode.asked").read_text()) < gone
    assert capsys.readouterr().err == (
        f"pdc vllm-demo: the decode engine (pid {engines[1].proc.pid}) ended by SIGABRT while "
        f"stopping (log: {tmp_path / 'decode.log'})\n")
