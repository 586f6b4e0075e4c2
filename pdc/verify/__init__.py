"""Verification models: what `pdc parity` runs in its prefill and decode processes.

Note [Parity models]: the parity harness (pdc/verify/parity.py) drives any model through one small
interface, `ParityModel` (pdc/verify/models.py): build from the family's layout, chunked
prefill, export the state as a flat dict of named tensors, rebuild a cache from such a dict,
and greedy decode. Two kinds implement it:

- `HfModel`: a tiny random-weight transformers model (pdc/verify/hf_state.py), for the hf-* specs;
- the seed toys (seed_qwen38.py, seed_glm52.py): tiny torch models whose cache is exactly the
  state of the seed systems' specs (QSA rings, PLE, DSA indexer, MTP/EAGLE draft, aux rows),
  built from the spec's own layout with its parameters scaled down.

The binding of a spec family to its model is data (pdc/verify/hf_adapter.py BINDINGS). Nothing in
this package is imported by the runtime.
"""
