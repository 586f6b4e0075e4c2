"""Serving-engine integrations: pdc as the PD transfer layer inside real serving engines.

Each subpackage imports its engine (vllm, sglang) at import time and is imported only by that
engine, in that engine's environment; the rest of pdc never imports them.
"""
