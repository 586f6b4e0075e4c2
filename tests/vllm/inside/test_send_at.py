"""Note [Sends at the first layer] (integrations/vllm/worker.py): a step's sends are queued at
its first save_kv_layer, so each layer is reported to pdc while the forward goes on; a request
whose proxy asked `pdc_send_at: "after_forward"` is queued at start_load_kv, after the forward
(the switch bench/vllm_send_at.py measures the two with). The scheduler carries the switch into
the step's metadata; the worker's calls are checked against a recording endpoint (a stand-in:
tests/vllm/test_vllm_faults.py and the bench run the real one)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from pdc.integrations.vllm.events import ForwardEvents
from pdc.integrations.vllm.metadata import PdcConnectorMetadata, SendReq
from pdc.integrations.vllm.worker import PdcWorker

from .test_scheduler import assert_empty, make_scheduler, model_dir, request, step  # noqa: F401


def test_the_scheduler_carries_each_requests_send_point(model_dir, caplog):  # noqa: F811
    s = make_scheduler(model_dir, "kv_producer")
    try:
        for rid, at in (("a", None), ("b", "after_forward"), ("c", "first_layer"),
                        ("d", "soon")):
            params = {"do_remote_decode": True} | ({"pdc_send_at": at} if at else {})
            s.add_request(request(rid, 40, params, max_tokens=1))
        with caplog.at_level(logging.ERROR, logger="pdc.vllm"):
            out, _ = step(s)
        assert [(r.req_id, r.after_forward) for r in out.kv_connector_metadata.send] == [
            ("a", False), ("b", True), ("c", False), ("d", False)]
        assert [r.getMessage() for r in caplog.records if r.name == "pdc.vllm"] == [
            "pdc: request d: kv_transfer_params['pdc_send_at'] is 'soon'; sending at the "
            "first layer\n  hint: use one of first_layer, after_forward"]
        step(s)
        step(s, sending={"a", "b", "c", "d"})
        assert_empty(s)
    finally:
        s.connector.shutdown()


class Recorder:
    """The calls a prefill endpoint gets, in order."""

    def __init__(self):
        self.calls: list[tuple] = []

    def sender(self, room):
        calls = self.calls

        class Sender:
            def send(self, pages, start, last, seq_len, slot=-1, stream=False, layer_slots=None):
                calls.append(("send", room, stream))

        return Sender()

    def layer_done(self, layer, event=None):
        self.calls.append(("layer", layer))

    def forward_done(self, event=None):
        self.calls.append(("forward_done",))


def test_first_layer_sends_go_before_the_forward_the_others_after_it():
    w = PdcWorker.__new__(PdcWorker)
    ep = Recorder()
    w.settings = SimpleNamespace(is_prefill=True, peer_tp=None)
    w.prefill_ep, w.senders, w._streaming, w.events = ep, {}, False, ForwardEvents()
    w._queued, w._queued_ids = None, set()
    meta = PdcConnectorMetadata(bootstrap="tcp://127.0.0.1:1", send=[
        SendReq("a", 1, (1, 2), 40), SendReq("b", 2, (3, 4), 40, after_forward=True)])
    w.bind(meta)
    for layer in (0, 1):
        w.save_kv_layer(f"model.layers.{layer}.self_attn.attn", meta)
    w.start_load_kv(meta)  # vLLM calls it after the forward when no load is synchronous
    w.wait_for_save()
    assert ep.calls == [("send", 1, True), ("layer", 0), ("layer", 1), ("send", 2, True),
                        ("forward_done",)]
    assert set(w.senders) == {"a", "b"}
    # the next step queues its own requests again
    nxt = PdcConnectorMetadata(bootstrap="tcp://127.0.0.1:1", send=[SendReq("c", 3, (5,), 9)])
    w.save_kv_layer("model.layers.0.self_attn.attn", nxt)
    assert ep.calls[-2:] == [("send", 3, True), ("layer", 0)]
