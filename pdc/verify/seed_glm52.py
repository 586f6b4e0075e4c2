"""GLM-5.2-like toy (specs/glm52.yaml, seed 001), built from the spec's layout.

Every tensor of the toy's cache is one component of the spec, at the spec's (scaled) shape,
dtype and index mode (docs/parity.md, "The seed toys"). One step at position p, per layer
(MLA with a DSA indexer; the draft layer in its own id band the same way):

- `mla_kv` / `draft_mla_kv` (page, bf16 [kv_lora_rank + rope]): the normalised latent c and
  the RoPE'd key k_r of the token. The query attends over every row with absorbed weights
  (q_nope·c + q_rope·k_r), plus the token's index score, minus a finite penalty for tokens
  outside the top-k (a real DSA reads only the selected rows; the penalty keeps every row in
  the result, so a corrupt unselected row fails parity too).
- `dsa_index_k` (page, uint8 [index_head_dim + 4]): the token's index key as fp8 e4m3 with
  its fp32 scale. The index score of every token is (dequantised key)·(index query); the top
  `index_topk` tokens are selected.
- The draft layer embeds the token with the previous position's final hidden state
  (`aux_draft_hidden`); its selection is the top-k of its own index scores plus a bonus for
  the positions of `aux_dsa_topk`, the target's last layer's selection at the previous
  position (GLM-5.2 IndexShare: the draft round is seeded with the target's top-k). After
  the step both rows are replaced by this position's.

Decode's first token is read from `aux_first_token` (toy.first_token). Under DP attention a
decode step is a padded batch of one row per DP rank (`dp`): the request's row and idle rows
(token 0, no pages, no index selection); projections run on the whole batch, attention and
the draft only on the request's row, and the logits are trimmed to it (seed 001: idle DP
ranks skip sparse index selection, EAGLE postprocessing consumes only rank-local rows).
"""

from __future__ import annotations

import torch

from .toy import VOCAB, ToyCache, ToyModel, Weights, rmsnorm, rope_row, rotate

HEADS = 2  # query heads of the toy's MLA
INDEX_WEIGHT = 0.25  # how much the index score adds to an attention score
UNSELECTED_PENALTY = 4.0  # subtracted from the attention score of tokens outside the top-k
SEED_BONUS = 4.0  # added to the draft layer's index score of the seeded positions
FP8_MAX = 448.0  # largest float8_e4m3fn


def build(layout, params: dict[str, int], dtype: str, seed: int = 0) -> Glm52Toy:
    return Glm52Toy(layout, params, seed)


class Glm52Toy(ToyModel):
    dp_padding = True

    def __init__(self, layout, params: dict[str, int], seed: int = 0):
        c = {comp.name: comp for comp in layout.components}
        self.layout = layout
        self.draft = layout.draft_ids[0]
        self.latent = c["mla_kv"].shape[1]
        self.hidden = c["aux_draft_hidden"].shape[0]
        self.topk = c["aux_dsa_topk"].shape[0]
        self.index_row = c["dsa_index_k"].shape[1]
        self.index_dim = self.index_row - 4
        # the latent row is kv_lora_rank | qk_rope_head_dim (the spec's params)
        self.kv_lora, self.rope = params["kv_lora_rank"], params["qk_rope_head_dim"]
        if self.kv_lora + self.rope != self.latent:
            raise ValueError(f"mla_kv rows of {self.latent} are not kv_lora_rank "
                             f"{self.kv_lora} + qk_rope_head_dim {self.rope}")
        H, w = self.hidden, Weights(seed)
        self.embed = w(VOCAB, H, scale=1.0)
        self.layers = {}
        for i, kind in layout.kind_of:
            self.layers[i] = dict(
                dkv=w(H, self.kv_lora), kr=w(H, self.rope), q=w(H, HEADS * self.kv_lora),
                qr=w(H, HEADS * self.rope), iq=w(H, self.index_dim), ik=w(H, self.index_dim),
                uv=w(self.kv_lora, H // HEADS), o=w(H, H))
            if kind == "mtp":
                self.layers[i]["w_in"] = w(2 * H, H)
        self.lm_head = w(H, VOCAB)

    # ~~~ cache ~~~

    def new_cache(self) -> ToyCache:
        s: dict[str, torch.Tensor] = {}
        for i, kind in self.layout.kind_of:
            name = "draft_mla_kv" if kind == "mtp" else "mla_kv"
            s[f"L{i}.{name}"] = torch.zeros(0, self.latent, dtype=torch.bfloat16)
            s[f"L{i}.dsa_index_k"] = torch.zeros(0, self.index_row, dtype=torch.uint8)
        s["R.aux_first_token"] = torch.zeros(16, dtype=torch.int32)
        s["R.aux_draft_hidden"] = torch.zeros(self.hidden, dtype=torch.bfloat16)
        s["R.aux_dsa_topk"] = torch.full((self.topk,), -1, dtype=torch.int32)
        return ToyCache(s, 0)

    def describe(self, name: str):
        return ("aux" if name.startswith("R.") else "token"), None

    # ~~~ one token (a padded DP batch of rows) ~~~

    def step(self, c: ToyCache, token: int, dp: tuple[int, int] = (1, 0)) -> torch.Tensor:
        rows, me = dp
        p = c.seq_len
        tokens = torch.zeros(rows, dtype=torch.long)
        tokens[me] = token
        X = self.embed[tokens]
        rope = rope_row(p, 0, self.rope)
        last_topk = None
        for i, kind in self.layout.kind_of:
            if kind == "mtp":
                continue
            X, last_topk = self._layer(c, i, "mla_kv", X, me, p, rope)
        logits = rmsnorm(X) @ self.lm_head
        draft = self._draft(c, token, rope)
        c["R.aux_draft_hidden"] = X[me].to(torch.bfloat16)
        seed = torch.full((self.topk,), -1, dtype=torch.int32)
        seed[:len(last_topk)] = last_topk.to(torch.int32)
        c["R.aux_dsa_topk"] = seed
        c.seq_len = p + 1
        return torch.cat([logits[me], draft])

    def _index_row(self, k: torch.Tensor) -> torch.Tensor:
        scale = (k.abs().max() / FP8_MAX).clamp_min(1e-12).reshape(1)
        q8 = (k / scale).to(torch.float8_e4m3fn)
        return torch.cat([q8.view(torch.uint8), scale.view(torch.uint8)])

    def _index_scores(self, rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        keys = rows[:, :self.index_dim].contiguous().view(torch.float8_e4m3fn).float()
        scale = rows[:, self.index_dim:].contiguous().view(torch.float32)
        return (keys * scale) @ q

    def _layer(self, c: ToyCache, i: int, name: str, X, me: int, p: int, rope, seed=None):
        w = self.layers[i]
        XN = rmsnorm(X)
        lat = rmsnorm(XN @ w["dkv"])
        kr = XN @ w["kr"]
        qn = (XN @ w["q"]).view(len(X), HEADS, self.kv_lora)
        qr = (XN @ w["qr"]).view(len(X), HEADS, self.rope)
        qi, ki = XN @ w["iq"], XN @ w["ik"]
        # the request's row only: idle DP rows have no pages and skip index selection
        c.append(f"L{i}.{name}", torch.cat([lat[me], rotate(kr[me], rope)]))
        c.append(f"L{i}.dsa_index_k", self._index_row(ki[me]))
        score = self._index_scores(c[f"L{i}.dsa_index_k"], qi[me])
        n = p + 1
        pick = score.clone()
        if seed is not None:
            valid = seed[(seed >= 0) & (seed < n)].long()
            pick[valid] += SEED_BONUS
        top = torch.topk(pick, min(self.topk, n)).indices
        outside = torch.full((n,), UNSELECTED_PENALTY)
        outside[top] = 0.0
        kv = c[f"L{i}.{name}"].float()
        lat_all, kr_all = kv[:, :self.kv_lora], kv[:, self.kv_lora:]
        s = (torch.einsum("hc,nc->hn", qn[me], lat_all)
             + torch.einsum("hr,nr->hn", rotate(qr[me], rope), kr_all))
        s = s * (self.kv_lora + self.rope) ** -0.5 + INDEX_WEIGHT * score - outside
        o = torch.einsum("hn,nc->hc", torch.softmax(s, -1), lat_all)
        out = torch.zeros_like(X)
        out[me] = torch.einsum("hc,hcd->hd", o, w["uv"].expand(HEADS, -1, -1)).reshape(-1) @ w["o"]
        return X + out, top

    def _draft(self, c: ToyCache, token: int, rope) -> torch.Tensor:
        i = self.draft
        w = self.layers[i]
        hidden = c["R.aux_draft_hidden"].float()
        x = torch.cat([rmsnorm(self.embed[token]), rmsnorm(hidden)]) @ w["w_in"]
        x, _ = self._layer(c, i, "draft_mla_kv", x[None], 0, c.seq_len, rope,
                           seed=c["R.aux_dsa_topk"])
        return (rmsnorm(x) @ self.lm_head)[0]
