"""Hostile specs cannot hurt: every case ends, within a time and memory cap, in success or in
located errors with hints (Note [Spec limits] in compiler/limits.py).

The cases of issue 18 (an alias bomb alone and inside a valid spec's params, 10,000 levels of
nesting, ten billion and a million layers, a 5 MB spec, 20,000 params, a binary file, an
integer of 10,000 digits) and specs at the limits (4094 layers lowered for a pipeline
deployment, a 2,000-param chain written in reverse order) each run `pdc validate` in a fresh
process under RLIMIT_AS and RLIMIT_CPU; the process reports its own peak RSS (VmHWM). Hypothesis
then feeds YAML-ish text and mutated specs to one capped worker process, one case at a time,
each under an interval timer and a tracemalloc peak.

The caps (CASE_SECONDS, CASE_RSS_BYTES) are hang and blow-up guards, far above what the
cases take (under a second and ~50 MB on a 2-core machine); they are not speed claims.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
MINI = (Path(__file__).resolve().parent / "good_specs" / "mini.yaml").read_text()
CASE_SECONDS = 20
CASE_RSS_BYTES = 200 * 2**20
ADDRESS_SPACE_BYTES = 2 * 2**30  # the hard stop: a case that needs more is killed

# Every line of a failed validation: a located error, its source line and caret, a hint,
# or the summary.
ERROR = re.compile(r"^\S+?(:\d+:\d+)?: error: \S")
SUMMARY = re.compile(r"^pdc validate: \d+ errors? in 1 of 1 spec$")

# Run in the child: cap, validate, report rc, stderr, stdout and peak RSS as one JSON line.
_CHILD = textwrap.dedent("""
    import contextlib, io, json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({as_bytes}, {as_bytes}))
    resource.setrlimit(resource.RLIMIT_CPU, ({seconds}, {seconds}))
    from pdc.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["validate", sys.argv[1]])
    # VmHWM, not ru_maxrss: Linux carries the forking parent's peak into ru_maxrss at exec.
    hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    rss = int(hwm.split()[1]) * 1024
    print(json.dumps({{"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "rss": rss}}))
""").format(as_bytes=ADDRESS_SPACE_BYTES, seconds=CASE_SECONDS)


def validate_capped(path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                          text=True, timeout=CASE_SECONDS * 2, cwd=REPO)
    assert proc.returncode == 0, f"the capped process died ({proc.returncode}): {proc.stderr}"
    return json.loads(proc.stdout.splitlines()[-1])


def assert_located_or_ok(rc: int, out: str, err: str) -> None:
    assert "Traceback" not in err
    if rc == 0:
        assert out == "pdc validate: 1 spec ok\n" and err == ""
        return
    assert rc == 1 and out == ""
    lines = err.splitlines()
    assert SUMMARY.match(lines[-1]), lines[-1]
    errors = [ln for ln in lines if ": error: " in ln and not ln.startswith(" ")]
    assert errors and all(ERROR.match(ln) for ln in errors), err
    assert err.count("  hint: ") == len(errors), err


def _bomb(levels: int = 9) -> str:
    rows = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    names = "abcdefghijklmnop"
    for prev, name in zip(names, names[1:levels], strict=False):
        rows.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(rows) + "\n"


def _with_params(extra: str) -> str:
    return MINI.replace("  conv_dim: 3 * heads * head_dim\n",
                        "  conv_dim: 3 * heads * head_dim\n" + extra)


def _reverse_chain(n: int) -> str:
    chain = "".join(f"  p{i}: p{i + 1} + 1\n" for i in range(n - 1)) + f"  p{n - 1}: 1\n"
    return _with_params(chain)


# name -> (spec text or bytes, the first error's text, or None for a spec that must pass)
CASES = {
    "alias_bomb": (_bomb(), "YAML nodes with its aliases expanded"),
    "alias_bomb_in_params": (_with_params("".join(
        "  " + line.replace(": &", "_: &") + "\n" for line in _bomb().splitlines())),
        "YAML nodes with its aliases expanded"),
    "merge_key_bomb": ("a: &a {x: 1, y: 2, z: 3}\n" + "".join(
        f"b{i}: &b{i} {{<<: [*{'a' if i == 0 else f'b{i - 1}'}], k{i}: [*a, *a, *a]}}\n"
        for i in range(30)), "YAML nodes with its aliases expanded"),
    "nesting_flow_10000": ("family: " + "[" * 10_000 + "]" * 10_000 + "\n",
                           "nests more than 32 levels"),
    "nesting_block_10000": ("family: mini\nparams:\n  deep:\n    " + "- " * 10_000 + "x\n",
                            "nests more than 32 levels"),
    "ten_billion_layers": (MINI.replace("  num_layers: 4\n", "  num_layers: 10000000000\n"),
                           "layer count 10000000000 is beyond the limit"),
    "million_layers": (MINI.replace("  num_layers: 4\n", "  num_layers: 1000000\n"),
                       "layer count 1000000 is beyond the limit"),
    "ten_thousand_layers": (MINI.replace("  num_layers: 4\n", "  num_layers: 10000\n"),
                            "layer count 10000 is beyond the limit"),
    "layers_at_the_limit": (MINI.replace("  num_layers: 4\n", "  num_layers: 4094\n").replace(
        "deployments:\n", "deployments:\n  - {prefill: {tp: 2, pp: 8}, decode: {tp: 1, pp: 2}}\n"),
        None),
    "five_megabytes": (MINI + "# " + "x" * (5 * 2**20) + "\n", "larger than 262144 bytes"),
    "twenty_thousand_params": (_with_params("".join(f"  q{i}: 1\n" for i in range(20_000))),
                               "more than 5000 YAML nodes"),
    "params_beyond_the_limit": (_with_params("".join(f"  q{i}: {i}\n" for i in range(2100))),
                                "declares 2106 params, more than the limit of 2048"),
    "reverse_param_chain_at_the_limit": (_reverse_chain(2000), None),
    "param_cycle_with_tail": (_with_params("".join(f"  t{i}: t{i + 1}\n" for i in range(1500))
                                           + "  t1500: c0\n  c0: c1\n  c1: c0\n"),
                              "params refer to each other in a cycle: c0, c1"),
    "binary": (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4, "is not UTF-8 text"),
    "nul_byte": (MINI.replace("mini\n", "mi\x00ni\n").encode(), "holds a NUL byte"),
    "huge_integer": (MINI.replace("  kv_heads: 2\n", "  kv_heads: " + "9" * 10_000 + "\n"),
                     "cannot read scalar"),
    "power_tower": (MINI.replace("  heads: 4\n", "  heads: 2 ** 64 ** 64 ** 64\n"),
                    "value out of range"),
    "stage_range_beyond_layers": (MINI.replace(
        "deployments:\n", "deployments:\n  - {prefill: {stages: [[{from: 0, to: 4000000000}]]},"
        " decode: {tp: 1}}\n"), "layer id 4000000000 is beyond the limit"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_spec_ends_within_the_caps(name, tmp_path):
    text, first_error = CASES[name]
    path = tmp_path / f"{name}.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    r = validate_capped(path)
    assert r["rss"] < CASE_RSS_BYTES, f"peak RSS {r['rss'] / 2**20:.0f} MiB"
    assert_located_or_ok(r["rc"], r["out"], r["err"])
    if first_error is None:
        assert r["rc"] == 0, r["err"]
    else:
        assert first_error in r["err"].splitlines()[0], r["err"]


# ~~~ hypothesis: one capped worker, one case at a time ~~~

_WORKER = textwrap.dedent("""
    import contextlib, io, json, resource, signal, sys, tracemalloc
    resource.setrlimit(resource.RLIMIT_AS, ({as_bytes}, {as_bytes}))
    from pdc.cli import main

    def too_slow(*_):
        raise TimeoutError("case ran past its time cap")

    signal.signal(signal.SIGALRM, too_slow)
    path = sys.argv[1]
    for line in sys.stdin:
        with open(path, "w") as f:
            f.write(json.loads(line))
        out, err = io.StringIO(), io.StringIO()
        tracemalloc.start()
        signal.setitimer(signal.ITIMER_REAL, {seconds})
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(["validate", path])
        except BaseException as e:  # reported, and fails the test
            rc, err = -1, io.StringIO("Traceback: " + repr(e))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(json.dumps({{"rc": rc, "out": out.getvalue(), "err": err.getvalue(),
                           "peak": peak}}), flush=True)
""").format(as_bytes=ADDRESS_SPACE_BYTES, seconds=CASE_SECONDS)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "case.yaml"
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)

    def run(text: str) -> dict:
        proc.stdin.write(json.dumps(text) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"the capped worker died ({proc.wait()}) on {text!r}"
        return json.loads(line)

    yield run
    proc.stdin.close()
    proc.wait(timeout=CASE_SECONDS)


_YAMLISH = st.lists(st.sampled_from(list("[]{}:,-&*!|>'\"#?<=+% \n\t") +
                                    ["a", "0", "9", "x", "<<", "&a", "*a", "0x", "family",
                                     "params", "layers", "- "]),
                    max_size=300).map("".join)
_NASTY = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70).map(str),
    st.sampled_from(["''", "~", "[]", "{}", "*a", "&a x", "!!python/object:os.system x",
                     "2 ** 64 ** 2", "1 / 0", "x" * 600, "[" * 50 + "]" * 50,
                     "{from: 0, to: 99999999999}", "-1", "0", "4097", "!!binary aGk=",
                     "num_layers * num_layers * num_layers", "__import__('os')"]),
    st.text(max_size=40),
)


def _mutate(line_no: int, value: str) -> str:
    lines = MINI.splitlines()
    i = line_no % len(lines)
    key, sep, _ = lines[i].partition(":")
    lines[i] = f"{key}: {value}" if sep else f"{lines[i]} {value}"
    return "\n".join(lines) + "\n"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(_YAMLISH, st.builds(_mutate, st.integers(0, 200), _NASTY)))
def test_fuzzed_spec_ends_within_the_caps(worker, text):
    r = worker(text)
    assert r["peak"] < CASE_RSS_BYTES, f"peak {r['peak'] / 2**20:.0f} MiB"
    assert_located_or_ok(r["rc"], r["out"], r["err"])


def test_the_schema_caps_a_spec_side_as_the_command_line_is_capped():
    """A deployment in a spec and a --prefill/--decode flag share one set of limits."""
    from pdc.compiler.schema import spec_schema
    from pdc.compiler.topology import SIDE_MAX

    side = spec_schema()["$defs"]["side"]["properties"]
    assert {k: side[k]["maximum"] for k in SIDE_MAX} == SIDE_MAX
