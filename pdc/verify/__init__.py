"""Verification: the harnesses that show pdc moves the right bytes, kept out of the product.

Serving needs `pdc.runtime` and `pdc.generated` only; everything here exists to exercise and
judge them, from the command line (`pdc demo`, `pdc parity`), bench/ and tests/:

- ranks.py: rank processes on one host, shared by `pdc demo` and `pdc parity` (process start,
  native logs, bootstrap, endpoints, page / slot / window allocation, chunked sends, and the
  per-byte labels the demo and the reliability harness fill and check pools with);
- parity.py: the parity harness behind `pdc parity` (worker processes play the ranks of a
  plan, a decode-model process rebuilds the cache, the judge compares tokens and logits bit
  for bit with single-process generation, Note [Parity reference]);
- hf_state.py: tiny random-weight transformers models and their cache as named tensors
  (Note [State layout]); hf_adapter.py: the binding of a spec's components to its model's
  state (read from the spec by recipe.py) and the state tensors to pool items and back
  (Note [HF bindings]);
- models.py, toy.py, seed_qwen38.py, seed_glm52.py: the models parity runs (below);
- reliability.py: the reliability harness, many requests through a real engine while ranks
  are killed or stopped, requests aborted and control sockets fuzzed, every byte checked
  (Note [What is checked]); used by tests/runtime/test_reliability.py and bench/reliability.py.
  It is the parent (scheduler, page pools, faults, fuzzer, report); reliability_ranks.py is
  what each of its rank processes does.

The harnesses make endpoints misbehave only through the endpoints' explicit fault hooks
(`Faults`, Note [Fault hooks] in runtime/endpoints/faults.py), never by patching them.

Imports point one way: this package imports the runtime, the compiler (a parent lowers
plans from specs), the generated families and pdc.console; nothing in runtime/, compiler/,
generated/ or integrations/ imports it (tests/test_dependency_direction.py).

Note [Parity models]: the parity harness (pdc/verify/parity.py) drives any model through one
small interface, `ParityModel` (pdc/verify/models.py): build from the family's layout, chunked
prefill, export the state as a flat dict of named tensors, rebuild a cache from such a dict,
and greedy decode. Two kinds implement it:

- `HfModel`: a tiny random-weight transformers model (pdc/verify/hf_state.py), for the hf-*
  specs;
- the seed toys (seed_qwen38.py, seed_glm52.py): tiny torch models whose cache is exactly the
  state of the seed systems' specs (QSA rings, PLE, DSA indexer, MTP/EAGLE draft, aux rows),
  built from the spec's own layout with its parameters scaled down.

The binding of a spec family to its model is data, the spec's `parity` block (Note [Parity
recipe] in compiler/model_parity.py), read by recipe.py.
"""
