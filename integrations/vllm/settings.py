"""The connector's settings, read once from `kv_connector_extra_config` and checked.

Every bad value is refused at engine start with the key, the value and the fix, so a typo
never shows up later as a hung or silently local request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINES = ("mooncake", "nixl")
ROLES = ("kv_producer", "kv_consumer")
KEYS = ("family", "engine", "knobs", "peer_tp", "host", "spec_path", "decode_engines",
        "decode_index")


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class PdcSettings:
    # spec family name, e.g. "vllm-llama" (generated module pdc.generated.vllm_llama); "":
    # the family whose `serves` names the served model's architecture, found on the spec path
    # (Note [Spec path] in runtime/spec_path.py) and bound to the model at start
    family: str
    engine: str  # transfer engine: mooncake | nixl
    role: str  # kv_producer (prefill) | kv_consumer (decode)
    peer_tp: int | None  # the other side's TP when known at start (else from the request)
    host: str  # address the prefill bootstrap service advertises
    knobs: dict = field(default_factory=dict)  # pdc runtime knobs (pdc.runtime.knobs)
    spec_path: tuple[str, ...] = ()  # folders of user specs, searched before PDC_SPEC_PATH
    # Note [Many engines] (links.py): the decode engines the prefill engines serve, the same
    # on every engine (the plan's decode DP groups), and this decode engine's group
    decode_engines: int = 1
    decode_index: int = 0

    @property
    def py_name(self) -> str:
        return self.family.replace("-", "_")

    @property
    def is_prefill(self) -> bool:
        return self.role == "kv_producer"


def _where(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def parse_settings(role: str, extra: dict | None) -> PdcSettings:
    extra = dict(extra or {})
    if role not in ROLES:
        raise SettingsError(f"kv_role {role!r}: PdcConnector runs as kv_producer (prefill) or "
                            f"kv_consumer (decode)\n  hint: set KVTransferConfig(kv_role=...) to "
                            f"one of {', '.join(ROLES)}")
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise SettingsError(f"{_where(unknown[0])}: unknown setting\n  hint: PdcConnector "
                            f"reads {', '.join(KEYS)}")
    family = extra.get("family", "")
    if not isinstance(family, str):
        raise SettingsError(f"{_where('family')}: {family!r} is not a family name\n  hint: "
                            f"name the spec family, e.g. \"vllm-llama\", or leave it out to "
                            f"take the spec that serves the model's architecture")
    spec_path = extra.get("spec_path", [])
    if isinstance(spec_path, str):
        spec_path = [spec_path]
    if not isinstance(spec_path, list) or not all(isinstance(p, str) and p for p in spec_path):
        raise SettingsError(f"{_where('spec_path')}: expected a folder or a list of folders "
                            f"of specs, got {spec_path!r}")
    engine = extra.get("engine", "mooncake")
    if engine not in ENGINES:
        raise SettingsError(f"{_where('engine')}: {engine!r} is not a transfer engine pdc "
                            f"runs inside vLLM\n  hint: use one of {', '.join(ENGINES)}")
    peer_tp = extra.get("peer_tp")
    if peer_tp is not None and (not isinstance(peer_tp, int) or isinstance(peer_tp, bool)
                                or peer_tp < 1):
        raise SettingsError(f"{_where('peer_tp')}: {peer_tp!r} is not a TP size (an int >= 1)")
    knobs = extra.get("knobs", {})
    if not isinstance(knobs, dict):
        raise SettingsError(f"{_where('knobs')}: expected a mapping of pdc knob names to "
                            f"values, got {type(knobs).__name__}")
    host = extra.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise SettingsError(f"{_where('host')}: expected a host name or address")
    counts = {}
    for key in ("decode_engines", "decode_index"):
        v = extra.get(key, 1 if key == "decode_engines" else 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < (key == "decode_engines"):
            least = 1 if key == "decode_engines" else 0
            raise SettingsError(f"{_where(key)}: {v!r} is not an int >= {least}")
        counts[key] = v
    if counts["decode_index"] >= counts["decode_engines"]:
        raise SettingsError(
            f"{_where('decode_index')}: {counts['decode_index']} is not below decode_engines "
            f"{counts['decode_engines']}\n  hint: number the decode engines 0 to "
            f"decode_engines - 1 and give every engine, prefill too, the same decode_engines")
    return PdcSettings(family, engine, role, peer_tp, host, knobs, tuple(spec_path), **counts)


def check_parallel(vllm_config) -> None:
    """Refuse at engine start what the connector cannot serve, before any request comes."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise SettingsError(
            f"PdcConnector: pipeline_parallel_size {pp}: pdc's vLLM connector moves the KV of "
            f"one pipeline stage\n  hint: start the engine with pipeline_parallel_size=1 "
            f"(spread the model with tensor_parallel_size, or run more engines)")
