"""A small, safe evaluator for the integer expressions a spec may write.

Specs write sizes and constraints as expressions over integer params: `conv_width - 1`,
`2 * key_dim + value_dim`, `page_size % qsa_ratio == 0`. They are parsed with `ast` and
walked here; only integer literals, param names, arithmetic (+ - * // % **), comparisons,
`and`/`or`/`not`, parentheses and the functions min/max are accepted. `eval` is never used.
True division `/` is rejected on purpose: sizes are integers and a silent float would hide
an indivisible size.
"""

from __future__ import annotations

import ast
import operator

from .limits import MAX_EXPR_CHARS, MAX_MAGNITUDE


class ExprError(ValueError):
    """The expression is malformed or cannot be evaluated; the message says why."""


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMPOPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_FUNCS = {"min": min, "max": max}
_MAX_POW = 64  # exponents above this are certainly a typo, and would be slow


def names_in(text: str) -> set[str]:
    """Names an expression refers to (for dependency and unknown-name checks)."""
    tree = _parse(text)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _FUNCS}


def _parse(text: str) -> ast.Expression:
    if not isinstance(text, str):
        raise ExprError(f"expected an expression string, got {type(text).__name__}")
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"expression of {len(text)} characters is longer than the "
                        f"{MAX_EXPR_CHARS} allowed (Note [Spec limits])")
    try:
        return ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"cannot parse expression '{text}': {e.msg}") from None
    except (RecursionError, MemoryError):
        raise ExprError(f"expression '{text}' nests too deeply") from None


def evaluate(value: int | str, env: dict[str, int]) -> int | bool:
    """Evaluate an int literal or an expression string against `env` (name -> int)."""
    if isinstance(value, bool):
        raise ExprError(f"expected an integer or an expression, got {value!r}")
    if isinstance(value, int):
        return _bounded(value, str(value))
    tree = _parse(value)
    try:
        return _eval(tree.body, env, value)
    except RecursionError:
        raise ExprError(f"expression '{value}' nests too deeply") from None


def _bounded(v, text: str):
    """Every value an expression computes stays within +-MAX_MAGNITUDE: sizes and ids fit
    in 64 bits, and chained `**` cannot build integers of megabytes."""
    if not isinstance(v, bool) and abs(v) > MAX_MAGNITUDE:
        raise ExprError(f"value out of range (more than 2**64 in magnitude) in '{text}'")
    return v


def _eval(node: ast.AST, env: dict[str, int], text: str):
    return _bounded(_eval_node(node, env, text), text)


def _eval_node(node: ast.AST, env: dict[str, int], text: str):
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise ExprError(f"only integer literals are allowed in '{text}', found {node.value!r}")
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ExprError(f"unknown name '{node.id}' in '{text}'")
        return env[node.id]
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, env, text)
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.UAdd):
            return v
        if isinstance(node.op, ast.Not):
            return not v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a = _eval(node.left, env, text)
        b = _eval(node.right, env, text)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
            raise ExprError(f"division by zero in '{text}'")
        if isinstance(node.op, ast.Pow) and (b < 0 or b > _MAX_POW):
            raise ExprError(f"exponent {b} out of range 0..{_MAX_POW} in '{text}'")
        return _BINOPS[type(node.op)](a, b)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        raise ExprError(f"'/' is not allowed in '{text}'; use '//' for integer division")
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, text)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            if type(op) not in _CMPOPS:
                break
            right = _eval(right_node, env, text)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        else:
            return True
    if isinstance(node, ast.BoolOp):
        vals = [_eval(v, env, text) for v in node.values]
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCS
        and not node.keywords
        and node.args
    ):
        return _FUNCS[node.func.id](*(_eval(a, env, text) for a in node.args))
    raise ExprError(f"unsupported syntax '{ast.unparse(node)}' in '{text}'")
