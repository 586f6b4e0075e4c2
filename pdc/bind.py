"""`pdc bind SPEC --config config.json`: a spec bound to a model's config, without an engine.

The spec is compiled in memory and its generated layout module run, so the values printed
are the ones a serving process binds at start (Note [Bound families] in runtime/binding.py).
Besides the spec's own rules, `pdc bind` checks what the config determines that the spec
writes by hand (Note [Config cross-check]).

Note [Config cross-check]: a spec that writes a number or a dtype the config also gives
(by convention params are named after config.json fields, `num_layers` after
num_hidden_layers and so on, CONFIG_NAMES) disagrees with the model when the two differ,
and validation alone cannot see it: the spec is self-consistent, only a parity run (or a
served request) would fail. With a config at hand every such param, the `model` dtype
against the config's dtype, and the layer kinds against the config's per-layer
`layer_types` are compared, and a difference is an error at the spec's line. A written
`head_dim` is compared with the config's, or with hidden_size // num_attention_heads, the size
a config without `head_dim` implies.

Note [Head axes]: which state a TP engine shards is decided by the config's head counts
(HEAD_KEYS): each rank keeps its own heads (attention KV heads, SSM and linear-attention
value heads), and keeps whole, on every rank, what has no head axis (an MLA latent, a
state sized by the SSM state size). So an item axis that counts a config head count, in a
component written `tp: replicated`, is a mistake: every TP rank of the engine holds a
different part of it, and pdc would move one rank's part as if it were all of it. The
reverse, a component sharded on an axis that the config gives as something other than a
head count (kv_lora_rank, state_size, conv_kernel), splits what every rank holds whole.
Neither shows at TP 1, where a parity run passes: binding names the spec line.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path

from pdc.runtime.binding import DTYPE_ALIASES, BindError
from pdc.runtime.diagnostics import Diagnostic, Location
from pdc.runtime.family import Family

# Note [Config cross-check]: a spec param's conventional name -> the config fields it names.
CONFIG_NAMES = {
    "num_layers": ("num_hidden_layers",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "conv_kernel": ("conv_kernel", "linear_conv_kernel_dim", "mamba_d_conv"),
    "window": ("sliding_window",),
    "d_state": ("state_size",),
    "head_dim": ("head_dim",),
}
# Note [Head axes]: the config fields that count heads (or head groups) a TP engine shards.
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "num_heads", "n_head", "n_heads",
             "linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads", "mamba_num_heads",
             "n_groups", "mamba_n_groups")


@dataclass(frozen=True)
class BindResult:
    family: Family
    sources: dict[str, list[str]]  # display path -> lines, for rendering diagnostics


def read_config(path: Path) -> tuple[dict | None, list[Diagnostic]]:
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        return None, [Diagnostic(Location(name), f"cannot read the config: {reason}",
                                 "give the model's config.json (--config PATH)")]
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return None, [Diagnostic(Location(name, e.lineno, e.colno), f"invalid JSON: {e.msg}",
                                 "the config is the model's config.json")]
    if not isinstance(data, dict):
        return None, [Diagnostic(Location(name, 1, 1), "the config is not a JSON object",
                                 "the config is the model's config.json")]
    return data, []


def generated_family(spec_path: str) -> tuple[Family | None, object, list[Diagnostic], dict]:
    """The spec's generated layout module, rendered and run in memory, as a Family."""
    from pdc.compiler.driver import build
    from pdc.compiler.emit.naming import family_module

    b = build([spec_path], deployments="skip")
    if not b.ok or b.output is None:
        return None, None, b.diagnostics, b.sources
    spec = b.specs[0]
    text = b.output.text(family_module(spec, "layout"))
    module = types.ModuleType(f"pdc_bind_{spec.py_name}")
    exec(compile(text, f"<generated layout of {spec.path}>", "exec"), module.__dict__)  # noqa: S102 - pdc's own generated code
    return Family.from_module(module), spec, [], b.sources


def cross_check(spec, config: dict) -> list[Diagnostic]:
    """Note [Config cross-check]."""
    out = []
    for p in spec.params:
        if p.source:
            continue
        for key in (p.name, *CONFIG_NAMES.get(p.name, ())):
            given = config.get(key)
            if isinstance(given, int) and not isinstance(given, bool) and given != p.value:
                out.append(Diagnostic(p.loc, f"param '{p.name}' is {p.value}, but the config's "
                                      f"{key} is {given}",
                                      f"write {given}, or take it from the model: "
                                      f"`{p.name}: {{from: config.{key}, example: {p.value}}}`"))
                break
        else:
            out += _implied_head_dim(p, config)
    out += _head_axes(spec, config)
    given = config.get("dtype") or config.get("torch_dtype")
    for d in spec.dtypes:
        if d.source or d.name != "model" or not isinstance(given, str):
            continue
        want = DTYPE_ALIASES.get(given, given)
        if want != d.dtype:
            out.append(Diagnostic(d.loc, f"dtype 'model' is {d.dtype}, but the config's dtype "
                                  f"is {given}", f"write {want}, or take it from the engine: "
                                  f"`model: {{from: engine.kv_dtype, example: {d.dtype}}}`"))
    types_ = config.get("layer_types")
    layers = spec.raw.get("layers", {})
    if isinstance(types_, list) and "from" not in layers:
        kinds = [k for i, k in spec.layers.kind_of if i < spec.layers.count]
        if len(types_) != len(kinds):
            out.append(Diagnostic(spec.layers.loc, f"the spec has {len(kinds)} layers, the "
                                  f"config's layer_types lists {len(types_)}",
                                  "bind the count: `count: {from: config.num_hidden_layers}`"))
        else:
            kind_of: dict[object, tuple[int, str]] = {}  # config type -> (first layer, kind)
            type_of: dict[str, tuple[int, object]] = {}  # spec kind -> (first layer, type)
            for i, (typ, kind) in enumerate(zip(types_, kinds, strict=True)):
                j, k = kind_of.setdefault(typ, (i, kind))
                j2, t2 = type_of.setdefault(kind, (i, typ))
                if k != kind or t2 != typ:
                    other = j if k != kind else j2
                    out.append(Diagnostic(spec.layers.loc, f"layer {i} has kind '{kind}' and "
                                          f"layer {other} kind '{kinds[other]}', but the "
                                          f"config's layer_types says {typ!r} and "
                                          f"{types_[other]!r}", "give the layers of one config "
                                          "type one kind; `layers: {from: config.layer_types, "
                                          "names: {...}}` takes them from the model"))
                    break
    return out


def _implied_head_dim(p, config: dict) -> list[Diagnostic]:
    """A written head_dim against hidden_size // num_attention_heads, when the config has no
    head_dim of its own (Note [Config cross-check])."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if p.name != "head_dim" or "head_dim" in config or not isinstance(hidden, int) \
            or not isinstance(heads, int) or heads < 1 or hidden // heads == p.value:
        return []
    return [Diagnostic(p.loc, f"param 'head_dim' is {p.value}, but the config's hidden_size "
                       f"// num_attention_heads is {hidden} // {heads} = {hidden // heads}",
                       f"write {hidden // heads}, or take it from the model: `head_dim: "
                       f"{{from: config.head_dim, default: hidden_size // heads}}`")]


def _config_key(p, config: dict) -> str | None:
    """The config field a param stands for: its `from`, else its conventional name."""
    if p.source.startswith("config."):
        return p.source.removeprefix("config.")
    return next((k for k in (p.name, *CONFIG_NAMES.get(p.name, ())) if k in config), None)


def _head_axes(spec, config: dict) -> list[Diagnostic]:
    """Note [Head axes]."""
    keys = {p.name: _config_key(p, config) for p in spec.params}
    value = {p.name: config[k] if isinstance(config.get(k), int) else p.value
             for p in spec.params if (k := keys[p.name]) is not None}
    out = []
    for c in spec.components:
        texts = c.item.shape_text
        if c.shard is None:
            for axis, text in enumerate(texts):
                key = keys.get(text)
                if key in HEAD_KEYS and value[text] > 1:
                    out.append(Diagnostic(
                        c.item.loc, f"component '{c.name}' is replicated across TP, but its "
                        f"axis {axis} '{text}' counts the config's {key} ({value[text]}), "
                        "which a TP engine shards: each rank keeps its own heads",
                        f"shard it: `tp: {{shard: {text}}}`"))
                    break
        elif len(c.shard.groups) == 1 and set(c.shard.units) == {1}:
            text = texts[c.shard.axis]
            key = keys.get(text)
            if key is not None and key not in HEAD_KEYS:
                out.append(Diagnostic(
                    c.shard.loc, f"component '{c.name}' is sharded on axis {c.shard.axis} "
                    f"'{text}', the config's {key} ({value[text]}), which counts no heads: "
                    "a TP engine keeps it whole on every rank",
                    "write `tp: replicated`, or shard an axis that counts heads"))
    return out


def run_bind(spec_path: str, config_path: Path, engine: dict, tp: int, out) -> int:
    """Print the bound family, or every error; 0 when it binds, 1 otherwise."""
    import sys

    from rich.markup import escape

    from .console import print_table

    def fail(diags: list[Diagnostic], sources: dict) -> int:
        lines = [d.render(sources) for d in sorted(diags, key=lambda d: d.loc)]
        sys.stderr.write("\n".join(lines) + "\n")
        n = len(diags)
        sys.stderr.write(f"pdc bind: {n} error{'s' if n != 1 else ''}; {spec_path} does not "
                         f"bind to {config_path}\n")
        return 1

    config, errors = read_config(config_path)
    family, spec, diags, sources = generated_family(spec_path)
    if diags or errors:
        return fail(diags + errors, sources)
    if spec is None or family is None or config is None:
        return fail([Diagnostic(Location(spec_path), "the spec did not compile")], sources)
    checks = cross_check(spec, config)
    try:
        bound = family.bind(config, engine)
    except BindError as e:
        return fail(checks + list(e.diagnostics), sources)
    if checks:
        return fail(checks, sources)
    layout = bound.layout
    b = bound.bound
    arch = (config.get("architectures") or ["?"])[0]
    print(f"{layout.family} ({layout.spec_path}) bound to {config_path} ({arch})", file=out)
    kinds: dict[str, int] = {}
    for _, k in layout.kind_of:
        kinds[k] = kinds.get(k, 0) + 1
    print(f"  {layout.num_layers} layers ({', '.join(f'{k} x{n}' for k, n in kinds.items())})"
          f", pages of {layout.default_page_size} tokens, fingerprint 0x{bound.fingerprint:016X}",
          file=out)
    by_name = {p.name: p for p in spec.params}
    rows = []
    values = b.params if b is not None else {p.name: p.value for p in spec.params}
    for name, value in values.items():
        p = by_name[name]
        src = p.source or (f"= {p.text}" if p.text != str(p.value) else "written")
        if p.source and p.default is not None and not _has(config, engine, p.source):
            src += f" (absent: default {p.default})"
        rows.append([name, f"{value:,}", src])
    print_table(["param", "value", "from"], rows, out, right=(1,), title="params")
    if spec.dtypes:
        dt = b.dtypes if b is not None else {d.name: d.dtype for d in spec.dtypes}
        print_table(["dtype", "value", "from"],
                    [[d.name, dt[d.name], d.source or "written"] for d in spec.dtypes], out,
                    title="dtypes")
    rows, per_token, per_request = [], 0, 0
    for c in layout.components:
        n = len(c.tensors) * max(1, len(c.layer_ids))
        rank = c.item_bytes_at(tp)
        if c.index in ("page", "window"):
            tok = n * rank // max(1, layout.default_page_size)
            per_token += tok
            cost = f"{tok:,} B/token"
        else:
            req = n * rank * max(1, c.ring_rows)
            per_request += req
            cost = f"{req:,} B/request"
        rows.append([c.name, c.index, f"{len(c.tensors)} x {max(1, len(c.layer_ids))}",
                     escape(str(list(c.shape))), c.dtype, f"{c.item_bytes:,}", f"{rank:,}",
                     cost])
    print_table(["component", "index", "tensors x layers", "item", "dtype", "item B",
                 f"B/rank TP{tp}", "per rank"], rows, out, right=(5, 6, 7),
                title="components")
    print(f"  per rank at TP {tp}: {per_token:,} bytes per token, {per_request:,} bytes per "
          "request", file=out)
    return 0


def _has(config: dict, engine: dict, source: str) -> bool:
    from pdc.runtime.binding import lookup

    kind, _, key = source.partition(".")
    return lookup(config if kind == "config" else engine, key) is not None
