"""`pdc parity`: real transformers models through pdc, tokens and logits bit for bit.

One run (a *case*) is one family, one topology, one engine and one dtype; see
docs/parity.md for the design. The model is a transformers one for the hf-* specs and a toy
of pdc.verify for the seed systems (Note [Parity models]); the harness is the same. In short:

- The parent (the CLI, or a test) loads the spec, lowers the plan, allocates the request's
  page / slot / window ids at random, and checks that the spec fits what the tiny model's
  cache exports (pdc.verify.hf_adapter.check_binding). It never imports torch.
- Worker processes (`ParityWorkers`, reusable across cases: a worker takes whatever rank a
  case gives it) play the ranks. Prefill ranks build the tiny random-weight model
  (pdc.verify.hf_state, seed 0), run the prompt as chunked prefill, and after each chunk place the
  state in their pools (their attention-TP share of every item, runtime.labels.project) and
  send the chunk through their PrefillEndpoint and the real engine.
- Decode ranks receive into their pools, then ship their items over a multiprocessing queue
  to one decode-model process (decode rank pp0.tp0), which stands in for decode's own TP
  all-gather: it merges the shares (runtime.labels.merge, which also checks that replicas
  agree), rebuilds the cache (pdc.verify.hf_state.import_state) and generates greedily. It also
  runs the single-process reference: the same chunked prefill and greedy decode on one
  cache in one process.
- The parent compares tokens and logits of every step bitwise, and the rebuilt state with
  the prefill's export tensor by tensor, and prints the verdict.

Note [Parity reference]: chunked prefill is not bitwise equal to one forward over the
prompt (other GEMM shapes: logits differ by ~1e-7 in float32), so "single-process
generation" is the same chunk schedule on one cache in one process. With one chunk
covering the prompt it is exactly pdc.verify.hf_state.aggregate_generate.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import queue
import struct
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from pdc.runtime.plan_types import dp_group_of_room

from .hf_adapter import (
    BINDINGS,
    Binding,
    bound_entries,
    check_binding,
    from_items,
    item_ids,
    state_key,
    to_items,
)
from .ranks import (
    ROLE_DECODE,
    ROLE_PREFILL,
    Processes,
    RankCrash,
    Req,
    allocate,
    bootstrap_server,
    chunk_plan,
    open_endpoint,
    send_chunk,
)

DTYPES = ("float32", "bfloat16")
ROOM = 1001  # odd: allocate() gives it shuffled (fragmented) pages
POISON = 0xA5  # decode items before the transfer: every state byte must be overwritten
DEFAULT_THREADS = 1  # torch threads per worker; equal everywhere (thread count changes bits)


class ParityError(Exception):
    """A problem with the request (spec, topology, options): printed, never a traceback.
    `diagnostics` holds the compiler's Diagnostics when the text is theirs (file:line:
    error: ...)."""

    def __init__(self, message: str, diagnostics: tuple = ()):
        super().__init__(message)
        self.diagnostics = diagnostics


@dataclass(frozen=True)
class Case:
    """Everything the workers need for one run; travels to them pickled."""

    job: int
    family: str
    py_name: str
    binding: Binding
    dtype: str
    engine: str
    plan_json: str
    layout: object | None  # a FamilyLayout when overrides make it differ from generated/
    prompt: tuple[int, ...]
    chunk_tokens: int
    steps: int
    ids: dict  # side -> the request's pool ids (pdc.verify.ranks.allocate)
    pages: int
    slots: int
    roles: tuple  # per worker index: (side, pp, tp, dp group) of the rank it plays
    model_worker: int
    timeout_s: float
    describe: str = ""  # the topology, for messages
    fingerprint: int = 0  # of the spec as evaluated, when `layout` is shipped
    params: tuple[tuple[str, int], ...] = ()  # the spec's evaluated params (the toys' sizes)
    decode_group: int = 0  # the request's decode DP group; the other groups' ranks idle


@dataclass
class Outcome:
    prefill: dict = field(default_factory=dict)  # (pp, tp) -> result dict
    decode: dict = field(default_factory=dict)  # (pp, tp) of the request's DP group
    idle: dict = field(default_factory=dict)  # (dp group, pp, tp) of the idle decode ranks
    model: dict | None = None
    wall_s: float = 0.0


# ~~~ worker processes ~~~


def _expect(cmd_q, kind: str, job: int):
    msg = cmd_q.get()
    if msg is None or msg[0] != kind or msg[1] != job:
        raise RuntimeError(f"expected {kind!r} of job {job}, got {msg!r}")
    return msg[2] if len(msg) > 2 else None


class _Worker:
    """One worker process: engines and models are kept across cases."""

    def __init__(self, index: int, gather_q, threads: int):
        import torch
        import transformers

        from pdc.verify import hf_state as H

        torch.set_num_threads(threads)
        # Import every family's modeling code now, while the workers start side by side,
        # not in the first case that needs it.
        for recipe in H.FAMILIES.values():
            getattr(transformers, recipe.config_class)
            getattr(transformers, recipe.model_class)
        self.index = index
        self.gather_q = gather_q
        self.engines: dict = {}
        self.models: dict = {}

    def model(self, binding: Binding, layout, params: tuple, dtype: str):
        """The case's model (Note [Parity models] in pdc/verify), kept across cases."""
        from pdc.verify import models

        name = binding.model_name
        key = (name, dtype) + ((layout, params) if name.startswith("verify:") else ())
        if key not in self.models:
            self.models[key] = models.build(name, layout, dict(params), dtype)
        return self.models[key]

    def engine(self, name: str):
        from pdc.runtime.engines import make_engine

        if name not in self.engines:
            self.engines[name] = make_engine(name)
        return self.engines[name]

    def close(self) -> None:
        for e in self.engines.values():
            e.close()

    # ~~~ probe: what the model's cache exports ~~~

    def probe(self, binding: Binding, layout, params: tuple, dtype: str, n_tokens: int) -> dict:
        import torch

        model = self.model(binding, layout, params, dtype)
        prompt = torch.full((n_tokens,), 3, dtype=torch.long)
        *_, (cache, _) = model.chunked_prefill(prompt, [(0, n_tokens)])
        rows = model.describe_state(model.export_state(cache))
        return {"rows": rows, "vocab_size": model.vocab_size}

    # ~~~ one case ~~~

    def run(self, case: Case, cmd_q, res_q) -> None:
        from pdc.runtime import knobs
        from pdc.runtime.family import Family
        from pdc.runtime.plan_types import Plan, RankId
        from pdc.runtime.pools import Capacity, RankPools

        knobs.override(transfer_timeout_s=case.timeout_s)
        side, pp, tp, group = case.roles[self.index]
        # A decode rank of another DP group than the request's: it registers and connects
        # like the others, then must see none of its bytes written (DP attention's idle rank).
        idle = side == ROLE_DECODE and group != case.decode_group
        if case.layout is not None:
            # Overrides that change layer ids or components (a scaled toy) need wire
            # bindings of their own: the runtime Family of the shipped layout has them.
            layout = case.layout
            wire = Family(layout, "", case.fingerprint, ())
        else:
            family = Family.load(case.py_name)  # also the codec of its control messages
            layout, wire = family.layout, family
        plan = Plan.from_json(case.plan_json)
        rank = RankId(pp, tp)
        boot = None
        if side == ROLE_PREFILL and (pp, tp) == (0, 0):
            boot = bootstrap_server(plan)
            res_q.put(("bootstrap", case.job, boot.address))
        address = _expect(cmd_q, "bootstrap", case.job)
        engine = self.engine(case.engine)
        cap = Capacity(pages=case.pages, slots=case.slots, aux_rows=case.slots,
                       window_pages=case.pages)
        pools = RankPools(layout, plan.registration(side, rank), cap)
        ep, report = None, None
        try:
            ep = open_endpoint(side, layout, wire, plan, rank, group, engine, pools, address)
            if idle:
                pools.arena[:] = POISON
            res_q.put(("ready", case.job, self.index))
            _expect(cmd_q, "go", case.job)
            if side == ROLE_PREFILL:
                res_q.put(("prefilled", case.job, (pp, tp),
                           self.prefill(case, layout, plan, rank, ep, pools)))
            elif not idle:
                res_q.put(("decoded", case.job, (pp, tp),
                           self.decode(case, layout, plan, rank, ep, pools)))
            if self.index == case.model_worker:
                first = _expect(cmd_q, "model", case.job)
                res_q.put(("model", case.job, self.decode_model(case, layout, plan, first)))
            _expect(cmd_q, "end", case.job)
            if idle:  # every transfer of the case is over by now
                report = {"written": int((pools.arena != POISON).sum()),
                          "bytes": int(pools.arena.size)}
        finally:
            if ep is not None:
                ep.close()
                engine.deregister(pools.base)
            if boot is not None:
                boot.close()
        res_q.put(("ended", case.job, self.index, report))

    def prefill(self, case: Case, layout, plan, rank, ep, pools) -> dict:
        import torch

        from pdc.runtime.endpoints import KVPoll
        from pdc.runtime.labels import project
        from pdc.verify import hf_state as H

        model = self.model(case.binding, layout, case.params, case.dtype)
        ids = case.ids[ROLE_PREFILL]
        side = plan.topology.prefill
        page_size = side.page_size
        reg = plan.registration(ROLE_PREFILL, rank)
        chunks = chunk_plan(len(case.prompt), case.chunk_tokens, page_size)
        prompt = torch.tensor(case.prompt, dtype=torch.long)
        sender = ep.sender(ROOM)
        bounds = [(c.start_token, c.end_token) for c in chunks]
        steps = zip(chunks, model.chunked_prefill(prompt, bounds), strict=True)
        for c, (cache, logits) in steps:  # noqa: B007 - the last chunk's are used below
            state = model.export_state(cache)
            # Place what a TP engine's pools hold after this chunk: the chunk's pages (final
            # now), the slot and ring state as it stands (updated in place by every chunk;
            # only the last chunk's is final) and, once the prompt is done, the window's
            # pages and the aux rows.
            for comp in layout.components:
                if comp.index in ("window", "aux") and not c.last:
                    continue
                keep = slice(c.first_page, c.end_page) if comp.index == "page" else slice(None)
                where = item_ids(comp, ids)[keep]
                for pos, (tensor, layer_id) in enumerate(reg.entries(comp.name)):
                    name = case.binding.hf_name(comp.name, tensor)
                    if name is None:
                        continue
                    full = to_items(comp, state[state_key(layer_id, name, comp)],
                                    c.end_token, page_size)[keep]
                    view = pools.view(comp.name, pos)
                    for item, row in zip(where, full, strict=True):
                        view[item] = project(comp, row, side.tp, rank.tp)
            send_chunk(sender, ids, c)
        status = _wait(sender.poll, case.timeout_s + 5, KVPoll)
        out = {"status": status, "reason": sender.reason, "bytes": sender.stats.bytes,
               "chunks": [c.end_token - c.start_token for c in chunks]}
        if (rank.pp, rank.tp) == (0, 0):
            out.update(first_token=model.token_of(logits), logits=_tensor_bytes(logits),
                       state=H.state_to_bytes(state), flags=model.export_flags(cache))
        return out

    def decode(self, case: Case, layout, plan, rank, ep, pools) -> dict:
        from pdc.runtime.endpoints import KVPoll

        ids = case.ids[ROLE_DECODE]
        reg = plan.registration(ROLE_DECODE, rank)
        for comp in layout.components:
            where = item_ids(comp, ids)
            for pos in range(len(reg.entries(comp.name))):
                pools.view(comp.name, pos)[where] = POISON
        rv = ep.receiver(ROOM)
        rv.init(ids["pages"], 0, slot=ids["slot"], ring_slot=ids["ring"], aux_row=ids["aux"],
                window_page_ids=ids["window"])
        status = _wait(rv.poll, case.timeout_s + 5, KVPoll)
        out = {"status": status, "reason": rv.reason, "bytes": rv.bytes}
        items = None
        if status == "Success":
            # This rank's share of every item of the request, for the decode model.
            items = {}
            for comp in layout.components:
                where = item_ids(comp, ids)
                for pos, (tensor, layer_id) in enumerate(reg.entries(comp.name)):
                    items[(comp.name, tensor, layer_id)] = pools.view(comp.name, pos)[where].copy()
        rv.release()
        self.gather_q.put((case.job, (rank.pp, rank.tp), items, out["reason"]))
        return out

    def decode_model(self, case: Case, layout, plan, first: dict | None) -> dict:
        """Gather every decode rank's items, rebuild the cache, decode; and the reference."""
        from pdc.runtime.labels import merge
        from pdc.runtime.plan_types import RankId
        from pdc.verify import hf_state as H

        D = plan.topology.decode
        gathered, failed = {}, []
        while len(gathered) + len(failed) < D.pp * D.tp:
            job, who, items, reason = self.gather_q.get(timeout=case.timeout_s + 30)
            if job != case.job:
                continue  # left over from an earlier case
            if items is None:
                failed.append(f"decode pp{who[0]}.tp{who[1]}: {reason or 'no items'}")
            else:
                gathered[who] = items
        out: dict = {"reference": self.reference(case, layout, plan)}
        if failed or first is None:
            out["error"] = "; ".join(failed) or "prefill produced no first token"
            return out
        seq_len, page_size = len(case.prompt), D.page_size
        state, disagree = {}, []
        for comp, tensor, layer_id, key in bound_entries(layout, case.binding):
            # A layer's entry lives on its stage; request-wide state on every stage that
            # registers it (owning_stages in runtime/lowering.py): each copy is one an
            # engine reads, so each must equal the first.
            stages = [s for s in range(D.pp) if (tensor, layer_id) in
                      plan.registration(ROLE_DECODE, RankId(s, 0)).entries(comp.name)]
            assert stages, (comp.name, layer_id)
            full = None
            for s in stages:
                parts = [gathered[(s, t)][(comp.name, tensor, layer_id)] for t in range(D.tp)]
                got, bad = merge(comp, parts, D.tp)
                disagree += [[comp.name, tensor, layer_id, f"pp{s}.tp{t}"] for t in bad]
                if full is None:
                    full = got
                elif not np.array_equal(got, full):
                    disagree.append([comp.name, tensor, layer_id, f"pp{s}"])
            state[key] = from_items(comp, full, seq_len, page_size)
        model = self.model(case.binding, layout, case.params, case.dtype)
        cache = model.import_state(state, seq_len)
        flags = model.export_flags(cache)
        tokens, logits = model.greedy_decode(cache, first["first_token"], case.steps - 1,
                                             (D.dp, case.decode_group))
        out.update(state=H.state_to_bytes(state), flags=flags, disagree=disagree,
                   tokens=tokens.tolist(), logits=_tensor_bytes(logits))
        return out

    def reference(self, case: Case, layout, plan) -> dict:
        """Single-process generation: the same chunked prefill, then greedy decode, on one
        cache in this process, with a model instance of its own (Note [Parity reference])."""
        import torch

        from pdc.verify import hf_state as H
        from pdc.verify import models

        model = models.build(case.binding.model_name, layout, dict(case.params), case.dtype)
        chunks = chunk_plan(len(case.prompt), case.chunk_tokens, plan.topology.prefill.page_size)
        prompt = torch.tensor(case.prompt, dtype=torch.long)
        *_, (cache, logits0) = model.chunked_prefill(
            prompt, [(c.start_token, c.end_token) for c in chunks])
        state = model.export_state(cache)
        tok0 = model.token_of(logits0)
        tokens, logits = model.greedy_decode(cache, tok0, case.steps - 1)
        return {"tokens": [tok0] + tokens.tolist(),
                "logits": _tensor_bytes(torch.cat([logits0[None], logits])),
                "state": H.state_to_bytes(state)}


def _tensor_bytes(t) -> bytes:
    from pdc.verify import hf_state as H

    return H.state_to_bytes({"t": t})


def _wait(poll, timeout_s: float, KVPoll) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = poll()
        if st in (KVPoll.Success, KVPoll.Failed):
            return st.name
        time.sleep(0.002)
    return "Timeout"


def _worker_main(cmd_q, res_q, index: int, gather_q, threads: int) -> None:
    w = _Worker(index, gather_q, threads)
    res_q.put(("up", index))
    try:
        while True:
            msg = cmd_q.get()
            if msg is None:
                break
            if msg[0] == "probe":
                res_q.put(("probed", msg[1], w.probe(*msg[2])))
            elif msg[0] == "job":
                w.run(msg[1], cmd_q, res_q)
            else:
                raise RuntimeError(f"unknown command {msg[0]!r}")
    finally:
        w.close()
    res_q.put(("bye", index))


class ParityWorkers:
    """A reusable set of worker processes; cases borrow as many as their topology needs
    (more are started on demand). Use as a context manager, or call close()."""

    def __init__(self, threads: int = DEFAULT_THREADS, progress=None):
        self.threads = threads
        # progress(text): called at each phase of a case (workers up, ranks ready, prefill
        # and decode done, the model's verdict), so a caller can show where a run is.
        self.progress = progress or (lambda text: None)
        self.procs: Processes | None = None
        self.gather_q = None
        self.jobs = 0
        self.broken = False
        self._probes: dict = {}

    def __enter__(self) -> ParityWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.procs) if self.procs else 0

    def ensure(self, n: int, timeout: float = 180.0) -> None:
        """At least n workers, started side by side; a broken set is replaced (its logs
        stay)."""
        if self.broken:
            self.procs.close(remove_logs=False)
            self.procs, self.broken, self._probes = None, False, {}
        if self.procs is None:
            self.procs = Processes("pdc-parity-")
            self.gather_q = self.procs.ctx.Queue()
        started = []
        while len(self.procs) < n:
            i = len(self.procs)
            started.append(self.procs.start(f"worker{i}", _worker_main,
                                             (i, self.gather_q, self.threads)))
        if started:
            self.progress(f"starting {len(started)} worker process"
                          f"{'' if len(started) == 1 else 'es'} (torch and the model)")
        for k, _ in enumerate(started, 1):
            self._get("up", timeout)
            self.progress(f"worker {k} of {len(started)} up")

    def _get(self, kind: str, timeout: float, job: int | None = None):
        msg = self.procs.get(timeout=timeout)
        if msg[0] != kind or (job is not None and msg[1] != job):
            raise RankCrash(f"expected {kind!r}, a worker sent {msg[:2]!r}")
        return msg

    def probe(self, binding: Binding, layout, params: tuple, dtype: str, n_tokens: int) -> dict:
        key = (binding.model_name, layout, params, dtype, n_tokens)
        if key not in self._probes:
            try:
                self.ensure(1)
                self.jobs += 1
                self.procs.put(0, ("probe", self.jobs, (binding, layout, params, dtype,
                                                        n_tokens)))
                self._probes[key] = self._get("probed", 180.0, self.jobs)[2]
            except (RankCrash, queue.Empty) as e:
                self._broke(e)
        return self._probes[key]

    def _broke(self, e: Exception):
        self.broken = True
        self.procs.kill()
        raise RankCrash(f"{e}\n  worker logs: {self.procs.log_dir}") from None

    def run(self, case: Case) -> Outcome:
        """Run one case; raises RankCrash (and marks the set broken) when a worker fails."""
        t0 = time.monotonic()
        involved = list(range(len(case.roles)))
        out = Outcome()
        wait = case.timeout_s + 60
        try:
            self.ensure(len(case.roles))
            for i in involved:
                self.procs.put(i, ("job", case))
            boot = self._get("bootstrap", 180.0, case.job)[2]
            for i in involved:
                self.procs.put(i, ("bootstrap", case.job, boot))
            for _ in involved:
                self._get("ready", wait, case.job)
            self.progress(f"{len(involved)} ranks ready; chunked prefill and transfer")
            for i in involved:
                self.procs.put(i, ("go", case.job))
            n_p = sum(1 for r in case.roles if r[0] == ROLE_PREFILL)
            active = sum(1 for r in case.roles
                         if r[0] == ROLE_PREFILL or r[3] == case.decode_group)
            while len(out.prefill) + len(out.decode) < active:
                msg = self.procs.get(timeout=wait)
                if msg[0] not in ("prefilled", "decoded") or msg[1] != case.job:
                    raise RankCrash(f"unexpected message {msg[:2]!r}")
                (out.prefill if msg[0] == "prefilled" else out.decode)[msg[2]] = msg[3]
                self.progress(f"{'prefill' if msg[0] == 'prefilled' else 'decode'} rank "
                              f"pp{msg[2][0]}.tp{msg[2][1]} done")
            assert len(out.prefill) == n_p
            leader = out.prefill.get((0, 0))
            first = leader if leader and leader["status"] == "Success" else None
            self.procs.put(case.model_worker, ("model", case.job, first))
            self.progress("decode model: rebuilding the cache and generating")
            out.model = self._get("model", wait, case.job)[2]
            for i in involved:
                self.procs.put(i, ("end", case.job))
            for _ in involved:
                msg = self._get("ended", wait, case.job)
                if msg[3] is not None:
                    _, pp, tp, group = case.roles[msg[2]]
                    out.idle[(group, pp, tp)] = msg[3]
        except (RankCrash, queue.Empty) as e:
            self._broke(e)
        out.wall_s = time.monotonic() - t0
        return out

    def close(self) -> None:
        if self.procs is None:
            return
        if not self.broken:
            self.procs.broadcast(None)
            try:
                for _ in range(len(self.procs)):
                    self._get("bye", 30.0)
            except (RankCrash, queue.Empty):
                self.broken = True
        self.procs.close(remove_logs=not self.broken)
        self.procs = None


# ~~~ the parent: prepare a case ~~~


def prepare(spec_path: str, prefill: str, decode: str, engine: str, dtype: str | None,
            workers: ParityWorkers, *, tokens: int = 20, chunk_tokens: int | None = None,
            steps: int = 10, seed: int = 0, timeout_s: float = 30.0,
            drop: tuple[str, ...] = (), params: tuple[tuple[str, int], ...] = ()) -> Case:
    """Load, lower and check everything the parent can; raises ParityError."""
    from pdc.compiler.diagnostics import SpecErrors
    from pdc.compiler.family import plan_spec
    from pdc.compiler.frontend import load_spec
    from pdc.compiler.topology import parse_side_arg

    if tokens < 1 or (chunk_tokens is not None and chunk_tokens < 1):
        raise ParityError("--tokens and --chunk must be at least 1")
    if steps < 2:
        raise ParityError("--steps must be at least 2: step 0 is the prefill's last position, "
                          "the others decode")
    if dtype is not None and dtype not in DTYPES:
        raise ParityError(f"--dtype must be one of {', '.join(DTYPES)}")
    sides = [parse_side_arg(prefill, "--prefill"), parse_side_arg(decode, "--decode")]
    errs = sides[0][1] + sides[1][1]
    try:
        if errs:
            raise SpecErrors(errs)
        if sides[0][0].get("dp", 1) != 1:
            raise ParityError("pdc parity runs one request: use dp=1 on the prefill side "
                              "(decode dp > 1 runs it on one DP group, the others idle)")
        page = sides[0][0].get("page_size") or sides[1][0].get("page_size")
        spec = load_spec(spec_path)
        binding = BINDINGS.get(spec.family)
        if binding is None:
            raise ParityError(f"no parity model bound to family '{spec.family}'; pdc parity "
                              f"knows {', '.join(sorted(BINDINGS))} (pdc/verify/hf_adapter.py)")
        # The binding's scaled sizes, the sides' page size, then --param (last one wins).
        wanted = dict(binding.params)
        if page:
            wanted["page_size"] = page
        wanted.update(params)
        overrides = {k: v for k, v in wanted.items() if spec.env.get(k) != v} or None
        dtypes = None
        if dtype is not None:
            if binding.dtype_name not in {d.name for d in spec.dtypes}:
                raise ParityError(f"{spec_path} declares no dtype name '{binding.dtype_name}' in "
                                  "`dtypes`, so --dtype cannot set the model's dtype")
            dtypes = {binding.dtype_name: dtype}
        if overrides or dtypes:
            # Scaled sizes (a toy's, or --param) leave the deployments out: they are
            # proved at the declared sizes by `pdc validate`.
            spec = load_spec(spec_path, overrides, dtypes,
                             deployments=not (binding.params or params))
        family, plan = plan_spec(spec, prefill, decode, engine)
    except SpecErrors as e:
        raise ParityError(str(e), diagnostics=tuple(e.diagnostics)) from None
    layout, topo = family.layout, plan.topology
    model_dtype = dtype or next((d.dtype for d in spec.dtypes if d.name == binding.dtype_name),
                                "float32")
    if model_dtype not in DTYPES:
        raise ParityError(f"the model dtype {model_dtype} is not one pdc parity runs "
                          f"({', '.join(DTYPES)})")
    page_size = topo.prefill.page_size
    if topo.decode.dp > 1 and not binding.dp_attention:
        raise ParityError(f"decode dp={topo.decode.dp} needs a model with DP attention "
                          f"padding; the {binding.hf_family} model has none (use dp=1)")
    if chunk_tokens is None:
        chunk_tokens = 2 * page_size
    if chunk_tokens % page_size:
        raise ParityError(f"--chunk {chunk_tokens} is not a multiple of the page size "
                          f"{page_size}: chunks end on page boundaries")
    try:
        generated = importlib.import_module(f"pdc.generated.{spec.py_name}.layout").LAYOUT
    except ImportError:
        raise ParityError(f"generated/{spec.py_name}/ is missing; run `pdc compile "
                          f"{spec_path}`") from None
    same = dataclasses.replace(layout, spec_path=generated.spec_path) == generated
    unknown = sorted(set(drop) - {c.name for c in layout.components})
    if unknown:
        raise ParityError(f"--drop names no component of {spec.family}: {', '.join(unknown)}")
    if drop:
        plan = _drop(plan, set(drop))

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ParityError(f"{' and '.join(missing)} not installed: pip install -e '.[kernels,hf]'")
    env = tuple(sorted(spec.env.items()))
    probe = workers.probe(binding, layout, env, model_dtype, tokens)
    problems = check_binding(layout, binding, probe["rows"], tokens, page_size)
    if problems:
        raise ParityError(f"{spec_path} does not fit the {binding.hf_family} model's cache "
                          f"({model_dtype}, {tokens} tokens):\n  " + "\n  ".join(problems))
    rng = np.random.default_rng(seed)
    prompt = tuple(int(x) for x in rng.integers(3, probe["vocab_size"], tokens))
    req = Req(room=ROOM, tokens=tokens, chunk_tokens=chunk_tokens, prefix_tokens=0)
    n_pages = -(-tokens // page_size)
    pages, slots = 4 * n_pages, 4
    allocate(plan, layout, [req], rng, pages, slots)
    group = dp_group_of_room(ROOM, topo.decode.dp)
    roles = [(ROLE_PREFILL, r.pp, r.tp, 0) for r in topo.prefill.ranks()]
    model_worker = len(roles)
    roles += [(ROLE_DECODE, r.pp, r.tp, group) for r in topo.decode.ranks()]
    roles += [(ROLE_DECODE, r.pp, r.tp, g) for g in range(topo.decode.dp) if g != group
              for r in topo.decode.ranks()]
    workers.jobs += 1
    return Case(workers.jobs, spec.family, spec.py_name, binding, model_dtype, engine,
                plan.to_json(), None if same else layout, prompt, chunk_tokens, steps,
                req.ids, pages, slots, tuple(roles), model_worker, timeout_s,
                topo.describe(), family.fingerprint, env, group)


def _drop(plan, names: set[str]):
    """The plan without any link entry of the named components (a negative control)."""
    from pdc.runtime.plan_types import Link

    links = tuple(Link(lk.prefill, lk.decode,
                       tuple(e for e in lk.entries if e.component not in names),
                       tuple(c for c in lk.elected_for if c not in names))
                  for lk in plan.links)
    return dataclasses.replace(plan, links=links, _index={})


# ~~~ the parent: judge and report ~~~


def parse_state(buf: bytes) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """pdc.verify.hf_state.state_to_bytes without torch: name -> (dtype, shape, raw bytes)."""
    (n,) = struct.unpack_from("<Q", buf)
    offset, out = 8 + n, {}
    for name, dtype, shape in json.loads(buf[8:8 + n]):
        nbytes = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        out[name] = (dtype, tuple(shape), np.frombuffer(buf, np.uint8, nbytes, offset))
        offset += nbytes
    return out


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}


def _floats(dtype: str, raw: np.ndarray) -> np.ndarray:
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    raise ValueError(f"no float view of {dtype}")


@dataclass
class Verdict:
    ok: bool
    lines: list[str]
    tokens: list[int] = field(default_factory=list)  # the PD run's tokens, when it ran


def judge(case: Case, out: Outcome) -> Verdict:
    """Compare the PD run with the reference; the lines name what differs first."""
    lines: list[str] = []
    failed = [f"prefill pp{k[0]}.tp{k[1]}: {r['status']} {r['reason']}".rstrip()
              for k, r in sorted(out.prefill.items()) if r["status"] != "Success"]
    failed += [f"decode pp{k[0]}.tp{k[1]}: {r['status']} {r['reason']}".rstrip()
               for k, r in sorted(out.decode.items()) if r["status"] != "Success"]
    model = out.model or {}
    if failed or "error" in model:
        lines.append("transfer FAILED: " + "; ".join(failed or [model.get("error", "")]))
        return Verdict(False, lines)
    leader = out.prefill[(0, 0)]
    ref = model["reference"]
    steps = case.steps
    pd_tokens = [leader["first_token"]] + model["tokens"]
    ref_logits = parse_state(ref["logits"])["t"]
    pd0 = parse_state(leader["logits"])["t"]
    pd_rest = parse_state(model["logits"])["t"]
    dtype, vocab = ref_logits[0], ref_logits[1][-1]
    ref_rows = ref_logits[2].reshape(steps, -1)
    pd_rows = np.concatenate([pd0[2], pd_rest[2]]).reshape(steps, -1)
    first = None
    for i in range(steps):
        if pd_tokens[i] != ref["tokens"][i] or not np.array_equal(pd_rows[i], ref_rows[i]):
            first = i
            break
    same_dtype = pd0[0] == dtype and pd_rest[0] == dtype
    lines.append(f"tokens   {pd_tokens}")

    # State: the rebuilt tensors against the prefill's export, in spec order.
    exported, rebuilt = parse_state(leader["state"]), parse_state(model["state"])
    layout = case.layout or importlib.import_module(f"pdc.generated.{case.py_name}.layout").LAYOUT
    diffs = []
    for comp, tensor, layer_id, key in bound_entries(layout, case.binding):
        a, b = exported[key], rebuilt[key]
        where = (f"request-wide component {comp.name}" if comp.request_wide else
                 f"layer {layer_id} component {comp.name}")
        if a[:2] != b[:2]:
            diffs.append(f"{where} ({key}): shape/dtype "
                         f"{b[1]} {b[0]}, exported {a[1]} {a[0]}")
        elif not np.array_equal(a[2], b[2]):
            n = int((a[2] != b[2]).sum())
            diffs.append(f"{where}"
                         + (f" tensor {tensor}" if len(comp.tensors) > 1 else "")
                         + f" ({key}): {n} of {len(a[2])} bytes differ from the prefill export")
    for comp, tensor, layer_id, t in model["disagree"]:
        diffs.append(f"layer {layer_id} component {comp} tensor {tensor}: decode {t}'s copy "
                     "of a replicated unit differs from a lower rank's copy")
    for (g, pp, tp), r in sorted(out.idle.items()):
        if r["written"]:
            diffs.append(f"idle decode rank dp{g}.pp{pp}.tp{tp}: {r['written']} of its "
                         f"{r['bytes']} pool bytes were written (the request is on DP group "
                         f"{case.decode_group})")
    flags_ok = model["flags"] == leader["flags"]
    moved = sum(r["bytes"] for r in out.decode.values())
    lines.append(f"state    {len(exported)} tensors, {moved} bytes received by "
                 f"{len(out.decode)} decode rank(s); "
                 + ("every rebuilt tensor equals the prefill export" if not diffs else
                    f"{len(diffs)} differ from the prefill export")
                 + ("" if flags_ok else f"; flags differ: rebuilt {model['flags']}, prefill "
                    f"{leader['flags']}"))
    if out.idle:
        groups = sorted({g for g, _, _ in out.idle})
        lines.append(f"dp       the request on decode DP group {case.decode_group}, padded with "
                     f"idle group(s) {', '.join(map(str, groups))} whose pools "
                     + ("stayed untouched" if not any(r["written"] for r in out.idle.values())
                        else "were written"))
    lines += [f"  differs: {d}" for d in diffs]
    if first is None and same_dtype and not diffs and flags_ok:
        lines.append(f"parity   OK: tokens and logits of all {steps} steps bitwise equal to "
                     "single-process generation")
        return Verdict(True, lines, pd_tokens)
    if first is None:
        lines.append("parity   FAILED: tokens and logits are equal, but "
                     + ("the logits dtype differs" if not same_dtype else
                        "the transferred state is not (see above)"))
        return Verdict(False, lines, pd_tokens)
    what = "the prefill's last position" if first == 0 else f"decode step {first}"
    pd, rf = _floats(dtype, pd_rows[first]), _floats(dtype, ref_rows[first])
    n = int((pd_rows[first].view(np.uint8).reshape(vocab, -1) !=
             ref_rows[first].view(np.uint8).reshape(vocab, -1)).any(axis=1).sum())
    lines.append(f"parity   FAILED at step {first} ({what}): token {pd_tokens[first]} vs "
                 f"{ref['tokens'][first]} (single process); {n} of {vocab} logits differ, "
                 f"max |diff| {float(np.max(np.abs(pd - rf))):.3g}")
    if diffs:
        lines.append(f"cause    {diffs[0]}")
    elif parse_state(ref["state"]).keys() == exported.keys() and any(
            not np.array_equal(v[2], parse_state(ref["state"])[k][2])
            for k, v in exported.items()):
        lines.append("cause    the prefill's own state differs from the single-process "
                     "prefill's: the prefill computation is not reproducible here")
    else:
        lines.append("cause    every transferred tensor equals the prefill export: the "
                     "difference arises on the decode side")
    return Verdict(False, lines, pd_tokens)


def run_parity(specs: list[str], prefill: str = "tp=1", decode: str = "tp=1",
               engine: str = "mooncake", dtype: str | None = None, *,
               workers: ParityWorkers | None = None, out=None, err=None,
               report: dict | None = None, **options) -> int:
    """Run every spec's case on one set of workers; 0 when all reach parity, else 1.
    `options` go to `prepare` (tokens, chunk_tokens, steps, seed, timeout_s); `drop` removes
    the named components from the plan of every spec that has them. `report`, when given,
    receives what was printed as data (for `pdc parity --json`): "specs", one dict per SPEC
    run or refused, and "errors", error dicts (pdc.console.error) or Diagnostics."""
    from pdc.console import error, wrap

    out = out or sys.stdout
    err = err or sys.stderr
    report = report if report is not None else {}
    results, errors = report.setdefault("specs", []), report.setdefault("errors", [])
    drop = tuple(options.pop("drop", ()))
    has = {}
    if drop:  # each name must be a component of some SPEC; it is dropped where it is one
        from pdc.compiler.diagnostics import SpecErrors
        from pdc.compiler.frontend import load_spec

        for spec in specs:
            try:
                has[spec] = {c.name for c in load_spec(spec).components}
            except SpecErrors:
                has[spec] = set()  # prepare() reports the spec's errors
        unknown = [d for d in drop if not any(d in names for names in has.values())]
        if unknown:
            message = f"--drop names no component of {', '.join(specs)}: {', '.join(unknown)}"
            print(f"pdc parity: error: {message}", file=err)
            errors.append(error("--drop", message, "name a component of a SPEC's `components`"))
            return 1
    own = workers is None
    # `is None`, not `or`: a fresh ParityWorkers has no processes yet, so len() 0 is falsy,
    # and `or` silently replaced the caller's (its --threads and progress were lost).
    workers = workers if workers is not None else ParityWorkers()
    ok = True
    first_case = len(workers) < 2
    try:
        for spec in specs:
            try:
                case = prepare(spec, prefill, decode, engine, dtype, workers, **options,
                               drop=tuple(d for d in drop if d in has.get(spec, ())))
            except ParityError as e:
                print(str(e) if e.diagnostics else f"pdc parity: error: {e}", file=err)
                refused = list(e.diagnostics) or [error(spec, str(e), "")]
                results.append({"spec": spec, "ok": False, "ran": False})
                errors.extend(refused)
                ok = False
                continue
            except RankCrash as e:
                print(f"pdc parity: error: {e}", file=err)
                errors.append(error("<parity>", str(e), "a worker process failed; its "
                                    "traceback is above"))
                return 1
            chunks = chunk_plan(len(case.prompt), case.chunk_tokens,
                                json.loads(case.plan_json)["topology"]["prefill"]["page_size"])
            # every line within 100 columns (Note [Console output]): the topology on a line
            # of its own when it does not fit, continuations under the value
            head = f"pdc parity: {case.family} ({case.binding.hf_family}, {case.dtype})"
            print(wrap(f"{head} {case.describe}") if len(head) + len(case.describe) < 100
                  else f"{wrap(head)}\n{wrap('  ' + case.describe, indent='    ')}", file=out)
            print(wrap(f"  prompt   {len(case.prompt)} tokens in {len(chunks)} chunks ("
                       + "+".join(str(c.end_token - c.start_token) for c in chunks)
                       + f"), {case.steps} steps", indent=" " * 11), file=out)
            try:
                outcome = workers.run(case)
            except RankCrash as e:
                print(f"pdc parity: error: {e}", file=err)
                errors.append(error("<parity>", str(e), "a worker process failed; its "
                                    "traceback is above"))
                return 1
            verdict = judge(case, outcome)
            for line in verdict.lines:
                print(wrap(f"  {line}", indent=" " * 11), file=out)
            print(f"  wall     {outcome.wall_s:.2f} s"
                  + (" (worker start-up included)" if first_case else ""), file=out)
            results.append({
                "spec": spec, "ok": verdict.ok, "ran": True, "family": case.family,
                "hf_family": case.binding.hf_family, "dtype": case.dtype,
                "topology": case.describe, "prompt_tokens": len(case.prompt),
                "chunks": [c.end_token - c.start_token for c in chunks], "steps": case.steps,
                "tokens": verdict.tokens, "report": verdict.lines,
                "wall_s": round(outcome.wall_s, 3)})
            if not verdict.ok:
                errors.append(error(spec, next((line.strip() for line in verdict.lines
                                                if "FAILED" in line), verdict.lines[-1]),
                                    "the report names the first differing step and state"))
            first_case = False
            ok &= verdict.ok
    finally:
        if own:
            workers.close()
    return 0 if ok else 1
