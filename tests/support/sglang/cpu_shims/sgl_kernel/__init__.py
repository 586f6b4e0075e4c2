"""Pure-torch stand-in for sgl_kernel's CPU build (test support for SGLang on a CPU machine).

The registry has sgl-kernel only as CUDA wheels (no sdist, no CPU build), but SGLang 0.5.23 on
`--device cpu` imports a few of its CPU ops at module level (`kernels/ops/kvcache/cache_move.py`,
`srt/mem_cache/allocation.py`). The two that a dense model's path calls are implemented here in
torch, and so are the ops of the seed families' paths:
- hybrid Gated DeltaNet (Qwen3-Next): gdn.py, `sgl_kernel.mamba` and the
  `torch.ops.sgl_kernel.*` GDN / gated-norm ops, plus the rebinds of pdc_sglang_cpu_paths.py (beside this package);
- MLA (DeepSeek-V2/V3) through `--attention-backend intel_amx`: attention.py's
  `extend_attention_cpu` / `decode_attention_cpu`.
Every other `*_cpu` name resolves to a function that raises when called (speculative
decoding and AMX kernels, imported at load time but never called on these paths).
Each op is unit-tested against a reference in tests/integrations/test_sglang_cpu_shim.py.

`torch.ops.sgl_kernel.convert_weight_packed` is deliberately not registered, so SGLang's
`_is_intel_amx_backend_available()` stays false and it takes its native-torch paths.
On a GPU machine install the real sglang-kernel wheel instead.
"""

import ctypes
import os

import torch

from . import attention, gdn

__version__ = "0.0.0+pdc.cpu.shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Write each request's new KV slots into its row of req_to_token (SGLang's contract)."""
    consumed = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[consumed : consumed + count].to(
                req_to_token.dtype
            )
        consumed += count


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer (base address, row stride in bytes) copy row src_loc[j] onto tgt_loc[j]."""
    pairs = list(zip(src_loc.tolist(), tgt_loc.tolist(), strict=True))
    for base, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for src, tgt in pairs:
            ctypes.memmove(base + tgt * row_bytes, base + src * row_bytes, row_bytes)


def _not_in_shim(name):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel CPU shim: {name} is not implemented; this test shim covers only the "
            "dense-model path (install the real sglang-kernel on a machine that has a build)"
        )

    op.__name__ = name
    return op


def __getattr__(name):
    if name.endswith("_cpu"):
        return _not_in_shim(name)
    raise AttributeError(name)


# Note [Shim fault]: PDC_SGL_SHIM_FAULT=<op> makes that op drop the state it was given (the
# GDN decode step: its slot's recurrent state; MLA/MHA decode: the cached prefix, each token
# attending to itself only). A negative control that a served model's tokens depend on that
# state; for tests only. PDC_SGL_SHIM_FAULT=@<path> reads the op's name from that file at each
# call (missing or empty: no fault), so that a test can break and mend a running server.
FAULT_ENV = "PDC_SGL_SHIM_FAULT"


def _fault_now() -> str:
    value = os.environ.get(FAULT_ENV, "")
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:]) as f:
            return f.read().strip()
    except OSError:
        return ""


def _gdn_decode_from_zero_state(fn, *args, **kwargs):
    if "initial_state_source" in kwargs:
        kwargs["initial_state_source"] = kwargs["initial_state_source"].clone().zero_()
    else:
        args = args[:7] + (args[7].clone().zero_(),) + args[8:]
    return fn(*args, **kwargs)


def _decode_without_prefix(fn, q, k_buffer, v_buffer, key_scale, value_scale, output, k, v,
                           loc, attn_logits, req_to_token, req_pool_indices, seq_lens, *rest):
    own_rows = loc.reshape(-1, 1).to(req_to_token.dtype)
    fn(q, k_buffer, v_buffer, key_scale, value_scale, output, k, v, loc, attn_logits,
       own_rows, torch.arange(loc.numel()), torch.ones_like(seq_lens), *rest)


_FAULTS = {
    "fused_sigmoid_gating_delta_rule_update_cpu": _gdn_decode_from_zero_state,
    "decode_attention_cpu": _decode_without_prefix,
}


def _with_fault(name, fn):
    def op(*args, **kwargs):
        if _fault_now() == name:
            return _FAULTS[name](fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return op


_lib = torch.library.Library("sgl_kernel", "FRAGMENT")
for _module in (gdn, attention):
    for _name, _schema in _module.SCHEMAS.items():
        _fn = getattr(_module, _name)
        _lib.define(_name + _schema)
        _lib.impl(_name, _with_fault(_name, _fn) if _name in _FAULTS else _fn,
                  "CompositeExplicitAutograd")
