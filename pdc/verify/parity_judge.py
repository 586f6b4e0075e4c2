"""The judge of `pdc parity`: tokens and logits of every step compared bitwise with the
single-process reference, and the rebuilt state with the prefill's export (Note [Parity
reference] in pdc/verify/parity.py)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import struct
from dataclasses import dataclass, field

import numpy as np

from .hf_adapter import bound_entries
from .parity_case import Case, Outcome


def parse_state(buf: bytes) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """pdc.verify.hf_state.state_to_bytes without torch: name -> (dtype, shape, raw bytes)."""
    (n,) = struct.unpack_from("<Q", buf)
    offset, out = 8 + n, {}
    for name, dtype, shape in json.loads(buf[8:8 + n]):
        nbytes = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        out[name] = (dtype, tuple(shape), np.frombuffer(buf, np.uint8, nbytes, offset))
        offset += nbytes
    return out


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}


def _floats(dtype: str, raw: np.ndarray) -> np.ndarray:
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    raise ValueError(f"no float view of {dtype}")


@dataclass
class Verdict:
    ok: bool
    lines: list[str]
    tokens: list[int] = field(default_factory=list)  # the PD run's tokens, when it ran


def judge(case: Case, out: Outcome) -> Verdict:
    """Compare the PD run with the reference; the lines name what differs first."""
    lines: list[str] = []
    failed = [f"prefill pp{k[0]}.tp{k[1]}: {r['status']} {r['reason']}".rstrip()
              for k, r in sorted(out.prefill.items()) if r["status"] != "Success"]
    failed += [f"decode pp{k[0]}.tp{k[1]}: {r['status']} {r['reason']}".rstrip()
               for k, r in sorted(out.decode.items()) if r["status"] != "Success"]
    model = out.model or {}
    if failed or "error" in model:
        lines.append("transfer FAILED: " + "; ".join(failed or [model.get("error", "")]))
        return Verdict(False, lines)
    leader = out.prefill[(0, 0)]
    ref = model["reference"]
    steps = case.steps
    pd_tokens = [leader["first_token"]] + model["tokens"]
    ref_logits = parse_state(ref["logits"])["t"]
    pd0 = parse_state(leader["logits"])["t"]
    pd_rest = parse_state(model["logits"])["t"]
    dtype, vocab = ref_logits[0], ref_logits[1][-1]
    ref_rows = ref_logits[2].reshape(steps, -1)
    pd_rows = np.concatenate([pd0[2], pd_rest[2]]).reshape(steps, -1)
    first = None
    for i in range(steps):
        if pd_tokens[i] != ref["tokens"][i] or not np.array_equal(pd_rows[i], ref_rows[i]):
            first = i
            break
    same_dtype = pd0[0] == dtype and pd_rest[0] == dtype
    lines.append(f"tokens   {pd_tokens}")

    # State: the rebuilt tensors against the prefill's export, in spec order.
    exported, rebuilt = parse_state(leader["state"]), parse_state(model["state"])
    layout = case.layout or importlib.import_module(f"pdc.generated.{case.py_name}.layout").LAYOUT
    diffs = []
    for comp, tensor, layer_id, key in bound_entries(layout, case.binding):
        a, b = exported[key], rebuilt[key]
        where = (f"request-wide component {comp.name}" if comp.request_wide else
                 f"layer {layer_id} component {comp.name}")
        if a[:2] != b[:2]:
            diffs.append(f"{where} ({key}): shape/dtype "
                         f"{b[1]} {b[0]}, exported {a[1]} {a[0]}")
        elif not np.array_equal(a[2], b[2]):
            n = int((a[2] != b[2]).sum())
            diffs.append(f"{where}"
                         + (f" tensor {tensor}" if len(comp.tensors) > 1 else "")
                         + f" ({key}): {n} of {len(a[2])} bytes differ from the prefill export")
    for comp, tensor, layer_id, t in model["disagree"]:
        diffs.append(f"layer {layer_id} component {comp} tensor {tensor}: decode {t}'s copy "
                     "of a replicated unit differs from a lower rank's copy")
    for (g, pp, tp), r in sorted(out.idle.items()):
        if r["written"]:
            diffs.append(f"idle decode rank dp{g}.pp{pp}.tp{tp}: {r['written']} of its "
                         f"{r['bytes']} pool bytes were written (the request is on DP group "
                         f"{case.decode_group})")
    flags_ok = model["flags"] == leader["flags"]
    moved = sum(r["bytes"] for r in out.decode.values())
    lines.append(f"state    {len(exported)} tensors, {moved} bytes received by "
                 f"{len(out.decode)} decode rank(s); "
                 + ("every rebuilt tensor equals the prefill export" if not diffs else
                    f"{len(diffs)} differ from the prefill export")
                 + ("" if flags_ok else f"; flags differ: rebuilt {model['flags']}, prefill "
                    f"{leader['flags']}"))
    if out.idle:
        groups = sorted({g for g, _, _ in out.idle})
        lines.append(f"dp       the request on decode DP group {case.decode_group}, padded with "
                     f"idle group(s) {', '.join(map(str, groups))} whose pools "
                     + ("stayed untouched" if not any(r["written"] for r in out.idle.values())
                        else "were written"))
    lines += [f"  differs: {d}" for d in diffs]
    if first is None and same_dtype and not diffs and flags_ok:
        lines.append(f"parity   OK: tokens and logits of all {steps} steps bitwise equal to "
                     "single-process generation")
        return Verdict(True, lines, pd_tokens)
    if first is None:
        lines.append("parity   FAILED: tokens and logits are equal, but "
                     + ("the logits dtype differs" if not same_dtype else
                        "the transferred state is not (see above)"))
        return Verdict(False, lines, pd_tokens)
    what = "the prefill's last position" if first == 0 else f"decode step {first}"
    pd, rf = _floats(dtype, pd_rows[first]), _floats(dtype, ref_rows[first])
    n = int((pd_rows[first].view(np.uint8).reshape(vocab, -1) !=
             ref_rows[first].view(np.uint8).reshape(vocab, -1)).any(axis=1).sum())
    lines.append(f"parity   FAILED at step {first} ({what}): token {pd_tokens[first]} vs "
                 f"{ref['tokens'][first]} (single process); {n} of {vocab} logits differ, "
                 f"max |diff| {float(np.max(np.abs(pd - rf))):.3g}")
    if diffs:
        lines.append(f"cause    {diffs[0]}")
    elif parse_state(ref["state"]).keys() == exported.keys() and any(
            not np.array_equal(v[2], parse_state(ref["state"])[k][2])
            for k, v in exported.items()):
        lines.append("cause    the prefill's own state differs from the single-process "
                     "prefill's: the prefill computation is not reproducible here")
    else:
        lines.append("cause    every transferred tensor equals the prefill export: the "
                     "difference arises on the decode side")
    return Verdict(False, lines, pd_tokens)
