"""Transfer engines, looked up by name.

Importing this package imports no engine library: each entry of ENGINES names a module and a
class, and the module (and with it Mooncake or NIXL) is imported only when that engine is
made. That keeps `import pdc.runtime` cheap and working on machines with only one engine
installed.
"""

from __future__ import annotations

import importlib

from .base import (
    Batch,
    BatchState,
    DescriptorError,
    TransferEngine,
    TransferError,
)

# name -> (module relative to this package, class name)
ENGINES: dict[str, tuple[str, str]] = {
    "mooncake": (".mooncake", "MooncakeEngine"),
    "nixl": (".nixl", "NixlEngine"),
    "local": (".local", "LocalEngine"),
    "cuda_ipc": (".cuda_ipc", "CudaIpcEngine"),
}

# Note [Device engines]: an engine whose device memory takes other code than its host memory
# has a second class, listed here; `device=` picks it. This is the one place that chooses
# between them (an engine's constructor never returns another class). Engines not listed here
# take `device=` as an argument of their one class (Mooncake, NIXL, CUDA IPC).
DEVICE_ENGINES: dict[str, tuple[str, str]] = {
    "local": (".local_device", "LocalDeviceEngine"),
}


def engine_class(name: str, device: object = None) -> type[TransferEngine]:
    """The engine class registered under name (its device class when `device` is given and it
    has one, Note [Device engines]); imports its module (and library) now."""
    try:
        module_name, class_name = ENGINES[name]
    except KeyError:
        known = ", ".join(sorted(ENGINES))
        raise ValueError(f"unknown transfer engine {name!r}; known engines: {known}") from None
    if device is not None and name in DEVICE_ENGINES:
        module_name, class_name = DEVICE_ENGINES[name]
    module = importlib.import_module(module_name, __name__)
    return getattr(module, class_name)


def plan_backend(name: str) -> str:
    """The backend a plan for the engine `name` is lowered for (Note [Plan backend])."""
    cls = engine_class(name)
    return cls.plan_backend or cls.name


def make_engine(name: str, **kwargs: object) -> TransferEngine:
    """Constructs the engine registered under name with the engine's own keyword arguments;
    `device=` (None: host memory) selects a device class where there is one."""
    if name in DEVICE_ENGINES and kwargs.get("device", 0) is None:
        del kwargs["device"]  # the host class takes no device
    return engine_class(name, kwargs.get("device"))(**kwargs)


__all__ = [
    "DEVICE_ENGINES",
    "ENGINES",
    "Batch",
    "BatchState",
    "DescriptorError",
    "TransferEngine",
    "TransferError",
    "engine_class",
    "make_engine",
    "plan_backend",
]
