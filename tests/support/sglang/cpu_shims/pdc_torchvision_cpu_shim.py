"""Let the registry's CUDA-linked torchvision import beside a CPU-only torch (test support).

The registry has no CPU build of torchvision; 0.28.0 (the release matching torch 2.13.0) links
libc10_cuda.so, so its C extension does not load and `torchvision/_meta_registrations.py` then
fails on `register_fake("torchvision::nms")` because the op was never defined. SGLang imports
torchvision on its main import chain but its text-only paths never call torchvision's C++ ops.
This finder defines the two op schemas torchvision registers fakes for, right before torchvision
is first imported, and lets the normal finders load the real package. It is loaded at interpreter
start by `pdc_sglang_cpu_shims.pth` (installed with this folder by scripts/install-sglang.sh).
"""

import importlib.abc
import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


class _DefineTorchvisionOpsFirst(importlib.abc.MetaPathFinder):
    library = None

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision" or _DefineTorchvisionOpsFirst.library is not None:
            return None
        import torch

        library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _SCHEMAS:
            try:
                library.define(schema)
            except RuntimeError:  # already defined (a working torchvision build)
                pass
        _DefineTorchvisionOpsFirst.library = library  # the fragment lives as long as this
        return None


if not any(isinstance(f, _DefineTorchvisionOpsFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineTorchvisionOpsFirst())
