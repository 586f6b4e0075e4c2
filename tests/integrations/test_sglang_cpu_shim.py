"""The CPU test shim's sgl_kernel ops (tests/support/sglang/cpu_shims/sgl_kernel) against
references: transformers' torch implementations of Qwen3-Next's Gated DeltaNet pieces
(chunked delta rule, recurrent delta rule, causal conv, gated RMSNorm), and naive math for the
gates and for paged attention. Each at several shapes, with SGLang's layouts on the shim side
(packed token axis, states in pool slots, the temporal state as (HV, V, K)).

Runs in pdc's own environment (torch and transformers, no SGLang): the shim is pure torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "sglang" / "cpu_shims"))
import sgl_kernel  # noqa: E402
from sgl_kernel import attention, gdn, mamba  # noqa: E402

ops = torch.ops.sgl_kernel
F32 = torch.float32


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _spans(cu):
    return list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))


def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=_gen(seed)) * scale


# ~~~ causal conv ~~~

CONV_SHAPES = [(8, 4, [5]), (24, 4, [1, 7, 3]), (12, 2, [16, 2])]  # dim, kernel, seq lens


@pytest.mark.parametrize("dim,kernel,lens", CONV_SHAPES)
def test_prefill_conv_matches_transformers_per_sequence_and_fills_the_slots(dim, kernel, lens):
    weight, bias = _randn(dim, kernel, seed=1), _randn(dim, seed=2)
    x = _randn(dim, sum(lens), seed=3)
    slots = [5, 0, 3][: len(lens)]
    conv_states = torch.full((6, dim, kernel - 1), 7.0)  # stale values a fresh request ignores
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    out = mamba.causal_conv1d_fn_cpu(x, weight, bias, "silu", conv_states,
                                     torch.zeros(len(lens), dtype=torch.bool),
                                     torch.tensor(slots), cu, lens)
    for (s, e), slot in zip(_spans(cu), slots, strict=True):
        ref = qn.causal_conv1d_fn(x[None, :, s:e], weight, bias, "silu")[0]
        torch.testing.assert_close(out[:, s:e], ref, atol=1e-5, rtol=1e-5)
        seq = torch.cat([torch.zeros(dim, kernel - 1), x[:, s:e]], dim=1)
        assert torch.equal(conv_states[slot], seq[:, -(kernel - 1):])


@pytest.mark.parametrize("dim,kernel,lens", CONV_SHAPES)
def test_prefill_conv_in_two_chunks_equals_one_pass(dim, kernel, lens):
    weight, bias = _randn(dim, kernel, seed=4), None
    total = sum(lens) + 3
    x = _randn(dim, total, seed=5)
    whole = qn.causal_conv1d_fn(x[None], weight, bias, "silu")[0]
    conv_states = torch.zeros(2, dim, kernel - 1)
    cut = total // 2
    pieces = []
    for start, end, has_prefix in ((0, cut, False), (cut, total, True)):
        pieces.append(mamba.causal_conv1d_fn_cpu(
            x[:, start:end].contiguous(), weight, bias, "silu", conv_states,
            torch.tensor([has_prefix]), torch.tensor([1]), torch.tensor([0, end - start]),
            [end - start]))
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim,kernel,steps", [(8, 4, 1), (20, 4, 3), (6, 3, 1)])
def test_decode_conv_matches_transformers_and_skips_padding_rows(dim, kernel, steps):
    weight, bias = _randn(dim, kernel, seed=6), _randn(dim, seed=7)
    x = _randn(3, dim, steps, seed=8)
    states = _randn(4, dim, kernel - 1, seed=9)
    before = states.clone()
    slots = torch.tensor([2, -1, 0])  # row 1 is a padded batch row
    out = mamba.causal_conv1d_update_cpu(x if steps > 1 else x[..., 0], states, weight, bias,
                                         "silu", conv_state_indices=slots)
    out = out if steps > 1 else out[..., None]
    for row, slot in ((0, 2), (2, 0)):
        ref_state = before[slot:slot + 1].clone()
        ref = qn.causal_conv1d_update(x[row:row + 1], ref_state, weight, bias, "silu")
        torch.testing.assert_close(out[row:row + 1], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[slot], ref_state[0])
    assert torch.equal(out[1], torch.zeros(dim, steps))
    assert torch.equal(states[[1, 3]], before[[1, 3]])


# ~~~ gated delta rule ~~~

# (q/k heads, value heads, K, V, sequence lengths): GQA and K != V, so that a head grouping or
# a state transposition error shows
GDN_SHAPES = [(2, 4, 16, 24, [9]), (1, 1, 8, 8, [3, 70]), (2, 2, 16, 8, [1, 5, 65])]


def _gdn_inputs(h, hv, k_dim, v_dim, total, seed):
    q = _randn(1, total, h, k_dim, seed=seed)
    k = _randn(1, total, h, k_dim, seed=seed + 1)
    v = _randn(1, total, hv, v_dim, seed=seed + 2)
    a, b = _randn(total, hv, seed=seed + 3), _randn(total, hv, seed=seed + 4)
    A_log, dt_bias = _randn(hv, seed=seed + 5, scale=0.5), _randn(hv, seed=seed + 6)
    return q, k, v, a, b, A_log, dt_bias


def _hf_delta_rule(fn, q, k, v, g, beta, state_vk):
    """transformers' reference for one sequence: q/k repeated to the value heads as its
    Qwen3-Next layer does, state in its (B, HV, K, V) layout."""
    group = v.shape[2] // q.shape[2]
    out, state = fn(q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2), v,
                    g, beta, initial_state=state_vk.transpose(-1, -2)[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out, state[0].transpose(-1, -2)


def test_gdn_gates_match_the_model_formula():
    a, b = _randn(7, 4, seed=1), _randn(7, 4, seed=2)
    A_log, dt_bias = _randn(4, seed=3), _randn(4, seed=4)
    g, beta = ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    ref_g = -A_log.exp() * torch.log1p((a + dt_bias).exp())
    torch.testing.assert_close(g, ref_g[None], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(beta, (1 / (1 + (-b).exp()))[None])
    big = torch.full((1, 4), 30.0)  # past the softplus threshold: linear
    assert torch.equal(ops.fused_gdn_gating_cpu(torch.zeros(4), big, big, torch.zeros(4))[0],
                       -big[None])


@pytest.mark.parametrize("h,hv,k_dim,v_dim,lens", GDN_SHAPES)
def test_chunked_prefill_delta_rule_matches_transformers_chunked_kernel(h, hv, k_dim, v_dim,
                                                                        lens):
    total = sum(lens)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(h, hv, k_dim, v_dim, total, seed=10)
    g, beta = ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    pool = _randn(5, hv, v_dim, k_dim, seed=20, scale=0.1)  # (slots, HV, V, K)
    before = pool.clone()
    slots = [3, 0, 4][: len(lens)]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    out, final, _ = mamba.chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, cu, False, True,
                                                  torch.tensor(slots))
    for i, ((s, e), slot) in enumerate(zip(_spans(cu), slots, strict=True)):
        ref, ref_state = _hf_delta_rule(qn.torch_chunk_gated_delta_rule, q[:, s:e], k[:, s:e],
                                        v[:, s:e], g[:, s:e], beta[:, s:e], before[slot])
        torch.testing.assert_close(out[:, s:e], ref, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(pool[slot], ref_state, atol=2e-4, rtol=2e-4)
        assert torch.equal(final[i], pool[slot])
    untouched = [s for s in range(5) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("h,hv,k_dim,v_dim,lens", GDN_SHAPES)
def test_decode_delta_rule_matches_transformers_recurrent_kernel(h, hv, k_dim, v_dim, lens):
    batch = len(lens)  # one token per request
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(h, hv, k_dim, v_dim, batch, seed=30)
    pool = _randn(batch + 2, hv, v_dim, k_dim, seed=40, scale=0.1)
    before = pool.clone()
    slots = list(range(batch + 1, 0, -1))[:batch]
    cu = torch.arange(batch + 1)
    out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool,
        initial_state_indices=torch.tensor(slots), cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0, softplus_threshold=20.0)
    g, beta = gdn.gdn_gating(A_log, a, dt_bias, b)
    for i, slot in enumerate(slots):
        ref, ref_state = _hf_delta_rule(qn.torch_recurrent_gated_delta_rule, q[:, i:i + 1],
                                        k[:, i:i + 1], v[:, i:i + 1], g[None, i:i + 1],
                                        beta[None, i:i + 1], before[slot])
        torch.testing.assert_close(out[:, i:i + 1], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[slot], ref_state, atol=1e-5, rtol=1e-5)


def test_decode_delta_rule_leaves_padding_rows_at_zero_and_their_slots_alone():
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(2, 4, 16, 24, 2, seed=50)
    pool = _randn(3, 4, 24, 16, seed=51)
    before = pool.clone()
    out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q, k, v, a, b, pool, torch.tensor([-1, 2]), torch.arange(3), True,
        1.0, 20.0)
    assert torch.equal(out[0, 0], torch.zeros(4, 24))
    assert torch.equal(pool[:2], before[:2]) and not torch.equal(pool[2], before[2])


def test_negative_control_a_state_in_the_wrong_layout_fails_the_reference():
    # The comparison above can see a layout error: the same state handed over as (HV, K, V)
    # instead of the pool's (HV, V, K) gives another output.
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(2, 2, 8, 8, 4, seed=60)
    g, beta = ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    state = _randn(2, 8, 8, seed=61)
    ref, _ = _hf_delta_rule(qn.torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
    pool = state.transpose(-1, -2).clone()[None]
    out, _, _ = mamba.chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, torch.tensor([0, 4]),
                                              False, True, torch.tensor([0]))
    assert not torch.allclose(out, ref, atol=1e-3)


@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 16), (1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rmsnorm_matches_transformers(shape, dtype):
    x, z = _randn(*shape, seed=70).to(dtype), _randn(*shape, seed=71).to(dtype)
    norm = qn.Qwen3NextRMSNormGated(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(shape[-1], seed=72))
        ref = norm(x, gate=z)
    out = ops.fused_rmsnorm_gated_cpu(x, norm.weight.detach(), z, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_shared_expert_gate_matches_the_model_formula():
    hidden, weight, shared = _randn(5, 16, seed=80), _randn(16, seed=81), _randn(5, 16, seed=82)
    ref = torch.sigmoid(hidden @ weight)[:, None] * shared
    torch.testing.assert_close(gdn.gate_sigmoid_mul(hidden, weight, shared), ref)
    acc = torch.ones(5, 16)
    gdn.gate_sigmoid_mul_add(hidden, weight, shared, acc)
    torch.testing.assert_close(acc, ref + 1)


# ~~~ paged attention (the intel_amx backend's two ops) ~~~

# (query heads, KV heads, q/k dims, v dims): GQA, and MLA's two forms: MHA (nope + rope per
# head) and absorbed (latent + rope against one KV head, v a prefix of the key)
ATTN_SHAPES = [(4, 2, 32, 32), (4, 4, 48, 32), (4, 1, 48, 32)]


def _naive_attention(q, k, v, scale, causal_from):
    """Per query and head, softmax over the keys it may see: a plain loop."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        visible = k.shape[0] if causal_from is None else causal_from + i + 1
        for h in range(q.shape[1]):
            kh, vh = k[:visible, h // group, : q.shape[-1]], v[:visible, h // group]
            out[i, h] = torch.softmax((kh @ q[i, h]) * scale, 0) @ vh
    return out


def _paged(lens, seed):
    """A token pool with each request's rows scattered: req_to_token maps positions to rows."""
    rows = torch.randperm(sum(lens) + 10, generator=_gen(seed))[: sum(lens)] + 1
    table = torch.zeros(len(lens) + 1, max(lens), dtype=torch.int32)
    start = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = rows[start:start + n]
        start += n
    return table, torch.arange(1, len(lens) + 1)


@pytest.mark.parametrize("heads,kv_heads,qk_dim,v_dim", ATTN_SHAPES)
@pytest.mark.parametrize("lens,new", [([7], [7]), ([20, 5], [4, 5]), ([3, 33, 16], [1, 17, 16])])
def test_extend_attention_reads_the_prefix_from_the_pool_and_the_chunk_from_its_arguments(
        heads, kv_heads, qk_dim, v_dim, lens, new):
    pool_rows = sum(lens) + 12
    k_buffer = _randn(pool_rows, kv_heads, qk_dim, seed=90)
    v_buffer = _randn(pool_rows, kv_heads, v_dim, seed=91)
    table, req_idx = _paged(lens, seed=92)
    q = _randn(sum(new), heads, qk_dim, seed=93)
    k_ext, v_ext = _randn(sum(new), kv_heads, qk_dim, seed=94), \
        _randn(sum(new), kv_heads, v_dim, seed=95)
    out = torch.zeros(sum(new), heads, v_dim)
    starts = torch.tensor([0] + list(torch.tensor(new).cumsum(0)[:-1]))
    ops.extend_attention_cpu(q, k_ext, v_ext, out, k_buffer, v_buffer, 1.0, 1.0, table, req_idx,
                             torch.tensor(lens), torch.tensor(new), starts, max(new), 0.2, 0.0,
                             False, 0, None, None, None, True)
    for i, (n, m) in enumerate(zip(lens, new, strict=True)):
        s = int(starts[i])
        rows = table[i + 1, : n - m].long()
        k = torch.cat([k_buffer[rows], k_ext[s:s + m]])
        v = torch.cat([v_buffer[rows], v_ext[s:s + m]])
        torch.testing.assert_close(out[s:s + m], _naive_attention(q[s:s + m], k, v, 0.2, n - m),
                                   atol=1e-5, rtol=1e-5)


def test_extend_attention_in_mlas_mha_form_ignores_the_latent_pool():
    # a fresh prefill of MLA runs per-head K/V of qk_nope + rope dims (4 heads x 32) while the
    # pool holds one latent + rope row (1 x 48) per token: only k/v_extend may be read
    k_buffer, v_buffer = _randn(30, 1, 48, seed=96), _randn(30, 1, 32, seed=97)
    table, req_idx = _paged([9, 4], seed=98)
    q, k, v = _randn(13, 4, 32, seed=99), _randn(13, 4, 32, seed=100), _randn(13, 4, 24, seed=101)
    out = torch.zeros(13, 4, 24)
    ops.extend_attention_cpu(q, k, v, out, k_buffer, v_buffer, 1.0, 1.0, table, req_idx,
                             torch.tensor([9, 4]), torch.tensor([9, 4]), torch.tensor([0, 9]), 9,
                             0.25, 0.0, False, 0, None, None, None, True)
    for s, n in ((0, 9), (9, 4)):
        torch.testing.assert_close(out[s:s + n], _naive_attention(q[s:s + n], k[s:s + n],
                                                                  v[s:s + n], 0.25, 0),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,qk_dim,v_dim", ATTN_SHAPES)
def test_decode_attention_stores_the_new_token_and_attends_over_the_pool(heads, kv_heads,
                                                                         qk_dim, v_dim):
    lens = [5, 18, 1]
    k_buffer = _randn(40, kv_heads, qk_dim, seed=100)
    v_buffer = _randn(40, kv_heads, v_dim, seed=101)
    table, req_idx = _paged(lens, seed=102)
    loc = torch.stack([table[i + 1, n - 1] for i, n in enumerate(lens)]).long()
    q = _randn(3, heads, qk_dim, seed=103)
    k_new, v_new = _randn(3, kv_heads, qk_dim, seed=104), _randn(3, kv_heads, v_dim, seed=105)
    out = torch.zeros(3, heads, v_dim)
    ops.decode_attention_cpu(q, k_buffer, v_buffer, 1.0, 1.0, out, k_new, v_new, loc,
                             torch.zeros(3, heads, 8, v_dim + 1), table, req_idx,
                             torch.tensor(lens), 0.3, 0.0, False, 0, None, None)
    assert torch.equal(k_buffer[loc], k_new) and torch.equal(v_buffer[loc], v_new)
    for i, n in enumerate(lens):
        rows = table[i + 1, :n].long()
        torch.testing.assert_close(out[i:i + 1], _naive_attention(
            q[i:i + 1], k_buffer[rows], v_buffer[rows], 0.3, None), atol=1e-5, rtol=1e-5)


def _naive_windowed(q, k, v, scale, first, window, sinks):
    """Query i (at position first + i) sees keys first + i - window + 1 .. first + i; a
    head's sink logit joins its softmax's denominator: a plain loop."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        hi = first + i + 1
        lo = max(0, hi - window)
        for h in range(q.shape[1]):
            kh, vh = k[lo:hi, h // group, : q.shape[-1]], v[lo:hi, h // group]
            logits = torch.cat([(kh @ q[i, h]) * scale, sinks[h:h + 1]])
            out[i, h] = torch.softmax(logits, 0)[:-1] @ vh
    return out


def test_sliding_window_and_sinks_in_both_ops():
    # GPT-OSS's sliding layers (the backend passes window_left + 1 = 5) with a sink per head:
    # a 3-token prefix in the pool and a 9-token chunk, then one decode step at position 12
    heads, kv_heads, dim, window = 4, 2, 16, 5
    k_buffer, v_buffer = _randn(40, kv_heads, dim, seed=120), _randn(40, kv_heads, dim, seed=121)
    table, req_idx = _paged([13], seed=122)
    sinks = _randn(heads, seed=123)
    q, k, v = (_randn(9, heads, dim, seed=124), _randn(9, kv_heads, dim, seed=125),
               _randn(9, kv_heads, dim, seed=126))
    out = torch.zeros(9, heads, dim)
    ops.extend_attention_cpu(q, k, v, out, k_buffer, v_buffer, 1.0, 1.0, table, req_idx,
                             torch.tensor([12]), torch.tensor([9]), torch.tensor([0]), 9, 0.25,
                             0.0, False, window, None, sinks, None, True)
    rows = table[1, :3].long()
    all_k, all_v = torch.cat([k_buffer[rows], k]), torch.cat([v_buffer[rows], v])
    torch.testing.assert_close(out, _naive_windowed(q, all_k, all_v, 0.25, 3, window, sinks),
                               atol=1e-5, rtol=1e-5)
    k_buffer[table[1, 3:12].long()], v_buffer[table[1, 3:12].long()] = k, v
    q1, out1 = _randn(1, heads, dim, seed=127), torch.zeros(1, heads, dim)
    loc = table[1, 12:13].long()
    ops.decode_attention_cpu(q1, k_buffer, v_buffer, 1.0, 1.0, out1, k[:1], v[:1], loc,
                             torch.zeros(1, heads, 8, dim + 1), table, req_idx,
                             torch.tensor([13]), 0.25, 0.0, False, window, None, sinks)
    rows = table[1, :13].long()
    torch.testing.assert_close(out1, _naive_windowed(q1, k_buffer[rows], v_buffer[rows], 0.25,
                                                     12, window, sinks), atol=1e-5, rtol=1e-5)


def test_attention_refuses_what_it_does_not_implement():
    q = torch.zeros(1, 1, 8)
    with pytest.raises(NotImplementedError) as e:
        attention.extend_attention_cpu(q, q, q, q.clone(), q, q, 1.0, 1.0,
                                       torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]),
                                       torch.tensor([1]), torch.tensor([1]), torch.tensor([0]),
                                       1, 1.0, 0.0, False, 4, None, None, q, True)
    assert str(e.value) == ("sgl_kernel CPU shim: attention with a tree mask or cross "
                            "attention is not implemented")


# ~~~ the negative-control faults the server tests use (Note [Shim fault]) ~~~

def test_shim_fault_makes_the_gdn_decode_forget_its_slot(monkeypatch):
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(2, 4, 16, 24, 1, seed=110)
    pool = _randn(1, 4, 24, 16, seed=111)
    args = dict(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b,
                initial_state_indices=torch.tensor([0]), cu_seqlens=torch.arange(2),
                use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0)
    good = ops.fused_sigmoid_gating_delta_rule_update_cpu(initial_state_source=pool.clone(),
                                                          **args)
    monkeypatch.setenv(sgl_kernel.FAULT_ENV, "fused_sigmoid_gating_delta_rule_update_cpu")
    bad = ops.fused_sigmoid_gating_delta_rule_update_cpu(initial_state_source=pool.clone(),
                                                         **args)
    zero = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        initial_state_source=torch.zeros_like(pool), **args)
    assert torch.equal(bad, zero) and not torch.allclose(bad, good, atol=1e-3)


def test_shim_fault_makes_decode_attention_ignore_the_prefix(monkeypatch):
    k_buffer, v_buffer = _randn(10, 1, 8, seed=120), _randn(10, 1, 8, seed=121)
    table = torch.tensor([[0, 0, 0], [3, 7, 9]], dtype=torch.int32)
    q = _randn(1, 2, 8, seed=122)

    def run():
        out = torch.zeros(1, 2, 8)
        ops.decode_attention_cpu(q, k_buffer, v_buffer, 1.0, 1.0, out, None, None,
                                 torch.tensor([9]), torch.zeros(1), table, torch.tensor([1]),
                                 torch.tensor([3]), 0.5, 0.0, False, 0, None, None)
        return out

    good = run()
    monkeypatch.setenv(sgl_kernel.FAULT_ENV, "decode_attention_cpu")
    bad = run()
    torch.testing.assert_close(bad, v_buffer[9:10].expand(1, 2, 8))
    assert not torch.allclose(bad, good, atol=1e-3)


def test_shim_fault_named_in_a_file_is_read_at_each_call(monkeypatch, tmp_path):
    flag = tmp_path / "fault"
    monkeypatch.setenv(sgl_kernel.FAULT_ENV, f"@{flag}")
    assert sgl_kernel._fault_now() == ""
    flag.write_text("decode_attention_cpu\n")
    assert sgl_kernel._fault_now() == "decode_attention_cpu"
    flag.write_text("")
    assert sgl_kernel._fault_now() == ""
