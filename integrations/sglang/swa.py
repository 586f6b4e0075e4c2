"""SGLang's sliding-window pool (SWAKVPool) as the spec's window component.

Note [SGLang SWA pools]: SGLang 0.5.23 serves an architecture as hybrid SWA when
`configs/model_config.py` `is_hybrid_swa_model` says so (GptOssForCausalLM, Gemma 4, ...;
`--disable-hybrid-swa-memory` turns it off) and then keeps its layers in two pools
(`mem_cache/swa_memory_pool.py` SWAKVPool): the full-attention layers' paged MHA pool goes in
`kv_data_ptrs` as the KV (K of every full layer, then V; `build_kv_layer_ids` names no layer
for it, so its buffers are the spec's KV layers in order), and the sliding layers' own paged
MHA pool, with a smaller page space of its own, goes in KVArgs as the state component "swa"
(disaggregation/utils.py `setup_state_kv_args`: `get_state_buf_infos`, K of every sliding
layer, then V; `swa_kv_cache_layout` its element order). Its entry of `state_indices`, sent
with the last chunk, is a request's second page list: the SWA pages of the window only,
tokens from max(decode's prefix, seq_len - sliding window) floored to a page, to seq_len
(`_swa_payload` of disaggregation/prefill.py and decode.py; each side computes its own). The
spec declares that pool as one window-indexed component (`index: {window: sliding_window}`,
`on_prefix_hit: skip`: specs/sglang-swa.yaml), and pdc carries the two lists as
window_page_ids (Note [Window pages] in pdc/runtime/indices.py), paired position by position.
At start the backend checks what SGLang decides from the same config.json against the bound
spec: the window (SGLang reads `sliding_window_size`, else `sliding_window`, else
`window_size`: ModelConfig._get_sliding_window_size), the split into sliding and full layers
(its own `get_hybrid_layer_ids`), the buffer counts and the NHD element order; each mismatch
is refused naming both sides. The MXFP8 block scales ("block_scale_swa") are refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace

from pdc.runtime.layout_types import FamilyLayout

from .regions import RefusedModel, Region, state_entry

WHERE = "state type 'swa': SWAKVPool's sliding-window layers, a page space of their own"
WINDOW_KEYS = ("sliding_window_size", "sliding_window", "window_size")  # SGLang's order


def window_component(layout: FamilyLayout | None):
    """The spec's window-indexed component (SGLang's SWA pool), None without one."""
    if layout is None:
        return None
    return next((c for c in layout.components if c.index == "window"), None)


def swa_buffers_of(kv_args, i: int, layout: FamilyLayout | None, locate
                   ) -> dict[tuple[str, str, int], Region]:
    """KVArgs' state component `i` (type "swa") as (component, tensor, layer id) -> region:
    K of every sliding layer, then V, the layers in the component's order."""
    ptrs, lens = list(kv_args.state_data_ptrs[i]), list(kv_args.state_data_lens[i])
    items = list(kv_args.state_item_lens[i])
    comp = window_component(layout)
    if comp is None:
        name = "no spec" if layout is None else \
            f"{layout.family} declares no window-indexed component ({layout.spec_path})"
        raise RefusedModel(
            f"pdc: SGLang registered {len(ptrs)} sliding-window KV buffers ({WHERE}), but "
            f"{name}; hint: serve it with a spec whose window component takes them "
            "(specs/sglang-swa.yaml)")
    order = getattr(kv_args, "swa_kv_cache_layout", None) or "nhd"
    if order != "nhd":
        raise RefusedModel(
            f"pdc: SGLang's sliding-window pool is laid out {order!r} "
            f"(KVArgs.swa_kv_cache_layout), but {layout.family}'s {comp.name} ({comp.loc}) "
            "holds token-major pages [page_size, kv_heads, head_dim] ('nhd'), sharded by KV "
            "head; hint: serve without SGLANG_USE_HND_KVCACHE")
    ids, tensors = list(comp.layer_ids), list(comp.tensors)
    if len(ptrs) != len(ids) * len(tensors):
        raise RefusedModel(
            f"pdc: SGLang registered {len(ptrs)} sliding-window KV buffers ({WHERE}), "
            f"{layout.family}'s {comp.name} ({comp.loc}) takes {len(ids) * len(tensors)} "
            f"({', '.join(tensors)} of sliding layers {ids})")
    out = {}
    for j, (ptr, nbytes, item) in enumerate(zip(ptrs, lens, items, strict=True)):
        tensor, layer = tensors[j // len(ids)], ids[j % len(ids)]
        out[(comp.name, tensor, layer)] = Region(
            int(ptr), int(nbytes), int(item),
            f"SGLang's sliding-window {tensor.upper()} buffer of layer {layer}",
            locate(int(ptr)))
    return out


def check_registered(types: list[str], layout: FamilyLayout | None) -> None:
    """A spec whose window component holds layers needs SGLang's "swa" state component."""
    comp = window_component(layout)
    if comp is None or not comp.layer_ids or "swa" in types:
        return
    raise RefusedModel(
        f"pdc: {layout.family}'s {comp.name} ({comp.loc}) holds the window pages of sliding "
        f"layers {list(comp.layer_ids)}, but SGLang registered no sliding-window pool (state "
        "type 'swa'): it keeps every layer in one pool unless it serves the architecture as "
        "hybrid SWA (configs/model_config.py is_hybrid_swa_model) without "
        "--disable-hybrid-swa-memory; hint: serve it with the hybrid SWA pool, or with a spec "
        "without a window component")


def sglang_window(config: dict) -> tuple[str, int] | None:
    """(config key, tokens) of the sliding window SGLang reads from the served config."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in WINDOW_KEYS:
        if text.get(key) is not None:
            return key, int(text[key])
    return None


def check_served(layout: FamilyLayout, config: dict, split=None) -> None:
    """The bound spec's window and layer split against SGLang's reading of the served config
    (Note [SGLang SWA pools]); `split` is (sliding ids, full ids), SGLang's own by default."""
    comp = window_component(layout)
    if comp is None:
        return
    window = sglang_window(config)
    if window is not None and window[1] != comp.window_tokens:
        raise RefusedModel(
            f"pdc: {layout.family}'s {comp.name} ({comp.loc}) moves the pages of the last "
            f"{comp.window_tokens} tokens, but SGLang's sliding window is {window[1]} tokens "
            f"(config.json {window[0]}), the window whose SWA pages it sends; hint: bind the "
            f"component's window to config.{window[0]}")
    if split is None:
        split = _sglang_split(config)
    if split is None:
        return
    sliding, full = sorted(split[0]), sorted(split[1])
    kv = [c for c in layout.components if c.index == "page"]
    spec_full = sorted({i for c in kv for i in c.layer_ids if i not in layout.draft_ids})
    if list(comp.layer_ids) != sliding or spec_full != full:
        raise RefusedModel(
            f"pdc: {layout.family} ({layout.spec_path}) holds sliding-window layers "
            f"{list(comp.layer_ids)} ({comp.name}) and full-attention layers {spec_full}, but "
            f"SGLang splits the served model into sliding {sliding} and full {full} "
            "(configs/model_config.py get_hybrid_layer_ids); hint: bind the layer kinds to "
            "the config's layer_types (`layers: {from: config.layer_types, names: ...}`)")


def _sglang_split(config: dict) -> tuple[list[int], list[int]] | None:
    """SGLang's own split of the served model into sliding and full layers."""
    try:
        from sglang.srt.configs.model_config import get_hybrid_layer_ids
    except ImportError:  # pdc's unit tests run without SGLang: they pass `split`
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    sliding, full = get_hybrid_layer_ids(list(config.get("architectures") or []),
                                         SimpleNamespace(**text))
    return None if sliding is None else (list(sliding), list(full or []))


def window_pages(state_indices, state_types) -> list[int] | None:
    """The request's SWA pages in SGLang's "swa" entry of `state_indices`, None without."""
    entry = state_entry(state_indices, state_types, "swa")
    return None if entry is None else [int(x) for x in entry]
