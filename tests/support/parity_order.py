"""The parity tests run in a shuffled order in every run, the seed in the summary.

Their results must not depend on which test ran first in the process (torch thread counts,
Note in tests/parity/conftest.py). Shuffling them inside the one run proves that without a
second pass over tests/parity (~8 min of CI). Modules stay whole (module-scoped fixtures
set up once): the module order and the test order inside each module are shuffled.
`PDC_PARITY_ORDER_SEED=N pytest` repeats an order; `PDC_PARITY_ORDER_SEED=off` keeps file order.
tests/conftest.py registers these hooks.
"""

from __future__ import annotations

import os
import random

ENV = "PDC_PARITY_ORDER_SEED"
FOLDER = "tests/parity/"
_seed: list[int | None] = []


def _order_seed() -> int | None:
    if not _seed:
        given = os.environ.get(ENV, "")
        _seed.append(None if given == "off" else int(given) if given.isdigit()
                     else random.SystemRandom().randrange(1 << 31))
    return _seed[0]


def order_line() -> str:
    """The line the terminal summary prints (the README's pytest runs with -q: no header)."""
    seed = _order_seed()
    if seed is None:
        return f"parity tests in file order ({ENV}=off)"
    return f"parity tests shuffled with seed {seed} ({ENV}={seed} pytest repeats the order)"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if any(r.nodeid.startswith(FOLDER) for key in ("passed", "failed", "error")
           for r in terminalreporter.stats.get(key, ())):
        terminalreporter.write_line(order_line())


def pytest_collection_modifyitems(session, config, items):
    seed = _order_seed()
    where = [i for i, item in enumerate(items) if item.nodeid.startswith(FOLDER)]
    if seed is None or not where:
        return
    modules: dict[str, list] = {}
    for i in where:
        modules.setdefault(items[i].nodeid.split("::")[0], []).append(items[i])
    rng = random.Random(seed)
    groups = list(modules.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    shuffled = [item for group in groups for item in group]
    for i, item in zip(where, shuffled, strict=True):
        items[i] = item
