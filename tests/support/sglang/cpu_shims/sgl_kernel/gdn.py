"""Gated DeltaNet (GDN) linear attention and its gated norm in pure torch, as SGLang's CPU path
calls them (`layers/attention/linear/gdn_backend.py`, `linear/kernels/gdn_triton.py`,
`kernels/ops/attention/fla/fused_norm_gate.py` in SGLang 0.5.23).

Layouts are SGLang's: a sequence batch is packed along one token axis (`cu_seqlens` /
`query_start_loc` mark where each sequence starts), and the recurrent state lives in SGLang's
mamba pool, one slot per request: the temporal state of a slot is (value heads, V, K), the conv
state (conv channels, kernel - 1). Each op reads the slot named by the request's index and
writes it back in place, which is what the pool expects of the real kernel.

The math is done in float32 and cast once at the end. Numbers follow the model definition
(transformers' Qwen3-Next torch fallbacks), not SGLang's AMX kernels' blocking, so that a
served model's greedy tokens can be compared with transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

F32 = torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(A_log, a, dt_bias, b, softplus_beta: float = 1.0,
               softplus_threshold: float = 20.0):
    """The per-token, per-value-head log decay g and write strength beta (float32)."""
    g = -A_log.to(F32).exp() * F.softplus(a.to(F32) + dt_bias.to(F32), beta=softplus_beta,
                                          threshold=softplus_threshold)
    return g, torch.sigmoid(b.to(F32))


def delta_rule(q, k, v, g, beta, state_vk, use_qk_l2norm: bool):
    """One sequence through the gated delta rule, token by token.

    q, k: (T, H, K); v: (T, HV, V); g, beta: (T, HV); state_vk: (HV, V, K) in the pool's
    layout. Value heads share a q/k head in groups of HV // H (head i reads q/k head
    i // (HV // H)). Returns the output (T, HV, V) and the new state (HV, V, K), float32."""
    q, k, v, g, beta = (t.to(F32) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = v.shape[1] // q.shape[1]
    q = q.repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5
    k = k.repeat_interleave(group, dim=1)
    state = state_vk.to(F32).clone()  # (HV, V, K)
    out = torch.empty(v.shape, dtype=F32)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        remembered = torch.einsum("hvk,hk->hv", state, k[t])
        delta = (v[t] - remembered) * beta[t][:, None]
        state = state + delta[:, :, None] * k[t][:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
    return out, state


def _spans(cu_seqlens):
    cu = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:], strict=True))


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """(T, HV) gate inputs -> g, beta as (1, T, HV), the chunk kernel's layout."""
    g, beta = gdn_gating(A_log, a, dt_bias, b)
    return g.unsqueeze(0), beta.unsqueeze(0)


def chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state,
                               cu_seqlens, head_first, use_qk_l2norm_in_kernel,
                               initial_state_indices):
    """Prefill: every sequence of the packed batch (1, T, ...) from its slot's state; the
    final state is written back into the slot (SGLang zeroes a fresh request's slot)."""
    if head_first:
        raise NotImplementedError("sgl_kernel CPU shim: head_first layout is not used on CPU")
    out = torch.empty(value.shape, dtype=query.dtype)
    finals = []
    for (start, end), slot in zip(_spans(cu_seqlens), initial_state_indices.tolist(),
                                  strict=True):
        o, state = delta_rule(query[0, start:end], key[0, start:end], value[0, start:end],
                              g[0, start:end], beta[0, start:end], initial_state[slot],
                              use_qk_l2norm_in_kernel)
        out[0, start:end] = o.to(out.dtype)
        initial_state[slot] = state.to(initial_state.dtype)
        finals.append(initial_state[slot])
    final = torch.stack(finals) if finals else initial_state[:0]
    return out, final


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b,
                                               initial_state_source, initial_state_indices,
                                               cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta, softplus_threshold):
    """Decode: the gates and the delta rule in one op; a and b are (T, HV), q/k/v (1, T, ...).
    A negative slot (a padded batch row) produces zeros and touches no state."""
    g, beta = gdn_gating(A_log, a, dt_bias, b, softplus_beta, softplus_threshold)
    out = torch.zeros(v.shape, dtype=q.dtype)
    for (start, end), slot in zip(_spans(cu_seqlens), initial_state_indices.tolist(),
                                  strict=True):
        if slot < 0:
            continue
        o, state = delta_rule(q[0, start:end], k[0, start:end], v[0, start:end],
                              g[start:end], beta[start:end], initial_state_source[slot],
                              use_qk_l2norm_in_kernel)
        out[0, start:end] = o.to(out.dtype)
        initial_state_source[slot] = state.to(initial_state_source.dtype)
    return out


def fused_rmsnorm_gated_cpu(x, weight, z, eps):
    """RMSNorm of x (weight applied in x's dtype, as the model does), times silu(z)."""
    h = x.to(F32)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    h = weight * h
    return (h.to(F32) * F.silu(z.to(F32))).to(x.dtype)


def _conv(x, state, weight, bias, silu: bool):
    """Depthwise causal conv of one sequence: x (dim, T) after state (dim, K - 1); returns the
    output (dim, T) in x's dtype and the new state, the last K - 1 inputs."""
    window = weight.shape[-1] - 1
    full = torch.cat([state.to(F32), x.to(F32)], dim=-1)
    y = F.conv1d(full.unsqueeze(0), weight.to(F32).unsqueeze(1),
                 None if bias is None else bias.to(F32), groups=x.shape[0])[0]
    if silu:
        y = F.silu(y)
    return y.to(x.dtype), full[:, full.shape[-1] - window:]


def _is_silu(activation) -> bool:
    if activation in (None, ""):
        return False
    if activation in ("silu", "swish"):
        return True
    raise NotImplementedError(f"sgl_kernel CPU shim: conv activation {activation!r}")


def causal_conv1d_fn_cpu(x, weight, bias, activation, conv_states, has_initial_state,
                         cache_indices, query_start_loc, seq_lens_cpu=None, **_):
    """Prefill conv over a packed batch x (dim, T): each sequence starts from its slot's
    conv state when it has a prefix (a later chunk), else from zeros, and leaves its last
    K - 1 inputs in the slot."""
    silu = _is_silu(activation)
    out = torch.zeros_like(x)
    window = weight.shape[-1] - 1
    for i, ((start, end), slot) in enumerate(zip(_spans(query_start_loc),
                                                 cache_indices.tolist(), strict=False)):
        if slot < 0 or end <= start:
            continue
        if bool(has_initial_state[i]):
            state = conv_states[slot]
        else:
            state = x.new_zeros(x.shape[0], window)
        y, new_state = _conv(x[:, start:end], state, weight, bias, silu)
        out[:, start:end] = y
        conv_states[slot] = new_state.to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x, conv_states, weight, bias, activation, conv_state_indices,
                             **_):
    """Decode conv: x is (B, dim) or (B, dim, T), one row per request slot."""
    silu = _is_silu(activation)
    steps = x.unsqueeze(-1) if x.dim() == 2 else x
    out = torch.zeros_like(steps)
    for i, slot in enumerate(conv_state_indices.tolist()):
        if slot < 0:
            continue
        y, new_state = _conv(steps[i], conv_states[slot], weight, bias, silu)
        out[i] = y
        conv_states[slot] = new_state.to(conv_states.dtype)
    return out.squeeze(-1) if x.dim() == 2 else out


def gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
    """sigmoid(hidden . gate) * shared expert output: Qwen2/3-MoE's shared-expert gate, which
    SGLang runs as a Triton kernel (`kernels/ops/elementwise/elementwise.py`) off AMX."""
    gate = torch.sigmoid(hidden_states @ gate_weight.reshape(-1, 1).to(hidden_states.dtype))
    return gate * shared_output


def gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    final_hidden_states += gate_sigmoid_mul(hidden_states, gate_weight, shared_output)


SCHEMAS = {
    "fused_gdn_gating_cpu": (
        "(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)"),
    "chunk_gated_delta_rule_cpu": (
        "(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
        "Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, "
        "bool head_first, bool use_qk_l2norm_in_kernel, Tensor initial_state_indices) "
        "-> (Tensor, Tensor)"),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, "
        "Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, "
        "bool use_qk_l2norm_in_kernel, float softplus_beta, float softplus_threshold) "
        "-> Tensor"),
    "fused_rmsnorm_gated_cpu": "(Tensor x, Tensor weight, Tensor z, float eps) -> Tensor",
}
