"""SGLang module attributes rebound after import, for a CPU without AMX (test support).

SGLang 0.5.23 sends three hybrid-model (Qwen3-Next) paths to Triton whenever the CPU lacks
AMX, and Triton has no CPU driver ("0 active drivers"):
- `kernels/ops/attention/fla/fused_norm_gate.py:20` and `layernorm_gated.py:35` set
  `_use_cpu = is_cpu() and cpu_has_amx_support()`; the CPU branch calls
  `torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu`, which this shim provides, so `_use_cpu` is
  set to True;
- `models/qwen2_moe.py` imports the Triton-only `fused_gate_sigmoid_mul(_add)`
  (`kernels/ops/elementwise/elementwise.py`) by name for the shared-expert gate; the names
  are rebound to torch versions (gdn.gate_sigmoid_mul*).
And one for MLA: `--attention-backend intel_amx` falls back to torch_native on a CPU without
AMX (`arg_groups/overrides.py:1301` `_attention_backend_platform_fallbacks`, run by name from
`arg_groups/attention_hook.py:272`), because the real
kernels need AMX; this shim implements that backend's two ops in torch (attention.py), so the
fallback is lifted for intel_amx (the pass still runs for every other backend).

A meta-path finder wraps the loader of exactly these modules and sets the attributes right
after the module body ran; no SGLang file is changed, and every other import is untouched.
It is installed at interpreter start by `pdc_sglang_cpu_shims.pth` (server arguments are
resolved before anything imports sgl_kernel) and imports nothing heavy until a module it
rebinds is imported.
"""

from __future__ import annotations

import importlib.abc
import sys


def _gdn(name):
    def call(*args):
        from sgl_kernel import gdn

        return getattr(gdn, name)(*args)

    call.__name__ = name
    return call


REBINDS = {
    "sglang.kernels.ops.attention.fla.fused_norm_gate": {"_use_cpu": True},
    "sglang.kernels.ops.attention.fla.layernorm_gated": {"_use_cpu": True},
    "sglang.srt.models.qwen2_moe": {
        "fused_gate_sigmoid_mul": _gdn("gate_sigmoid_mul"),
        "fused_gate_sigmoid_mul_add": _gdn("gate_sigmoid_mul_add"),
    },
}


def _keep_intel_amx_attention(module) -> None:
    """Wrap the fallback pass where SGLang keeps it: the module attribute (which
    `arg_groups/attention_hook.py` imports by name) and the registry list."""
    name = "_attention_backend_platform_fallbacks"
    original = getattr(module, name)

    def fallbacks_except_intel_amx(view):
        if view.attention_backend == "intel_amx" and view.device == "cpu":
            return {}
        return original(view)

    fallbacks_except_intel_amx.__name__ = name
    setattr(module, name, fallbacks_except_intel_amx)
    passes = module.POST_PROCESS_PASSES
    passes[:] = [fallbacks_except_intel_amx if fn is original else fn for fn in passes]


REBINDS["sglang.srt.arg_groups.overrides"] = {}
AFTER_IMPORT = {"sglang.srt.arg_groups.overrides": _keep_intel_amx_attention}


def _rebind(module) -> None:
    for name, value in REBINDS[module.__name__].items():
        setattr(module, name, value)
    if module.__name__ in AFTER_IMPORT:
        AFTER_IMPORT[module.__name__](module)


class _RebindAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in REBINDS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_rebind(module):
            exec_module(module)
            _rebind(module)

        spec.loader.exec_module = exec_and_rebind
        return spec


def install() -> None:
    """Rebind in modules already imported, and in the others when they are."""
    for name in REBINDS:
        if name in sys.modules:
            _rebind(sys.modules[name])
    if not any(isinstance(f, _RebindAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RebindAfterImport())
