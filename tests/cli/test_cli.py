"""The `pdc` command line, in process through `main(argv)` and once as the console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdc.cli import main
from pdc.commands import common
from pdc.commands.common import COMMANDS, arg, command

REPO = Path(__file__).resolve().parents[2]
QWEN = REPO / "specs" / "qwen38.yaml"
N_SPECS = len(list((REPO / "specs").glob("*.yaml")))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


@pytest.fixture
def bogus_spec(tmp_path) -> tuple[Path, int]:
    """A copy of specs/qwen38.yaml with an extra top-level key; returns (path, its line)."""
    text = QWEN.read_text()
    path = tmp_path / "qwen38-bogus.yaml"
    path.write_text(text + "bogus_key: 1\n")
    return path, text.count("\n") + 1


@pytest.fixture(scope="module")
def compiled_once(tmp_path_factory) -> Path:
    """Every spec compiled once per module (~20 s on the 2-core box); tests get copies."""
    root = tmp_path_factory.mktemp("compiled")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert main(["compile", "--out", "gen"]) == 0
    return root / "gen"


@pytest.fixture
def compiled(compiled_once, tmp_path, monkeypatch) -> Path:
    """Every spec compiled into tmp_path/gen, with the working directory at tmp_path (a copy
    of one compile, modification times kept)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(compiled_once, tmp_path / "gen", copy_function=shutil.copy2)
    return tmp_path / "gen"


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))


# ~~~ validate ~~~


def test_validate_ok(capsys):
    assert run(capsys, "validate", str(QWEN)) == (0, "pdc validate: 1 spec ok\n", "")


def test_validate_without_spec_validates_every_spec(capsys):
    assert run(capsys, "validate") == (0, f"pdc validate: {N_SPECS} specs ok\n", "")


def test_unknown_top_level_key_is_reported_at_its_line(capsys, bogus_spec):
    path, line = bogus_spec
    rc, out, err = run(capsys, "validate", str(path))
    assert (rc, out) == (1, "")
    assert err == (
        f"{path}:{line}:1: error: unknown key 'bogus_key' in the spec\n"
        "  bogus_key: 1\n"
        "  ^\n"
        "  hint: allowed keys: backends, components, constraints, deployments, description, dtypes, "
        "family, layers, params, parity, serves, version\n"
        "pdc validate: 1 error in 1 of 1 spec\n"
    )


def test_console_script_reports_the_bogus_key_without_a_traceback(bogus_spec):
    path, line = bogus_spec
    script = Path(sys.executable).with_name("pdc")
    exe = str(script) if script.exists() else shutil.which("pdc")
    assert exe, "the pdc console script is not installed (pip install -e .)"
    result = subprocess.run([exe, "validate", str(path)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"{path}:{line}:1: error: unknown key 'bogus_key'" in result.stderr
    assert "Traceback" not in result.stderr


# ~~~ compile and check ~~~


def test_compile_then_check_is_ok(compiled, capsys):
    rendered = _files(REPO / "generated")
    assert _files(compiled) == [f for f in rendered if f != "__init__.py"]
    for rel in _files(compiled):
        assert (compiled / rel).read_bytes() == (REPO / "generated" / rel).read_bytes()
    rc, out, err = run(capsys, "check", "--out", "gen")
    assert (rc, err) == (0, "")
    assert out == f"pdc check: gen/ is up to date ({N_SPECS} specs, {len(_files(compiled))} files)\n"


def test_compile_prints_what_it_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "compile", str(QWEN), "--out", "gen")
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[:-1] == [f"wrote gen/qwen38/{m}.py"
                          for m in ("__init__", "kernels", "layout", "plans")]
    n = len(_files(tmp_path / "gen"))
    assert lines[-1] == f"pdc compile: {n} of {n} files changed (1 spec)"


def test_compile_leaves_unchanged_files_untouched(compiled, capsys):
    before = {rel: (compiled / rel).stat().st_mtime_ns for rel in _files(compiled)}
    layout = compiled / "qwen38" / "layout.py"
    layout.write_text(layout.read_text() + "# edited by hand\n")
    os.utime(layout, ns=(1, 1))
    rc, out, _ = run(capsys, "compile", "--out", "gen")
    assert rc == 0
    assert out.splitlines() == [
        "wrote gen/qwen38/layout.py",
        f"pdc compile: 1 of {len(before)} files changed ({N_SPECS} specs)",
    ]
    after = {rel: (compiled / rel).stat().st_mtime_ns for rel in _files(compiled)}
    assert {rel for rel in before if before[rel] != after[rel]} == {"qwen38/layout.py"}
    rc, out, _ = run(capsys, "compile", "--out", "gen")
    assert out == f"pdc compile: {len(before)} files up to date ({N_SPECS} specs)\n"
    assert {rel: (compiled / rel).stat().st_mtime_ns for rel in _files(compiled)} == after


def test_stale_file_fails_check_with_a_diff_and_the_command(compiled, capsys):
    layout = compiled / "qwen38" / "layout.py"
    text = layout.read_text()
    layout.write_text(text.replace("NUM_LAYERS = 48", "NUM_LAYERS = 47"))
    rc, out, err = run(capsys, "check", "--out", "gen")
    assert rc == 1
    assert out.startswith("--- a/gen/qwen38/layout.py\n+++ b/gen/qwen38/layout.py\n@@ ")
    assert "\n-NUM_LAYERS = 47\n+NUM_LAYERS = 48\n" in out
    assert err == (
        "pdc check: gen/ is out of date: 1 stale file\n"
        "  stale: gen/qwen38/layout.py\n"
        "regenerate with: pdc compile --out gen\n"
    )


def test_missing_file_fails_check(compiled, capsys):
    (compiled / "glm52" / "layout.py").unlink()
    rc, out, err = run(capsys, "check", "--out", "gen")
    assert rc == 1
    assert out.startswith("--- /dev/null\n+++ b/gen/glm52/layout.py\n")
    assert err == (
        "pdc check: gen/ is out of date: 1 stale file\n"
        "  missing: gen/glm52/layout.py\n"
        "regenerate with: pdc compile --out gen\n"
    )


def test_orphan_file_fails_check(compiled, capsys):
    (compiled / "qwen38" / "old_module.py").write_text("X = 1\n")
    (compiled / "qwen38" / "__pycache__").mkdir()
    (compiled / "qwen38" / "__pycache__" / "ignored.py").write_text("")
    rc, out, err = run(capsys, "check", "--out", "gen")
    assert (rc, out) == (1, "")
    assert err == (
        "pdc check: gen/ is out of date: 1 orphan file\n"
        "  orphan: gen/qwen38/old_module.py (produced by no spec)\n"
        "regenerate with: pdc compile --out gen\n"
    )


def test_compile_of_every_spec_removes_generated_orphans_only(compiled, capsys):
    header = (compiled / "qwen38" / "layout.py").read_text().split('"""')[0]
    (compiled / "gone").mkdir()
    (compiled / "gone" / "layout.py").write_text(header + "X = 1\n")
    (compiled / "hand_written.py").write_text("X = 1\n")
    rc, out, err = run(capsys, "compile", str(QWEN), "--out", "gen")  # named specs: no pruning
    assert rc == 0 and (compiled / "gone" / "layout.py").exists()
    rc, out, err = run(capsys, "compile", "--out", "gen")
    assert rc == 0
    assert "removed gen/gone/layout.py (no spec produces it)\n" in out
    assert not (compiled / "gone").exists()
    assert err == ("pdc compile: warning: gen/hand_written.py is produced by no spec and has no "
                   "@generated header; delete it by hand\n")
    assert (compiled / "hand_written.py").exists()


def test_check_of_the_repository_is_ok(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    n = len(_files(REPO / "generated")) - 1  # generated/__init__.py belongs to no spec
    assert run(capsys, "check") == (
        0, f"pdc check: generated/ is up to date ({N_SPECS} specs, {n} files)\n", "")


def test_compile_writes_nothing_when_a_spec_is_broken(tmp_path, capsys, bogus_spec):
    path, line = bogus_spec
    rc, out, err = run(capsys, "compile", str(QWEN), str(path), "--out", str(tmp_path / "gen"))
    assert (rc, out) == (1, "")
    assert err.splitlines()[0] == f"{path}:{line}:1: error: unknown key 'bogus_key' in the spec"
    assert err.endswith("pdc compile: 1 error in 1 of 2 specs; nothing written\n")
    assert not (tmp_path / "gen").exists()


def test_an_unwritable_output_is_an_error_not_a_traceback(tmp_path, capsys):
    blocker = tmp_path / "gen"
    blocker.write_text("a file where the output folder should be\n")
    rc, out, err = run(capsys, "compile", str(QWEN), "--out", str(blocker))
    assert (rc, out) == (1, "")
    assert err.startswith("pdc compile: error: cannot write ")
    rc, out, err = run(capsys, "check", "--out", str(blocker))
    assert rc == 1


# ~~~ help, usage, registry ~~~


def test_top_level_help_lists_every_subcommand(capsys):
    rc, out, err = run(capsys, "--help")
    assert (rc, err) == (0, "")
    for name, c in COMMANDS.items():
        assert f"    {name}" in out
        assert c.summary.split()[0] in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_help(name, capsys):
    rc, out, err = run(capsys, name, "--help")
    assert (rc, err) == (0, "")
    assert out.startswith(f"usage: pdc {name}")
    assert COMMANDS[name].doc.splitlines()[0] in out
    assert len(COMMANDS[name].doc.splitlines()) > 2  # a description, not only a summary


@pytest.mark.parametrize("argv", [
    [],
    ["nosuch"],
    ["compile", "--bogus"],
    ["check", "specs/qwen38.yaml"],
    ["validate", "--out"],
])
def test_usage_errors_exit_2(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.startswith("usage: pdc")
    assert "Traceback" not in err


def test_version(capsys):
    assert run(capsys, "--version") == (0, "pdc 0.1.0\n", "")


def test_demo_rejects_a_topology_the_backend_matrix_forbids(capsys):
    code, out, err = run(capsys, "demo", "--prefill", "tp=4", "--decode", "tp=1", "--engine",
                         "nixl", "--requests", "1")
    assert code == 1
    assert "specs/qwen38.yaml:114:3: error: backend 'nixl' does not support heterogeneous " \
           "attention TP (prefill tp=4, decode tp=1): rule `hetero_attention_tp: false`" in err
    assert "Traceback" not in err


def test_demo_usage_errors_exit_2(capsys):
    assert run(capsys, "demo", "--requests", "0")[0] == 2
    assert run(capsys, "demo", "--engine", "carrier-pigeon")[0] == 2


def test_demo_serves_metrics_and_names_the_transport(capsys):
    code, out, err = run(capsys, "demo", "--metrics-port", "0", "--requests", "3")
    assert code == 0, out + err
    assert "pdc demo: metrics on http://127.0.0.1:" in out
    assert "transport        mooncake: tcp on 127.0.0.1" in out


def test_demo_metrics_port_out_of_range_is_a_usage_error(capsys):
    code, _, err = run(capsys, "demo", "--metrics-port", "70000", "--requests", "1")
    assert code == 2
    assert err == ("pdc demo: error: --metrics-port 70000 is not a TCP port\n"
                   "  hint: give 0-65535; 0 picks a free one\n")


def test_a_subcommand_is_one_decorated_function(monkeypatch, capsys):
    monkeypatch.setattr(common, "COMMANDS", dict(COMMANDS))

    @command("echo", arg("words", nargs="+"), arg("--loud", action="store_true"))
    def cmd_echo(args):
        """Print the words.

        A test-only subcommand.
        """
        text = " ".join(args.words)
        print(text.upper() if args.loud else text)
        return 3

    assert run(capsys, "echo", "a", "b", "--loud") == (3, "A B\n", "")
    rc, out, _ = run(capsys, "--help")
    assert "echo" in out and "Print the words." in out
    with pytest.raises(ValueError, match="registered twice"):
        command("echo")(cmd_echo)
