"""Paged attention over SGLang's token pool in pure torch: the two ops of SGLang's CPU
attention backend (`layers/attention/intel_amx_backend.py`, selected with
`--attention-backend intel_amx`), which is the backend that serves MLA on CPU.

Why this backend for MLA: SGLang's DeepSeek attention runs a fresh prefill in "MHA" form
(q and k of qk_nope + rope dims per head, v of v_head_dim, the latent cached aside) and every
later chunk and decode step in the absorbed "MLA" form (q of kv_lora + rope dims against the
cached latent, one KV head). The extend op must therefore take the new tokens' K/V from its
k_extend / v_extend arguments and only the cached prefix from the pool: in MHA form the pool
holds latents, not K/V. (SGLang's torch_native backend reads the whole sequence from the pool,
which is why it cannot serve MLA: the MHA-form prefill then attends over latents.)

Each request's pool rows are `req_to_token[req_pool_indices[i], :seq_lens[i]]` (for a
sliding layer of a SWAKVPool the backend hands rows already translated to the SWA pool's).
Math in float32. A sliding window (`sliding_window` W > 0: a query sees the keys less than W
positions before it, itself included; the backend passes the layer's window_left + 1) and
attention sinks (one logit per query head that joins the softmax's denominator only, GPT-OSS)
are applied; tree masks and cross attention are not used by the families served here and are
refused.
"""

from __future__ import annotations

import torch

F32 = torch.float32


def attend(q, k, v, sm_scale: float, logit_cap: float, first_query_pos: int | None,
           window: int = 0, sinks=None):
    """q (Tq, H, D); k (Tk, Hk, >= D); v (Tk, Hk, Dv). Query j sees keys up to position
    first_query_pos + j (None: all keys), and with `window` W > 0 none W or more positions
    before it (None: the queries are the last Tq positions). KV heads are shared by groups
    of H // Hk query heads; `sinks` (H,) joins each head's softmax. Returns (Tq, H, Dv)
    float32."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k[..., : q.shape[-1]].to(F32).repeat_interleave(heads // kv_heads, dim=1)
    v = v.to(F32).repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(F32), k) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    key_pos = torch.arange(k.shape[0])
    query_pos = (k.shape[0] - q.shape[0] if first_query_pos is None else first_query_pos) \
        + torch.arange(q.shape[0])
    if first_query_pos is not None:
        scores = scores.masked_fill((key_pos[None, :] > query_pos[:, None])[None], -torch.inf)
    if window > 0:
        old = key_pos[None, :] <= query_pos[:, None] - window
        scores = scores.masked_fill(old[None], -torch.inf)
    if sinks is not None:
        sink = sinks.to(F32)[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _refuse_unused(is_cross, tree_mask=None):
    if is_cross or tree_mask is not None:
        raise NotImplementedError(
            "sgl_kernel CPU shim: attention with a tree mask or cross attention is not "
            "implemented")


def extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, key_scale,
                         value_scale, req_to_token, req_pool_indices, seq_lens,
                         extend_seq_lens, extend_start_loc, max_len_extend, sm_scale,
                         logit_cap, is_cross, sliding_window, encoder_lens, sinks, tree_mask,
                         is_causal):
    """Prefill chunk: the cached prefix from the pool, the chunk's own K/V from k/v_extend."""
    _refuse_unused(is_cross, tree_mask)
    for i in range(seq_lens.shape[0]):
        total, new, start = int(seq_lens[i]), int(extend_seq_lens[i]), int(extend_start_loc[i])
        prefix = total - new
        k, v = k_extend[start:start + new].to(F32), v_extend[start:start + new].to(F32)
        if prefix:  # (MLA's MHA form runs only without one: its pool rows are latents)
            rows = req_to_token[int(req_pool_indices[i]), :prefix].long()
            k = torch.cat([k_buffer[rows].to(F32) * key_scale, k])
            v = torch.cat([v_buffer[rows].to(F32) * value_scale, v])
        o = attend(q_extend[start:start + new], k, v, sm_scale, logit_cap,
                   prefix if is_causal else None, int(sliding_window), sinks)
        o_extend[start:start + new] = o.to(o_extend.dtype)


def decode_attention_cpu(q, k_buffer, v_buffer, key_scale, value_scale, output, k, v, loc,
                         attn_logits, req_to_token, req_pool_indices, seq_lens, sm_scale,
                         logit_cap, is_cross, sliding_window, encoder_lens, sinks):
    """One token per request: stores the new K/V at `loc` (when given), then attends over
    the request's pool rows."""
    _refuse_unused(is_cross)
    if k is not None:
        k_buffer[loc.long()] = k.reshape(k.shape[0], *k_buffer.shape[1:]).to(k_buffer.dtype)
    if v is not None:
        v_buffer[loc.long()] = v.reshape(v.shape[0], *v_buffer.shape[1:]).to(v_buffer.dtype)
    for i in range(seq_lens.shape[0]):
        rows = req_to_token[int(req_pool_indices[i]), : int(seq_lens[i])].long()
        o = attend(q[i:i + 1], k_buffer[rows].to(F32) * key_scale,
                   v_buffer[rows].to(F32) * value_scale, sm_scale, logit_cap, None,
                   int(sliding_window), sinks)
        output[i] = o[0].to(output.dtype)


SCHEMAS = {
    "extend_attention_cpu": (
        "(Tensor q_extend, Tensor k_extend, Tensor v_extend, Tensor(a!) o_extend, "
        "Tensor(b!) k_buffer, Tensor(c!) v_buffer, float key_scale, float value_scale, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, "
        "float sm_scale, float logit_cap, bool is_cross, int sliding_window, "
        "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"),
    "decode_attention_cpu": (
        "(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float key_scale, "
        "float value_scale, Tensor(c!) output, Tensor? k, Tensor? v, Tensor loc, "
        "Tensor attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "float sm_scale, float logit_cap, bool is_cross, int sliding_window, "
        "Tensor? encoder_lens, Tensor? sinks) -> ()"),
}
