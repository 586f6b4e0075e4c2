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
generation" is the same chunk schedule on one cache in one process, and its decode steps
run in PD decode's batch shape (a DP-attention model's step padded with the idle DP ranks'
rows: on an AVX-512/AMX host one row alone and two rows round differently). With one chunk
covering the prompt and decode dp=1 it is exactly pdc.verify.hf_state.aggregate_generate.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys

import numpy as np

from pdc.runtime.plan_types import dp_group_of_room

from .hf_adapter import check_binding
from .parity_case import DTYPES, ROOM, Case, ParityError
from .parity_judge import judge
from .parity_workers import ParityWorkers
from .ranks import (
    ROLE_DECODE,
    ROLE_PREFILL,
    RankCrash,
    Req,
    allocate,
    chunk_plan,
)
from .recipe import binding_of

# ~~~ the parent: prepare a case ~~~


def prepare(spec_path: str, prefill: str, decode: str, engine: str, dtype: str | None,
            workers: ParityWorkers, *, tokens: int = 20, chunk_tokens: int | None = None,
            steps: int = 10, seed: int = 0, timeout_s: float = 30.0,
            drop: tuple[str, ...] = (), params: tuple[tuple[str, int], ...] = ()) -> Case:
    """Load, lower and check everything the parent can; raises ParityError."""
    from pdc.compiler.diagnostics import Diagnostic, SpecErrors
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
        binding = binding_of(spec, spec_path)
        if binding is None:
            raise ParityError(f"{spec_path} has no `parity` block: pdc parity needs the tiny "
                              "model to run the family on and the state tensor each component "
                              "carries (docs/adding-a-family.md, step 7)")
        if binding.kind == "toy" and importlib.util.find_spec(
                f"pdc.verify.{binding.model}") is None:
            raise ParityError(f"{binding.loc}: error: `parity.toy` names '{binding.model}', "
                              "which is no module of pdc.verify; hint: a toy is one of pdc's "
                              "own models (seed_qwen38, seed_glm52); a transformers model is "
                              "named by `parity.transformers`")
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
                          f"padding; the {binding.model} model has none (use dp=1)")
    if chunk_tokens is None:
        chunk_tokens = 2 * page_size
    if chunk_tokens % page_size:
        raise ParityError(f"--chunk {chunk_tokens} is not a multiple of the page size "
                          f"{page_size}: chunks end on page boundaries")
    same = _same_as_generated(layout, spec, spec_path)
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
    if probe.get("located"):  # a recipe mistake: one line naming the spec line
        where, message, hint = probe["located"]
        raise ParityError(probe["error"], diagnostics=(Diagnostic(_location(where), message,
                                                                  hint),))
    if "error" in probe:
        raise ParityError(f"{spec_path}: {probe['error']}")
    problems = check_binding(layout, binding, probe["rows"], tokens, page_size)
    if problems:
        raise ParityError(f"{spec_path} does not fit the {binding.model} model's cache "
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


def _same_as_generated(layout, spec, spec_path: str) -> bool:
    """Whether the workers may load the family's generated module (else the parent ships
    them the layout it compiled). A spec of pdc's package must have its module; a user's
    spec (from a folder of their own, Note [Spec path]) is compiled here, in memory."""
    from pathlib import Path

    try:
        generated = importlib.import_module(f"pdc.generated.{spec.py_name}.layout").LAYOUT
    except ImportError:
        ours = Path(__file__).resolve().parents[2] / "specs"
        if Path(spec_path).resolve().parent == ours:
            raise ParityError(f"generated/{spec.py_name}/ is missing; run `pdc compile "
                              f"{spec_path}`") from None
        return False
    return dataclasses.replace(layout, spec_path=generated.spec_path) == generated


def _location(text: str):
    from pdc.compiler.diagnostics import Location

    rest, _, col = text.rpartition(":")
    file, _, line = rest.rpartition(":")
    if line.isdigit() and col.isdigit():
        return Location(file, int(line), int(col))
    return Location(text)


def _drop(plan, names: set[str]):
    """The plan without any link entry of the named components (a negative control)."""
    from pdc.runtime.plan_types import Link

    links = tuple(Link(lk.prefill, lk.decode,
                       tuple(e for e in lk.entries if e.component not in names),
                       tuple(c for c in lk.elected_for if c not in names))
                  for lk in plan.links)
    return dataclasses.replace(plan, links=links, _index={})


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
            head = f"pdc parity: {case.family} ({case.binding.model}, {case.dtype})"
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
                "model": case.binding.model, "dtype": case.dtype,
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
