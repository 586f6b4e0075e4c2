"""The SGLang backend's pages sent ahead of SGLang's send (Note [SGLang per-layer sends]),
without SGLang: the bookkeeping of SendsAhead against stand-in manager and sender objects.
The real servers are tests/integrations/test_sglang_servers.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pdc.integrations.sglang.layerwise import SendsAhead, drain_swapped, eligibility


class _Sender:
    """pdc's PrefillSender as SendsAhead uses it."""

    def __init__(self):
        self.sent = []
        self.pending = 0
        self.room = 5

    def send(self, pages, page_start, last, seq_len, stream=False):
        self.sent.append((list(pages), page_start, last, seq_len, stream))

    def writes_pending(self) -> bool:
        self.pending -= 1
        return self.pending >= 0


def _kv(sender=None, **mgr):
    mgr = SimpleNamespace(page_size=16, sent_ahead=0, swapped_pages=0, swapped=[], **mgr)
    kv = SendsAhead()
    kv.kv_mgr, kv.sender, kv.num_pages, kv.error, kv.idle = mgr, sender or _Sender(), 4, "", \
        False
    return kv


def test_pages_sent_ahead_are_skipped_when_sglang_sends_them_in_pieces():
    kv = _kv()
    kv.send_ahead([7, 8], 0, 32, stream=False)
    kv.send_ahead([9, 3], 32, 60, stream=True)
    assert kv.sender.sent == [([7, 8], 0, False, 32, False), ([9, 3], 2, False, 60, True)]
    assert (kv.queued_until, kv.kv_mgr.sent_ahead) == (60, 4)
    assert kv.match_ahead([7]) == []
    assert kv.match_ahead([8, 9, 3, 11]) == [11]
    assert kv.match_ahead([12]) == [12]
    assert (kv.kv_mgr.swapped, kv.kv_mgr.swapped_pages) == ([], 0)


def test_a_page_the_radix_cache_swapped_is_kept_and_its_writes_drained_first():
    kv = _kv()
    kv.send_ahead([7, 8, 9], 0, 40, stream=True)
    assert kv.match_ahead([7, 8, 25]) == []
    assert (kv.kv_mgr.swapped, kv.kv_mgr.swapped_pages) == ([kv.sender], 1)
    kv.sender.pending = 2  # two polls still pending, then drained
    drain_swapped(kv.kv_mgr)
    assert (kv.kv_mgr.swapped, kv.sender.pending) == ([], -1)


def test_only_a_writing_rank_after_bootstrap_sends_ahead():
    kv = _kv()
    assert kv.can_send_ahead()
    kv.num_pages = None  # before SGLang's init(): decode's prefix not known yet
    assert not kv.can_send_ahead()
    kv.num_pages, kv.idle = 4, True
    assert not kv.can_send_ahead()


def test_families_with_request_state_or_speculation_keep_the_after_forward_path():
    args = SimpleNamespace(speculative_algorithm=None, enable_two_batch_overlap=False)

    def why(writes=True, state_types=(), **server):
        mgr = SimpleNamespace(writes=writes, kv_args=SimpleNamespace(state_types=state_types),
                              server_args=SimpleNamespace(**{**vars(args), **server}))
        return eligibility(mgr)

    assert why() == ""
    assert why(writes=False) == \
        "this prefill rank writes nothing (Note [SGLang idle prefill rank])"
    assert why(state_types=("mamba",)) == \
        "the model keeps request state beside its pages (hybrid, DSA, SWA families)"
    assert why(speculative_algorithm="EAGLE") == \
        "the server speculates (the draft forward reuses layer ids)"
    assert why(enable_two_batch_overlap=True) == \
        "two-batch overlap runs each layer twice per forward"


def test_held_chunks_go_with_the_last_one_from_the_first_held_position(monkeypatch):
    """Note [SGLang held chunks]."""
    kv = _kv(family=SimpleNamespace(device="cuda:0"))
    kv.kv_mgr.kv_args = SimpleNamespace(state_types=())
    assert kv.hold([7, 8], 0, False) == ([7, 8], 0)  # "auto" on a GPU: each chunk as it comes
    monkeypatch.setenv("PDC_SGLANG_HOLD_CHUNKS", "1")
    assert kv.hold([7, 8], 3, False) is None
    assert kv.hold([9], 5, False) is None
    assert kv.hold([4, 2], 6, True) == ([7, 8, 9, 4, 2], 3)
    assert kv.held == ()
    assert kv.hold([5], 0, True) == ([5], 0)  # an unchunked request: nothing held
    monkeypatch.setenv("PDC_SGLANG_LAYER_SEND", "1")  # pages go before SGLang's send
    assert kv.hold([7], 0, False) == ([7], 0)
    monkeypatch.delenv("PDC_SGLANG_LAYER_SEND")
    kv.kv_mgr.kv_args = SimpleNamespace(state_types=("swa",))  # a window SGLang may free
    assert kv.hold([7], 0, False) == ([7], 0)


def test_held_chunks_by_default_where_the_kv_cache_is_in_host_memory(monkeypatch):
    """Note [SGLang held chunks]: "auto" holds on a CPU server, not on a GPU; 0 and 1 say so
    whatever the memory."""
    monkeypatch.delenv("PDC_SGLANG_HOLD_CHUNKS", raising=False)
    for device, value, held in (("", None, True), ("cuda:1", None, False), ("", "0", False),
                                ("cuda:1", "1", True), ("", "auto", True)):
        if value is not None:
            monkeypatch.setenv("PDC_SGLANG_HOLD_CHUNKS", value)
        kv = _kv(family=SimpleNamespace(device=device))
        kv.kv_mgr.kv_args = SimpleNamespace(state_types=())
        assert (kv.hold([7, 8], 0, False) is None) == held, (device, value)
    monkeypatch.setenv("PDC_SGLANG_HOLD_CHUNKS", "2")
    with pytest.raises(ValueError) as e:
        _kv(family=SimpleNamespace(device="")).hold([7], 0, False)
    assert str(e.value) == ("PDC_SGLANG_HOLD_CHUNKS='2' is not one of auto, 0, 1 (default "
                            "auto)")
