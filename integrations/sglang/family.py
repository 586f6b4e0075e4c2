"""The family and plan of the model an SGLang server serves, and its buffers as pdc pools.

Note [Served family]: the served model's architecture (`config.json`'s `architectures[0]`)
names the spec whose `serves` lists it for SGLang, found on the spec path (Note [Spec path]
in runtime/spec_path.py: the folders of PDC_SPEC_PATH first, then pdc's package). The spec
is bound to the model at start (Note [Bound families] in runtime/binding.py): its params
from the model's config.json, the page size from `--page-size`, the KV dtype from
`--kv-cache-dtype`, else `--dtype`. A config that breaks a rule of the spec is refused with
the config key, its value and the spec line; a bound family that does not fit SGLang's own
buffers item for item (count, bytes; KVArgs carry addresses and byte counts only) is refused
with the first difference, so the message says which spec to write or fix.

Note [SGLang aux row]: SGLang's MetadataBuffers registers one buffer per field, in the order
of `MetadataBuffers.get_buf_infos` (disaggregation/utils.py); pdc's spec names each field as
a tensor of an aux component. AUX_FIELDS is that order for the buffers SGLang registers by
default; optional fields (sampling mask, DSA top-k, KV checksum) change the list and are
refused by name.
"""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass

from pdc.runtime.binding import BindError
from pdc.runtime.diagnostics import SpecErrors
from pdc.runtime.family import Family, FamilyNotFound
from pdc.runtime.layout_types import FamilyLayout
from pdc.runtime.plan_types import Plan, RankId
from pdc.runtime.pools import EnginePools, RegistrationMismatch
from pdc.runtime.spec_path import find_family, search_folders

ENGINE = "sglang"  # the engine a spec's `serves` names for this backend

# Note [SGLang aux row]: get_buf_infos order with SGLang's default settings.
AUX_FIELDS = (
    "output_ids", "cached_tokens", "output_token_logprobs_val", "output_token_logprobs_idx",
    "output_top_logprobs_val", "output_top_logprobs_idx", "output_topk_p",
    "output_topk_index", "output_hidden_states", "bootstrap_room",
)
# aux components with one tensor carry it under the component's name in the spec
AUX_SINGLE = {"output_top_logprobs_val": "aux_top_val", "output_top_logprobs_idx": "aux_top_idx",
              "output_topk_index": "aux_topk_index", "output_hidden_states": "aux_hidden",
              "bootstrap_room": "aux_room"}


class RefusedModel(RuntimeError):
    """pdc cannot serve this model (or these SGLang settings); the message says why."""


@dataclass(frozen=True)
class ServedFamily:
    family: Family
    wire: Family  # the codec of its control messages (Family.encode/decode)
    architecture: str
    kv_dtype: str = ""  # the server's KV dtype ("" when it does not say); Note [Served family]

    @property
    def layout(self) -> FamilyLayout:
        return self.family.layout


def model_config(model_path: str) -> dict:
    """The served model's config.json as a mapping."""
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise RefusedModel(f"pdc: cannot read the served model's config ({path}): {e}") from None
    if not isinstance(config, dict):
        raise RefusedModel(f"pdc: {path} is not a JSON object")
    return config


def architecture(model_path: str, config: dict | None = None) -> str:
    config = model_config(model_path) if config is None else config
    archs = config.get("architectures") or []
    if not archs:
        raise RefusedModel(f"pdc: {os.path.join(model_path, 'config.json')} names no "
                           "architecture")
    return str(archs[0])


@dataclass(frozen=True)
class Region:
    """One SGLang buffer as KVArgs describes it: address, bytes, bytes per item."""

    addr: int
    nbytes: int
    item_bytes: int
    what: str  # in SGLang's words, for messages


def buffers_of(kv_args) -> dict[tuple[str, str, int], Region]:
    """SGLang's KV buffers as (component, tensor, layer id) -> region.

    `kv_data_ptrs` lists K of every layer, then V of every layer (MHA pools), with
    `kv_layer_ids` naming the global layer of each entry where the pool reports them."""
    out: dict[tuple[str, str, int], Region] = {}
    ptrs, lens, items = kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens
    if len(ptrs) % 2:
        raise RefusedModel(f"pdc: SGLang registered {len(ptrs)} KV buffers; an MHA pool "
                           "registers K and V per layer (MLA pools are not supported yet)")
    half = len(ptrs) // 2
    layer_ids = list(getattr(kv_args, "kv_layer_ids", None) or [])
    if len(layer_ids) != len(ptrs):
        start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
        layer_ids = [start + i for i in range(half)] * 2
    for i, (ptr, nbytes, item) in enumerate(zip(ptrs, lens, items, strict=True)):
        tensor = "k" if i < half else "v"
        layer = int(layer_ids[i])
        out[("kv", tensor, layer)] = Region(int(ptr), int(nbytes), int(item),
                                            f"SGLang's {tensor.upper()} buffer of layer {layer}")
    return out


def aux_buffers_of(kv_args) -> dict[tuple[str, str], Region]:
    """SGLang's aux buffers as (component, tensor) -> region; Note [SGLang aux row]."""
    ptrs, lens, items = kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens
    if len(ptrs) != len(AUX_FIELDS):
        raise RefusedModel(
            f"pdc: SGLang registered {len(ptrs)} aux buffers, pdc's SGLang specs declare "
            f"{len(AUX_FIELDS)} ({', '.join(AUX_FIELDS)}); turn off "
            "SGLANG_ENABLE_DISAGG_SAMPLING_MASK, --disaggregation-enable-kv-checksum and "
            "DSA top-k seeding, which add buffers")
    out = {}
    for name, ptr, nbytes, item in zip(AUX_FIELDS, ptrs, lens, items, strict=True):
        comp = AUX_SINGLE.get(name)
        if comp is None:
            comp = "aux_i32" if name in ("output_ids", "cached_tokens",
                                         "output_token_logprobs_idx") else "aux_f32"
        out[(comp, name)] = Region(int(ptr), int(nbytes), int(item),
                                   f"SGLang's aux buffer {name}")
    return out


def _tensor_over(region: Region, dtype_name: str):
    """A torch view of SGLang's memory, one row per item, in the component's dtype: KVArgs
    carries only addresses, so bytes per item and item count are what is checked."""
    import torch

    dtype = getattr(torch, dtype_name, None)
    elem = torch.empty((), dtype=dtype).element_size() if dtype is not None else 1
    if dtype is None or region.item_bytes % elem:
        dtype, elem = torch.uint8, 1
    raw = (ctypes.c_uint8 * region.nbytes).from_address(region.addr)
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    items = region.nbytes // region.item_bytes
    return flat[:items * region.item_bytes].view(dtype).reshape(items,
                                                                region.item_bytes // elem)


def served_kv_dtype(kv_args, server_dtype: str = "") -> str:
    """The dtype SGLang's KV pool holds: `--kv-cache-dtype` unless auto, else `--dtype`
    unless auto, else "" (unknown: only bytes are checked)."""
    aliases = {"float": "float32", "half": "float16"}
    for value in (getattr(kv_args, "kv_cache_dtype_str", ""), server_dtype):
        value = str(value or "")
        if value not in ("", "auto"):
            return aliases.get(value, value)
    return ""


def engine_pools(layout: FamilyLayout, plan: Plan, side: str, rank: RankId,
                 kv_args, kv_dtype: str | None = None) -> EnginePools:
    """SGLang's own KV and aux buffers of this rank, in place, checked against the plan
    (Note [Engine-owned memory] in pdc.runtime.pools) and, when known, the KV dtype."""
    reg = plan.registration(side, rank)
    kv = buffers_of(kv_args)
    aux = aux_buffers_of(kv_args)
    if kv_dtype is None:
        kv_dtype = served_kv_dtype(kv_args)
    tensors, labels = {}, {}
    for name, entries, _ in reg.components:
        comp = layout.component(name)
        for tensor, layer_id in entries:
            if comp.index == "aux":
                region = aux.get((name, tensor if len(comp.tensors) > 1 else _single_field(name)))
            else:
                region = kv.get((name, tensor, layer_id))
                if region is not None and kv_dtype not in ("", "auto", comp.dtype):
                    raise RefusedModel(f"pdc: {layout.family} ({comp.loc}) holds {name} in "
                                       f"{comp.dtype}, the server's KV cache is {kv_dtype}")
            if region is None:
                continue  # EnginePools names what is missing
            key = (name, tensor, layer_id)
            tensors[key] = _tensor_over(region, comp.dtype)
            labels[key] = region.what
    tp = plan.topology.prefill.tp if side == "prefill" else plan.topology.decode.tp
    try:
        return EnginePools(layout, reg, tp, tensors, label=lambda key: labels[key])
    except RegistrationMismatch as e:
        raise RefusedModel(f"pdc: {layout.family} does not fit the served model's buffers: "
                           f"{e}") from None


def _single_field(component: str) -> str:
    return next(f for f, c in AUX_SINGLE.items() if c == component)


def served_family(model_path: str, kv_args, tp: int, tp_rank: int,
                  server_dtype: str = "") -> ServedFamily:
    """Note [Served family]: checked on this rank's own shard (tp, tp_rank); `server_dtype`
    is the server's `--dtype`."""
    kv_dtype = served_kv_dtype(kv_args, server_dtype)
    config = model_config(model_path)
    arch = architecture(model_path, config)
    try:
        family = find_family(ENGINE, arch, search_folders())
    except FamilyNotFound as e:
        raise RefusedModel(f"pdc: the served model ({model_path}): {e}") from None
    page_size = int(kv_args.page_size)
    try:
        family = family.bind(config, {"page_size": page_size, "kv_dtype": kv_dtype})
    except BindError as e:
        raise RefusedModel(f"pdc: the served model ({model_path}) breaks "
                           f"{family.layout.spec_path}:\n{e}") from None
    layout = family.layout
    if page_size != layout.default_page_size:
        raise RefusedModel(f"pdc: {layout.family} ({layout.spec_path}) pages hold "
                           f"{layout.default_page_size} tokens, the server's --page-size is "
                           f"{page_size}")
    one = side(tp, 1, 1, page_size)
    plan = make_plan(family, one, one, "local")
    try:
        engine_pools(layout, plan, "prefill", RankId(0, tp_rank), kv_args, kv_dtype)
    except RefusedModel as e:
        raise RefusedModel(f"pdc: {arch} ({model_path}) does not fit its spec: "
                           + str(e).removeprefix("pdc: ")) from None
    return ServedFamily(family, family, arch, kv_dtype)


def side(tp: int, pp: int, dp: int, page_size: int) -> str:
    return f"tp={tp},pp={pp},dp={dp},page_size={page_size}"


def make_plan(family: Family, prefill: str, decode: str, engine: str) -> Plan:
    """The plan for the live topology, made in the runtime (no compiler)."""
    try:
        return family.plan_for(prefill, decode, engine)
    except SpecErrors as e:
        raise RefusedModel(f"pdc: no plan for {family.name} from prefill {prefill} to decode "
                           f"{decode} over {engine}: {e}") from None
