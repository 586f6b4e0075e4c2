"""Note [vLLM AMX attention]: pdc's vLLM general plugin has each vLLM process ask Linux for
AMX state and keeps vLLM's CPU attention on "vec" where it would pick "amx"
(integrations/vllm/cpu_attention.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from pdc.integrations.vllm import cpu_attention
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends import cpu_attn

# A fresh process: whether Linux lets it run AMX (arch_prctl ARCH_GET_XCOMP_PERM, the tile
# data bit) before and after the plugin, vLLM's pick for bf16 over 32-token blocks, and
# whether the plugin wrapped the pick.
FRESH = r"""
import ctypes, torch
from vllm.platforms import current_platform
from vllm.v1.attention.backends import cpu_attn
def permitted():
    mask = ctypes.c_uint64(0)
    ctypes.CDLL(None, use_errno=True).syscall(158, 0x1022, ctypes.byref(mask))
    return bool(mask.value & (1 << 18))
before = permitted()
from pdc.integrations.vllm import cpu_attention
cpu_attention.register()
print(before, permitted(), cpu_attn._get_attn_isa(torch.bfloat16, 32, 64),
      hasattr(cpu_attn._get_attn_isa, "pdc_wrapped"))
"""


def _fresh(keep: bool) -> str:
    env = dict(os.environ)
    env.pop(cpu_attention.KEEP_ENV, None)
    if keep:
        env[cpu_attention.KEEP_ENV] = "1"
    r = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def _original():
    return getattr(cpu_attn._get_attn_isa, "pdc_wrapped", cpu_attn._get_attn_isa)


def test_a_process_may_run_amx_after_the_plugin_and_its_attention_is_vec():
    if torch.cpu._is_amx_tile_supported():
        assert _fresh(keep=False) == "False True vec True"
        assert _fresh(keep=True) == "False False amx False"  # vLLM as it is
    else:
        assert _fresh(keep=False) == _fresh(keep=True)
        assert _fresh(keep=False).endswith(" False")


def test_vllm_loads_the_plugin_once():
    load_general_plugins()
    load_general_plugins()
    vllm_choice = _original()(torch.bfloat16, 32, 64)
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) == \
        ("vec" if vllm_choice == "amx" else vllm_choice)
    assert hasattr(cpu_attn._get_attn_isa, "pdc_wrapped") == torch.cpu._is_amx_tile_supported()
    assert not hasattr(_original(), "pdc_wrapped")


def test_the_wrapper_changes_amx_only():
    def pick(dtype, block_size, head_size=None):
        return {16: "vec16", 32: "amx", 64: "vec"}[block_size]

    wrapped = cpu_attention._vec_for_amx(pick)
    assert [wrapped(torch.bfloat16, b) for b in (16, 32, 64)] == ["vec16", "vec", "vec"]
    assert wrapped.pdc_wrapped is pick
