"""Tests that import vLLM run only under the vLLM environment's python (Note [vLLM
environment] in scripts/install-vllm.sh); pdc's own test run reaches them through
tests/vllm/test_inside_vllm.py, which runs this folder there."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
