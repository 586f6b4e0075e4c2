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
default; the DSA top-k seed goes before the room where the bound family holds `aux_dsa_topk`
(`aux_fields`); the other optional fields (sampling mask, KV checksum) are refused by name.

Note [SGLang memory kinds]: on a GPU SGLang 0.5.23 allocates its KV pools on the scheduler's
GPU (`mem_cache/memory_pool.py:2580-2648`, MHATokenToKVPool._create_buffers_normal: K and V of
a layer as the two halves of one [2, rows, heads, head_dim] tensor) and its MetadataBuffers on
the host (`disaggregation/utils.py:416`), or on the GPU when
SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK (`utils.py:425-426`). KVArgs carries
addresses only, so the backend asks the CUDA driver where each buffer lives
(`address_device`) and makes its engine for that memory (Note [Two memory kinds] in
runtime/pools.py): host memory on a CPU server, the GPU's when any buffer is on it; that
engine registers each buffer with its own kind, so SGLang's default GPU layout (KV on the
GPU, metadata on the host) moves as it is (tests/integrations/test_sglang_gpu.py, run on an
H100). Buffers on two GPUs are refused, naming one on each. Views over device buffers are
torch tensors on that GPU, over host buffers on the host (`_tensor_over`).

Note [SGLang draft state]: with `--speculative-algorithm EAGLE` (EAGLE3, NEXTN: an alias of
EAGLE) SGLang's PD servers move the draft model's KV beside the target's: the draft's own pool
registered after the target's in KVArgs (`num_draft_entries` of them,
disaggregation/prefill.py `_init_kv_manager`), its layers numbered after the target's
(disaggregation/utils.py `build_kv_layer_ids`), and the aux row's hidden state widens to the
draft model's hidden size in its dtype (scheduler.py's MetadataBuffers,
speculative/eagle_utils.py `get_draft_recurrent_hidden_state_spec_from_config`). The backend
binds the spec's draft band to the draft model (Note [Draft components] in
runtime/binding.py): `engine.draft_layers` is the draft's KV layer count as SGLang sizes its
pool (`num_nextn_predict_layers` when positive, else `num_hidden_layers`;
model_runner_components/layer_setup.py `_compute_model_num_layers`), `engine.draft` its
config.json (`--speculative-draft-model-path`, the target's own for NEXTN), and
`engine.hidden_dtype` the dtype SGLang runs it in. Page components whose layers are all draft
layers take the draft buffers in spec order; a server that speculates against a spec without
draft components, or the reverse, is refused naming both.
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
from pdc.runtime.pools import EnginePools, RegistrationMismatch, address_device, engine_device
from pdc.runtime.spec_path import find_family, search_folders

from .dsa import DSA_INDEX, check_registered, dsa_buffers_of
from .qsa import QSA_TYPES, qsa_buffers_of
from .qsa import check_registered as check_qsa_registered
from .regions import UNCARRIED_STATE, RefusedModel, Region
from .swa import check_registered as check_swa_registered
from .swa import check_served as check_swa_served
from .swa import swa_buffers_of

ENGINE = "sglang"  # the engine a spec's `serves` names for this backend
# page components SGLang registers as state, not in kv_data_ptrs, each in its own dtype
STATE_PAGES = (*DSA_INDEX, "qsa_compressed")

# Note [SGLang aux row]: get_buf_infos order with SGLang's default settings.
AUX_FIELDS = (
    "output_ids", "cached_tokens", "output_token_logprobs_val", "output_token_logprobs_idx",
    "output_top_logprobs_val", "output_top_logprobs_idx", "output_topk_p",
    "output_topk_index", "output_hidden_states", "bootstrap_room",
)
# aux components with one tensor carry it under the component's name in the spec
AUX_SINGLE = {"output_top_logprobs_val": "aux_top_val", "output_top_logprobs_idx": "aux_top_idx",
              "output_topk_index": "aux_topk_index", "output_hidden_states": "aux_hidden",
              "bootstrap_room": "aux_room", "output_dsa_topk_indices": "aux_dsa_topk"}


@dataclass(frozen=True)
class ParallelLayout:
    """Where one SGLang scheduler process sits: its rank within its attention-DP group and
    that group among the server's groups (Note [SGLang DP attention])."""

    attn_tp: int
    attn_tp_rank: int
    attn_dp: int
    attn_dp_rank: int


def parallel_layout_of(parallel, server_args) -> ParallelLayout:
    """Note [SGLang DP attention]: with `--enable-dp-attention --dp N` (SGLang 0.5.23 turns
    it into `attn_dp_size` N) a server of TP T runs N schedulers, each with its own KV pool
    and attention TP T / N; a pool's KV heads are split over attention TP only. pdc names
    ranks within a group (`RankId(pp, tp)`, tp = the attention-TP rank) and the group by
    its attention-DP rank, which is the `prefill_dp_rank` SGLang's decode resolves for a
    request (the router's `disagg_prefill_dp_rank`, else room % prefill's DP size). `parallel`
    is SGLang's ParallelContext (runtime_context.get_parallel()); replicas (`dp_size` > 1
    without DP attention), pipeline and attention context parallelism are refused."""
    def read(name: str, default: int) -> int:
        try:  # SGLang raises RuntimeError / ValueError for a width not published yet
            value = getattr(parallel, name)
        except (AttributeError, RuntimeError, ValueError):
            value = None
        if value is None:
            value = getattr(server_args, name, None)
        return default if value is None else int(value)

    pp, cp, attn_dp = read("pp_size", 1), read("attn_cp_size", 1), read("attn_dp_size", 1)
    # num_dp_ranks: replicas times attention-DP groups (SGLang's runtime_context)
    dp_ranks = read("num_dp_ranks", attn_dp)
    if pp != 1 or cp != 1 or dp_ranks != attn_dp:
        raise RefusedModel(
            "pdc's SGLang backend runs attention DP (--enable-dp-attention), not pipeline "
            "parallelism, attention context parallelism or DP replicas (got "
            f"pp_size {pp}, attn_cp_size {cp}, {dp_ranks} DP ranks of which {attn_dp} "
            "attention-DP groups)")
    return ParallelLayout(read("attn_tp_size", read("tp_size", 1)), read("attn_tp_rank", 0),
                          attn_dp, read("attn_dp_rank", 0))


@dataclass(frozen=True)
class ServedFamily:
    family: Family
    wire: Family  # the codec of its control messages (Family.encode/decode)
    architecture: str
    kv_dtype: str = ""  # the server's KV dtype ("" when it does not say); Note [Served family]
    device: str = ""  # the GPU of SGLang's buffers, "" for host memory (Note [SGLang memory kinds])

    @property
    def engine_kwargs(self) -> dict:
        """make_engine's `device=` for this rank's buffers."""
        return {"device": self.device} if self.device else {}

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
class DraftModel:
    """The draft model a speculating SGLang server runs (Note [SGLang draft state])."""

    algorithm: str
    config: dict
    layers: int  # KV layers of its pool
    dtype: str  # the dtype SGLang runs it in: the hidden row's


DRAFT_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


def draft_model(server_args, model_path: str, server_dtype: str = "") -> DraftModel | None:
    """The server's draft model, None when it does not speculate; other algorithms (their
    PD state differs: no hidden row, or no draft pool) are refused by name."""
    algo = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
    if algo in ("", "NONE"):
        return None
    if algo not in DRAFT_ALGORITHMS:
        raise RefusedModel(f"pdc: --speculative-algorithm {algo}: pdc's SGLang backend carries "
                           f"the draft state of {', '.join(DRAFT_ALGORITHMS)} only")
    path = str(getattr(server_args, "speculative_draft_model_path", None) or model_path)
    config = model_config(path)
    mtp = config.get("num_nextn_predict_layers")
    layers = mtp if isinstance(mtp, int) and mtp > 0 else config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool):
        raise RefusedModel(f"pdc: the draft model's config ({path}) gives neither "
                           "num_nextn_predict_layers nor num_hidden_layers")
    return DraftModel(algo, config, layers, _run_dtype(config, server_dtype))


def _run_dtype(config: dict, server_dtype: str) -> str:
    """The dtype SGLang runs a model in: --dtype, else for auto the config's dtype with
    float32 checkpoints run in float16 (bfloat16 for Gemma; configs/model_config.py
    `_get_and_verify_dtype`)."""
    aliases = {"float": "float32", "half": "float16"}
    if server_dtype not in ("", "auto"):
        return aliases.get(server_dtype, server_dtype)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    dtype = aliases.get(dtype.removeprefix("torch."), dtype.removeprefix("torch."))
    if dtype == "float32":
        return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") \
            else "float16"
    return dtype


def draft_page_components(layout: FamilyLayout) -> tuple[str, ...]:
    """The page components that hold draft layers only (Note [Draft components]: the only
    ones that may hold no layers, when the band is empty), in spec order."""
    draft = set(layout.draft_ids)
    return tuple(c.name for c in layout.components
                 if c.index == "page" and set(c.layer_ids) <= draft and c.name not in STATE_PAGES)


def buffers_of(kv_args, page_tensors=(("kv", "k"), ("kv", "v")), layout=None,
               locate=address_device
               ) -> dict[tuple[str, str, int], Region]:
    """SGLang's KV buffers as (component, tensor, layer id) -> region.

    Note [SGLang KV buffers]: `kv_data_ptrs` is tensor-major, one buffer per layer of each
    tensor the pool keeps: an MHA pool lists K of every layer, then V of every layer; an MLA
    pool one latent buffer per layer. `page_tensors` is the spec's page-indexed tensors in that
    order ((kv, k), (kv, v) for MHA; (latent, data) for MLA), `kv_layer_ids` names the global
    layer of each entry where the pool reports them (a hybrid model's attention layers)."""
    out: dict[tuple[str, str, int], Region] = {}
    ptrs, lens, items = kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens
    ptrs, lens, items = list(ptrs), list(lens), list(items)
    draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    layer_ids = list(getattr(kv_args, "kv_layer_ids", None) or [])
    if layout is not None:  # Note [SGLang draft state]: the draft's buffers come last
        names = draft_page_components(layout)
        page_tensors = tuple(t for t in page_tensors if t[0] not in names)
        out.update(_draft_buffers(kv_args, layout, names, draft, layer_ids, locate))
        if draft:
            ptrs, lens, items = ptrs[:-draft], lens[:-draft], items[:-draft]
            layer_ids = layer_ids[:-draft] if len(layer_ids) == len(ptrs) + draft else []
    elif draft:
        raise RefusedModel(f"pdc: SGLang registered {draft} draft-model KV buffers after the "
                           "target's (speculative decoding), and no spec was given for them")
    if not page_tensors:
        if ptrs:
            raise RefusedModel(f"pdc: SGLang registered {len(ptrs)} KV buffers; the spec "
                               "declares no page-indexed component")
        return out
    if len(ptrs) % len(page_tensors):
        names = ", ".join(f"{c}.{t}" for c, t in page_tensors)
        raise RefusedModel(f"pdc: SGLang registered {len(ptrs)} KV buffers, not a whole "
                           f"number of layers of the spec's page tensors ({names})")
    per_tensor = len(ptrs) // len(page_tensors)
    own = [i for i in layout.component(page_tensors[0][0]).layer_ids
           if i not in layout.draft_ids] if layout is not None else []
    if len(layer_ids) != len(ptrs) and len(own) == per_tensor:
        layer_ids = own * len(page_tensors)  # a pool that names no layers holds the spec's
    elif len(layer_ids) != len(ptrs):
        start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
        layer_ids = [start + i for i in range(per_tensor)] * len(page_tensors)
    for i, (ptr, nbytes, item) in enumerate(zip(ptrs, lens, items, strict=True)):
        comp, tensor = page_tensors[i // per_tensor]
        layer = int(layer_ids[i])
        what = tensor.upper() if comp == "kv" else comp
        out[(comp, tensor, layer)] = Region(int(ptr), int(nbytes), int(item),
                                            f"SGLang's {what} buffer of layer {layer}",
                                            locate(int(ptr)))
    return out


def _draft_buffers(kv_args, layout: FamilyLayout, names: tuple[str, ...], draft: int,
                   layer_ids: list, locate=address_device) -> dict[tuple[str, str, int], Region]:
    """The draft model's KV buffers (the last `draft` of KVArgs) as the spec's draft
    components' (component, tensor, layer id), tensor-major like the target's (Note [SGLang
    KV buffers]); a spec and a server that disagree on speculating are refused."""
    comps = [layout.component(n) for n in names]
    tensors = [(c.name, t) for c in comps for t in (c.tensors if len(c.tensors) > 1
                                                     else ("data",))]
    ids = layout.draft_ids
    where = ", ".join(f"{c.name} ({c.loc})" for c in comps)
    if draft and not ids:
        if comps:
            what = f"was bound to no draft layers: its draft components {where} hold none"
            hint = ("the band's count is engine.draft_layers, which pdc takes from the "
                    "server's --speculative-algorithm and draft model")
        else:
            what = f"declares no draft components ({layout.spec_path})"
            hint = ("give the spec a draft band (`layers: draft: {kind: K, count: {from: "
                    "engine.draft_layers, ...}}`) and page components of kind K (Note [Draft "
                    "components]), or serve without --speculative-algorithm")
        raise RefusedModel(
            f"pdc: SGLang registered {draft} draft-model KV buffers after the target's (the "
            f"server speculates), but {layout.family} {what}; hint: {hint}")
    if not draft and ids:
        raise RefusedModel(
            f"pdc: {layout.family}'s draft components {where} hold {len(ids)} draft layers, "
            "but SGLang registered no draft-model KV buffers (the server does not "
            "speculate); hint: start it with the --speculative-algorithm the spec describes, "
            "or bind the band's count to engine.draft_layers")
    if not draft:
        return {}
    names_t = ", ".join(f"{c}.{t}" for c, t in tensors)
    if draft != len(tensors) * len(ids):
        raise RefusedModel(
            f"pdc: SGLang registered {draft} draft-model KV buffers, {layout.family}'s draft "
            f"components {where} take {len(tensors) * len(ids)} ({names_t} of {len(ids)} draft "
            "layers); hint: the band's count is engine.draft_layers, the draft pool's layer "
            "count: check the draft model's config.json (num_nextn_predict_layers, else "
            "num_hidden_layers)")
    start = len(kv_args.kv_data_ptrs) - draft
    out = {}
    for i in range(draft):
        comp, tensor = tensors[i // len(ids)]
        layer = ids[i % len(ids)]
        j = start + i
        given = int(layer_ids[j]) if len(layer_ids) == len(kv_args.kv_data_ptrs) else layer
        what = tensor.upper() if tensor in ("k", "v") else comp
        out[(comp, tensor, given)] = Region(
            int(kv_args.kv_data_ptrs[j]), int(kv_args.kv_data_lens[j]),
            int(kv_args.kv_item_lens[j]), f"SGLang's draft-model {what} buffer of layer {given}",
            locate(int(kv_args.kv_data_ptrs[j])))
    return out


def state_buffers_of(kv_args, slot_components=("gdn_conv", "gdn_ssm"), locate=address_device,
                     layout: FamilyLayout | None = None) -> dict[tuple[str, str, int], Region]:
    """SGLang's per-request state buffers (mamba pool) as (component, tensor, layer id).

    Note [SGLang mamba state]: KVArgs carries one list of buffers per state type; the mamba
    pool's list is every layer's conv state, then every layer's temporal state
    (MambaPool.get_contiguous_buf_infos), `state_layer_ids` naming each entry's layer. Its
    items are slots: SGLang sends the request's slot in `state_indices` with the last chunk.
    A DSA pool's indexer keys are page-indexed (Note [SGLang DSA indexer keys] in dsa.py), a
    QSA pool's state ring- and page-indexed (Note [SGLang QSA state] in qsa.py), a SWAKVPool's
    sliding layers window-indexed (Note [SGLang SWA pools] in swa.py); other state types are
    refused by name until a spec declares them."""
    out: dict[tuple[str, str, int], Region] = {}
    types = [str(getattr(t, "value", t)) for t in getattr(kv_args, "state_types", None) or []]
    check_registered(types, layout)
    check_qsa_registered(types, layout)
    check_swa_registered(types, layout)
    for i, kind in enumerate(types):
        if kind in ("dsa", "swa"):
            made = dsa_buffers_of if kind == "dsa" else swa_buffers_of
            out.update(made(kv_args, i, layout, locate))
            continue
        if kind in QSA_TYPES:
            out.update(qsa_buffers_of(kv_args, i, kind, layout, locate))
            continue
        if kind != "mamba":
            why = f" ({UNCARRIED_STATE[kind]})" if kind in UNCARRIED_STATE else ""
            raise RefusedModel(f"pdc: SGLang registered {kind!r} state buffers{why}; pdc's "
                               "SGLang specs carry mamba slot state, DSA indexer keys, QSA "
                               "indexer state and sliding-window pages only so far")
        ptrs, lens = kv_args.state_data_ptrs[i], kv_args.state_data_lens[i]
        items = kv_args.state_item_lens[i]
        layer_ids = list((getattr(kv_args, "state_layer_ids", None) or [[]] * (i + 1))[i])
        blocks = len(slot_components)
        first = layout.component(slot_components[0]) if layout and slot_components else None
        if first is not None and len(ptrs) != blocks * len(first.layer_ids):
            raise RefusedModel(
                f"pdc: SGLang registered {len(ptrs)} mamba state buffers, {layout.family}'s "
                f"{', '.join(slot_components)} take {blocks * len(first.layer_ids)} ({blocks} "
                f"per GDN layer, {first.loc}); hint: slot state of other layers (Qwen3.8's PLE "
                "short-conv and n-gram state, ple_layer_ids) is not described by pdc's specs")
        if len(ptrs) % blocks:
            raise RefusedModel(f"pdc: SGLang registered {len(ptrs)} mamba state buffers, not "
                               f"{blocks} per layer ({', '.join(slot_components)})")
        per_block = len(ptrs) // blocks
        if len(layer_ids) != len(ptrs):
            layer_ids = list(range(per_block)) * blocks
        for j, (ptr, nbytes, item) in enumerate(zip(ptrs, lens, items, strict=True)):
            comp, layer = slot_components[j // per_block], int(layer_ids[j])
            field = "conv" if j // per_block == 0 else "temporal"
            out[(comp, "data", layer)] = Region(
                int(ptr), int(nbytes), int(item),
                f"SGLang's mamba {field} state of layer {layer}", locate(int(ptr)))
    return out


def aux_fields(layout: FamilyLayout | None) -> tuple[str, ...]:
    """SGLang's aux fields in get_buf_infos order for this family: the default ones, and the
    DSA top-k seed before the room where the bound family holds it (docs/sglang.md "DSA
    top-k seed")."""
    seed = layout is not None and any(c.name == "aux_dsa_topk" and c.stages != "none"
                                      for c in layout.components)
    return AUX_FIELDS[:-1] + ("output_dsa_topk_indices",) * seed + AUX_FIELDS[-1:]


def aux_buffers_of(kv_args, locate=address_device,
                   layout: FamilyLayout | None = None) -> dict[tuple[str, str], Region]:
    """SGLang's aux buffers as (component, tensor) -> region; Note [SGLang aux row]."""
    ptrs, lens, items = kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens
    fields = aux_fields(layout)
    if len(ptrs) != len(fields):
        who = layout.family if layout is not None else "pdc's SGLang spec"
        raise RefusedModel(
            f"pdc: SGLang registered {len(ptrs)} aux buffers, {who} declares {len(fields)} "
            f"({', '.join(fields)}); SGLang adds 3 for SGLANG_ENABLE_DISAGG_SAMPLING_MASK and 1 "
            "for --disaggregation-enable-kv-checksum, which pdc's specs do not carry, and 1 for "
            "the DSA top-k seed where a DSA model's config sets index_share_for_mtp_iteration; "
            "hint: turn off the first two (docs/sglang.md \"DSA top-k seed\")")
    out = {}
    for name, ptr, nbytes, item in zip(fields, ptrs, lens, items, strict=True):
        comp = AUX_SINGLE.get(name)
        if comp is None:
            comp = "aux_i32" if name in ("output_ids", "cached_tokens",
                                         "output_token_logprobs_idx") else "aux_f32"
        out[(comp, name)] = Region(int(ptr), int(nbytes), int(item),
                                   f"SGLang's aux buffer {name}", locate(int(ptr)))
    return out


class _DeviceBytes:
    """`nbytes` bytes of GPU memory at `addr`, for torch.as_tensor (no copy)."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (addr, False), "version": 3}


def _tensor_over(region: Region, dtype_name: str):
    """A torch view of SGLang's memory (host or GPU: Note [SGLang memory kinds]), one row per
    item, in the component's dtype: KVArgs carries only addresses, so bytes per item and item
    count are what is checked."""
    import torch

    dtype = getattr(torch, dtype_name, None)
    elem = torch.empty((), dtype=dtype).element_size() if dtype is not None else 1
    if dtype is None or region.item_bytes % elem:
        dtype, elem = torch.uint8, 1
    if region.device != "cpu":
        flat = torch.as_tensor(_DeviceBytes(region.addr, region.nbytes), device=region.device)
    else:
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
    kv = buffers_of(kv_args, _kv_tensors(layout), layout)
    kv.update(state_buffers_of(kv_args, tuple(c for c, _ in _tensors_of(layout, "slot")),
                               layout=layout))
    aux = aux_buffers_of(kv_args, layout=layout)
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
                # the KV dtype names the page pools; slot state keeps its own (GDN's
                # recurrent state is float32 in a bfloat16 model)
                if region is not None and comp.index == "page" and name not in STATE_PAGES \
                        and kv_dtype not in ("", "auto", comp.dtype):
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


def served_device(layout: FamilyLayout, kv_args, locate=address_device) -> str:
    """The GPU of the buffers SGLang registers on this rank, "" when all are host memory (Note
    [SGLang memory kinds]); buffers on two GPUs are refused."""
    regions = [*buffers_of(kv_args, _kv_tensors(layout), layout, locate).values(),
               *state_buffers_of(kv_args, tuple(c for c, _ in _tensors_of(layout, "slot")),
                                 locate, layout).values(),
               *aux_buffers_of(kv_args, locate, layout).values()]
    try:
        chosen = engine_device({r.what: r.device for r in regions}, layout.spec_path,
                               owner="SGLang's buffers of this rank", hint=TWO_GPUS_HINT,
                               label=str, host_too=True)
    except RegistrationMismatch as e:
        raise RefusedModel(f"pdc: {e}") from None
    return str(chosen.get("device", ""))


TWO_GPUS_HINT = ("a rank's one transfer engine registers host memory and one GPU's (Note "
                 "[Two memory kinds]): keep each scheduler's KV pools and metadata buffers on "
                 "its own GPU or on the host")


def _tensors_of(layout: FamilyLayout, index: str) -> tuple[tuple[str, str], ...]:
    """(component, tensor) of the layout's components indexed by `index`, in spec order."""
    return tuple((c.name, t) for c in layout.components if c.index == index
                 for t in (c.tensors if len(c.tensors) > 1 else ("data",)))


def _kv_tensors(layout: FamilyLayout) -> tuple[tuple[str, str], ...]:
    """The page tensors SGLang registers in kv_data_ptrs: all but the DSA indexer keys and
    the QSA compressed keys, which come as state (Notes [SGLang DSA indexer keys] in dsa.py,
    [SGLang QSA state] in qsa.py)."""
    return tuple(t for t in _tensors_of(layout, "page") if t[0] not in STATE_PAGES)


def _single_field(component: str) -> str:
    return next(f for f, c in AUX_SINGLE.items() if c == component)


def served_family(model_path: str, kv_args, tp: int, tp_rank: int,
                  server_dtype: str = "", draft: DraftModel | None = None) -> ServedFamily:
    """Note [Served family]: checked on this rank's own shard (tp, tp_rank); `server_dtype`
    is the server's `--dtype`, `draft` its draft model (Note [SGLang draft state])."""
    kv_dtype = served_kv_dtype(kv_args, server_dtype)
    config = model_config(model_path)
    arch = architecture(model_path, config)
    try:
        family = find_family(ENGINE, arch, search_folders())
    except FamilyNotFound as e:
        raise RefusedModel(f"pdc: the served model ({model_path}): {e}") from None
    page_size = int(kv_args.page_size)
    try:
        engine = {"page_size": page_size, "kv_dtype": kv_dtype, "draft_layers": 0,
                  "hidden_dtype": "float32"}  # SGLang's 16-value padding row
        if draft is not None:
            engine.update(draft_layers=draft.layers, draft=draft.config,
                          hidden_dtype=draft.dtype)
        family = family.bind(config, engine)
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
        check_swa_served(layout, config)  # Note [SGLang SWA pools]
        engine_pools(layout, plan, "prefill", RankId(0, tp_rank), kv_args, kv_dtype)
    except RefusedModel as e:
        raise RefusedModel(f"pdc: {arch} ({model_path}) does not fit its spec: "
                           + str(e).removeprefix("pdc: ")) from None
    return ServedFamily(family, family, arch, kv_dtype, served_device(layout, kv_args))


def side(tp: int, pp: int, dp: int, page_size: int) -> str:
    return f"tp={tp},pp={pp},dp={dp},page_size={page_size}"


def make_plan(family: Family, prefill: str, decode: str, engine: str) -> Plan:
    """The plan for the live topology, made in the runtime (no compiler)."""
    try:
        return family.plan_for(prefill, decode, engine)
    except SpecErrors as e:
        raise RefusedModel(f"pdc: no plan for {family.name} from prefill {prefill} to decode "
                           f"{decode} over {engine}: {e}") from None


def decode_instance(advertise_host: str, port: int) -> str:
    """The name a decode server registers under with prefill servers (Note [Decode instances]
    in pdc.runtime.endpoints.handshake): the address its peers reach it at (pdc's advertise
    host, never a wildcard) and its HTTP port. Every TP rank of the server says the same
    (they share its server args); two servers never do (on one host their ports differ, on
    two hosts their addresses); a server restarted on its port is the same instance, so
    prefill fails the requests of its previous incarnation."""
    host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
    return f"{host}:{int(port)}"
