"""The tiny random-weight models the SGLang demo and tests serve, and the server flags and
fixes each family needs (re-exported by sglang_harness, which starts the servers)."""

from __future__ import annotations

# The tiny random-weight models that pdc's SGLang specs describe, by family name:
# (transformers config class, model class, config); `pdc sglang-demo --family` picks one.
TINY_MODELS = {
    # served by specs/sglang-llama.yaml, bound to this config at start
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)),
    # dense Qwen3, head_dim set apart from hidden / heads; specs/sglang-llama.yaml too
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, tie_word_embeddings=False)),
    # hybrid, 3 Gated DeltaNet layers : 1 attention layer; specs/sglang-qwen3-next.yaml. K != V
    # in the linear attention, so that a transposed state cannot pass
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    # MLA with unequal head dims (qk_nope + rope 32, latent + rope 48, v 24), dense layers;
    # specs/sglang-deepseek-mla.yaml. Yarn of factor 1: SGLang's CPU rope wants a
    # rope_scaling (layers/rotary_embedding/factory.py:478)
    "deepseek-mla": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=1024,
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
            "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0})),
    # hybrid sliding-window (SGLang's SWAKVPool): sliding layers 0 and 2 with a 32-token
    # window, full 1 and 3, attention sinks, MoE; specs/sglang-swa.yaml
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
        layer_types=["sliding_attention", "full_attention"] * 2)),
}
# config.json keys SGLang 0.5.23 reads that transformers 5.19 does not save: Qwen3-Next's
# full_attention_interval (SGLang's configs/qwen3_next.py; transformers saves layer_types) and
# DeepSeek's moe_layer_freq (models/deepseek_v2.py `_is_layer_sparse`, even with no MoE layer)
CONFIG_FIXES = {"qwen3-next": {"full_attention_interval": 4},
                "deepseek-mla": {"moe_layer_freq": 1}}
# Note [Tiny GDN decay]: transformers initializes a Gated DeltaNet layer's decay rate A
# uniformly in (0, 16), so its state keeps e^-10 of a token after one step: a random model's
# GDN state then barely moves the logits (zeroing every slot before decode changed no greedy
# token; 0.004 of logits of std 0.16), and a wrong slot would pass unseen. With A in
# (0.01, 0.1) the state keeps most of its history, and a zeroed state changes 14-15 of 16
# tokens (measured 2026-12-03 with transformers). Trained Qwen3-Next layers learn slow decays.
WEIGHT_FIXES = {
    "qwen3-next": (
        "g = torch.Generator().manual_seed(1)\n"
        "for layer in model.model.layers:\n"
        "    gdn = getattr(layer, 'linear_attn', None)\n"
        "    if gdn is not None:\n"
        "        a = torch.empty(gdn.A_log.shape).uniform_(0.01, 0.1, generator=g)\n"
        "        gdn.A_log.data.copy_(a.log())\n"),
}
# Note [Seed families in float32]: the seed families' tiny models are served in float32
# (weights saved in bfloat16, computed and cached in float32; the specs bind the KV dtype to
# the server's). A random model's best two logits often lie within bfloat16's rounding: in
# bfloat16 the MLA model at 16 prompts came out 15/16 against its plain server through a PD
# pair with pdc's backend and with SGLang's own (another prompt each run, 14/16 over NIXL),
# though the plain server alone gives the same tokens at 1, 4 and 16 prompts in flight; and a
# plain bfloat16 TP-2 server is not token-identical to a TP-1 one (the all-reduce sums in
# another order; docs/sglang.md, "Heterogeneous TP"). float32 rounds 2^16 times finer: PD
# pairs at TP 1, TP 2 -> 1 and TP 1 -> 2 give the plain TP-1 server's tokens.
SEED_DTYPE = "float32"
# Server flags a family needs on SGLang's CPU path (docs/sglang.md, "Families"): the hybrid
# model's mamba radix cache needs state snapshots the CPU lacks (`mamba_hook.py:120`); MLA runs
# on the intel_amx backend (its ops are in the CPU shim), since torch_native reads the MHA-form
# prefill's K/V from a pool that holds latents
SERVER_ARGS: dict[str, tuple[str, ...]] = {
    "llama": (), "qwen3": (),
    "qwen3-next": ("--disable-radix-cache", "--dtype", SEED_DTYPE),
    "deepseek-mla": ("--attention-backend", "intel_amx", "--dtype", SEED_DTYPE),
    # GPT-OSS: intel_amx is the one CPU backend SGLang allows it (arg_groups/model_hook.py:538);
    # bfloat16, since its attention weights keep the config's dtype (models/gpt_oss.py:559)
    "gpt-oss": ("--attention-backend", "intel_amx"),
}


def served_dtype(family: str) -> str:
    """The --dtype a family's servers run (start_server's bfloat16 unless SERVER_ARGS says)."""
    args = SERVER_ARGS[family]
    return args[args.index("--dtype") + 1] if "--dtype" in args else "bfloat16"
