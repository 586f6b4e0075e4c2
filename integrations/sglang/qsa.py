"""SGLang's QSA indexer state (Qwen3.8, SGLang's Qwen4-Exp) as the spec's ring and page components.

Note [SGLang QSA state]: SGLang 0.5.23 keeps a model whose config sets the compressed QSA
indexer fields (`layers/attention/qsa/config.py` parse_qsa_profile: indexer_n_heads,
indexer_kv_heads, indexer_head_dim, indexer_budget, indexer_compress_ratio) in a
`QSATokenToKVPool` (mem_cache/qsa_kv_pool.py; built by mem_cache/kv_cache_configurator.py),
the hybrid GDN + attention pool plus, for every full-attention layer:
- the pending raw index keys, a ring of `compress_ratio` rows per request: row
  `req_pool_idx * ratio + pos % ratio` of a [request slots * ratio, index heads, index dim]
  bfloat16 buffer, and one request-wide RoPE position ring ([slots * ratio, 3] int64) shared by
  all layers. SGLang registers them as the state type "qsa_pending" (disaggregation/utils.py
  setup_state_kv_args): one entry per layer and the RoPE ring last, the layer ids in
  `state_layer_ids` (the RoPE ring's is QSA_ROPE_STATE_LAYER_ID, 2^32 - 2), each item one
  request's whole ring (`ratio` rows). Its `state_indices` entry is the request's row of the
  request pool, `req_pool_idx`, on each side (`get_qsa_pending_state_indices`; prefill.py and
  decode.py `_qsa_pending_payload`), sent with the last chunk;
- the compressed index keys, `page_size / ratio` rows per full-KV page ("qsa_compressed", one
  entry per layer, an item per KV page), whose `state_indices` entry is every page of the
  request from position 0 (`_full_kv_pages_payload`), decode's cached prefix included.
pdc declares them as the spec's ring components `qsa_pending` (the layers) and `qsa_rope` (the
request-wide ring, under the same sentinel 2^32 - 2), one item a row, R = the bound ratio, so
that the request's ring moves row for row into decode's own `req_pool_idx` (the ring order is
the position's, so equal ratios on both sides keep it: the ratio is a bound param, part of the
plan digest); and `qsa_compressed` as a page component that moves with the KV pages chunk by
chunk. SGLang's compressed page list past decode's prefix must be the request's KV pages (the
backend checks it, as for the DSA indexer pages); its req_pool_idx is the ring slot pdc moves.
A server that registers QSA state against a spec without these components, or the reverse,
is refused naming both.
"""

from __future__ import annotations

from pdc.runtime.layout_types import FamilyLayout

from .dsa import dsa_pages, page_list_error
from .regions import RefusedModel, Region, layout_component, state_entry

QSA_TYPES = ("qsa_pending", "qsa_compressed")
ROPE_LAYER_ID = (1 << 32) - 2  # SGLang's QSA_ROPE_STATE_LAYER_ID (mem_cache/qsa_kv_pool.py)
WHAT = {"qsa_pending": "QSA pending index-key ring", "qsa_rope": "QSA RoPE position ring",
        "qsa_compressed": "QSA compressed index keys"}
INDEX = {"qsa_pending": "ring", "qsa_rope": "ring", "qsa_compressed": "page"}
COMPONENTS = {"qsa_pending": ("qsa_pending", "qsa_rope"), "qsa_compressed": ("qsa_compressed",)}
HINT = "serve a model with the QSA indexer (indexer_n_heads in its config) with " \
    "specs/sglang-qwen38.yaml"


def _component(layout: FamilyLayout | None, name: str):
    return layout_component(layout, name, INDEX[name])


def qsa_buffers_of(kv_args, i: int, kind: str, layout: FamilyLayout | None, locate
                   ) -> dict[tuple[str, str, int], Region]:
    """KVArgs' state component `i` (type "qsa_pending" or "qsa_compressed") as (component,
    "data", layer id) -> region, one item a ring row or a KV page (Note [SGLang QSA state])."""
    ptrs, lens = list(kv_args.state_data_ptrs[i]), list(kv_args.state_data_lens[i])
    items = list(kv_args.state_item_lens[i])
    all_ids = getattr(kv_args, "state_layer_ids", None) or []
    ids = [int(x) for x in (all_ids[i] if i < len(all_ids) else [])]
    names = COMPONENTS[kind]
    missing = [n for n in names if _component(layout, n) is None]
    if missing:
        spec = "no spec" if layout is None else f"{layout.family} declares no " + " or ".join(
            f"{INDEX[n]} component {n}" for n in missing) + f" ({layout.spec_path})"
        raise RefusedModel(
            f"pdc: SGLang registered {len(ptrs)} {WHAT[names[0]]} buffers (state type "
            f"{kind!r}: a QSATokenToKVPool's, the model's config sets the QSA indexer), but "
            f"{spec}; hint: {HINT}")
    if len(ids) != len(ptrs):
        raise RefusedModel(
            f"pdc: SGLang registered {len(ptrs)} {kind!r} state buffers with {len(ids)} layer "
            "ids; pdc maps QSA state by SGLang's layer ids (disaggregation/utils.py "
            "setup_state_kv_args)")
    out = {}
    for ptr, nbytes, item, layer in zip(ptrs, lens, items, ids, strict=True):
        name = "qsa_rope" if kind == "qsa_pending" and layer == ROPE_LAYER_ID else names[0]
        comp = _component(layout, name)
        rows = comp.ring_rows if comp.index == "ring" else 1
        where = "(request-wide)" if layer == ROPE_LAYER_ID else f"of layer {layer}"
        if item % rows:
            raise RefusedModel(
                f"pdc: SGLang's {WHAT[name]} {where} holds {item} bytes per request, not "
                f"{rows} rows ({layout.family}'s {name} ({comp.loc}) is a ring of {rows} rows "
                f"of {comp.item_bytes} bytes); hint: the ring's rows are the config's "
                "indexer_compress_ratio")
        out[(name, "data", layer)] = Region(int(ptr), int(nbytes), int(item) // rows,
                                            f"SGLang's {WHAT[name]} buffer {where}",
                                            locate(int(ptr)))
    return out


def check_registered(types: list[str], layout: FamilyLayout | None) -> None:
    """A spec whose QSA components hold layers needs SGLang's QSA state components."""
    for kind, names in COMPONENTS.items():
        comp = _component(layout, names[0])
        if comp is None or not comp.layer_ids or kind in types:
            continue
        raise RefusedModel(
            f"pdc: {layout.family}'s {names[0]} ({comp.loc}) holds the {WHAT[names[0]]} of "
            f"{len(comp.layer_ids)} layers, but SGLang registered no {kind!r} state (its KV "
            "pool is not a QSATokenToKVPool: SGLang builds one only when the model's config "
            "sets the QSA indexer fields, layers/attention/qsa/config.py parse_qsa_profile); "
            "hint: serve a hybrid model without the QSA indexer with "
            "specs/sglang-qwen3-next.yaml")


def ring_slot(state_indices, state_types) -> int:
    """The request's req_pool_idx in SGLang's "qsa_pending" entry, -1 without one."""
    entry = state_entry(state_indices, state_types, "qsa_pending")
    return int(entry[0]) if entry is not None and len(entry) else -1


def compressed_list_error(state_indices, state_types, pages: list[int],
                          prefix_pages: int) -> str:
    """"" when SGLang's compressed-key pages past decode's prefix are the request's pages
    (Note [SGLang QSA state]), else the reason that fails the request."""
    entry = state_entry(state_indices, state_types, "qsa_compressed")
    if entry is None:
        return ""
    given = [int(x) for x in entry]
    if given[prefix_pages:] == pages:
        return ""
    return (f"SGLang's QSA compressed-key pages {_short(given[prefix_pages:])} (past decode's "
            f"{prefix_pages} prefix pages) are not the request's KV pages {_short(pages)}: pdc "
            "moves the compressed keys with the KV pages")


def _short(pages: list[int]) -> str:
    return str(pages) if len(pages) <= 8 else f"{pages[:8]}... ({len(pages)} pages)"


def state_pages_error(state_indices, state_types, pages: list[int], prefix_pages: int) -> str:
    """"" when SGLang's page-indexed state lists (DSA indexer pages, QSA compressed-key pages)
    agree with the request's KV pages, else the reason that fails the request."""
    return page_list_error(dsa_pages(state_indices, state_types), pages) or \
        compressed_list_error(state_indices, state_types, pages, prefix_pages)
