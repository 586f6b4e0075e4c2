"""The located YAML loader: a Location for every node and key; duplicate keys rejected."""

from __future__ import annotations

from pdc.compiler.diagnostics import Diagnostic, Location
from pdc.compiler.yaml_loader import load_located

TEXT = """\
# comment
family: qwen38
params:
  layers: 48
  conv_dim: 2 * key_dim + value_dim
components:
  kv: {layers: {kind: qsa}, tensors: [k, v]}
  list:
    - first
    -   second
"""


def _load(text: str, path: str = "s.yaml"):
    doc, errors = load_located(text, path)
    return doc, errors


def test_data_is_plain_python():
    doc, errors = _load(TEXT)
    assert errors == []
    assert doc.data == {
        "family": "qwen38",
        "params": {"layers": 48, "conv_dim": "2 * key_dim + value_dim"},
        "components": {"kv": {"layers": {"kind": "qsa"}, "tensors": ["k", "v"]},
                       "list": ["first", "second"]},
    }


def test_values_keys_and_list_items_have_locations():
    doc, _ = _load(TEXT)
    assert doc.loc(()) == Location("s.yaml", 2, 1)
    assert doc.loc(("family",)) == Location("s.yaml", 2, 9)
    assert doc.key_loc(("family",)) == Location("s.yaml", 2, 1)
    assert doc.loc(("params", "conv_dim")) == Location("s.yaml", 5, 13)
    assert doc.key_loc(("params", "conv_dim")) == Location("s.yaml", 5, 3)
    assert doc.loc(("components", "kv", "layers", "kind")) == Location("s.yaml", 7, 23)
    assert doc.loc(("components", "kv", "tensors", 1)) == Location("s.yaml", 7, 42)
    assert doc.loc(("components", "list", 0)) == Location("s.yaml", 9, 7)
    assert doc.loc(("components", "list", 1)) == Location("s.yaml", 10, 9)


def test_a_missing_path_falls_back_to_its_nearest_ancestor():
    doc, _ = _load(TEXT)
    assert doc.loc(("params", "nope", "deeper")) == Location("s.yaml", 4, 3)
    assert doc.key_loc(("params", "nope")) == Location("s.yaml", 4, 3)


def test_location_renders_as_file_line_col():
    assert str(Location("specs/x.yaml", 3, 7)) == "specs/x.yaml:3:7"
    assert str(Location("specs/x.yaml")) == "specs/x.yaml"


def test_duplicate_key_is_an_error_at_the_second_key():
    doc, errors = _load("a: 1\nb:\n  c: 1\n  d: 2\n  c: 3\n")
    assert errors == [Diagnostic(Location("s.yaml", 5, 3), "duplicate key 'c'",
                                 "'c' is already defined at line 3; remove one of them")]
    assert doc.data == {"a": 1, "b": {"c": 1, "d": 2}}  # the first one is kept


def test_duplicate_keys_in_flow_mappings_and_at_top_level_are_all_reported():
    _, errors = _load("a: {x: 1, x: 2}\na: 3\n")
    assert [(e.loc.line, e.loc.col, e.message) for e in errors] == [
        (1, 11, "duplicate key 'x'"),
        (2, 1, "duplicate key 'a'"),
    ]


def test_a_key_that_is_not_a_name_is_an_error():
    _, errors = _load("? [a, b]\n: 1\n")
    assert errors == [Diagnostic(Location("s.yaml", 1, 3), "mapping key ['a', 'b'] is not a name",
                                 "keys are plain names")]


def test_invalid_yaml_points_at_the_problem():
    doc, errors = _load("a: [1, 2\nb: 3\n")
    assert doc is None
    assert len(errors) == 1
    assert errors[0].loc == Location("s.yaml", 2, 2)
    assert errors[0].message == "invalid YAML: expected ',' or ']', but got ':'"


def test_tabs_are_invalid_yaml():
    doc, errors = _load("a:\n\tb: 1\n")
    assert doc is None
    assert errors[0].message.startswith("invalid YAML: found character '\\t'")


def test_empty_and_comment_only_documents_are_empty_specs():
    for text in ("", "# only a comment\n", "\n\n"):
        doc, errors = _load(text)
        assert doc is None
        assert errors == [Diagnostic(Location("s.yaml", 1, 1), "the spec is empty",
                                     "a spec is a mapping with at least `family` and `params`")]


def test_anchors_and_merge_keys_work_and_keep_locations():
    doc, errors = _load("base: &b {x: 1, y: 2}\nderived:\n  <<: *b\n  y: 3\n")
    assert errors == []
    assert doc.data["derived"] == {"x": 1, "y": 3}  # an explicit key overrides a merged one
    assert doc.loc(("derived", "y")) == Location("s.yaml", 4, 6)
    assert doc.loc(("derived", "x")) == Location("s.yaml", 1, 14)  # where it was written


def test_a_key_written_twice_next_to_a_merge_is_still_a_duplicate():
    _, errors = _load("base: &b {y: 2}\nderived:\n  <<: *b\n  y: 3\n  y: 4\n")
    assert errors == [Diagnostic(Location("s.yaml", 5, 3), "duplicate key 'y'",
                                 "'y' is already defined at line 4; remove one of them")]


def test_python_tags_are_rejected_without_running_anything():
    doc, errors = _load("a: !!python/object/apply:os.system ['echo pwned']\n")
    assert errors == [Diagnostic(
        Location("s.yaml", 1, 4),
        "YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed here",
        "specs use plain mappings, lists and scalars")]
    doc, errors = _load("a: !!python/name:os.system\n")
    assert doc is None
    assert errors == [Diagnostic(
        Location("s.yaml", 1, 4),
        "invalid YAML: could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/name:os.system'", "fix the YAML syntax")]
