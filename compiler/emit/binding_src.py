"""Emit the binding section of a bindable family's layout.py (Note [Bound families] in
runtime/binding.py): the spec's formulas as Python lambdas over the params, which the
runtime evaluates at start for the served model without the compiler.

Expressions are already checked by the compiler's evaluator (compiler/expr.py), so their
syntax is the safe subset; here they are rewritten, node by node, into Python source:
a name `x` becomes `p["x"]`, `a ** b` becomes `_binding.checked_pow(a, b)` (the exponent
bounded as the compiler bounds it) and everything else keeps its meaning.
"""

from __future__ import annotations

import ast

from pdc.runtime.layout_types import FamilyLayout

from ..diagnostics import Location
from ..model import Spec
from .pysrc import py_str


class _ToPython(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Subscript(ast.Name("p", ast.Load()), ast.Constant(node.id), ast.Load())

    def visit_Call(self, node: ast.Call) -> ast.AST:  # min/max: keep the function's name
        node.args = [self.visit(a) for a in node.args]
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Pow):
            return ast.Call(ast.Attribute(ast.Name("_binding", ast.Load()), "checked_pow",
                                          ast.Load()), [node.left, node.right], [])
        return node


def formula(value: int | str) -> str:
    """`lambda p: ...` source computing `value` (an integer or a checked expression)."""
    if isinstance(value, bool) or isinstance(value, int):
        return f"lambda p: {int(value)}"
    tree = _ToPython().visit(ast.parse(str(value).strip(), mode="eval"))
    return f"lambda p: {ast.unparse(tree)}"


def _dependency_order(spec: Spec) -> list[str]:
    """Param names in an order where each comes after every param its formula uses (the
    model has already refused cycles)."""
    from ..expr import names_in

    raw = spec.raw["params"]
    deps = {}
    for name, value in raw.items():
        text = value.get("default") if isinstance(value, dict) else value
        deps[name] = (names_in(text) if isinstance(text, str) else set()) & raw.keys()
    out: list[str] = []
    done: set[str] = set()
    while len(out) < len(raw):
        for name in raw:
            if name not in done and deps[name] <= done:
                out.append(name)
                done.add(name)
    return out


def _q(loc: Location | str) -> str:
    return py_str(str(loc))


def binding_source(spec: Spec, layout: FamilyLayout) -> str:
    """The TEMPLATE constant and `bind` of a bindable spec's layout module ("" otherwise)."""
    if not spec.bindable and "from" not in spec.raw["layers"]:
        return ""
    raw = spec.raw
    by_name = {p.name: p for p in spec.params}
    out = ["", "", "# ~~~ binding: Note [Bound families] in pdc/runtime/binding.py ~~~",
           "# The spec's formulas over its params, in dependency order; `bind` evaluates them",
           "# for the served model's config and the engine's settings at start.",
           "TEMPLATE = _binding.Template(",
           "    example=LAYOUT,",
           "    spec_sha256=SPEC_SHA256,",
           "    params=("]
    for name in _dependency_order(spec):
        p = by_name.get(name)
        if p is None:
            continue
        value = raw["params"][name]
        if p.source:
            extra = ""
            if p.default is not None:
                extra = (f", default={formula(p.default)}, "
                         f"default_text={py_str(str(p.default))}")
            out.append(f"        _binding.BoundParam({py_str(name)}, {_q(p.loc)}, "
                       f"{py_str(p.source)}, source={py_str(p.source)}{extra}),")
        else:
            out.append(f"        _binding.BoundParam({py_str(name)}, {_q(p.loc)}, "
                       f"{py_str(str(value))}, f={formula(value)}),")
    out.append("    ),")
    out.append("    dtypes=(")
    for d in spec.dtypes:
        out.append(f"        _binding.BoundDtype({py_str(d.name)}, {_q(d.loc)}, "
                   f"{py_str(d.source)}, {py_str(d.dtype)}),")
    out.append("    ),")
    lay = raw["layers"]
    if "pattern" in lay:
        out.append(f"    count={formula(lay['count'])},")
    else:
        out.append("    count=None,")
    out.append(f"    count_loc={_q(spec.layers.loc)},")
    out.append(f"    pattern={tuple(spec.layers.pattern)!r},")
    draft = lay.get("draft")
    if draft is not None:
        first = draft.get("first_id", lay["count"] if "pattern" in lay else
                          spec.layers.count)
        out.append(f"    draft_count={formula(draft['count'])},")
        out.append(f"    draft_first={formula(first)},")
        out.append(f"    draft_kind={py_str(draft['kind'])},")
    else:
        out += ["    draft_count=None,", "    draft_first=None,", "    draft_kind=\"\","]
    out.append("    components=(")
    for c in spec.components:
        rc = raw["components"][c.name]
        sel = rc["layers"]
        if sel in ("all", "request"):
            layers, kinds = sel, ()
        elif "kind" in sel or "kinds" in sel:
            layers, kinds = "kinds", tuple([sel["kind"]] if "kind" in sel else sel["kinds"])
        else:
            layers, kinds = "ids", ()
        item = rc["item"]
        shape = ", ".join(formula(x) for x in item["shape"])
        out.append("        _binding.BoundComponent(")
        out.append(f"            fixed={_const(spec, c.name)},")
        out.append(f"            layers={py_str(layers)},")
        out.append(f"            kinds={kinds!r},")
        out.append(f"            shape=({shape},),")
        out.append(f"            shape_text={tuple(str(x) for x in item['shape'])!r},")
        out.append(f"            dtype={py_str(item['dtype'])},")
        if c.shard is not None:
            tp = rc["tp"]
            groups = "".join(f"{formula(g)}, " for g in tp.get("groups", []))
            unit = tp.get("unit", 1)
            units = "".join(f"{formula(u)}, " for u in (unit if isinstance(unit, list)
                                                       else [unit]))
            out.append(f"            shard=_binding.BoundShard({c.shard.axis}, ({groups}), "
                       f"({units}), {_q(c.shard.loc)}),")
        else:
            out.append("            shard=None,")
        index = rc["index"]
        ring = formula(index["ring"]) if isinstance(index, dict) and "ring" in index else None
        window = formula(index["window"]) if isinstance(index, dict) and "window" in index \
            else None
        out.append(f"            ring={ring},")
        out.append(f"            window={window},")
        out.append(f"            pitch={formula(item['pitch']) if 'pitch' in item else None},")
        out.append(f"            sentinel={formula(rc['sentinel']) if 'sentinel' in rc else None},")
        if "present" in rc:  # Note [Present components] in runtime/binding.py
            st = rc.get("stages", "all")
            rule = f"kind:{st['with_kind']}" if isinstance(st, dict) else st
            out.append(f"            present={formula(rc['present'])},")
            out.append(f"            present_stages={py_str(rule)},")
        out.append("        ),")
    out.append("    ),")
    out.append("    constraints=(")
    for k in spec.constraints:
        out.append(f"        _binding.BoundConstraint({py_str(k.expr)}, {py_str(k.why)}, "
                   f"{_q(k.loc)}, {formula(k.expr)}),")
    out.append("    ),")
    out.append(f"    page_size_param={'page_size' in by_name},")
    if "from" in lay:
        out.append(f"    kinds_from={py_str(lay['from'])},")
        out.append(f"    kind_names={tuple(lay.get('names', {}).items())!r},")
    out.append(")")
    out += ["", "",
            "def bind(config, engine=None) -> _binding.Bound:",
            '    """The family bound to a model\'s config (its config.json as a mapping) and the',
            "    engine's settings (page_size, kv_dtype); raises _binding.BindError naming the",
            '    spec line, the config key and its value for every rule they break."""',
            "    return _binding.bind(TEMPLATE, config, engine)"]
    return "\n".join(out) + "\n"


def _const(spec: Spec, name: str) -> str:
    from .naming import MODULE_CONSTANTS, component_constants

    consts, _ = component_constants(spec, MODULE_CONSTANTS)
    return consts[name]


def serves_source(spec: Spec) -> str:
    if spec.serves is None:
        return ""
    engine, archs = spec.serves
    return ("\n# The engine and architectures this spec describes (its `serves`): integrations "
            "find it by them.\n"
            f"SERVES = ({py_str(engine)}, {archs!r})\n")
