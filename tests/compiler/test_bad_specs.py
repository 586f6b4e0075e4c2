"""Every broken spec of bad_specs/ fails `pdc validate` with exactly the text beside it.

Each `bad_specs/NAME.patch` turns good_specs/mini.yaml into a spec with one rule broken (its
first line says which; Note [Bad specs as patches] in spec_patches.py); `bad_specs/NAME.expected`
is the complete stderr of `pdc validate bad_specs/NAME.yaml` on the patched spec: every
diagnostic (file:line:col, source line, caret, hint) and the summary line.

After an intended change of wording, regenerate the expected files with
`PDC_ACCEPT=1 pytest tests/compiler/test_bad_specs.py` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdc.cli import main

from .spec_patches import BAD, BASE, CASES, PatchError, apply_patch, bad_spec_text

REPO = Path(__file__).resolve().parents[2]
GOOD = BASE.parent
ACCEPT = os.environ.get("PDC_ACCEPT") == "1"


def _validate(capsys, *paths: str) -> tuple[int, str, str]:
    rc = main(["validate", *paths])
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_case_has_an_expected_file_and_vice_versa():
    assert CASES
    expected = sorted(p.stem for p in BAD.glob("*.expected"))
    assert expected == CASES
    assert sorted(p.name for p in BAD.iterdir()) == sorted(
        f"{n}{suffix}" for n in CASES for suffix in (".patch", ".expected"))


@pytest.mark.parametrize("name", CASES)
def test_every_patch_breaks_the_base_and_says_how(name):
    text = bad_spec_text(name)
    assert text != BASE.read_text()
    assert text == "" or text.startswith("# mini.yaml ")  # which rule it breaks


def test_a_patch_that_no_longer_fits_the_base_names_the_case_and_line():
    patch = "@@ -3 +3 @@\n-family: maxi\n+family: mini2\n"
    with pytest.raises(PatchError) as e:
        apply_patch(BASE.read_text(), patch, "renamed_family")
    assert str(e.value) == ("renamed_family: line 3 of mini.yaml is 'family: mini', the patch "
                            "removes 'family: maxi'; regenerate the patch")


def test_the_base_spec_is_valid(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert _validate(capsys, "tests/compiler/good_specs/mini.yaml") == (
        0, "pdc validate: 1 spec ok\n", "")


@pytest.mark.parametrize("name", CASES)
def test_bad_spec(name, capsys, bad_spec):
    rc, out, err = _validate(capsys, bad_spec(name))
    expected_file = BAD / f"{name}.expected"
    if ACCEPT:
        expected_file.write_text(err)
    assert rc == 1
    assert out == ""
    assert "Traceback" not in err
    assert err == expected_file.read_text()


def test_output_does_not_depend_on_the_working_directory(capsys, monkeypatch, tmp_path):
    """Specs inside the repository are named by their repository path (Note [Spec paths])."""
    layouts = []
    for cwd in (REPO, tmp_path):
        monkeypatch.chdir(cwd)
        assert main(["compile", str(BASE), "--out", str(tmp_path / "out")]) == 0
        layouts.append((tmp_path / "out" / "mini" / "layout.py").read_text())
    capsys.readouterr()
    assert layouts[0] == layouts[1]
    assert "from tests/compiler/good_specs/mini.yaml" in layouts[0].splitlines()[0]


def test_several_errors_in_one_spec_are_reported_at_once(capsys, bad_spec):
    rc, _, err = _validate(capsys, bad_spec("several_errors"))
    assert rc == 1
    messages = [line.split(": error: ", 1)[1] for line in err.splitlines() if ": error: " in line]
    assert messages == [
        "sentinel 0x00000003 of component 'ngram' collides with layer 3 (attn)",
        "constraint 'page_size % 32 == 0' does not hold: pages hold whole groups of 32 tokens",
        "unknown backend 'rdma'",
        "deployment gives an `error` but expects to be accepted",
    ]
    assert err.endswith("pdc validate: 4 errors in 1 of 1 spec\n")


def test_several_shape_errors_in_one_spec_are_reported_at_once(capsys, bad_spec):
    rc, _, err = _validate(capsys, bad_spec("several_shape_errors"))
    assert rc == 1
    locations = [line.split(": error: ")[0] for line in err.splitlines() if ": error: " in line]
    assert locations == [
        "bad_specs/several_shape_errors.yaml:13:42",
        "bad_specs/several_shape_errors.yaml:15:5",
        "bad_specs/several_shape_errors.yaml:17:20",
    ]


def test_errors_of_several_specs_are_reported_together(capsys, bad_spec):
    names = ["param_cycle", "bad_dtype", "unknown_key_top_level"]
    rc, out, err = _validate(capsys, str(REPO / "specs" / "qwen38.yaml"),
                             *(bad_spec(n) for n in names))
    assert rc == 1
    assert out == ""
    bodies = ["".join((BAD / f"{n}.expected").read_text().splitlines(True)[:-1]) for n in names]
    assert err == "".join(bodies) + "pdc validate: 3 errors in 3 of 4 specs\n"


def test_two_specs_of_one_family_are_rejected(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    copy = tmp_path / "mini-copy.yaml"
    copy.write_text((GOOD / "mini.yaml").read_text())
    rc, _, err = _validate(capsys, "tests/compiler/good_specs/mini.yaml", str(copy))
    assert rc == 1
    assert err == (
        f"{copy}:3:1: error: family 'mini' would be generated into generated/mini/, which "
        "family 'mini' of tests/compiler/good_specs/mini.yaml already uses\n"
        "  family: mini\n"
        "  ^\n"
        "  hint: give every spec its own family name\n"
        "pdc validate: 1 error in 1 of 2 specs\n"
    )


def test_an_unreadable_spec_is_an_error_not_a_traceback(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _validate(capsys, "missing.yaml")
    assert (rc, out) == (1, "")
    assert err == (
        "missing.yaml: error: cannot read spec: No such file or directory\n"
        "  hint: check the path\n"
        "pdc validate: 1 error in 1 of 1 spec\n"
    )


def test_a_fifo_is_refused_at_once_instead_of_blocking(capsys, monkeypatch, tmp_path):
    """Opening a FIFO for reading would wait for a writer forever."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo("spec.yaml")
    rc, out, err = _validate(capsys, "spec.yaml")
    assert (rc, out) == (1, "")
    assert err == (
        "spec.yaml: error: cannot read spec: it is a FIFO, not a regular file\n"
        "  hint: name a YAML file\n"
        "pdc validate: 1 error in 1 of 1 spec\n"
    )


def test_a_directory_is_refused_naming_what_it_is(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs.yaml").mkdir()
    rc, _, err = _validate(capsys, "specs.yaml")
    assert rc == 1
    assert err.splitlines()[0] == ("specs.yaml: error: cannot read spec: it is a directory, "
                                   "not a regular file")


def test_a_non_utf8_spec_names_line_and_column(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"family: mini\n# caf\xe9 au lait\n")
    rc, out, err = _validate(capsys, "latin1.yaml")
    assert (rc, out) == (1, "")
    assert err.splitlines()[0] == ("latin1.yaml:2:6: error: the spec is not UTF-8 text "
                                   "(byte 18, 0xe9, is not)")
    assert "  hint: save the spec as UTF-8; a spec is a YAML text file" in err


@pytest.mark.parametrize("spec", sorted(p.name for p in (REPO / "specs").glob("*.yaml")))
def test_real_spec_round_trips_through_the_cli(spec, capsys, monkeypatch, tmp_path):
    """validate says ok, and compile writes exactly the checked-in generated files."""
    monkeypatch.chdir(REPO)
    assert _validate(capsys, f"specs/{spec}") == (0, "pdc validate: 1 spec ok\n", "")
    assert main(["compile", f"specs/{spec}", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.py"))
    py_name = spec.removesuffix(".yaml").replace("-", "_")
    assert "/layout.py" in "".join(written)
    assert written == sorted(p.relative_to(REPO / "generated").as_posix()
                             for p in (REPO / "generated" / py_name).glob("*.py"))
    for rel in written:
        assert (tmp_path / rel).read_bytes() == (REPO / "generated" / rel).read_bytes(), rel


def test_the_language_reference_lists_every_case():
    reference = (REPO / "docs" / "spec-language.md").read_text()
    for name in CASES:
        if not name.startswith("several_"):
            assert f"| `{name}` |" in reference, name
