"""Shape validation of a loaded spec against schema/pdc-spec.schema.json (JSON Schema 2020-12).

The schema owns shape only (types, required keys, enums, no unknown keys). Each jsonschema
error is mapped through the loader's location index to the offending node and rewritten
into a short message with a hint.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from pathlib import Path

import jsonschema
from jsonschema.exceptions import ValidationError, best_match

from .diagnostics import Diagnostic
from .yaml_loader import Located

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schema" / "pdc-spec.schema.json"


@cache
def spec_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@cache
def _validator() -> jsonschema.protocols.Validator:
    schema = spec_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _where(path: tuple) -> str:
    if not path:
        return "the spec"
    return "'" + ".".join(str(p) for p in path) + "'"


# How a YAML author names what they wrote (JSON Schema's and Python's names are not theirs).
_REFERENCE = "see the spec language reference in docs/spec-language.md"
_KINDS = {"object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer",
          "number": "a number", "boolean": "true or false", "null": "null"}


def _shown(value: object) -> str:
    """A value as the message quotes it: scalars verbatim, containers by kind only."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "empty"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _or(options: list[str]) -> str:
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def _expected(schema: dict) -> list[str]:
    """What one schema (a oneOf branch) accepts, as words: "'page'", "a mapping", ..."""
    if "$ref" in schema:  # a branch that names a definition: what the definition accepts
        return _expected(spec_schema()["$defs"][schema["$ref"].rsplit("/", 1)[-1]])
    if "oneOf" in schema:
        return [w for b in schema["oneOf"] for w in _expected(b)]
    if "enum" in schema:
        return [repr(v) for v in schema["enum"]]
    if "const" in schema:
        return [repr(schema["const"])]
    t = schema.get("type")
    if t is not None:
        return [_KINDS.get(str(x), str(x)) for x in (t if isinstance(t, list) else [t])]
    return ["a mapping"] if "properties" in schema else []


def _did_you_mean(word: object, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f"did you mean '{close[0]}'?" if close else ""


def _mismatch(e: ValidationError) -> bool:
    """The error says the instance itself is not the kind of value this branch describes."""
    return not e.relative_path and e.validator in ("type", "enum", "const")


def _describe_one_of(err: ValidationError, doc: Located) -> Diagnostic:
    path = tuple(err.absolute_path)
    branches: dict[int, list[ValidationError]] = {}
    for e in err.context:
        branches.setdefault(e.relative_schema_path[0], []).append(e)
    fitting = [errs for errs in branches.values() if not any(_mismatch(e) for e in errs)]
    wrong_value = [errs for errs in branches.values()
                   if all(e.validator in ("enum", "const") and not e.relative_path
                          for e in errs)]
    if not fitting and len(wrong_value) == 1 and all("$ref" in b for b in err.validator_value):
        # The right kind of value, not one of a branch's values (a dtype misspelt, where a
        # mapping `{from: ...}` is the other branch): say which values that branch takes.
        return _describe(wrong_value[0][0], doc)
    if not fitting:
        # No branch accepts this kind of value at all: say what would have been accepted.
        expected = [w for b in err.validator_value for w in _expected(b)]
        strings = [s.strip("'") for s in expected if s.startswith("'")]
        hint = _did_you_mean(err.instance, strings) if isinstance(err.instance, str) else ""
        return Diagnostic(doc.loc(path), f"{_where(path)} is {_shown(err.instance)}; expected "
                          f"{_or(expected)}", hint or f"write {err.schema.get('description', _or(expected))}")
    # Report the branch that describes this kind of value and got furthest (fewest errors).
    fewest = min(len(errs) for errs in fitting)
    best = [errs for errs in fitting if len(errs) == fewest]
    if all(e.validator == "not" for errs in best for e in errs):
        return Diagnostic(doc.loc(path), f"{_where(path)} mixes keys that exclude each other",
                          err.schema.get("description", _REFERENCE))
    return _describe(best_match(best[0] if len(best) == 1 else err.context), doc)


def _describe(err: ValidationError, doc: Located) -> Diagnostic:
    path = tuple(err.absolute_path)
    v = err.validator
    if v == "oneOf" and err.context:
        return _describe_one_of(err, doc)
    if v == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed)) if isinstance(err.instance, dict) else []
        name = extra[0] if extra else "?"
        return Diagnostic(
            doc.key_loc(path + (name,)),
            f"unknown key '{name}' in {_where(path)}",
            " ".join(filter(None, (_did_you_mean(name, allowed),
                                   f"allowed keys: {', '.join(allowed)}" if allowed else "remove it"))),
        )
    if v == "required":
        have = err.instance if isinstance(err.instance, dict) else {}
        missing = [k for k in err.validator_value if k not in have] or ["?"]
        return Diagnostic(doc.key_loc(path), f"missing required key '{missing[0]}' in "
                          f"{_where(path)}", f"add '{missing[0]}'")
    if v == "type":
        want = _or(_expected(err.schema))
        return Diagnostic(doc.loc(path), f"{_where(path)} is {_shown(err.instance)}; expected "
                          f"{want}", f"write {want} here")
    if v == "const":
        return Diagnostic(doc.loc(path), f"{_where(path)} is {_shown(err.instance)}; expected "
                          f"{err.validator_value!r}", f"write {err.validator_value!r}")
    if v == "enum":
        words = ", ".join(map(str, err.validator_value))
        hint = _did_you_mean(err.instance, err.validator_value) if isinstance(err.instance, str) else ""
        return Diagnostic(doc.loc(path), f"{_where(path)} is {_shown(err.instance)}, not one of "
                          f"{words}", " ".join(filter(None, (hint, f"use one of: {words}"))))
    if v == "pattern" and "propertyNames" in err.schema_path:
        # jsonschema reports a bad key at the mapping holding it: point at the key itself.
        return Diagnostic(doc.key_loc(path + (err.instance,)), f"key {err.instance!r} in "
                          f"{_where(path)} is not a valid name",
                          f"names match {err.validator_value}")
    if v == "pattern":
        return Diagnostic(doc.loc(path), f"{_where(path)} is {err.instance!r}, which is not a "
                          f"valid name", f"names match {err.validator_value}")
    if v == "maxProperties" and err.validator_value == 1 and "properties" in err.schema:
        keys = ", ".join(sorted(err.schema["properties"]))
        return Diagnostic(doc.loc(path), f"{_where(path)} sets {len(err.instance)} keys, but takes "
                          f"exactly one of: {keys}", "keep one of them")
    if v == "minimum":
        return Diagnostic(doc.loc(path), f"{_where(path)} is {_shown(err.instance)}; expected at "
                          f"least {err.validator_value}", f"use a value >= {err.validator_value}")
    if v == "maximum":
        return Diagnostic(doc.loc(path), f"{_where(path)} is {_shown(err.instance)}; expected at "
                          f"most {err.validator_value}", f"use a value <= {err.validator_value} "
                          "(Note [Spec limits] in compiler/limits.py)")
    if v in ("minItems", "minProperties", "minLength") and len(err.instance) == 0:
        return Diagnostic(doc.loc(path), f"{_where(path)} is empty",
                          f"give at least {_plural(err.validator_value, 'entry', 'entries')}")
    if v in ("minItems", "minProperties", "maxProperties", "minLength", "maxLength"):
        return Diagnostic(doc.loc(path), f"{_where(path)}: {err.message}",
                          _REFERENCE)
    if v == "not" or v == "oneOf":
        return Diagnostic(doc.loc(path), f"{_where(path)} mixes keys that exclude each other",
                          _REFERENCE)
    return Diagnostic(doc.loc(path), f"{_where(path)}: {err.message}",
                      _REFERENCE)


def validate_shape(doc: Located) -> list[Diagnostic]:
    errs = sorted(_validator().iter_errors(doc.data), key=lambda e: list(map(str, e.absolute_path)))
    out, seen = [], set()
    for e in errs:
        d = _describe(e, doc)
        if (d.loc, d.message) not in seen:
            seen.add((d.loc, d.message))
            out.append(d)
    return out
