"""The worker processes of `pdc parity`: each plays the ranks a case gives it (prefill ranks
run the tiny model's chunked prefill and send; decode ranks receive; one decode-model
process rebuilds the cache and generates, and runs the single-process reference). See
pdc/verify/parity.py for the whole design."""

from __future__ import annotations

import queue
import time

import numpy as np

from .hf_adapter import (
    Binding,
    bound_entries,
    from_items,
    item_ids,
    state_key,
    to_items,
)
from .parity_case import DEFAULT_THREADS, POISON, ROOM, Case, Outcome
from .ranks import (
    ROLE_DECODE,
    ROLE_PREFILL,
    Processes,
    RankCrash,
    bootstrap_server,
    chunk_plan,
    open_endpoint,
    send_chunk,
)

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
        import transformers  # noqa: F401 - imported while the workers start side by side

        from pdc.verify import hf_state  # noqa: F401

        torch.set_num_threads(threads)
        self.index = index
        self.gather_q = gather_q
        self.engines: dict = {}
        self.models: dict = {}

    def model(self, binding: Binding, layout, params: tuple, dtype: str):
        """The case's model (Note [Parity models] in pdc/verify), kept across cases."""
        from pdc.verify import models

        key = (binding, dtype) + ((layout, params) if binding.kind == "toy" else ())
        if key not in self.models:
            self.models[key] = models.build(binding, layout, dict(params), dtype)
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

        # A recipe or config mistake (a user's new family) comes back as data, named with the
        # recipe line it failed at, and `prepare` refuses the case with it: no traceback.
        try:
            model = self.model(binding, layout, params, dtype)
            prompt = torch.full((n_tokens,), 3, dtype=torch.long)
            *_, (cache, _) = model.chunked_prefill(prompt, [(0, n_tokens)])
            rows = model.describe_state(model.export_state(cache))
        except Exception as e:  # noqa: BLE001 - every failure of user code is reported
            from pdc.verify.hf_state import RecipeError

            located = (e.loc, e.message, e.hint) if isinstance(e, RecipeError) else None
            return {"error": probe_error(e, binding.model), "located": located}
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

        model = models.build(case.binding, layout, dict(case.params), case.dtype)
        chunks = chunk_plan(len(case.prompt), case.chunk_tokens, plan.topology.prefill.page_size)
        prompt = torch.tensor(case.prompt, dtype=torch.long)
        *_, (cache, logits0) = model.chunked_prefill(
            prompt, [(c.start_token, c.end_token) for c in chunks])
        state = model.export_state(cache)
        tok0 = model.token_of(logits0)
        # Decode steps in the batch shape PD decode runs (padded with idle DP rows where the
        # model pads): a GEMM of another row count may round differently.
        D = plan.topology.decode
        tokens, logits = model.greedy_decode(cache, tok0, case.steps - 1,
                                             (D.dp, case.decode_group))
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


def probe_error(e: Exception, model: str) -> str:
    """One line for a failed probe: a RecipeError says everything itself; any other error is
    named with the innermost line of pdc's model recipes (pdc/verify/) it came from."""
    import traceback

    from pdc.verify.hf_state import RecipeError

    if isinstance(e, RecipeError):
        return str(e)
    where = ""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        parts = frame.filename.replace("\\", "/").split("/")
        if "verify" in parts and parts[-1].endswith(".py"):
            where = f" at pdc/verify/{parts[-1]}:{frame.lineno} ({frame.line})"
            break
    return (f"the {model} model failed to build or export its cache{where}: "
            f"{type(e).__name__}: {e}")


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
        key = (binding, layout, params, dtype, n_tokens)
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
