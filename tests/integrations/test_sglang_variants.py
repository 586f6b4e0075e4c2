"""`pdc sglang-demo --dp N` and `--spec-decode` (no SGLang needed): the servers' flags each
variant builds (Note [Demo variants] in pdc/serving/sglang_variants.py), and the refusals of
what SGLang cannot run on this machine, given before any server starts, exact messages."""

from __future__ import annotations

import pytest

from pdc.cli import main
from pdc.serving import sglang_variants as V
from pdc.serving.sglang_variants import Refusal, Variant, plan_variant

MLA = ("--attention-backend", "intel_amx", "--dtype", "float32")
DP2 = ("--dp", "2", "--enable-dp-attention", "--no-enable-tp-lm-head-all-to-all")
STEPS = ("--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "3")
CUDA = ("--device", "cuda", "--attention-backend", "triton")
CUDA_ENV = (("SGLANG_USE_CPU_ENGINE", "0"),)
TORCH_NATIVE = (
    "DP attention's batch padding asks the attention backend for "
    "get_cpu_graph_seq_len_fill_value (model_executor/forward_batch_info.py:2014, "
    "_pad_inputs_to_size), which ")
DP_HINT = ("--family deepseek-mla runs DP attention on the CPU (its intel_amx backend); see "
           "docs/sglang.md, \"DP attention\"")
NO_SPEC = (
    "--spec-decode: SGLang 0.5.23 cannot run speculative decoding on a machine without CUDA: "
    "torch_native has no EAGLE draft backend (speculative/draft_utils.py:64), intel_amx's "
    "alloc_for_spec_decode calls the Triton kernel get_last_loc_triton "
    "(mem_cache/allocation.py:133) and Triton has no CPU driver, and at page size 1 the "
    "draft's cache locations need the CPU sglang-kernel op "
    "assign_draft_cache_locs_contiguous_cpu (kernels/ops/speculative/cache_locs.py:27-30), "
    "which has no build")


def spec_hint(band: str, spec: str, algorithm: str, path: str) -> str:
    return (f"the layout (target and draft pools, the {band} band of {spec}, the draft's "
            "hidden row) is proven with SGLang's own pools for the tiny Llama with an EAGLE "
            "draft and the tiny DeepSeek MLA with an MTP layer: pytest "
            "tests/integrations/inside/test_speculative_pools.py under the SGLang "
            "environment's python (tests/integrations/test_sglang_inside.py runs it); on a "
            "CUDA machine the demo runs both PD servers with --speculative-algorithm "
            f"{algorithm} --speculative-draft-model-path {path} " + " ".join(STEPS))


def test_dp_2_runs_two_attention_dp_groups_of_one_rank_on_every_server():
    v = plan_variant("deepseek-mla", dp=2)
    assert v == Variant("deepseek-mla", 2, None, False, MLA + DP2, MLA + DP2)
    assert (v.tp, v.label()) == (2, "--dp 2 (tp 2, DP attention)")


def test_the_plain_variant_is_the_familys_cpu_flags():
    assert plan_variant("qwen3-next") == Variant(
        "qwen3-next", 1, None, False, ("--disable-radix-cache", "--dtype", "float32"),
        ("--disable-radix-cache", "--dtype", "float32"))
    assert (plan_variant("llama").tp, plan_variant("llama").label()) == (1, "")


@pytest.mark.parametrize(("family", "why"), [
    ("llama", TORCH_NATIVE + "torch_native, the family's CPU attention backend, lacks; and "
     "SGLang's dense Llama does not gather the attention-DP groups' tokens in its MLP"),
    ("qwen3", TORCH_NATIVE + "torch_native, the family's CPU attention backend, lacks"),
    ("qwen3-next", TORCH_NATIVE + "the hybrid backend hands to its full-attention backend "
     "torch_native (layers/attention/hybrid_linear_attn_backend.py:1396), which lacks it"),
])
def test_dp_attention_of_a_torch_native_family_is_refused_on_a_cpu(family, why):
    assert plan_variant(family, dp=2) == Refusal(
        f"--dp 2: SGLang 0.5.23 cannot run the tiny {family} with DP attention on a CPU: {why}",
        DP_HINT)
    on_cuda = plan_variant(family, dp=2, cuda=True)
    if family == "llama":
        assert on_cuda == Refusal(
            "--dp 2: SGLang 0.5.23 cannot run the tiny llama with DP attention: SGLang's dense "
            "Llama does not gather the attention-DP groups' tokens in its MLP", DP_HINT)
    else:
        assert isinstance(on_cuda, Variant) and on_cuda.tp == 2


def test_spec_decode_is_refused_without_cuda_naming_sglangs_causes_and_the_pool_test():
    assert plan_variant("llama", spec_decode=True) == Refusal(
        NO_SPEC, spec_hint("eagle", "specs/sglang-llama.yaml", "EAGLE", "DRAFT"))
    assert plan_variant("deepseek-mla", dp=2, spec_decode=True) == Refusal(
        NO_SPEC, spec_hint("mtp", "specs/sglang-deepseek-mla.yaml", "NEXTN", "TARGET"))


def test_spec_decode_of_a_family_without_a_draft_band_is_refused_everywhere():
    for cuda in (False, True):
        assert plan_variant("qwen3-next", spec_decode=True, cuda=cuda) == Refusal(
            "--spec-decode: specs/sglang-qwen3-next.yaml declares no draft components, so "
            "pdc's backend refuses a speculating server of it",
            "--family llama or qwen3 (EAGLE, the eagle band of specs/sglang-llama.yaml) or "
            "deepseek-mla (MTP, the mtp band of specs/sglang-deepseek-mla.yaml)")


def test_spec_decode_on_cuda_gives_both_pd_servers_the_draft_and_the_plain_server_none():
    v = plan_variant("llama", spec_decode=True, cuda=True).with_draft("/m/draft")
    assert v.pd_args == CUDA + ("--speculative-algorithm", "EAGLE",
                                "--speculative-draft-model-path", "/m/draft") + STEPS
    assert (v.plain_args, v.env, v.tp) == (CUDA, CUDA_ENV, 1)
    assert v.label() == ("EAGLE speculative decoding (the eagle band of "
                         "specs/sglang-llama.yaml)")
    mtp = plan_variant("deepseek-mla", dp=2, spec_decode=True, cuda=True)
    assert mtp.draft == V.Draft("NEXTN", "mtp", "specs/sglang-deepseek-mla.yaml", True)
    assert mtp.with_draft("/m/target").pd_args == MLA + CUDA + DP2 + (
        "--speculative-algorithm", "NEXTN", "--speculative-draft-model-path",
        "/m/target") + STEPS
    assert mtp.plain_args == MLA + CUDA + DP2


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_refuses_before_looking_for_sglang(capsys, monkeypatch):
    monkeypatch.setenv("PDC_SGLANG_PYTHON", "/nonexistent/python")  # never reached
    monkeypatch.setattr(V, "cuda_machine", lambda: False)
    assert run(capsys, "sglang-demo", "--family", "qwen3", "--dp", "2") == (
        1, "", f"pdc sglang-demo: error: --dp 2: SGLang 0.5.23 cannot run the tiny qwen3 with "
        f"DP attention on a CPU: {TORCH_NATIVE}torch_native, the family's CPU attention "
        f"backend, lacks\n  hint: {DP_HINT}\n")
    assert run(capsys, "sglang-demo", "--spec-decode") == (
        1, "", f"pdc sglang-demo: error: {NO_SPEC}\n  hint: "
        + spec_hint("eagle", "specs/sglang-llama.yaml", "EAGLE", "DRAFT") + "\n")
    assert run(capsys, "sglang-demo", "--dp", "9") == (
        2, "", "pdc sglang-demo: error: --dp is 9\n  hint: give --dp from 1 to 8\n")


def test_dp_groups_reads_which_groups_pdcs_managers_registered_under(tmp_path):
    line = ("[DP{g} TP{g}] pdc SGLang backend: {side} DeepseekV3ForCausalLM rank pp0.tp0, "
            "family sglang-deepseek-mla (specs/sglang-deepseek-mla.yaml) bound to 2 layers, "
            "pages of 16 tokens, KV float32, engine mooncake on host memory, attention-DP "
            "group {g} of 2\n")
    (tmp_path / "pdc-mooncake-tp2to2-prefill.log").write_text(
        line.format(g=1, side="prefill") + line.format(g=0, side="prefill"))
    (tmp_path / "pdc-mooncake-tp2to2-decode.log").write_text(line.format(g=0, side="decode"))
    from pdc.serving.sglang_demo import dp_groups

    assert dp_groups(str(tmp_path), 2) == ("pdc's managers registered on prefill groups 0, 1 "
                                           "of 2 and decode groups 0 of 2")
    assert dp_groups(str(tmp_path), 3).endswith("decode groups none of 3")


def _names(python: str, path: str) -> list[str]:
    import json as _json
    import subprocess

    code = ("import json, sys; from safetensors import safe_open\n"
            "f = safe_open(sys.argv[1] + '/model.safetensors', 'pt')\n"
            "print(json.dumps(sorted(f.keys())))")
    out = subprocess.run([python, "-c", code, path], capture_output=True, text=True, check=True)
    return _json.loads(out.stdout)


@pytest.mark.sglang
@pytest.mark.skipif(V.H.sglang_python() is None, reason="no SGLang environment: run "
                    "scripts/install-sglang.sh (CI does)")
def test_the_drafts_are_made_like_the_tiny_targets(tmp_path):
    import json

    python = V.H.sglang_python()
    target, v = V.make_models(python, str(tmp_path / "eagle"),
                              plan_variant("llama", spec_decode=True, cuda=True))
    draft = v.pd_args[v.pd_args.index("--speculative-draft-model-path") + 1]
    assert draft == str(tmp_path / "eagle" / "draft-llama")
    config = json.loads((tmp_path / "eagle" / "draft-llama" / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["hidden_size"],
            config["num_key_value_heads"]) == (["LlamaForCausalLMEagle"], 1, 64, 2)
    layer = [f"layers.0.{n}.weight" for n in (
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm",
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")]
    assert _names(python, draft) == ["embed_tokens.weight", "fc.bias", "fc.weight", *layer,
                                     "lm_head.weight"]
    target, v = V.make_models(python, str(tmp_path / "mtp"),
                              plan_variant("deepseek-mla", spec_decode=True, cuda=True))
    assert v.pd_args[v.pd_args.index("--speculative-draft-model-path") + 1] == target
    config = json.loads((tmp_path / "mtp" / "tiny-deepseek-mla" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (2, 1)
    mtp = {n.removeprefix("model.layers.2.") for n in _names(python, target)
           if n.startswith("model.layers.2.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight", "self_attn.kv_a_proj_with_mqa.weight",
            "mlp.gate.weight"} <= mtp
