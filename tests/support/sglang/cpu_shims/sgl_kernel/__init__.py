"""Pure-torch stand-in for sgl_kernel's CPU build (test support for SGLang on a CPU machine).

The registry has sgl-kernel only as CUDA wheels (no sdist, no CPU build), but SGLang 0.5.23 on
`--device cpu` imports a few of its CPU ops at module level (`kernels/ops/kvcache/cache_move.py`,
`srt/mem_cache/allocation.py`). The two that a dense model's path calls are implemented here in
torch; every other `*_cpu` name resolves to a function that raises when called (speculative
decoding and AMX kernels, imported at load time but never called on this path).

`torch.ops.sgl_kernel.convert_weight_packed` is deliberately not registered, so SGLang's
`_is_intel_amx_backend_available()` stays false and it takes its native-torch paths.
On a GPU machine install the real sglang-kernel wheel instead.
"""

import ctypes

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
