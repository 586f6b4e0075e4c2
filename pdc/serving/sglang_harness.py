"""Real SGLang servers as subprocesses, for `pdc sglang-demo` and the SGLang tests.

Everything SGLang runs in the SGLang environment that scripts/install-sglang.sh builds (a
venv outside the clone; `sglang_python()` finds it). This module itself imports no SGLang:
it starts servers, waits for them, sends token-id prompts over HTTP and reads /metrics.

CPU settings (../shared/reference/sglang-on-cpu.md, docs/sglang.md): SGLANG_USE_CPU_ENGINE=1
(SGLang's CPU paths), SGLANG_HOST_IP=127.0.0.1 (bootstrap and engines on loopback),
MOONCAKE_PROTOCOL=tcp, SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0 (its early send of a
cached prefix calls torch.cuda.Event on the overlap scheduler), and decode's
`--disaggregation-decode-retraction-backup cpu_tensor` (the default host pool needs CUDA).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .sglang_models import (  # noqa: F401 - the harness's names for them
    CONFIG_FIXES,
    SEED_DTYPE,
    SERVER_ARGS,
    TINY_MODELS,
    WEIGHT_FIXES,
    served_dtype,
)

PAGE_SIZE = 16  # the spec's page_size
CHUNK_TOKENS = 64  # --chunked-prefill-size: a 300-token prompt is 5 chunks
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_TCP_ENABLE_CONNECTION_POOL": "true",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
    "OMP_NUM_THREADS": "1",  # two servers on a 2-core box; one thread each is deterministic
    "NO_PROXY": "127.0.0.1,localhost",
}


class HarnessError(RuntimeError):
    """A server did not start or answer; the message names it and its log."""


def sglang_python() -> str | None:
    """The SGLang environment's interpreter: $PDC_SGLANG_PYTHON, else the venv that
    scripts/install-sglang.sh linked as sglang-current in the cache folder."""
    explicit = os.environ.get("PDC_SGLANG_PYTHON")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    cache = Path(os.environ.get("PDC_CACHE_DIR", Path.home() / ".cache" / "pdc"))
    python = cache / "sglang-current" / "bin" / "python"
    return str(python) if (cache / "sglang-current" / ".pdc-complete").exists() and \
        python.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORTS_GIVEN: set[int] = set()
# SGLang's ports next to a server's own (`PortArgs.init_new`, server_args.py: its ZeroMQ ports
# from port + 233 on, under DP attention)
SGLANG_NEXT_PORTS = tuple(range(233, 241))


def harness_port(low: int = 20000, high: int = 29999, beside: tuple[int, ...] = ()) -> int:
    """A port for a server (HTTP, bootstrap, router, torch rendezvous), never one handed out
    before in this process, nor `beside` one (port + offset, ports the server derives).

    Note [Harness ports]: a port found free is bound by the server only seconds later (an
    SGLang server listens once its model is loaded). Drawn from the kernel's ephemeral range
    (free_port()), it was taken meanwhile by another socket's ephemeral port once in a while:
    the harness's own HTTP polls and the client's requests open one per connection, and a
    decode server failed to listen (EADDRINUSE, 2026-12-06). And SGLang draws its torch
    rendezvous port (`--nccl-port`) itself, at random below the ephemeral range, binding it
    at start too: a pair's two servers drew the same one and decode died (a CI run,
    2026-12-06). So every port the harness hands a server comes from here: below the ephemeral
    range, where the kernel never puts an ephemeral port, and from one memory, so that no two
    servers of this process get one port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]) - 1 - max(beside, default=0))
    except (OSError, ValueError, IndexError):
        pass
    drawn = min(256, high - low + 1)
    for port in random.sample(range(low, high + 1), drawn):
        wanted = {port} | {port + b for b in beside}
        if wanted & _PORTS_GIVEN:
            continue
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
        except OSError:
            continue
        _PORTS_GIVEN.update(wanted)
        return port
    raise HarnessError(f"no free port in {low}-{high}: each of the {drawn} drawn is bound or "
                       "already handed to a server of this process")


def make_tiny_model(python: str, out_dir: str, family: str = "llama",
                    overrides: dict | None = None) -> str:
    """Write a tiny model of TINY_MODELS (safetensors + config, no tokenizer) with the SGLang
    env's transformers; seed 0, so every run serves the same weights. `overrides` replace
    keys of the family's config."""
    config_class, model_class, config = TINY_MODELS[family]
    config = dict(config, **(overrides or {}))
    code = (
        "import sys, torch\n"
        f"from transformers import {config_class}, {model_class}\n"
        f"cfg = {config_class}(**{config!r}, torch_dtype='bfloat16', bos_token_id=1, "
        "eos_token_id=2)\n"
        "torch.manual_seed(0)\n"
        f"model = {model_class}(cfg)\n"
        f"{WEIGHT_FIXES.get(family, '')}"
        "model.to(torch.bfloat16).save_pretrained(sys.argv[1])\n"
        "import json, pathlib\n"
        "p = pathlib.Path(sys.argv[1]) / 'config.json'\n"
        f"fixes = {CONFIG_FIXES.get(family, {})!r}\n"
        "p.write_text(json.dumps({**json.loads(p.read_text()), **fixes}, indent=2))\n"
    )
    subprocess.run([python, "-c", code, out_dir], check=True, capture_output=True, timeout=300)
    return out_dir


@dataclass(frozen=True)
class TransformersCheck:
    """transformers' view of served tokens: its own greedy tokens (generate), and per prompt
    the largest amount by which its logit of a served token falls short of its best logit at
    that step, teacher-forced on the served tokens (0.0: every served token is its argmax)."""

    tokens: list[list[int]]
    shortfall: list[float]


def transformers_check(python: str, model: str, prompts: list[list[int]],
                       served: list[list[int]], max_new_tokens: int,
                       dtype: str = "bfloat16") -> TransformersCheck:
    """Run transformers' own implementation of the model (in the SGLang env, the
    transformers that wrote it), one thread, in the served `dtype`."""
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "torch.set_num_threads(1)\n"
        f"m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.{dtype}).eval()\n"
        "tokens, short = [], []\n"
        "for p, s in json.loads(sys.stdin.read()):\n"
        "    ids = torch.tensor([p])\n"
        "    g = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,\n"
        f"                   max_new_tokens={max_new_tokens}, min_new_tokens={max_new_tokens})\n"
        "    tokens.append(g[0, len(p):].tolist())\n"
        "    with torch.no_grad():\n"
        "        lg = m(torch.tensor([p + s])).logits[0, len(p) - 1:len(p) - 1 + len(s)]\n"
        "    lg = lg.float()\n"
        "    got = lg[torch.arange(len(s)), torch.tensor(s)]\n"
        "    short.append(float((lg.max(-1).values - got).max()) if s else 0.0)\n"
        "print(json.dumps([tokens, short]))\n"
    )
    done = subprocess.run([python, "-c", code, model], text=True, capture_output=True,
                          input=json.dumps([list(x) for x in zip(prompts, served, strict=True)]),
                          timeout=900)
    if done.returncode:
        raise HarnessError(f"transformers could not run {model}:\n{done.stderr[-2000:]}")
    tokens, shortfall = json.loads(done.stdout.strip().splitlines()[-1])
    return TransformersCheck(tokens, shortfall)


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: str

    def tail(self, lines: int = 30) -> str:
        try:
            with open(self.log, errors="replace") as f:
                text = [ln for ln in f.read().splitlines() if "Warning" not in ln]
            return "\n".join(text[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:  # not a group leader (a test's own process): itself
                self.proc.kill()
                self.proc.wait(timeout=10)
                return
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _spawn(name: str, argv: list[str], log_dir: str, env: dict[str, str]) -> subprocess.Popen:
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "w") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def start_server(python: str, model: str, name: str, log_dir: str, *, mode: str = "null",
                 backend: str = "pdc", bootstrap_port: int = 0, engine: str = "mooncake",
                 extra_env: dict | None = None, metrics: bool = True,
                 extra_args: tuple[str, ...] = (), tp: int = 1, host: str = "127.0.0.1",
                 netns: str = "") -> Server:
    """One SGLang server (plain, prefill or decode); returns at once, see wait_ready.

    `netns` starts it inside that network namespace (`ip netns exec`, Note [Namespace
    hosts]) listening on `host`, the namespace's address: SGLang's bootstrap host and pdc's
    bind host (control sockets, Mooncake's hostname) are that address too.

    `tp` > 1 runs SGLang's CPU tensor parallelism (gloo): one scheduler process per rank,
    each bound to one core (SGLANG_CPU_OMP_THREADS_BIND "0|1|..."; without it SGLang refuses
    more ranks than NUMA nodes, `utils/numa_utils.py:463`), so every rank runs one thread like
    a TP-1 server does."""
    port = harness_port(beside=SGLANG_NEXT_PORTS)  # Note [Harness ports]
    argv = [python, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
            "--skip-tokenizer-init", "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch", "--dtype", "bfloat16",
            "--max-total-tokens", "8192", "--max-running-requests", "16",
            "--chunked-prefill-size", str(CHUNK_TOKENS), "--page-size", str(PAGE_SIZE),
            "--host", host, "--port", str(port), "--log-level", "info"]
    if metrics:
        argv.append("--enable-metrics")
    if mode != "null":
        argv += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend,
                 "--disaggregation-bootstrap-port", str(bootstrap_port)]
        if mode == "decode":
            argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    if tp > 1:
        argv += ["--tp", str(tp)]
    if "--nccl-port" not in extra_args:
        argv += ["--nccl-port", str(harness_port())]
    argv += list(extra_args)
    env = dict(os.environ, **_host_env(host), PDC_SGLANG_ENGINE=engine, **(extra_env or {}))
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    cores = os.cpu_count() or 1
    if tp > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp))
    elif "OMP_PROC_BIND" not in (extra_env or {}):  # the caller's own binding, or "false"
        env.update(server_cores(mode, cores))
    proc = _spawn(name, argv, log_dir, env)
    return Server(name, f"http://{_url_host(host)}:{port}", proc,
                  os.path.join(log_dir, f"{name}.log"))


def server_cores(mode: str, cores: int) -> dict[str, str]:
    """Note [Server cores]: a TP-1 server's scheduler computes on one OpenMP thread; without
    a place of its own (SGLang binds it only on CPUs with AMX) the prefill and the decode
    scheduler share both cores of a 2-core box, and prefill's forward may take turns with
    decode's steps on one core. As the vLLM demo does (Note [Engine
    threads] in vllm_proxy.py), a prefill server goes on core 0, a decode server and a
    server alone on the last core: the launching process binds its main thread when OpenMP
    starts, and its tokenizer, scheduler and detokenizer processes and their threads (the
    transfer backend's too) inherit the place. Every backend's servers get the same places;
    the router and the client stay unbound."""
    core = 0 if mode == "prefill" else cores - 1
    return {"OMP_PROC_BIND": "true", "OMP_PLACES": f"{{{core}}}"}


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _host_env(host: str) -> dict[str, str]:
    """CPU_ENV for a server on `host`; off loopback, pdc binds its control sockets there."""
    if host == "127.0.0.1":
        return dict(CPU_ENV)
    return dict(CPU_ENV, SGLANG_HOST_IP=host, PDC_BIND_HOST=host,
                NO_PROXY=f"{CPU_ENV['NO_PROXY']},{host}")


def start_router(python: str, prefill: Server, bootstrap_port: int, decode: Server,
                 log_dir: str, *, more: tuple[tuple[Server, int] | Server, ...] = (),
                 host: str = "127.0.0.1", netns: str = "", mini_lb: bool = True,
                 extra_args: tuple[str, ...] = ()) -> Server:
    """SGLang's router in PD mode: its Python mini load balancer (random pairs, a fixed
    worker list), or with `mini_lb=False` the Rust router, whose worker list changes at run
    time (POST /workers, DELETE /workers/ID). `more` adds (prefill, bootstrap port) pairs and
    decode servers."""
    port = harness_port()
    argv = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url]
    for extra in more:
        argv += (["--prefill", extra[0].url, str(extra[1])] if isinstance(extra, tuple)
                 else ["--decode", extra.url])
    argv += ["--host", host, "--port", str(port)]
    argv += ["--mini-lb"] if mini_lb else ["--policy", "random", "--log-level", "info"]
    argv += list(extra_args)
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    proc = _spawn("router", argv, log_dir, dict(os.environ, **_host_env(host)))
    return Server("router", f"http://{_url_host(host)}:{port}", proc,
                  os.path.join(log_dir, "router.log"))


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read()


# SGLang logs it once its own warm-up request and the gc freeze after it are done: a server
# answers /model_info before, and a request sent then met the freeze (a plain server's third
# request took ~0.7 s where the rest took 10-35 ms, the p99 of every one-engine row).
WARMED = "The server is fired up and ready to roll!"
UNBOUND = "error while attempting to bind on address"  # uvicorn's words


def wait_ready(servers: list[Server], timeout_s: float, path: str = "/model_info",
               progress=None, every_s: float = 10.0, logged: str | None = WARMED) -> None:
    """Until every server answers `path` and, with `logged`, has that line in its log. A
    server that exits, or one still not ready after `timeout_s`, raises HarnessError with
    its log's tail, and so does one whose log says it could not listen. `progress(text)`
    hears, every `every_s`, which servers it still waits for and since when (a CPU server
    takes a minute or more to start)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    next_report = t0 + every_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                raise HarnessError(f"{s.name} exited with {s.proc.returncode} while starting; "
                                   f"{s.log}:\n{s.tail()}")
            try:
                _get(s.url + path, 2.0)
            except (urllib.error.URLError, OSError):
                if UNBOUND in s.tail(2_000):  # it would stay up without listening
                    raise HarnessError(f"{s.name} could not listen on its port; "
                                       f"{s.log}:\n{s.tail()}") from None
                continue
            if logged is None or logged in s.tail(10_000):
                pending.remove(s)
        if pending and time.monotonic() > deadline:
            raise HarnessError(f"{', '.join(s.name for s in pending)} not ready within "
                               f"{timeout_s:.0f} s; {pending[0].log}:\n{pending[0].tail()}")
        if pending and progress is not None and time.monotonic() >= next_report:
            next_report += every_s
            what = f"to answer {path}" + (" and finish its warm-up" if logged else "")
            progress(f"waiting for {', '.join(s.name for s in pending)} {what} "
                     f"({time.monotonic() - t0:.0f} s of at most {timeout_s:.0f} s)")
        if pending:
            time.sleep(min(1.0, every_s))


@dataclass
class Result:
    prompt: int
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    error: str = ""


def generate(url: str, input_ids: list[int], max_new_tokens: int, *, index: int = 0,
             timeout_s: float = 120.0, extra: dict | None = None,
             disconnect_after_s: float | None = None) -> Result:
    """Greedy generation of one prompt, streamed so that the first token's time is seen.
    With `disconnect_after_s` the client hangs up then (error "disconnected by the client")."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True}}
    body.update(extra or {})
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    res = Result(index)
    t0 = time.monotonic()
    read_timeout = timeout_s if disconnect_after_s is None else max(disconnect_after_s, 0.01)
    try:
        with urllib.request.urlopen(req, timeout=read_timeout) as r:
            for raw in r:
                if disconnect_after_s is not None and \
                        time.monotonic() - t0 > disconnect_after_s:
                    res.error = "disconnected by the client"
                    break
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[5:])
                if "error" in msg:
                    res.error = str(msg["error"])[:300]
                    break
                if not res.ttft_s:
                    res.ttft_s = time.monotonic() - t0
                res.tokens = list(msg.get("output_ids", res.tokens))
                finish = (msg.get("meta_info") or {}).get("finish_reason") or {}
                if finish.get("type") == "abort":
                    res.error = str(finish.get("message", "aborted"))[:300]
    except urllib.error.HTTPError as e:
        res.error = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        if disconnect_after_s is not None and isinstance(e, TimeoutError | socket.timeout):
            res.error = "disconnected by the client"
        else:
            res.error = f"{type(e).__name__}: {e}"[:300]
    res.total_s = time.monotonic() - t0
    return res


def run_prompts(url: str, prompts: list[list[int]], max_new_tokens: int, in_flight: int,
                on_done=None, timeout_s: float = 120.0) -> list[Result]:
    """Every prompt, `in_flight` at a time; results in prompt order."""
    results: list[Result | None] = [None] * len(prompts)
    lock = threading.Lock()
    next_index = [0]

    def worker():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(prompts):
                return
            results[i] = generate(url, prompts[i], max_new_tokens, index=i, timeout_s=timeout_s)
            if on_done is not None:
                on_done(results[i])

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(in_flight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def mixed_prompts(n: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """n prompts of mixed lengths: single pages, partial pages and several chunks."""
    lengths = (7, 300, 64, 17, 200, 130, 33, 257, 96, 150, 1, 250, 48, 190, 80, 275)
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])]
            for i in range(n)]


def metrics(url: str) -> dict[str, float]:
    """Prometheus text of a server's /metrics as {name{labels}: value} (samples summed
    over label sets that differ only in tp/pp/dp rank are left separate)."""
    out: dict[str, float] = {}
    for line in _get(url + "/metrics", 10.0).decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(samples: dict[str, float], name: str) -> float:
    """Sum of every sample of `name` (all label sets)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def transfer_totals(url: str) -> tuple[float, float]:
    """(transfers, bytes) a prefill server's /metrics has counted for pdc so far."""
    samples = metrics(url)
    return (metric_sum(samples, "sglang:kv_transfer_latency_ms_count"),
            metric_sum(samples, "sglang:kv_transfer_total_mb_sum") * 1024 * 1024)


def wait_transfers(url: str, before: tuple[float, float], count: int,
                   timeout_s: float = 30.0) -> tuple[float, float]:
    """(transfers, bytes) since `before`, once `count` more are counted: prefill's scheduler
    observes a transfer's metric when it next polls the sender, which may be after decode
    has replied (bounded wait; the caller asserts the figures)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = transfer_totals(url)
        if now[0] - before[0] >= count or time.monotonic() > deadline:
            return now[0] - before[0], now[1] - before[1]
        time.sleep(0.2)


@dataclass
class PDPair:
    """A prefill server, a decode server and SGLang's router, started together."""

    prefill: Server
    decode: Server
    router: Server
    bootstrap_port: int
    log_dir: str
    prefill_tp: int = 1
    decode_tp: int = 1

    @classmethod
    def start(cls, python: str, model: str, log_dir: str, *, backend: str = "pdc",
              engine: str = "mooncake", timeout_s: float = 600.0,
              prefill_env: dict | None = None, decode_env: dict | None = None,
              prefill_tp: int = 1, decode_tp: int = 1, server_args: tuple[str, ...] = (),
              decode_args: tuple[str, ...] = (), progress=None, hosts: tuple = (),
              secret_file: str = "") -> PDPair:
        """`server_args` go to both servers, `decode_args` to decode only. Note [SGLang
        plan]: prefill learns decode's TP from PDC_SGLANG_DECODE. `hosts` = (prefill,
        decode, router) namespace hosts (pdc.netns.Host) puts each on its own; call it
        inside the router's namespace (pdc.netns.inside), which reaches the other two.
        `secret_file` authenticates pdc's control plane (PDC_CONTROL_SECRET_FILE)."""
        bport = harness_port()
        auth = {"PDC_CONTROL_SECRET_FILE": secret_file} if secret_file else {}
        prefill_env = dict(prefill_env or {}, **auth)
        decode_env = dict(decode_env or {}, **auth)
        if backend == "pdc" and decode_tp != prefill_tp:
            prefill_env.setdefault("PDC_SGLANG_DECODE", f"tp={decode_tp}")
        name = f"{backend}-{engine}-tp{prefill_tp}to{decode_tp}"
        where = [dict(host=h.address, netns=h.namespace) for h in hosts] or [{}, {}, {}]
        prefill = start_server(python, model, f"{name}-prefill", log_dir,
                               mode="prefill", backend=backend, bootstrap_port=bport,
                               engine=engine, extra_env=prefill_env, tp=prefill_tp,
                               extra_args=server_args, **where[0])
        decode = start_server(python, model, f"{name}-decode", log_dir,
                              mode="decode", backend=backend, bootstrap_port=bport,
                              engine=engine, extra_env=decode_env, tp=decode_tp,
                              extra_args=server_args + decode_args, **where[1])
        pair = None
        try:
            wait_ready([prefill, decode], timeout_s, progress=progress)
            router = start_router(python, prefill, bport, decode, log_dir, **where[2])
            pair = cls(prefill, decode, router, bport, log_dir, prefill_tp, decode_tp)
            wait_ready([router], 120.0, path="/v1/models", progress=progress, logged=None)
            return pair
        except BaseException:
            for s in (prefill, decode) + ((pair.router,) if pair else ()):
                s.stop()
            raise

    def stop(self) -> None:
        for s in (self.router, self.decode, self.prefill):
            s.stop()

    def first_token_router(self, process: bool = False):
        """pdc's router for this pair, started (Note [SGLang first token from prefill]): the
        client's first token comes from prefill. `process`: as a process of its own, as
        SGLang's router runs, logging beside the servers. Stop it before the pair."""
        from urllib.parse import urlsplit

        from .sglang_router import FirstTokenRouter, Prefill, RouterProcess

        host = urlsplit(self.prefill.url).hostname or "127.0.0.1"
        prefills, decodes = [Prefill(self.prefill.url, host, self.bootstrap_port)], [self.decode.url]
        if process:
            return RouterProcess(prefills, decodes,
                                 os.path.join(self.log_dir, "pdc-router.log"), host)
        return FirstTokenRouter(prefills, decodes).start()


def start_plain(python: str, model: str, log_dir: str, timeout_s: float = 600.0,
                extra_args: tuple[str, ...] = (), tp: int = 1, progress=None,
                extra_env: dict | None = None) -> Server:
    plain = start_server(python, model, f"plain-tp{tp}", log_dir, metrics=False,
                         extra_args=extra_args, tp=tp, extra_env=extra_env)
    try:
        wait_ready([plain], timeout_s, progress=progress)
    except BaseException:
        plain.stop()
        raise
    return plain
