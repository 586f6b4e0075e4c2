"""Qwen3.8-Flash-Next-like toy (specs/qwen38.yaml, seed 000), built from the spec's layout.

Every tensor of the toy's cache is one component of the spec, at the spec's (scaled) shape,
dtype and index mode (docs/parity.md, "The seed toys"). One step at position p:

- PLE (request-wide): `ple_ngram` shifts in the token; the n-gram hash of all its entries
  picks a PLE embedding row; `ple_short_conv` holds the last kernel-1 inputs of a short
  causal conv over those rows; the conv output, projected, is added to the token embedding.
- `qsa_rope` (request-wide ring, row p % R): the rotary row of position p, written once and
  read by every QSA layer for the R positions the pending ring holds.
- GDN layers: a causal conv over `gdn_conv` (the last kernel-1 q|k|v inputs) and a gated
  delta rule on `gdn_temporal` (fp32, per value head).
- QSA layers: the raw key goes to `qsa_pending` row p % R and, rotated, to the `kv` page; when
  p closes a group of R positions, the group is compressed from the pending ring (each row
  rotated by its `qsa_rope` row) into one `qsa_compressed` row. The query attends over every
  `kv` row, biased per token by its group's compressed key (complete groups) and by the
  rotated pending-ring key (the last R positions).
- MTP (draft id band): embeds the token with the previous position's hidden state
  (`aux_draft_hidden`), attends over its own `kv` pages, and gives draft logits; the final
  hidden state of p becomes the next draft hidden state.

Decode's first token is read from `aux_first_token` (toy.first_token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .toy import VOCAB, ToyCache, ToyModel, Weights, attend, rmsnorm, rope_row, rotate

PLE_ROWS = 257  # PLE embedding rows the n-gram hash picks from (toy)
NGRAM_MULT = 1_000_003


def build(layout, params: dict[str, int], dtype: str, seed: int = 0) -> Qwen38Toy:
    return Qwen38Toy(layout, seed)


class Qwen38Toy(ToyModel):
    def __init__(self, layout, seed: int = 0):
        c = {comp.name: comp for comp in layout.components}
        self.layout = layout
        self.kinds = dict(layout.kind_of)
        self.R = c["qsa_pending"].ring_rows
        _, self.kvh, self.hd = c["kv"].shape
        self.rope_dim = c["qsa_rope"].shape[0]
        conv = c["gdn_conv"]
        self.conv_dim, k1 = conv.shape
        self.conv_k = k1 + 1
        self.nk = conv.shard.group_units[0]
        self.nv, self.dk, self.dv = c["gdn_temporal"].shape
        self.key_dim = self.nk * self.dk
        self.ple_dim, p1 = c["ple_short_conv"].shape
        self.ple_k = p1 + 1
        self.ngram = c["ple_ngram"].shape[0]
        self.hidden = c["aux_draft_hidden"].shape[0]
        self.comps = c
        self.nq = 2 * self.kvh
        H, w = self.hidden, Weights(seed)
        self.embed = w(VOCAB, H, scale=1.0)
        self.ple_table = w(PLE_ROWS, self.ple_dim, scale=1.0)
        self.ple_conv = w(self.ple_dim, self.ple_k, scale=0.5)
        self.ple_proj = w(self.ple_dim, H)
        self.layers = {}
        for i, kind in layout.kind_of:
            if kind == "gdn":
                self.layers[i] = dict(
                    w_in=w(H, self.conv_dim), conv=w(self.conv_dim, self.conv_k, scale=0.5),
                    w_a=w(H, self.nv), w_b=w(H, self.nv), w_o=w(self.nv * self.dv, H))
            else:  # qsa and the mtp draft layer
                self.layers[i] = dict(
                    wq=w(H, self.nq * self.hd), wk=w(H, self.kvh * self.hd),
                    wv=w(H, self.kvh * self.hd), wo=w(self.nq * self.hd, H))
                if kind == "mtp":
                    self.layers[i]["w_in"] = w(2 * H, H)
        self.lm_head = w(H, VOCAB)

    # ~~~ cache ~~~

    def new_cache(self) -> ToyCache:
        s: dict[str, torch.Tensor] = {}
        bf, f32 = torch.bfloat16, torch.float32
        for i, kind in self.layout.kind_of:
            if kind == "gdn":
                s[f"L{i}.gdn_conv"] = torch.zeros(self.conv_dim, self.conv_k - 1, dtype=bf)
                s[f"L{i}.gdn_temporal"] = torch.zeros(self.nv, self.dk, self.dv, dtype=f32)
                continue
            s[f"L{i}.k"] = torch.zeros(0, self.kvh, self.hd, dtype=bf)
            s[f"L{i}.v"] = torch.zeros(0, self.kvh, self.hd, dtype=bf)
            if kind == "qsa":
                s[f"L{i}.qsa_compressed"] = torch.zeros(0, self.kvh, self.hd, dtype=bf)
                s[f"L{i}.qsa_pending"] = torch.zeros(self.R, self.kvh, self.hd, dtype=bf)
        s["R.qsa_rope"] = torch.zeros(self.R, self.rope_dim, dtype=f32)
        s["R.ple_short_conv"] = torch.zeros(self.ple_dim, self.ple_k - 1, dtype=bf)
        s["R.ple_ngram"] = torch.zeros(self.ngram, dtype=torch.int32)
        s["R.aux_first_token"] = torch.zeros(16, dtype=torch.int32)
        s["R.aux_draft_hidden"] = torch.zeros(self.hidden, dtype=bf)
        return ToyCache(s, 0)

    def describe(self, name: str):
        comp = name.split(".", 1)[1]
        if comp in ("k", "v"):
            return "token", dict(shard_axis=1, shard_size=self.kvh)
        if comp == "qsa_compressed":
            return "token", None
        if comp in ("qsa_pending", "qsa_rope"):
            return "ring", None
        if comp == "gdn_conv":
            return "slot", dict(shard_axis=0, segments=[("q", self.key_dim), ("k", self.key_dim),
                                                        ("v", self.nv * self.dv)],
                                segment_units=[self.nk, self.nk, self.nv])
        if comp == "gdn_temporal":
            return "slot", dict(shard_axis=0, shard_size=self.nv)
        if comp.startswith("aux_"):
            return "aux", None
        return "slot", None  # ple_short_conv, ple_ngram

    # ~~~ one token ~~~

    def step(self, c: ToyCache, token: int, dp=(1, 0)) -> torch.Tensor:
        p = c.seq_len
        x = self.embed[token] + self._ple(c, token) @ self.ple_proj
        rope = rope_row(p, token, self.rope_dim)
        c["R.qsa_rope"][p % self.R] = rope
        for i, kind in self.layout.kind_of:
            if kind == "gdn":
                x = x + self._gdn(c, i, x)
            elif kind == "qsa":
                x = x + self._qsa(c, i, x, p, rope)
        logits = rmsnorm(x) @ self.lm_head
        draft = self._mtp(c, token, rope)
        c["R.aux_draft_hidden"] = x.to(torch.bfloat16)
        c.seq_len = p + 1
        return torch.cat([logits, draft])

    def _ple(self, c: ToyCache, token: int) -> torch.Tensor:
        ctx = torch.cat([c["R.ple_ngram"][1:], torch.tensor([token], dtype=torch.int32)])
        c["R.ple_ngram"] = ctx
        mult = torch.tensor([pow(NGRAM_MULT, j, PLE_ROWS) for j in range(self.ngram)])
        row = int(torch.remainder((ctx.to(torch.int64) % PLE_ROWS * mult).sum(), PLE_ROWS))
        win = torch.cat([c["R.ple_short_conv"].float(), self.ple_table[row][:, None]], 1)
        c["R.ple_short_conv"] = win[:, 1:].to(torch.bfloat16)
        return F.silu((win * self.ple_conv).sum(1))

    def _gdn(self, c: ToyCache, i: int, x: torch.Tensor) -> torch.Tensor:
        w = self.layers[i]
        xn = rmsnorm(x)
        win = torch.cat([c[f"L{i}.gdn_conv"].float(), (xn @ w["w_in"])[:, None]], 1)
        c[f"L{i}.gdn_conv"] = win[:, 1:].to(torch.bfloat16)
        cv = F.silu((win * w["conv"]).sum(1))
        q, k, v = torch.split(cv, [self.key_dim, self.key_dim, self.nv * self.dv])
        rep = self.nv // self.nk
        q = F.normalize(q.view(self.nk, self.dk), dim=-1).repeat_interleave(rep, 0)
        k = F.normalize(k.view(self.nk, self.dk), dim=-1).repeat_interleave(rep, 0)
        v = v.view(self.nv, self.dv)
        decay = torch.exp(-F.softplus(xn @ w["w_a"]))
        beta = torch.sigmoid(xn @ w["w_b"])
        S = c[f"L{i}.gdn_temporal"] * decay[:, None, None]
        delta = (v - torch.einsum("hk,hkv->hv", k, S)) * beta[:, None]
        S = S + k[:, :, None] * delta[:, None, :]
        c[f"L{i}.gdn_temporal"] = S
        o = torch.einsum("hk,hkv->hv", q * self.dk ** -0.5, S)
        return o.reshape(-1) @ w["w_o"]

    def _qkv(self, i: int, x: torch.Tensor):
        w = self.layers[i]
        xn = rmsnorm(x)
        return ((xn @ w["wq"]).view(self.nq, self.hd), (xn @ w["wk"]).view(self.kvh, self.hd),
                (xn @ w["wv"]).view(self.kvh, self.hd))

    def _qsa(self, c: ToyCache, i: int, x, p: int, rope) -> torch.Tensor:
        R = self.R
        q, k_raw, v = self._qkv(i, x)
        pend = c[f"L{i}.qsa_pending"]
        pend[p % R] = k_raw.to(torch.bfloat16)
        c.append(f"L{i}.k", rotate(k_raw, rope))
        c.append(f"L{i}.v", v)
        ring = c["R.qsa_rope"]
        # the pending ring as rotated keys: row j holds the position ≡ j (mod R)
        local = torch.stack([rotate(pend[j].float(), ring[j]) for j in range(R)])
        if p % R == R - 1:  # the ring closes a group: compress it
            c.append(f"L{i}.qsa_compressed", local.mean(0))
        q = rotate(q, rope)
        keys, values = c[f"L{i}.k"].float(), c[f"L{i}.v"].float()
        n = p + 1
        qg = q.view(self.kvh, -1, self.hd)
        scale = self.hd ** -0.5
        bias = torch.zeros(self.kvh, qg.shape[1], n)
        comp = c[f"L{i}.qsa_compressed"].float()
        if len(comp):
            cs = torch.einsum("grd,ngd->grn", qg, comp) * scale
            bias[..., :len(comp) * R] += cs.repeat_interleave(R, -1)
        lo = max(0, n - R)
        rows = [j % R for j in range(lo, n)]
        bias[..., lo:n] += torch.einsum("grd,ngd->grn", qg, local[rows]) * (0.5 * scale)
        out = attend(q, keys, values, bias)
        return out @ self.layers[i]["wo"]

    def _mtp(self, c: ToyCache, token: int, rope) -> torch.Tensor:
        i = self.layout.draft_ids[0]
        w = self.layers[i]
        hidden = c["R.aux_draft_hidden"].float()
        x = torch.cat([rmsnorm(self.embed[token]), rmsnorm(hidden)]) @ w["w_in"]
        q, k, v = self._qkv(i, x)
        c.append(f"L{i}.k", rotate(k, rope))
        c.append(f"L{i}.v", v)
        x = x + attend(rotate(q, rope), c[f"L{i}.k"].float(), c[f"L{i}.v"].float()) @ w["wo"]
        return rmsnorm(x) @ self.lm_head
