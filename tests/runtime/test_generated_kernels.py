"""The generated kernels modules against the host staged path, on real plan segments.

For a head-sliced link (decode tp 1 reading two prefill tp ranks) the generated Triton gather
(interpreter on CPU) must pack exactly what pdc.runtime.staging.gather packs, and the
generated scatter must unpack it into exactly the bytes staging.scatter writes.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdc.runtime import staging  # noqa: E402

from ..compiler.planning import ROOT, plan_for  # noqa: E402


@pytest.mark.parametrize("spec,family,component,prefill,decode", [
    ("llama3-70b", "llama3_70b", "kv", {"tp": 2}, {"tp": 1}),
    ("qwen38", "qwen38", "gdn_conv", {"tp": 1}, {"tp": 2}),
])
def test_generated_gather_scatter_match_the_host_path(spec, family, component, prefill, decode):
    kernels = importlib.import_module(f"pdc.generated.{family}.kernels")
    _, plan = plan_for(ROOT / "specs" / f"{spec}.yaml", prefill, decode)
    link = plan.links[-1]
    entry = next(e for e in link.entries if e.component == component)
    rng = np.random.default_rng(0)
    cap, ids = 6, np.array([4, 1, 3])
    src = rng.integers(0, 256, (cap, entry.src_item_bytes), dtype=np.uint8)
    dst_np = np.full((cap, entry.dst_item_bytes), 0xAB, np.uint8)
    dst_t = torch.from_numpy(dst_np.copy())
    src_specs = kernels.segment_specs(entry.segments, entry.src_item_bytes, "src")
    dst_specs = kernels.segment_specs(entry.segments, entry.dst_item_bytes, "dst")
    for seg, s_spec, d_spec in zip(entry.segments, src_specs, dst_specs, strict=True):
        want = np.zeros(len(ids) * seg.total_bytes, np.uint8)
        staging.gather(src, ids, seg, want)
        got = torch.full((len(ids) * seg.total_bytes,), 0xAB, dtype=torch.uint8)
        kernels.gather(component, [kernels.Entry(torch.from_numpy(src), s_spec)],
                       torch.from_numpy(ids), got)
        assert np.array_equal(got.numpy(), want)
        staging.scatter(dst_np, ids, seg, want)
        kernels.scatter(component, [kernels.Entry(dst_t, d_spec)], torch.from_numpy(ids), got)
    assert np.array_equal(dst_t.numpy(), dst_np)
    assert kernels.ALIGN[component] == 16
