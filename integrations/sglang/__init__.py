"""pdc as an SGLang transfer backend: `--disaggregation-transfer-backend pdc`.

SGLang loads this through its plugin entry point (`sglang.srt.plugins`, declared in
pyproject.toml) in every process it starts; no SGLang file is changed. `register()`:
1. adds "pdc" to the CLI choices of `--disaggregation-transfer-backend`
   (`add_disagg_transfer_backend_choices`);
2. adds a PDC member to SGLang's closed `TransferBackend` enum;
3. AROUND-hooks `get_kv_class` through SGLang's HookRegistry (which also rebinds the
   `from ... import get_kv_class` copies) so that the pdc backend's name returns pdc's
   Manager, Sender, Receiver and bootstrap server (conn.py); every other backend is untouched;
4. AROUND-hooks `Scheduler.run_batch` and AFTER-hooks `RadixAttention.forward` for per-layer
   and early sends (layerwise.py), which act only on a prefill server of the pdc backend
   whose knobs ask for them;
5. AFTER-hooks prefill's `process_batch_result_disagg_prefill` to stream a request's first
   token right after its forward when the request asks (first_token.py, Note [SGLang first
   token from prefill]);
6. AFTER-hooks `Scheduler.on_idle` so that a turn that ran nothing while a pdc transfer is
   pending waits for the next event instead of turning again (idle_wait.py, Note [SGLang
   idle wait]).
See docs/sglang.md.
"""

from __future__ import annotations

NAME = "pdc"


def _extend_enum(enum_cls, member_name: str, value: str):
    """Add a member to a closed Enum (SGLang's TransferBackend has no registry)."""
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = object.__new__(enum_cls)
    member._name_ = member_name
    member._value_ = value
    member.__objclass__ = enum_cls
    enum_cls._member_map_[member_name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(member_name)
    type.__setattr__(enum_cls, member_name, member)
    return member


def register() -> None:
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils as du
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    _extend_enum(du.TransferBackend, "PDC", NAME)
    _cpu_fixes()

    def around_get_kv_class(original, transfer_backend, class_type):
        if getattr(transfer_backend, "value", transfer_backend) != NAME:
            return original(transfer_backend, class_type)
        from . import conn

        if class_type == du.KVClassType.KVARGS:
            from sglang.srt.disaggregation.base.conn import KVArgs

            return KVArgs
        return {
            du.KVClassType.MANAGER: conn.PdcKVManager,
            du.KVClassType.SENDER: conn.PdcKVSender,
            du.KVClassType.RECEIVER: conn.PdcKVReceiver,
            du.KVClassType.BOOTSTRAP_SERVER: conn.PdcKVBootstrapServer,
        }[class_type]

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", around_get_kv_class,
                          HookType.AROUND)
    from pdc.runtime import knobs

    if knobs.get("sglang_layer_send") or knobs.get("sglang_cached_send"):
        # only then: a hook on every attention layer's forward costs every server a call
        from .layerwise import register_hooks

        register_hooks()  # Note [SGLang per-layer sends]
    from . import first_token

    first_token.register_hooks()  # Note [SGLang first token from prefill]
    if knobs.get("sglang_idle_wait_us") > 0:
        from . import idle_wait

        idle_wait.register_hooks()  # Note [SGLang idle wait]


def _cpu_fixes() -> None:
    """On a machine without CUDA, keep SGLang's stock Mooncake sender off its pinned-memory
    index path (prefill.py: a pinned buffer and torch.cuda.Event), so that `--compare` can run
    SGLang's own backend beside pdc's on a CPU box. A class attribute; no file changes."""
    import torch

    if torch.cuda.is_available():
        return
    try:
        from sglang.srt.disaggregation.mooncake import conn as mooncake_conn
    except ImportError:  # Mooncake not installed: nothing to fix
        return
    mooncake_conn.MooncakeKVSender.supports_host_tensor_indices = False
