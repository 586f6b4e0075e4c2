"""The server flags of `pdc sglang-demo --dp N` and `--spec-decode`, and their refusals.

Note [Demo variants]: a variant is pure data built from the family and the flags before any
server starts; a combination SGLang cannot run here is refused then, with SGLang's reason,
and never half-started. `--dp N` runs both servers (and the plain reference server) with N
attention-DP groups of one rank each (`--tp N --dp N --enable-dp-attention`, the flags of
tests/integrations/test_sglang_dp.py). `--spec-decode` gives both servers the draft model
(prefill computes the draft state, decode speculates from it; the plain reference server
does not speculate, so the check also shows that speculation changed no greedy token): EAGLE
with a tiny random one-layer draft shaped like the target, or DeepSeek's MTP (NEXTN) with one
MTP layer in the target's own checkpoint. pdc's specs carry that state (Note [Draft
components] in runtime/binding.py: the `eagle` band of specs/sglang-llama.yaml, the `mtp` band
of specs/sglang-deepseek-mla.yaml).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from . import sglang_harness as H

# The flags of DP attention on the CPU besides --tp/--dp: SGLang turns on the TP LM-head
# all-to-all for a decode server of pure DP attention, whose collective has no CPU kernel
# (docs/sglang.md, "DP attention")
DP_FLAGS = ("--enable-dp-attention", "--no-enable-tp-lm-head-all-to-all")
_TORCH_NATIVE_DP = (
    "DP attention's batch padding asks the attention backend for "
    "get_cpu_graph_seq_len_fill_value (model_executor/forward_batch_info.py:2014, "
    "_pad_inputs_to_size), which torch_native, the family's CPU attention backend, lacks")
# Families SGLang 0.5.23 cannot serve with DP attention on a CPU, and why (measured
# 2026-12-03 for llama, 2026-12-04 for qwen3-next: the first forward fails); and anywhere
DP_REFUSED = {"llama": "SGLang's dense Llama does not gather the attention-DP groups' tokens "
                       "in its MLP"}
DP_REFUSED_ON_CPU = {
    "llama": _TORCH_NATIVE_DP + "; and " + DP_REFUSED["llama"],
    "qwen3": _TORCH_NATIVE_DP,
    "qwen3-next": _TORCH_NATIVE_DP.replace(
        "torch_native, the family's CPU attention backend, lacks",
        "the hybrid backend hands to its full-attention backend torch_native "
        "(layers/attention/hybrid_linear_attn_backend.py:1396), which lacks it"),
}


@dataclass(frozen=True)
class Draft:
    """The draft a family speculates with: SGLang's algorithm, the spec band that carries its
    state, and whether its weights live in the target's checkpoint (MTP)."""

    algorithm: str
    band: str
    spec: str
    in_target: bool


DRAFTS = {
    "llama": Draft("EAGLE", "eagle", "specs/sglang-llama.yaml", False),
    "qwen3": Draft("EAGLE", "eagle", "specs/sglang-llama.yaml", False),
    "deepseek-mla": Draft("NEXTN", "mtp", "specs/sglang-deepseek-mla.yaml", True),
}
# a short speculation: 2 draft steps of top-1, 3 tokens verified per decode step
SPEC_STEPS = ("--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "3")
_NO_SPEC_ON_CPU = (
    "SGLang 0.5.23 cannot run speculative decoding on a machine without CUDA: torch_native "
    "has no EAGLE draft backend (speculative/draft_utils.py:64), intel_amx's "
    "alloc_for_spec_decode calls the Triton kernel get_last_loc_triton "
    "(mem_cache/allocation.py:133) and Triton has no CPU driver, and at page size 1 the draft's "
    "cache locations need the CPU sglang-kernel op assign_draft_cache_locs_contiguous_cpu "
    "(kernels/ops/speculative/cache_locs.py:27-30), which has no build")
# On a GPU: SGLang's CUDA paths (the harness's CPU flags are overridden, the last flag wins),
# with SGLang's default memory layout (KV on the GPU, metadata on the host: docs/sglang.md,
# "GPU memory")
CUDA_ARGS = ("--device", "cuda", "--attention-backend", "triton")
CUDA_ENV = {"SGLANG_USE_CPU_ENGINE": "0"}


@dataclass(frozen=True)
class Refusal:
    message: str
    hint: str


@dataclass(frozen=True)
class Variant:
    """What `pdc sglang-demo` runs: the flags of the PD servers and of the plain reference
    server, their ranks, their environment and the draft (None: no speculation). DRAFT in a
    flag stands for the draft model's folder until `with_draft` fills it in."""

    family: str
    dp: int
    draft: Draft | None
    cuda: bool
    pd_args: tuple[str, ...]
    plain_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def tp(self) -> int:
        return self.dp

    def with_draft(self, path: str) -> Variant:
        return Variant(self.family, self.dp, self.draft, self.cuda,
                       tuple(path if a == "DRAFT" else a for a in self.pd_args),
                       self.plain_args, self.env)

    def label(self) -> str:
        parts = [f"--dp {self.dp} (tp {self.tp}, DP attention)"] if self.dp > 1 else []
        if self.draft is not None:
            parts.append(f"{self.draft.algorithm} speculative decoding (the {self.draft.band} "
                         f"band of {self.draft.spec})")
        return ", ".join(parts)


def plan_variant(family: str, dp: int = 1, spec_decode: bool = False,
                 cuda: bool = False) -> Variant | Refusal:
    """The variant of these flags, or why SGLang cannot run it here (Note [Demo variants])."""
    why = (DP_REFUSED if cuda else DP_REFUSED_ON_CPU).get(family) if dp > 1 else None
    if why is not None:
        return Refusal(
            f"--dp {dp}: SGLang 0.5.23 cannot run the tiny {family} with DP attention"
            f"{'' if cuda else ' on a CPU'}: {why}",
            "--family deepseek-mla runs DP attention on the CPU (its intel_amx backend); see "
            "docs/sglang.md, \"DP attention\"")
    draft = None
    if spec_decode:
        draft = DRAFTS.get(family)
        if draft is None:
            return Refusal(
                f"--spec-decode: specs/sglang-{family}.yaml declares no draft components, so "
                "pdc's backend refuses a speculating server of it",
                "--family llama or qwen3 (EAGLE, the eagle band of specs/sglang-llama.yaml) or "
                "deepseek-mla (MTP, the mtp band of specs/sglang-deepseek-mla.yaml)")
        if not cuda:
            return Refusal(
                f"--spec-decode: {_NO_SPEC_ON_CPU}",
                f"the layout (target and draft pools, the {draft.band} band of {draft.spec}, "
                "the draft's hidden row) is proven with SGLang's own pools for the tiny Llama "
                "with an EAGLE draft and the tiny DeepSeek MLA with an MTP layer: pytest "
                "tests/integrations/inside/test_speculative_pools.py under the SGLang "
                "environment's python (tests/integrations/test_sglang_inside.py runs it); on a "
                "CUDA machine the demo runs both PD servers with "
                + " ".join(spec_args(draft)).replace(
                    "DRAFT", "TARGET" if draft.in_target else "DRAFT"))
    base = H.SERVER_ARGS[family] + (CUDA_ARGS if cuda else ())
    if dp > 1:
        base += ("--dp", str(dp)) + DP_FLAGS
    env = tuple(CUDA_ENV.items()) if cuda else ()
    return Variant(family, dp, draft, cuda, base + (spec_args(draft) if draft else ()), base,
                   env)


def spec_args(draft: Draft) -> tuple[str, ...]:
    """The speculating servers' flags; DRAFT is the draft model's folder (the target's own for
    NEXTN, whose MTP layer is in the target's checkpoint)."""
    return ("--speculative-algorithm", draft.algorithm, "--speculative-draft-model-path",
            "DRAFT") + SPEC_STEPS


def cuda_machine() -> bool:
    """Whether this machine has an NVIDIA driver (no CUDA: no speculative decoding)."""
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


# The weights of a draft made like the tiny target (seed 1), in the SGLang env's transformers:
# EAGLE's draft is one Llama layer without its first input norm and no final norm, `fc` over
# [embedding, hidden], and an embedding and head (models/llama_eagle.py names them without
# "model."; SGLang's EAGLE worker may share the target's instead);
# NEXTN's MTP layer is layer `num_hidden_layers` of the target's checkpoint with enorm,
# hnorm, eh_proj and shared_head (models/deepseek_nextn.py).
_EAGLE = """
import json, sys, torch, pathlib
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(1)
cfg = LlamaConfig(**{config!r}, torch_dtype='bfloat16', bos_token_id=1, eos_token_id=2)
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
sd = {{k.removeprefix('model.'): v for k, v in m.state_dict().items()
      if k not in ('model.layers.0.input_layernorm.weight', 'model.norm.weight')}}
h = cfg.hidden_size
sd['fc.weight'] = (torch.randn(h, 2 * h) * 0.02).to(torch.bfloat16)
sd['fc.bias'] = torch.zeros(h, dtype=torch.bfloat16)
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
save_file({{k: v.contiguous() for k, v in sd.items()}}, str(out / 'model.safetensors'))
c = json.loads(cfg.to_json_string())
c['architectures'] = ['LlamaForCausalLMEagle']
(out / 'config.json').write_text(json.dumps(c, indent=2))
"""
_MTP = """
import json, sys, torch, pathlib
from safetensors.torch import load_file, save_file
out = pathlib.Path(sys.argv[1])
p = out / 'config.json'
c = json.loads(p.read_text())
n, h, v = c['num_hidden_layers'] - 1, c['hidden_size'], c['vocab_size']
c['num_hidden_layers'], c['num_nextn_predict_layers'] = n, 1
p.write_text(json.dumps(c, indent=2))
files = sorted(out.glob('*.safetensors'))
sd = {}
for f in files:
    sd.update(load_file(str(f)))
    f.unlink()
g = torch.Generator().manual_seed(1)
extra = {'enorm.weight': torch.ones(h), 'hnorm.weight': torch.ones(h),
         'eh_proj.weight': torch.randn(h, 2 * h, generator=g) * 0.02,
         'shared_head.norm.weight': torch.ones(h),
         'shared_head.head.weight': torch.randn(v, h, generator=g) * 0.02}
for k, t in extra.items():
    sd[f'model.layers.{n}.{k}'] = t.to(torch.bfloat16)
(out / 'model.safetensors.index.json').unlink(missing_ok=True)
save_file({k: t.contiguous() for k, t in sd.items()}, str(out / 'model.safetensors'))
"""


def make_models(python: str, workdir: str, variant: Variant) -> tuple[str, Variant]:
    """The tiny target model and the variant with its draft's folder filled in."""
    family, draft = variant.family, variant.draft
    target = f"{workdir}/tiny-{family}"
    if draft is None:
        return H.make_tiny_model(python, target, family), variant
    if not draft.in_target:
        H.make_tiny_model(python, target, family)
        path = f"{workdir}/draft-{family}"
        # EAGLE's draft is a Llama layer in the target's attention shape
        config = dict(H.TINY_MODELS[family][2], num_hidden_layers=1)
        _run(python, _EAGLE.format(config=config), path)
        return target, variant.with_draft(path)
    # MTP: one more layer than the target (a MoE layer past first_k_dense_replace, as SGLang
    # builds the NextN layer), then declared as the MTP layer
    layers = H.TINY_MODELS[family][2]["num_hidden_layers"]
    H.make_tiny_model(python, target, family, {"num_hidden_layers": layers + 1})
    _run(python, _MTP, target)
    return target, variant.with_draft(target)


def _run(python: str, code: str, path: str) -> None:
    done = subprocess.run([python, "-c", code, path], capture_output=True, text=True,
                          timeout=300)
    if done.returncode:
        raise H.HarnessError(f"could not write the draft model {path}:\n{done.stderr[-2000:]}")
