"""The connector's settings, read once from `kv_connector_extra_config` and checked.

Every bad value is refused at engine start with the key, the value and the fix, so a typo
never shows up later as a hung or silently local request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINES = ("mooncake", "nixl")
ROLES = ("kv_producer", "kv_consumer")
KEYS = ("family", "engine", "knobs", "peer_tp", "host")


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class PdcSettings:
    family: str  # spec family name, e.g. "vllm-llama" (generated module pdc.generated.vllm_llama)
    engine: str  # transfer engine: mooncake | nixl
    role: str  # kv_producer (prefill) | kv_consumer (decode)
    peer_tp: int | None  # the other side's TP when known at start (else from the request)
    host: str  # address the prefill bootstrap service advertises
    knobs: dict = field(default_factory=dict)  # pdc runtime knobs (pdc.runtime.knobs)

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
    family = extra.get("family")
    if not isinstance(family, str) or not family:
        raise SettingsError(f"{_where('family')}: missing; name the spec family whose "
                            f"layout matches the model, e.g. \"vllm-llama\"")
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
    return PdcSettings(family, engine, role, peer_tp, host, knobs)


def check_parallel(vllm_config) -> None:
    """Refuse at engine start what the connector cannot serve, before any request comes."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise SettingsError(
            f"PdcConnector: pipeline_parallel_size {pp}: pdc's vLLM connector moves the KV of "
            f"one pipeline stage\n  hint: start the engine with pipeline_parallel_size=1 "
            f"(spread the model with tensor_parallel_size, or run more engines)")
