"""What the seed toys (seed_qwen38.py, seed_glm52.py) share.

A toy's cache is a `ToyCache`: the dict of state tensors the spec names, in the spec's
dtypes and shapes (Note [State layout] in pdc/verify/hf_state.py: page-indexed rows token-major,
`[R, ...]` for a ring, the item itself for a slot or aux row), and `seq_len`. Nothing else
survives from one step to the next, so a decode that continues from a rebuilt cache
computes what the prefill process would have computed exactly when every byte of every
component arrived. Arithmetic is float32; state is rounded to its spec dtype when stored
and read back from it, in the prefill, the decode and the reference alike.

Every toy runs one token per step (`step`); chunked prefill is the prompt's tokens in
order, with the state exported after each chunk. Logits rows are `[main V | draft V]`: the
target model's logits, then the MTP/EAGLE draft layer's, so the draft's state (the draft
hidden state, the draft layer's own pages, the top-k seed) is compared bit for bit too.
"""

from __future__ import annotations

import torch

VOCAB = 256  # toy vocabulary; not a spec param
FIRST_TOKEN_ROW = "aux_first_token"


class ToyCache:
    def __init__(self, state: dict[str, torch.Tensor], seq_len: int):
        self.state = state
        self.seq_len = seq_len

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.state[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.state[key] = value

    def append(self, key: str, row: torch.Tensor) -> None:
        """One more row of a page-indexed tensor, stored in its dtype."""
        t = self.state[key]
        self.state[key] = torch.cat([t, row.to(t.dtype)[None]])


class Weights:
    """Deterministic random weights: float32 normal draws from one generator (seed), in
    creation order, so every process builds the same bits."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *shape: int, scale: float | None = None) -> torch.Tensor:
        s = scale if scale is not None else shape[0] ** -0.5
        return torch.randn(*shape, generator=self.g, dtype=torch.float32) * s


def rmsnorm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope_row(position: int, token: int, rope_dim: int) -> torch.Tensor:
    """cos | sin of the rotary angles of a position, float32 [rope_dim]. The angle's position
    id is the token's position shifted by its id (M-RoPE-like: not recomputable from the
    position alone, so decode must read the rows it did not compute itself)."""
    half = rope_dim // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = (position + (token % 7) / 8.0) * freq
    return torch.cat([torch.cos(angle), torch.sin(angle)])


def rotate(x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Rotate the first len(row) dims of x's last axis by a rope row (cos | sin)."""
    half = row.shape[0] // 2
    cos, sin = row[:half], row[half:]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias=None) -> torch.Tensor:
    """GQA attention of one query position: q [hq, d], k and v [n, hk, d]; bias [hk, r, n]."""
    hk = k.shape[1]
    qg = q.view(hk, -1, q.shape[-1])
    scores = torch.einsum("grd,ngd->grn", qg, k) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    w = torch.softmax(scores, -1)
    return torch.einsum("grn,ngd->grd", w, v).reshape(-1)


def first_token(cache: ToyCache) -> int:
    """The first output token as decode reads it: the sum of the aux row's 16 int32 values
    (the padding is zero), modulo the vocabulary. Every byte of the row counts, so a row
    that arrived only in part decodes another token; a poisoned row still decodes."""
    return int(cache[f"R.{FIRST_TOKEN_ROW}"].to(torch.int64).sum() % VOCAB)


class ToyModel:
    """The ParityModel half every toy shares; a toy supplies `new_cache`, `step` and
    `describe` (and sets `dp_padding` when its step pads a DP batch)."""

    vocab_size = VOCAB
    dp_padding = False

    def new_cache(self) -> ToyCache:
        raise NotImplementedError

    def step(self, cache: ToyCache, token: int, dp=(1, 0)) -> torch.Tensor:
        raise NotImplementedError

    def chunked_prefill(self, prompt: torch.Tensor, bounds):
        cache = self.new_cache()
        ids = [int(t) for t in prompt.view(-1)]
        for start, end in bounds:
            with torch.no_grad():
                for t in ids[start:end]:
                    logits = self.step(cache, t)
            row = cache[f"R.{FIRST_TOKEN_ROW}"]
            row.zero_()
            row[0] = self.token_of(logits)
            yield cache, logits

    def export_state(self, cache: ToyCache) -> dict:
        return {k: v.clone() for k, v in cache.state.items()}

    def export_flags(self, cache: ToyCache) -> dict[str, int]:
        return {"seq_len": cache.seq_len}

    def import_state(self, state: dict, seq_len: int) -> ToyCache:
        want = self.new_cache().state
        if set(state) != set(want):
            raise KeyError(f"state holds {sorted(set(state) ^ set(want))} the toy does not, "
                           "or lacks them")
        return ToyCache({k: v.clone() for k, v in state.items()}, seq_len)

    def greedy_decode(self, cache: ToyCache, first: int, steps: int, dp=(1, 0)):
        del first  # decode reads the first token from its transferred aux row
        if dp[0] > 1 and not self.dp_padding:
            raise ValueError(f"{type(self).__name__} has no DP attention padding")
        tok = first_token(cache)
        tokens, rows = [], []
        with torch.no_grad():
            for _ in range(steps):
                logits = self.step(cache, tok, dp)
                tok = self.token_of(logits)
                tokens.append(tok)
                rows.append(logits)
        return torch.tensor(tokens, dtype=torch.long), torch.stack(rows)

    def token_of(self, logits: torch.Tensor) -> int:
        return int(logits[:VOCAB].argmax())

    def describe_state(self, state: dict) -> list[dict]:
        rows = []
        for name, x in state.items():
            kind, shard = self.describe(name)
            row = dict(name=name, shape=tuple(x.shape), dtype=str(x.dtype)[6:], kind=kind,
                       shard_axis=None, shard_size=None, segments=[], segment_units=[])
            row.update(shard or {})
            rows.append(row)
        return rows

    def describe(self, name: str) -> tuple[str, dict | None]:
        """(hf_state kind, shard fields or None for replicated) of a state tensor."""
        raise NotImplementedError
