"""The serving-engine demos: harnesses that start real vLLM and SGLang engines as processes
and drive requests through them with pdc's integrations (`pdc vllm-demo`, `pdc sglang-demo`,
tests/vllm/, tests/integrations/, bench/sglang_ttft.py).

Kept out of `integrations/` on purpose: the integrations are product code that runs inside
a serving engine and imports only the runtime, while these harnesses are drivers around the
engines that print through the command line's console (docs/architecture.md, Folders).
"""
