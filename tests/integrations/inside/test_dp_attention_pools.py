"""DP attention with SGLang's own pool classes driven through pdc's backend classes, real
Mooncake engines moving the bytes (issue 30: where a configuration needs more than the CPU
box runs fast, its layout is proven with SGLang's pool classes, not pdc's harness layouts).

Two prefill schedulers and one or two decode schedulers of the tiny MLA model, each as SGLang
0.5.23 builds it with `--dp 2 --enable-dp-attention`: its own `MLATokenToKVPool` and
`MetadataBuffers` (mem_cache/memory_pool.py, disaggregation/utils.py), KVArgs filled as
disaggregation/prefill.py fills them, and pdc's PdcKVManager / PdcKVSender / PdcKVReceiver
driven in the order SGLang's scheduler calls them. The schedulers' place in the layout is what
SGLang's ParallelContext says for each (Note [SGLang DP attention]); everything else is pdc's
backend as a server runs it (one engine and endpoint per scheduler, pdc's bootstrap table).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
from pdc.integrations.sglang import conn as C
from pdc.integrations.sglang.family import ParallelLayout
from pdc.runtime import knobs
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from pdc.serving.sglang_harness import TINY_MODELS, free_port

PAGE = 16
PAGES = 12  # per pool, plus SGLang's padding page 0
LATENT, ROPE, LAYERS = 32, 16, 2
ROWS = 8  # metadata rows
ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MOONCAKE_PROTOCOL": "tcp",
       "MC_TCP_ENABLE_CONNECTION_POOL": "true", "PDC_SGLANG_ENGINE": "mooncake"}


class Scheduler:
    """One SGLang scheduler's transfer state: its pools, KVArgs and pdc's manager."""

    def __init__(self, mode, group: int, groups: int, model: str, bootstrap_port: int):
        self.pool = MLATokenToKVPool(size=PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                     kv_lora_rank=LATENT, qk_rope_head_dim=ROPE,
                                     layer_num=LAYERS, device="cpu",
                                     enable_memory_saver=False)
        self.meta = MetadataBuffers(ROWS, hidden_size=16, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=16)
        args = KVArgs()
        args.engine_rank = group  # prefill.py: the scheduler's TP rank (attention TP 1)
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = \
            self.pool.get_contiguous_buf_infos()
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_types, args.state_data_ptrs = [], []
        args.page_size, args.kv_cache_dtype_str, args.prefill_start_layer = PAGE, "auto", 0
        server_args = SimpleNamespace(model_path=model, dtype="bfloat16", tp_size=2, port=30000,
                                      disaggregation_bootstrap_port=bootstrap_port,
                                      layout=ParallelLayout(1, 0, groups, group))
        self.mgr = C.PdcKVManager(args, mode, server_args, is_mla_backend=True)

    def page(self, layer: int, page: int) -> torch.Tensor:
        return self.pool.kv_buffer[layer][page * PAGE:(page + 1) * PAGE].clone()


@pytest.fixture(scope="module", params=[2, 1], ids=["dp2-to-dp2", "dp2-to-dp1"])
def schedulers(request, tmp_path_factory):
    decode_groups = request.param
    saved = {k: os.environ.get(k) for k in (*ENV, C.DECODE_ENV)}
    os.environ.update(ENV, **{C.DECODE_ENV: f"tp=1,dp={decode_groups}"})
    real_layout = C.parallel_layout
    C.parallel_layout = lambda server_args: server_args.layout  # SGLang's ParallelContext
    knobs.override(transfer_timeout_s=4.0, prefill_room_timeout_s=8.0)
    model = tmp_path_factory.mktemp("mla")
    config = dict(TINY_MODELS["deepseek-mla"][2], architectures=["DeepseekV3ForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    port = free_port()
    table = C.PdcKVBootstrapServer("127.0.0.1", port)
    made = []
    try:
        prefill = [Scheduler(DisaggregationMode.PREFILL, g, 2, str(model), port)
                   for g in range(2)]
        made += prefill
        decode = [Scheduler(DisaggregationMode.DECODE, g, decode_groups, str(model), port)
                  for g in range(decode_groups)]
        made += decode
        gen = torch.Generator().manual_seed(7)
        for g, s in enumerate(prefill):  # each prefill group's latents are its own
            for buf in s.pool.kv_buffer:
                buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype) + 10 * g)
        addr = f"127.0.0.1:{port}"
        for d in decode:
            deadline = time.monotonic() + 60
            while not d.mgr.try_ensure_parallel_info(addr):
                assert time.monotonic() < deadline, "decode endpoint never opened"
            assert d.mgr.endpoint_errors == {}
            assert d.mgr.prefill_info_table[addr].dp_size == 2
        yield SimpleNamespace(prefill=prefill, decode=decode, addr=addr)
    finally:
        knobs.reset()
        C.parallel_layout = real_layout
        for s in made:
            ep = getattr(s.mgr, "endpoint", None)
            for e in ([ep] if ep else []) + list(getattr(s.mgr, "endpoints", {}).values()):
                e.close()
        table.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait(*handles, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        states = [h.poll() for h in handles]
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in states) or \
                time.monotonic() > deadline:
            return states
        time.sleep(0.01)


def transfer(s, room: int, prefill_group: int, decode_group: int, told_group: int,
             prefill_pages, decode_pages, row: int):
    """One request as SGLang's schedulers run it: decode's receiver told `told_group` (the
    router's prefill_dp_rank), prefill's sender in `prefill_group` (where SGLang put it)."""
    rv = C.PdcKVReceiver(s.decode[decode_group].mgr, s.addr, room)
    rv.init(told_group)
    tx = C.PdcKVSender(s.prefill[prefill_group].mgr, s.addr, room)
    deadline = time.monotonic() + 30
    while rv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    rv.send_metadata(decode_pages, aux_index=row)
    while tx.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    s.prefill[prefill_group].meta.output_ids[row].fill_(100 + room % 1000)
    tx.init(len(prefill_pages), aux_index=row)
    tx.send(prefill_pages, num_kv_tokens=len(prefill_pages) * PAGE)
    return rv, tx


@pytest.mark.parametrize("prefill_group", [0, 1])
def test_each_requests_latents_come_from_its_prefill_group_into_its_decode_group(
        schedulers, prefill_group):
    s = schedulers
    decode_group = (prefill_group + 1) % len(s.decode)  # crossed where there are two
    # the room points at the other prefill group: only the router's choice finds the pages
    room = 9_000_000 + 2 * prefill_group + (1 - prefill_group)
    other = [d for g, d in enumerate(s.decode) if g != decode_group]
    before = [d.pool.kv_buffer[0].clone() for d in other]
    src, dst = [3, 5], [7 + prefill_group, 2]
    rv, tx = transfer(s, room, prefill_group, decode_group, prefill_group, src, dst, row=1)
    assert _wait(rv, tx) == [KVPoll.Success, KVPoll.Success], (rv.error, tx.error)
    d = s.decode[decode_group]
    for layer in range(LAYERS):
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(d.page(layer, b), s.prefill[prefill_group].page(layer, a))
    assert int(d.meta.output_ids[1][0]) == 100 + room % 1000
    assert [torch.equal(x.pool.kv_buffer[0], b) for x, b in zip(other, before, strict=True)] \
        == [True] * len(other)  # the other decode group saw nothing
    rv.clear()


def test_a_decode_looking_in_the_other_prefill_group_fails_and_writes_nothing(schedulers):
    s = schedulers
    d = s.decode[0]
    before = d.pool.kv_buffer[0].clone()
    rv, tx = transfer(s, 9_100_001, prefill_group=1, decode_group=0, told_group=0,
                      prefill_pages=[4], decode_pages=[11], row=2)
    states = _wait(rv, timeout_s=20)
    assert states == [KVPoll.Failed]
    with pytest.raises(C.PdcTransferError) as e:
        rv.failure_exception()
    assert str(e.value).startswith("pdc: room 9100001: ")
    assert torch.equal(d.pool.kv_buffer[0], before)
    tx.abort()


def test_a_prefill_group_the_plan_lacks_fails_the_request_naming_it(schedulers):
    rv = C.PdcKVReceiver(schedulers.decode[0].mgr, schedulers.addr, 9_200_000)
    rv.init(2)
    assert rv.poll() == KVPoll.Failed
    assert rv.error == "room 9200000: prefill dp group 2 does not exist (the plan has 2)"
