"""`sgl_kernel.mamba`: the Python-level GDN entry points SGLang's CPU path imports by name
(`layers/attention/linear/gdn_backend.py`, `linear/kernels/gdn_triton.py`); see gdn.py."""

from __future__ import annotations

import torch

from .gdn import causal_conv1d_fn_cpu, causal_conv1d_update_cpu

__all__ = ["causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"]


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first,
                               use_qk_l2norm_in_kernel, initial_state_indices=None, **_):
    """SGLang unpacks (output, final state, per-chunk states); the CPU kernel keeps no
    per-chunk states."""
    out, final = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, initial_state, True, cu_seqlens, head_first,
        use_qk_l2norm_in_kernel, initial_state_indices)
    return out, final, None
