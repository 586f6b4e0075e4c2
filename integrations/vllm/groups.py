"""vLLM's KV cache groups as pdc sees them: which group's blocks are the family's pages and
which group's block is a request's state slot (Note [vLLM hybrid cache] in worker.py).

A model without state layers has one group (its attention layers): pages are group 0 and
there is no slot. A hybrid model under vLLM's hybrid KV cache manager has an attention group
and a state group (GDN or Mamba layers, `MambaSpec`); the state group's one block per request
is the slot of the family's slot components. Layouts pdc does not describe are refused at
engine start, naming what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from .settings import SettingsError


@dataclass(frozen=True)
class CacheGroups:
    page: int = 0  # the group whose blocks are the page component's items
    slot: int | None = None  # the state group: its block per request is the slot
    # state layer name -> its states in block order: (shape, torch dtype) of each
    states: dict = field(default_factory=dict)

    @classmethod
    def of(cls, kv_cache_config, vllm_config) -> CacheGroups:
        if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) <= 1:
            return cls()
        from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

        pages, slots, other = [], [], []
        for i, g in enumerate(kv_cache_config.kv_cache_groups):
            spec = g.kv_cache_spec
            if isinstance(spec, MambaSpec):
                slots.append(i)
            elif isinstance(spec, AttentionSpec) and getattr(spec, "sliding_window",
                                                             None) is None:
                pages.append(i)
            else:
                other.append(f"group {i} ({type(spec).__name__})")
        groups = kv_cache_config.kv_cache_groups
        if other or len(pages) != 1 or len(slots) != 1:
            found = ", ".join(f"group {i} ({type(g.kv_cache_spec).__name__}, "
                              f"{len(g.layer_names)} layers)" for i, g in enumerate(groups))
            raise SettingsError(
                f"PdcConnector moves one full-attention KV cache group and at most one state "
                f"(GDN/Mamba) group; vLLM made {found}\n  hint: pdc's vLLM hybrid families "
                f"have as many state layers as attention layers (vLLM then makes one group "
                f"of each); see docs/vllm.md, \"Hybrid families\"")
        spec = groups[slots[0]].kv_cache_spec
        mode = vllm_config.cache_config.mamba_cache_mode
        if mode != "none":
            raise SettingsError(
                f"PdcConnector moves one state block per request, but vLLM keeps "
                f"mamba_cache_mode {mode!r} (a state block per cached prefix block)\n"
                f"  hint: start a hybrid engine with enable_prefix_caching=False "
                f"(mamba_cache_mode 'none')")
        if spec.num_speculative_blocks:
            raise SettingsError(
                f"PdcConnector moves one state block per request, but vLLM keeps "
                f"{spec.num_speculative_blocks} speculative state blocks per request\n"
                f"  hint: start a hybrid engine without speculative decoding")
        states = {name: tuple(zip(spec.shapes, spec.dtypes, strict=True))
                  for name in groups[slots[0]].layer_names}
        return cls(pages[0], slots[0], states)

    def slot_of(self, per_group) -> int:
        """A request's state block (its slot), or -1 without a state group."""
        if self.slot is None:
            return -1
        blocks = per_group[self.slot]
        return int(blocks[-1]) if blocks else -1

    def state_views(self, name: str, pages) -> list:
        """The states of state layer `name` as views of vLLM's `[blocks, 1, 1, bytes]` int8
        page tensor, one `[blocks, *shape]` view per state, packed from each block's start
        in the state group's order (how vLLM's state layers unpack their block)."""
        import torch

        flat = pages.reshape(pages.shape[0], -1)
        out, at = [], 0
        for shape, dtype in self.states[name]:
            nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
            out.append(flat[:, at:at + nbytes].view(dtype).view(-1, *shape))
            at += nbytes
        return out
