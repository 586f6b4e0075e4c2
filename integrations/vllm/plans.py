"""The transfer plan for the live topology (prefill TP, decode TP, engine), made in the
serving process by the runtime's own lowering (pdc.runtime.family), never the compiler."""

from __future__ import annotations

from functools import cache

from pdc.runtime.family import Family, FamilyNotFound
from pdc.runtime.spec_path import find_family, search_folders


@cache
def make_plan(family: Family, prefill_tp: int, decode_tp: int, backend: str,
              decode_engines: int = 1):
    """`decode_engines` decode engines are the decode side's DP groups (Note [Many engines]
    in links.py)."""
    return family.plan_for(f"tp={prefill_tp}", f"tp={decode_tp},dp={decode_engines}", backend)


def served_family(settings, vllm_config, block_size: int = 0, ssm_dtype: str = "") -> Family:
    """The family of the served model, bound to it (Note [Bound families] in
    runtime/binding.py): the one `family` names, else the one whose `serves` lists the
    model's architecture for vLLM (Note [Spec path] in runtime/spec_path.py); params from
    the model's HF config, the page size from vLLM's block size (`block_size`: the one its
    KV cache config lays the page group out with, Note [Hybrid block size] in groups.py;
    0: cache_config's), the KV dtype from its cache dtype (the model's dtype when "auto"),
    the SSM dtype of state layers from the dtype vLLM keeps their recurrent state in. Raises SpecErrors (a BindError names the config
    key, its value and the spec line) or FamilyNotFound (naming where pdc looked)."""
    hf = vllm_config.model_config.hf_config
    if settings.family:
        family = Family.load(settings.py_name)
    else:
        archs = list(getattr(hf, "architectures", None) or [])
        if not archs:
            raise FamilyNotFound("pdc: the served model's config names no architecture; "
                                 "name the family in kv_connector_extra_config['family']")
        family = find_family("vllm", str(archs[0]), search_folders(settings.spec_path))
    cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
    if cache_dtype == "auto":
        cache_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    page = block_size or vllm_config.cache_config.block_size
    engine = {"page_size": page, "kv_dtype": cache_dtype}
    if ssm_dtype:
        engine["ssm_dtype"] = ssm_dtype
    return family.bind(hf.to_dict(), engine)
