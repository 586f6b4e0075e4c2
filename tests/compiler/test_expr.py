"""The expression evaluator: integers and params in, integers and conditions out, no eval."""

from __future__ import annotations

import builtins

import pytest
from pdc.compiler.expr import ExprError, evaluate, names_in

ENV = {"page_size": 64, "ratio": 4, "heads": 16, "dim": 128}


@pytest.mark.parametrize(("text", "value"), [
    (48, 48),
    ("48", 48),
    ("heads * dim", 2048),
    ("2 * heads * dim + 32 * dim", 8192),
    ("page_size // ratio", 16),
    ("page_size % ratio", 0),
    ("(heads + 2) * 3", 54),
    ("2 ** 10", 1024),
    ("-ratio + 5", 1),
    ("+ratio", 4),
    ("min(heads, dim)", 16),
    ("max(heads, dim, 7)", 128),
    ("page_size % ratio == 0", True),
    ("page_size % 3 == 0", False),
    ("1 < ratio <= 4 < heads", True),
    ("1 < ratio < 4", False),
    ("ratio != 4 or heads == 16", True),
    ("ratio == 4 and not heads == 16", False),
    ("0xFFFFFFFF", 2**32 - 1),
])
def test_accepts(text, value):
    result = evaluate(text, ENV)
    assert result == value
    assert type(result) is type(value)


@pytest.mark.parametrize(("text", "message"), [
    ("page_size / ratio", "'/' is not allowed in 'page_size / ratio'; use '//' for integer division"),
    ("pages * 2", "unknown name 'pages' in 'pages * 2'"),
    ("heads *", "cannot parse expression 'heads *': invalid syntax"),
    ("", "cannot parse expression '': invalid syntax"),
    ("1.5 * heads", "only integer literals are allowed in '1.5 * heads', found 1.5"),
    ("'a'", "only integer literals are allowed in ''a'', found 'a'"),
    ("True", "only integer literals are allowed in 'True', found True"),
    ("heads // 0", "division by zero in 'heads // 0'"),
    ("ratio % (heads - 16)", "division by zero in 'ratio % (heads - 16)'"),
    ("2 ** 65", "exponent 65 out of range 0..64 in '2 ** 65'"),
    ("2 ** -1", "exponent -1 out of range 0..64 in '2 ** -1'"),
    ("heads << 2", "unsupported syntax 'heads << 2' in 'heads << 2'"),
    ("~heads", "unsupported syntax '~heads' in '~heads'"),
    ("heads if ratio else dim", "unsupported syntax 'heads if ratio else dim' in "
     "'heads if ratio else dim'"),
    ("heads in (1, 2)", "unsupported syntax 'heads in (1, 2)' in 'heads in (1, 2)'"),
    ("abs(heads)", "unsupported syntax 'abs(heads)' in 'abs(heads)'"),
    ("min()", "unsupported syntax 'min()' in 'min()'"),
    ("min(a=heads)", "unsupported syntax 'min(a=heads)' in 'min(a=heads)'"),
    ("lambda: 1", "unsupported syntax 'lambda: 1' in 'lambda: 1'"),
    ("[heads]", "unsupported syntax '[heads]' in '[heads]'"),
])
def test_rejects(text, message):
    with pytest.raises(ExprError) as e:
        evaluate(text, ENV)
    assert str(e.value) == message


@pytest.mark.parametrize("text", [
    "__import__('os').system('echo pwned')",
    "__import__('os')",
    "().__class__.__bases__[0].__subclasses__()",
    "heads.__class__",
    "eval('1')",
    "open('/etc/passwd')",
    "(lambda: 1)()",
])
def test_rejects_attempts_to_reach_python(text, monkeypatch):
    """Calls, attributes and subscripts are not in the grammar: nothing is ever called."""
    called = []
    real_import = builtins.__import__

    def spy(*args, **kwargs):
        called.append(args[0])
        return real_import(*args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", spy)
    with pytest.raises(ExprError) as e:
        evaluate(text, ENV)
    monkeypatch.undo()
    assert str(e.value) == f"unsupported syntax '{text}' in '{text}'"
    assert "os" not in called


def test_dunder_names_are_just_unknown_names():
    with pytest.raises(ExprError) as e:
        evaluate("__builtins__", ENV)
    assert str(e.value) == "unknown name '__builtins__' in '__builtins__'"


def test_never_uses_eval_or_exec(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec/compile called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert evaluate("2 * heads * dim + min(ratio, 3)", ENV) == 4099


def test_booleans_are_not_integers():
    with pytest.raises(ExprError) as e:
        evaluate(True, ENV)
    assert str(e.value) == "expected an integer or an expression, got True"


def test_names_in():
    assert names_in("2 * key_dim + min(value_dim, 3)") == {"key_dim", "value_dim"}
    assert names_in("48") == set()
    with pytest.raises(ExprError):
        names_in("a +")
