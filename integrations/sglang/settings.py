"""The SGLang backend's settings from the environment: the engine, the address pdc's endpoints
advertise, and the decode layout a test may force (Note [SGLang plan] in conn.py)."""

from __future__ import annotations

import os

from .regions import RefusedModel

ENGINE_ENV = "PDC_SGLANG_ENGINE"  # mooncake (default) | nixl
DECODE_ENV = "PDC_SGLANG_DECODE"  # Note [SGLang plan]
ENGINES = ("mooncake", "nixl")


def bootstrap_host() -> str:
    return os.environ.get("SGLANG_HOST_IP", "127.0.0.1")


def bootstrap_zmq(addr: str) -> str:
    return addr if addr.startswith("tcp://") else f"tcp://{addr}"


def parse_side(text: str, what: str) -> dict[str, int]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in ("tp", "pp", "dp") or not value.isdigit() or int(value) < 1:
            raise RefusedModel(f"pdc: {what}={text!r}: expected tp=N,pp=N,dp=N with N >= 1")
        out[key] = int(value)
    return out


def engine_name() -> str:
    name = os.environ.get(ENGINE_ENV, "mooncake")
    if name not in ENGINES:
        raise RefusedModel(f"pdc: {ENGINE_ENV}={name!r}; use one of {', '.join(ENGINES)}")
    return name
