"""A summary at the end of every pytest run: which tests were skipped, why, and how to run them.

The README's test command skips whole folders on a machine without the vLLM or SGLang
environments, a GPU or root; a bare "14 skipped" leaves a newcomer guessing whether they
matter. tests/conftest.py registers this module as a plugin.
"""

from __future__ import annotations

from collections import Counter

# (text a skip reason contains, how to enable those tests); the first match wins.
HOW_TO_ENABLE = (
    ("no vLLM environment", "build it with ./scripts/install-vllm.sh (~3-5 min, ~3.8 GB, once)"),
    ("no SGLang environment", "build it with ./scripts/install-sglang.sh (~5-20 min, ~3.9 GB, once)"),
    ("CUDA device", "run on a machine with CUDA GPUs (bench/run_gpu.sh, BENCHMARKS.md)"),
    ("not installed", "./scripts/install.sh installs Mooncake and NIXL"),
    ("could not import 'transformers'", "pip install -e '.[hf]'"),
    ("could not import 'torch'", "pip install -e '.[kernels]'"),
    ("needs root", "run pytest as root"),
    ("IPv6 loopback", "enable IPv6 on lo: sysctl -w net.ipv6.conf.lo.disable_ipv6=0"),
)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def summary_lines(reasons: list[str]) -> list[str]:
    """One line per distinct reason, most frequent first, each with how to enable it."""
    lines = []
    for reason, count in sorted(Counter(reasons).items(), key=lambda kv: (-kv[1], kv[0])):
        hint = next((how for key, how in HOW_TO_ENABLE if key in reason), None)
        lines.append(f"{count} skipped: {reason}")
        if hint is not None and hint not in reason:
            lines.append(f"    to run them: {hint}")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.section("why tests were skipped")
    for line in summary_lines([skip_reason(r) for r in skipped]):
        terminalreporter.write_line(line)
