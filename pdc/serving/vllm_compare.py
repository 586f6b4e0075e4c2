"""`pdc vllm-demo --compare`: PdcConnector against vLLM's own PD connectors on the same engines.

Each backend runs the same model, prompts, engine settings and core binding (prefill on core
0, decode and the engine alone on core 1; Note [Engine threads] in pdc/serving/vllm_proxy.py):

- `pdc (ENGINE)`: PdcConnector over pdc's Mooncake or NIXL engine;
- `pdc, first token from prefill (ENGINE)`: the same engines, and the proxy streams prefill's
  token as the first one and decode continues from it (Note [First token from prefill] in
  integrations/vllm/scheduler.py; vLLM's own connectors cannot take that flow);
- `vLLM NixlConnector`, `vLLM MooncakeConnector` (TCP): vLLM's own connectors, with the CPU
  fixes of Note [vLLM's own connectors];
- `one engine`: a single vLLM engine serving the prompts itself, the floor the others are
  measured against ("over one engine" = TTFT minus this row's, p50 and p99);
- `pdc[knob=value] (ENGINE)`: PdcConnector with other runtime knobs (Note [Knob rows] in
  pdc/serving/knob_rows.py), from `--pdc-knobs`.

Every backend starts fresh engines in its own log folder; `--repeat N` runs them N times,
each repetition in another order (rotated), so that a load that comes and goes on the host
spreads over all of them, and the table shows the median over repetitions of each run's p50
and p99. Every generated token is compared with the reference engine's.

Note [vLLM's own connectors]: what they need on a CPU box, set here and nowhere else:
- NixlConnector: the `nixl` package (the small one that imports nixl-cu12's API; the vLLM
  environment installs it), `kv_buffer_device="cpu"`, `kv_role="kv_both"`, a side-channel
  port of its own per engine (VLLM_NIXL_SIDE_CHANNEL_PORT, host 127.0.0.1), and the engine
  put back on its core after start (on a CPU it moves the engine's thread to the last core
  of the NUMA node, pdc.serving.vllm_engine undoes that). UCX runs with the settings every engine of
  the demo gets (TCP over `lo`, engine_env), as pdc's NIXL engine does.
- MooncakeConnector: `mooncake_protocol: tcp` (its default is RDMA), a bootstrap port of its
  own on prefill (VLLM_MOONCAKE_BOOTSTRAP_PORT), VLLM_HOST_IP=127.0.0.1, prefill's engine id
  fixed by the demo, the proxy flow of Flow (pdc/serving/vllm_proxy.py), and in the engine process
  `torch.accelerator.current_device_index` answering 0 on a host without an accelerator
  (its worker asks for it and raises otherwise; pdc.serving.vllm_engine's `_cpu_fixes`).
"""

from __future__ import annotations

import socket
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from .host_load import busy_text, load_average
from .knob_rows import folder_name, knob_label
from .vllm_demo import print_timeline
from .vllm_proxy import DemoError, Engine, Flow, run_alone, run_pd, stop_engines

BACKENDS = ("pdc", "pdc-first", "nixl", "mooncake", "alone")
LABELS = {"nixl": "vLLM NixlConnector", "mooncake": "vLLM MooncakeConnector",
          "alone": "one engine", "pdc-first": "pdc, first token from prefill"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    backend: str
    rep: int
    logs: Path
    ttft_ms: list = field(default_factory=list)
    identical: int = 0
    errors: list = field(default_factory=list)
    # TTFT's parts per request: the prefill engine's own receipt -> answer, and the decode
    # engine's receipt -> first token (the one engine's TTFT for `alone`); the rest of TTFT
    # is the proxy and the hops between them
    prefill_ms: list = field(default_factory=list)
    decode_ms: list = field(default_factory=list)
    hops_ms: list = field(default_factory=list)
    second_ms: list = field(default_factory=list)  # the client's time to its second token

    @property
    def p50(self) -> float:
        return _pct(self.ttft_ms, 0.5)

    @property
    def p99(self) -> float:
        return _pct(self.ttft_ms, 0.99)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q * (len(ys) - 1))))]


def label(backend: str, engine_name: str) -> str:
    name = LABELS.get(backend, backend)
    return f"{name} ({engine_name})" if backend.startswith("pdc") else name


def run_backend(python: str, work: Path, model: str, family: str, engine_name: str,
                backend: str, rep: int, prompts: list[list[int]], ref: list[list[int]],
                max_tokens: int, in_flight: int, knobs_env: dict | None = None,
                warmup: list[list[int]] = ()) -> Run:
    """`knobs_env`: a pdc row's runtime knobs, for both of its engines; `warmup`: prompts
    the engines answer first, one at a time, outside the figures (Note [Warm servers] in
    sglang_demo.py: the cold first request was the p99 of most rows there)."""
    logs = work / f"rep{rep}-{folder_name(backend)}"
    logs.mkdir()
    run = Run(backend, rep, logs)
    engines: list[Engine] = []
    try:
        if backend == "alone":
            one = Engine(python, logs, "single", model, family, engine_name, core=1)
            engines.append(one)
            one.wait_up()
            if warmup:
                run_alone(one, list(warmup), max_tokens, 1)
            replies: dict = {}
            tokens, ttft = run_alone(one, prompts, max_tokens, in_flight, replies)
            errors = [""] * len(prompts)
            run.decode_ms = [t * 1e3 for t in ttft]
            run.second_ms = [replies[i]["second_s"] * 1e3 for i in range(len(prompts))]
        else:
            pre_env, dec_env, flow = {}, {}, Flow()
            if backend == "nixl":
                pre_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}
                dec_env = dict(pre_env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(_free_port()))
            elif backend == "mooncake":
                port = _free_port()
                pre_env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port),
                           "VLLM_HOST_IP": "127.0.0.1"}
                dec_env = dict(pre_env, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(_free_port()))
                flow = Flow(f"pdc-demo-prefill-{rep}", f"http://127.0.0.1:{port}", f"r{rep}")
            elif backend == "pdc-first":
                flow = Flow(first_token=True)
            connector = "pdc" if backend.startswith("pdc") else backend
            pre_env, dec_env = {**pre_env, **(knobs_env or {})}, {**dec_env, **(knobs_env or {})}
            pre = Engine(python, logs, "prefill", model, family, engine_name, core=0,
                         connector=connector, env=pre_env, engine_id=flow.mooncake_engine_id)
            engines.append(pre)
            pre.wait_up()
            dec = Engine(python, logs, "decode", model, family, engine_name, core=1,
                         connector=connector, env=dec_env)
            engines.append(dec)
            dec.wait_up()
            if warmup:
                run_pd(pre, dec, list(warmup), max_tokens, concurrency=1,
                       flow=replace(flow, tag=f"{flow.tag}w"))
            replies = {}
            second = [0.0] * len(prompts)
            tokens, _, ttft, errors, _ = run_pd(pre, dec, prompts, max_tokens,
                                             concurrency=in_flight, flow=flow,
                                             replies=replies, second=second)
            ok = [i for i, e in enumerate(errors) if not e]
            run.prefill_ms = [replies["prefill", i]["ttft_s"] * 1e3 for i in ok]
            run.decode_ms = [replies["decode", i]["ttft_s"] * 1e3 for i in ok]
            run.second_ms = [second[i] * 1e3 for i in ok]
            # with the first token from prefill, decode's time comes after the client's TTFT
            run.hops_ms = [ttft[i] * 1e3 - a - (0.0 if flow.first_token else b)
                           for i, a, b in zip(ok, run.prefill_ms, run.decode_ms, strict=True)]
        run.ttft_ms = [t * 1e3 for t, e in zip(ttft, errors, strict=True) if not e]
        run.identical = sum(t == r and not e for t, r, e in zip(tokens, ref, errors,
                                                                strict=True))
        run.errors = [f"prompt {i}: {e}" for i, e in enumerate(errors) if e] + \
            [f"prompt {i}: tokens differ from the engine alone" for i, (t, r, e) in
             enumerate(zip(tokens, ref, errors, strict=True)) if not e and t != r]
    except DemoError as e:
        run.errors.append(str(e))
    finally:
        stop_engines(engines)
    return run


def compare(python: str, work: Path, model: str, family: str, engine_name: str,
            prompts: list[list[int]], ref: list[list[int]], max_tokens: int, in_flight: int,
            repeat: int, backends: tuple[str, ...], phase,
            knob_envs: dict | None = None, warmup: list[list[int]] = ()) -> list[Run]:
    """Every backend `repeat` times, each repetition in another (rotated) order;
    `knob_envs`: the knobs of each pdc[...] backend."""
    runs = []
    for rep in range(repeat):
        order = backends[rep % len(backends):] + backends[:rep % len(backends)]
        for b in order:
            phase(f"repetition {rep + 1}/{repeat}: {label(b, engine_name)}")
            runs.append(run_backend(python, work, model, family, engine_name, b, rep, prompts,
                                    ref, max_tokens, in_flight, (knob_envs or {}).get(b),
                                    warmup))
    return runs


@dataclass(frozen=True)
class Row:
    backend: str
    runs: int
    identical: str
    p50_ms: float
    p99_ms: float
    over_p50_ms: float | None
    over_p99_ms: float | None
    # TTFT's parts (Run.prefill_ms, decode_ms), each the median over runs of its p50;
    # `hops_p50_ms`: the p50 of what TTFT leaves beside the two engines (proxy, hops)
    prefill_p50_ms: float | None = None
    hops_p50_ms: float | None = None
    decode_p50_ms: float | None = None
    second_p50_ms: float | None = None  # the client's time to its second token


def rows_of(runs: list[Run], engine_name: str, n_prompts: int) -> list[Row]:
    """One row per backend: medians over its runs; overhead over the `one engine` row."""
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.backend, []).append(r)
    med = {b: (statistics.median(r.p50 for r in rs), statistics.median(r.p99 for r in rs))
           for b, rs in by.items()}
    base = med.get("alone")
    out = []
    for b, rs in by.items():
        p50, p99 = med[b]
        pd = b != "alone"
        out.append(Row(label(b, engine_name), len(rs),
                       f"{sum(r.identical for r in rs)}/{n_prompts * len(rs)}", p50, p99,
                       None if base is None or not pd else p50 - base[0],
                       None if base is None or not pd else p99 - base[1],
                       _part(rs, lambda r: r.prefill_ms) if pd else None,
                       _part(rs, lambda r: r.hops_ms) if pd else None,
                       _part(rs, lambda r: r.decode_ms), _part(rs, lambda r: r.second_ms)))
    return out


def _part(runs: list[Run], of) -> float | None:
    """The median over runs of a part's p50; None when no run measured it."""
    p50s = [_pct(of(r), 0.5) for r in runs if of(r)]
    return statistics.median(p50s) if p50s else None


def print_rows(rows: list[Row], out, title: str) -> None:
    from ..console import print_table

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:+.0f}"

    print_table(("backend", "runs", "identical", "TTFT p50 ms", "TTFT p99 ms",
                 "over one engine p50", "p99"),
                [(r.backend, str(r.runs), r.identical, f"{r.p50_ms:.0f}", f"{r.p99_ms:.0f}",
                  ms(r.over_p50_ms), ms(r.over_p99_ms)) for r in rows], out,
                right=range(1, 7), title=title)
    if any(r.decode_p50_ms is not None for r in rows):
        print_parts(rows, out)


def print_parts(rows: list[Row], out) -> None:
    """Where each backend's TTFT goes: the prefill engine's own time, the proxy and hops
    beside the engines, and the decode engine's own time to its first token."""
    from ..console import print_table, wrap

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print_table(("backend", "prefill engine", "proxy and hops", "decode engine",
                 "2nd token"),
                [(r.backend, ms(r.prefill_p50_ms), ms(r.hops_p50_ms), ms(r.decode_p50_ms),
                  ms(r.second_p50_ms)) for r in rows], out, right=range(1, 5),
                title=wrap("TTFT's parts and the time to the second token, p50 ms (median "
                           "over repetitions); one engine: its own TTFT under decode engine; "
                           "first token from prefill: decode engine to its first token, the "
                           "client's second"))


def print_failures(runs: list[Run], engine_name: str, out=None) -> None:
    from ..console import wrap

    out = out if out is not None else sys.stdout
    for r in runs:
        for e in r.errors[:5]:
            print(wrap(f"  FAILED {label(r.backend, engine_name)} (repetition {r.rep + 1}): "
                       f"{e}", indent="    "), file=out)


def run_comparison(python, work, model, family, engine_name, prompts, ref, max_tokens, in_flight,
             repeat, with_others, timeline, phase, out, knob_rows: tuple[dict, ...] = (),
             warmup: list[list[int]] = ()) -> int:
    """`knob_rows`: one more pdc backend per environment of knobs (Note [Knob rows]);
    `warmup`: prompts every engine setup answers first, outside the figures."""
    from ..console import wrap

    knob_envs = {knob_label(k): k for k in knob_rows}
    backends = ("pdc", *knob_envs, *BACKENDS[1:]) if with_others else ("pdc", *knob_envs)
    load_before = load_average()
    runs = compare(python, work, model, family, engine_name, prompts, ref, max_tokens,
                   in_flight, repeat, backends, phase, knob_envs, warmup)
    print_rows(rows_of(runs, engine_name, len(prompts)), out, wrap(
        f"pdc vllm-demo: {len(prompts)} prompts, {in_flight} in flight, {repeat} "
        f"repetition(s) interleaved, {len(warmup)} warm-up request(s) per engine setup; "
        f"median over repetitions of each run's TTFT p50 / p99; "
        f"load average {load_before} before, {load_average()} after{busy_text()}"))
    print_failures(runs, engine_name, out)
    if timeline:
        for b in dict.fromkeys(r.backend for r in runs if r.backend.startswith("pdc")):
            print_timeline([r.logs for r in runs if r.backend == b], out,
                           f"{b} timeline ({engine_name}, every repetition)")
    return 0 if all(not r.errors for r in runs) else 1
