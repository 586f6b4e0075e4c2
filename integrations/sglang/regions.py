"""What the SGLang backend's modules share: SGLang's buffers as regions, and the refusal."""

from __future__ import annotations

from dataclasses import dataclass


class RefusedModel(RuntimeError):
    """pdc cannot serve this model (or these SGLang settings); the message says why."""


@dataclass(frozen=True)
class Region:
    """One SGLang buffer as KVArgs describes it: address, bytes, bytes per item."""

    addr: int
    nbytes: int
    item_bytes: int
    what: str  # in SGLang's words, for messages
    device: str = "cpu"  # "cuda:N" for a GPU's memory (Note [SGLang memory kinds])


def state_entry(state_indices, state_types, kind: str):
    """The entry of `state_indices` (one per KVArgs.state_types) whose state type is `kind`
    ("mamba", "dsa", ...), None when SGLang registered none of that type."""
    for t, entry in zip(state_types or (), state_indices or (), strict=False):
        if str(getattr(t, "value", t)) == kind:
            return entry
    return None


def mamba_slot(state_indices, state_types=None) -> int:
    """The request's mamba slot from SGLang's `state_indices` (one entry per state type of
    KVArgs.state_types, the mamba one an array holding the slot; Note [SGLang mamba state] in
    family.py), or -1 when the model keeps no slot state; a DSA pool's pages and a QSA ring's
    req_pool_idx are no mamba slot."""
    entries = [state_entry(state_indices, state_types, "mamba")] if state_types else \
        list(state_indices or ())
    return next((int(e[0]) for e in entries if e is not None and len(e)), -1)



def layout_component(layout, name: str, index: str):
    """The layout's component `name` when it is indexed by `index`, else (or without a
    layout) None: how the state mappings find the spec's side of a state type."""
    if layout is None:
        return None
    return next((c for c in layout.components if c.name == name and c.index == index), None)


# SGLang state types pdc refuses, and what they hold
UNCARRIED_STATE = {
    "dsa_tail": "the DSA indexer's kpool-compress tail, index_kpool > 1",
    "block_scale_swa": "the MXFP8 block scales of SWAKVPool's sliding-window pool",
}
