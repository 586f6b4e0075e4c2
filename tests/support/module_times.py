"""A summary at the end of every pytest run: the test files that took longest, all phases.

CI's time limit is 90 minutes and the project keeps it under 45; the 25 slowest tests
(`--durations=25`) say which test is slow, not which file's servers cost the run its
minutes: a module-scoped fixture's start is charged to the first test only. This sums
setup, call and teardown per file. tests/conftest.py registers this module as a plugin.
"""

from __future__ import annotations

from collections import defaultdict

SHOWN = 15  # files listed


def file_seconds(reports) -> dict[str, float]:
    """Seconds per test file over every report that carries a duration."""
    seconds: dict[str, float] = defaultdict(float)
    for report in reports:
        duration = getattr(report, "duration", None)
        nodeid = getattr(report, "nodeid", "")
        if duration is not None and nodeid:
            seconds[nodeid.split("::", 1)[0]] += duration
    return dict(seconds)


def summary_lines(seconds: dict[str, float], shown: int = SHOWN) -> list[str]:
    """The `shown` slowest files, slowest first, then the rest as one line."""
    ranked = sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [f"{s:8.1f}s  {path}" for path, s in ranked[:shown]]
    rest = ranked[shown:]
    if rest:
        lines.append(f"{sum(s for _, s in rest):8.1f}s  the other {len(rest)} files")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    reports = [r for rs in terminalreporter.stats.values() for r in rs]
    seconds = file_seconds(reports)
    if not seconds:
        return
    terminalreporter.section(f"slowest {min(SHOWN, len(seconds))} test files (setup + call + "
                             f"teardown; {sum(seconds.values()):.0f} s in all)")
    for line in summary_lines(seconds):
        terminalreporter.write_line(line)
