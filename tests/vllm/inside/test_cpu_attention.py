"""Note [vLLM AMX attention]: pdc's vLLM general plugin keeps vLLM's CPU attention off its
AMX kernel (integrations/vllm/cpu_attention.py)."""

from __future__ import annotations

import torch
from pdc.integrations.vllm import cpu_attention
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends import cpu_attn


def _original():
    return getattr(cpu_attn._get_attn_isa, "pdc_wrapped", cpu_attn._get_attn_isa)


def test_vllm_loads_the_plugin_and_picks_no_amx_attention():
    load_general_plugins()
    # bf16 with 32-token blocks and head size 64: the case vLLM runs on "amx" where it can
    vllm_choice = _original()(torch.bfloat16, 32, 64)
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) == \
        ("vec" if vllm_choice == "amx" else vllm_choice)
    if torch.cpu._is_amx_tile_supported():
        assert _original()(torch.bfloat16, 32, 64) == "amx"
        assert hasattr(cpu_attn._get_attn_isa, "pdc_wrapped")


def test_the_wrapper_changes_amx_only():
    def pick(dtype, block_size, head_size=None):
        return {16: "vec16", 32: "amx", 64: "vec"}[block_size]

    wrapped = cpu_attention._vec_for_amx(pick)
    assert [wrapped(torch.bfloat16, b) for b in (16, 32, 64)] == ["vec16", "vec", "vec"]
    assert wrapped.pdc_wrapped is pick


def test_the_environment_keeps_vllm_s_choice(monkeypatch):
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", _original())
    monkeypatch.setenv(cpu_attention.KEEP_ENV, "1")
    cpu_attention.register()
    assert not hasattr(cpu_attn._get_attn_isa, "pdc_wrapped")
    monkeypatch.delenv(cpu_attention.KEEP_ENV)
    cpu_attention.register()
    assert hasattr(cpu_attn._get_attn_isa, "pdc_wrapped") == torch.cpu._is_amx_tile_supported()
    cpu_attention.register()  # loaded twice: wrapped once
    assert cpu_attn._get_attn_isa is _original() or \
        not hasattr(cpu_attn._get_attn_isa.pdc_wrapped, "pdc_wrapped")
