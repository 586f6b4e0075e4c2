"""The parity tests are shuffled inside every run (tests/support/parity_order.py): only their
own slots move, each module stays whole, and a seed repeats an order."""

from __future__ import annotations

from dataclasses import dataclass

from .support import parity_order


@dataclass
class Item:
    nodeid: str


def _shuffled(seed: str, monkeypatch) -> list[str]:
    monkeypatch.setenv(parity_order.ENV, seed)
    monkeypatch.setattr(parity_order, "_seed", [])
    items = [Item("tests/a_test.py::x")]
    items += [Item(f"tests/parity/test_{m}.py::t{i}") for m in "pqr" for i in range(4)]
    items += [Item("tests/z_test.py::y")]
    parity_order.pytest_collection_modifyitems(None, None, items)
    return [i.nodeid for i in items]


def test_only_parity_slots_move_and_modules_stay_whole(monkeypatch):
    order = _shuffled("3", monkeypatch)
    assert order[0] == "tests/a_test.py::x" and order[-1] == "tests/z_test.py::y"
    modules = [n.split("::")[0] for n in order[1:-1]]
    assert [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m] == \
        sorted(set(modules), key=modules.index)  # each module's tests are contiguous
    assert sorted(order[1:-1]) == sorted(f"tests/parity/test_{m}.py::t{i}"
                                         for m in "pqr" for i in range(4))
    assert order == _shuffled("3", monkeypatch)  # the seed repeats the order
    assert order != _shuffled("4", monkeypatch)
    assert parity_order.order_line() == ("parity tests shuffled with seed 4 "
                                         "(PDC_PARITY_ORDER_SEED=4 pytest repeats the order)")


def test_off_keeps_file_order(monkeypatch):
    order = _shuffled("off", monkeypatch)
    assert order[1:5] == [f"tests/parity/test_p.py::t{i}" for i in range(4)]
