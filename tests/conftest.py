"""Fixtures that tests in several folders share.

Folder-specific ones live beside their tests (tests/runtime/conftest.py: endpoint pairs;
tests/parity/conftest.py: the torch thread count).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .compiler.spec_patches import write_bad_spec
from .support import module_times, parity_order, skip_summary

# The parity tests shuffled in every run (tests/support/parity_order.py).
from .support.parity_order import pytest_collection_modifyitems  # noqa: F401


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Why tests were skipped and how to run them; the slowest test files; the parity tests'
    order seed."""
    skip_summary.pytest_terminal_summary(terminalreporter, exitstatus, config)
    module_times.pytest_terminal_summary(terminalreporter, exitstatus, config)
    parity_order.pytest_terminal_summary(terminalreporter, exitstatus, config)


@pytest.fixture
def bad_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """`bad_spec(NAME)` writes bad-spec case NAME (mini.yaml with bad_specs/NAME.patch applied,
    Note [Bad specs as patches]) under a temporary working directory and returns the path to
    give `pdc validate`, which is also the name its diagnostics print: bad_specs/NAME.yaml."""
    monkeypatch.chdir(tmp_path)
    return lambda name: write_bad_spec(tmp_path, name)
