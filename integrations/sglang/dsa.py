"""SGLang's DSA indexer keys (DeepSeek-V3.2, GLM-5.2) as the spec's page components.

Note [SGLang DSA indexer keys]: SGLang 0.5.23 serves a model as DSA (DeepSeek sparse
attention, formerly NSA) when its architecture is one of `configs/model_config.py`
`is_deepseek_dsa`'s (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM, DeepseekV3ForCausalLM, ...)
and its config sets `index_topk`. Its KV pool is then a `DSATokenToKVPool`
(mem_cache/memory_pool.py): the MLA latent pool, plus one indexer-key buffer per layer
(mem_cache/index_key_cache.py `IndexKeyCache`), uint8, one row per KV page with the page's
`page_size * index_head_dim` fp8 key bytes first and then its `page_size * index_head_dim //
128` float32 scales. The latent goes in `kv_data_ptrs` as for MLA; the indexer keys go in
KVArgs as a state component of type "dsa" (disaggregation/utils.py `setup_state_kv_args`:
`DSATokenToKVPool.get_state_buf_infos`, the target's layers then, with an MTP draft, the
draft pool's), and their indices are the request's KV pages past decode's cached prefix
(prefill.py / decode.py `_dsa_pages_payload`, mem_cache/common.py `suffix_page_indices`),
sent with the last chunk. So the row of a page's keys is the page's own id: the spec
declares them as page components named `index_k` (the target's) and `draft_index_k` (the MTP
layers'), which move with the latent's pages chunk by chunk, and the backend checks that
SGLang's DSA page list is the request's page list. A server that registers indexer keys
against a spec without `index_k`, or the reverse, is refused naming both; the kpool-compress
tail ("dsa_tail") and IndexShare's 0-row placeholders are refused by name.
"""

from __future__ import annotations

from pdc.runtime.layout_types import FamilyLayout

from .regions import RefusedModel, Region, layout_component, state_entry

DSA_INDEX = ("index_k", "draft_index_k")  # the target's, the draft's: Note [SGLang DSA indexer keys]
WHERE = "state type 'dsa': a DSATokenToKVPool's indexer keys"


def _component(layout: FamilyLayout | None, name: str):
    return layout_component(layout, name, "page")


def dsa_buffers_of(kv_args, i: int, layout: FamilyLayout | None, locate
                   ) -> dict[tuple[str, str, int], Region]:
    """KVArgs' state component `i` (type "dsa") as (component, "data", layer id) -> region."""
    ptrs, lens = list(kv_args.state_data_ptrs[i]), list(kv_args.state_data_lens[i])
    items = list(kv_args.state_item_lens[i])
    target, draft = _component(layout, "index_k"), _component(layout, "draft_index_k")
    if target is None:
        name = "no spec" if layout is None else \
            f"{layout.family} declares no index_k component ({layout.spec_path})"
        raise RefusedModel(
            f"pdc: SGLang registered {len(ptrs)} DSA indexer-key buffers ({WHERE}; the model's "
            f"config sets index_topk), but {name}; hint: serve it with a spec whose page "
            "component index_k takes them (specs/sglang-deepseek-v32.yaml)")
    empty = [j for j, n in enumerate(items) if not n]
    if empty:
        raise RefusedModel(
            f"pdc: SGLang registered 0-row DSA indexer buffers for KVArgs entries {empty} "
            "(IndexShare: layers that reuse the previous layer's top-k, `indexer_types` in the "
            f"config); {layout.family}'s index_k ({target.loc}) holds keys for every layer")
    ids = list(target.layer_ids) + (list(draft.layer_ids) if draft is not None else [])
    if len(ptrs) != len(ids):
        names = f"index_k ({target.loc})" + (f" and draft_index_k ({draft.loc})" if draft
                                              else "")
        raise RefusedModel(
            f"pdc: SGLang registered {len(ptrs)} DSA indexer-key buffers, {layout.family}'s "
            f"{names} take {len(ids)} ({len(target.layer_ids)} target layers, "
            f"{len(ids) - len(target.layer_ids)} draft layers); hint: the target's come "
            "first, then the MTP draft pool's (disaggregation/utils.py setup_state_kv_args)")
    out = {}
    for j, (ptr, nbytes, item) in enumerate(zip(ptrs, lens, items, strict=True)):
        comp = "index_k" if j < len(target.layer_ids) else "draft_index_k"
        what = "draft-model " if comp == "draft_index_k" else ""
        out[(comp, "data", ids[j])] = Region(
            int(ptr), int(nbytes), int(item),
            f"SGLang's {what}DSA indexer keys of layer {ids[j]}", locate(int(ptr)))
    return out


def check_registered(types: list[str], layout: FamilyLayout | None) -> None:
    """A spec whose index_k holds layers needs SGLang's "dsa" state component."""
    target = _component(layout, "index_k")
    if target is None or not target.layer_ids or "dsa" in types:
        return
    raise RefusedModel(
        f"pdc: {layout.family}'s index_k ({target.loc}) holds the DSA indexer keys of "
        f"{len(target.layer_ids)} layers, but SGLang registered no DSA indexer-key buffers "
        "(its KV pool is not a DSATokenToKVPool: SGLang serves a model as DSA only when its "
        "config.json sets index_topk, configs/model_config.py is_deepseek_dsa); hint: serve "
        "a model without index_topk with specs/sglang-deepseek-mla.yaml")


def dsa_pages(state_indices, state_types) -> list[int] | None:
    """The request's pages in SGLang's "dsa" entry of `state_indices`, None without one."""
    entry = state_entry(state_indices, state_types, "dsa")
    return None if entry is None else [int(x) for x in entry]


def page_list_error(dsa: list[int] | None, pages: list[int]) -> str:
    """"" when SGLang's DSA pages are the request's pages (Note [SGLang DSA indexer keys]),
    else the reason that fails the request."""
    if dsa is None or dsa == pages:
        return ""
    return (f"SGLang's DSA indexer pages {_short(dsa)} are not the request's KV pages "
            f"{_short(pages)}: pdc moves the indexer keys with the KV pages")


def _short(pages: list[int]) -> str:
    return str(pages) if len(pages) <= 8 else f"{pages[:8]}... ({len(pages)} pages)"
