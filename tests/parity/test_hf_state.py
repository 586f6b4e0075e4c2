"""PD parity of pdc.verify.hf_state on real tiny transformers models (no mocks).

Prefill runs in this process; the state crosses to a spawned decode process as raw bytes
(`state_to_bytes`, no pickle of torch objects), where a fresh model built from the same config and
seed rebuilds the cache and keeps decoding. Tokens AND logits of every step must be bitwise equal
to the single-process run: random tiny models often emit the same tokens from a broken state, so
logits are the oracle (see the negative controls).
"""

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from pdc.verify import hf_state as H  # noqa: E402
from pdc.verify.recipe import family_recipe, parity_specs  # noqa: E402

THREADS = 2  # both processes; thread count changes bits (mamba2 fp32 differs between 1 and 2)
TORCH_THREADS = THREADS  # this process, set per test by conftest.py
PROMPT_LEN = 20  # > sliding_window (8) and > mamba2 chunk_size (16)
NEW_TOKENS = 10
DTYPES = ["float32", "bfloat16"]
# The transformers families, by the recipe names of the specs' `parity` blocks (short ids).
SPECS = Path(__file__).resolve().parents[2] / "specs"
R = {name.removeprefix("hf-").replace("-sw", "_sw").replace("-", "_"): family_recipe(b)
     for name, b in parity_specs(SPECS).items() if b.kind == "transformers"}
FAMILIES = list(R)


def _prompt(n: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def decode_proc():
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        assert pool.submit(os.getpid).result(timeout=60) != os.getpid()
        yield pool


def _reference(family, dtype_name, prompt):
    model = H.build_model(R[family], getattr(torch, dtype_name))
    return H.aggregate_generate(model, prompt, NEW_TOKENS)


def _pd(pool, family, dtype_name, prompt, mutate=None):
    """Prefill here on its own model, decode in the other process. Returns the whole trace (row 0
    from the prefill) plus the flags sent and the flags the decode side rebuilt."""
    model = H.build_model(R[family], getattr(torch, dtype_name))
    cache, logits0 = H.prefill_logits(model, prompt)
    state = H.export_state(R[family], model, cache)
    if mutate:
        mutate(state)
    tok0 = int(logits0.argmax())
    job = pool.submit(
        H.decode_from_payload, R[family], dtype_name, H.state_to_bytes(state), len(prompt), tok0,
        NEW_TOKENS - 1, 0, THREADS,
    )
    out = H.state_from_bytes(job.result(timeout=120))
    tokens = torch.cat([torch.tensor([tok0]), out["tokens"]])
    logits = torch.cat([logits0[None], out["logits"]])
    rebuilt = {k.removeprefix("flag:"): int(v) for k, v in out.items() if k.startswith("flag:")}
    return tokens, logits, H.export_flags(R[family], model, cache), rebuilt


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_pd_parity_across_processes(decode_proc, family, dtype_name):
    prompt = _prompt()
    ref_tokens, ref_logits = _reference(family, dtype_name, prompt)
    tokens, logits, sent, rebuilt = _pd(decode_proc, family, dtype_name, prompt)
    assert rebuilt == sent
    # (Mamba2ForCausalLM returns float32 logits even in a bf16 model; compare dtypes, too)
    assert logits.dtype == ref_logits.dtype and logits.shape == (NEW_TOKENS, 256)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize("n", [5, 7, 8])
def test_sliding_window_prompt_around_window(decode_proc, n):
    """Prompts shorter than, equal to and one past window - 1 (= 7 rows kept)."""
    prompt = _prompt(n)
    ref_tokens, ref_logits = _reference("mistral_sw", "float32", prompt)
    tokens, logits, sent, rebuilt = _pd(decode_proc, "mistral_sw", "float32", prompt)
    assert rebuilt == sent == {"L0.cumulative_length": n, "L1.cumulative_length": n}
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)


NEGATIVE = [
    ("qwen3_next", "float32", "L0.conv"),
    ("qwen3_next", "bfloat16", "L0.conv"),
    ("qwen3_next", "float32", "L1.ssm"),
    ("mamba2", "float32", "L1.conv"),
    ("llama", "float32", "L1.v"),
    ("mistral_sw", "float32", "L0.k"),
    ("deepseek_v3", "float32", "L1.kv_nope"),
]


@pytest.mark.parametrize(("family", "dtype_name", "name"), NEGATIVE)
def test_zeroed_state_tensor_changes_logits(decode_proc, family, dtype_name, name):
    prompt = _prompt()
    _, ref_logits = _reference(family, dtype_name, prompt)
    _, logits, _, _ = _pd(decode_proc, family, dtype_name, prompt, lambda s: s[name].zero_())
    assert torch.equal(logits[0], ref_logits[0])  # prefill row is untouched
    assert not torch.equal(logits[1:], ref_logits[1:])


def _decode_in_process(family, prompt, seq_len=None, mutate=None, post=None):
    model = H.build_model(R[family])
    cache, logits0 = H.prefill_logits(model, prompt)
    state = H.export_state(R[family], model, cache)
    if mutate:
        mutate(state)
    rebuilt = H.import_state(R[family], model, state, len(prompt) if seq_len is None else seq_len)
    if post:
        post(rebuilt)
    return H.greedy_decode(model, rebuilt, logits0.argmax(), NEW_TOKENS - 1)[1]


def test_flags_must_be_restored():
    prompt = _prompt()
    _, ref = _reference("mistral_sw", "float32", prompt)
    # Off by one absolute position: same 7 window rows, so only cumulative_length is wrong.
    assert not torch.equal(_decode_in_process("mistral_sw", prompt, seq_len=19), ref[1:])

    _, ref = _reference("qwen3_next", "float32", prompt)

    def forget(cache):
        cache.layers[0].has_previous_state[0] = False

    assert not torch.equal(_decode_in_process("qwen3_next", prompt, post=forget), ref[1:])


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_conv_state_oldest_column_is_dead(family):
    """HF keeps conv_kernel columns but the decode conv only reads the newest kernel - 1."""
    prompt = _prompt()
    _, ref = _reference(family, "float32", prompt)

    def zero_col(col):
        def mutate(state):
            for name, t in state.items():
                if name.endswith(".conv"):
                    t[:, col] = 0

        return mutate

    assert torch.equal(_decode_in_process(family, prompt, mutate=zero_col(0)), ref[1:])
    assert not torch.equal(_decode_in_process(family, prompt, mutate=zero_col(1)), ref[1:])

    # Also on the multi-token (chunk) path that a continued prefill would take.
    model = H.build_model(R[family])
    state = H.export_state(R[family], model, H.prefill(model, prompt))

    def chunk_logits(mutate):
        s = {k: v.clone() for k, v in state.items()}
        mutate(s)
        cache = H.import_state(R[family], model, s, PROMPT_LEN)
        with torch.no_grad():
            return model(input_ids=torch.tensor([[5, 9, 77]]), cache=cache, use_cache=True).logits

    ref_chunk = chunk_logits(lambda s: None)
    assert torch.equal(chunk_logits(zero_col(0)), ref_chunk)
    assert not torch.equal(chunk_logits(zero_col(1)), ref_chunk)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_state_schema_and_round_trip(family, dtype_name):
    dtype = getattr(torch, dtype_name)
    model = H.build_model(R[family], dtype)
    cache = H.prefill(model, _prompt())
    state = H.export_state(R[family], model, cache)
    kinds = H.layer_kinds(model)
    expected = [f"L{i}.{t.name}" for i, k in enumerate(kinds) for t in R[family].layer(k).tensors]
    assert list(state) == expected
    for row in H.describe_state(R[family], model, state):
        t = state[row["name"]]
        assert t.is_contiguous()
        if row["kind"] == H.TOKEN:
            assert t.shape[0] == PROMPT_LEN
        elif row["kind"] == H.WINDOW:
            assert t.shape[0] == model.config.sliding_window - 1
        if row["shard_size"] is not None:
            assert t.shape[row["shard_axis"]] == row["shard_size"]
        if row["segments"]:
            assert sum(n for _, n in row["segments"]) == t.shape[row["shard_axis"]]
    # bf16 models keep the SSM / GDN recurrent state in float32
    for name, t in state.items():
        assert t.dtype == (torch.float32 if name.endswith(".ssm") else dtype)

    wire = H.state_from_bytes(H.state_to_bytes(state))
    rebuilt = H.import_state(R[family], model, wire, PROMPT_LEN)
    again = H.export_state(R[family], model, rebuilt)
    assert list(again) == list(state)
    assert all(torch.equal(again[k], state[k]) and again[k].dtype == state[k].dtype for k in state)
    assert H.export_flags(R[family], model, rebuilt) == H.export_flags(R[family], model, cache)
    # Nothing else differs either: every attribute of every rebuilt cache layer matches.
    for i, (a, b) in enumerate(zip(cache.layers, rebuilt.layers, strict=True)):
        assert type(a) is type(b)
        assert vars(a).keys() == vars(b).keys(), i
        for attr in vars(a):
            assert _same(getattr(a, attr), getattr(b, attr)), (i, attr)


def _same(x, y) -> bool:
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    return type(x) is type(y) and x == y


def test_import_rejects_inconsistent_state():
    model = H.build_model(R["qwen3_next"], torch.bfloat16)
    state = H.export_state(R["qwen3_next"], model, H.prefill(model, _prompt()))
    with pytest.raises(ValueError, match="token rows"):
        H.import_state(R["qwen3_next"], model, state, PROMPT_LEN + 1)
    bad = dict(state, **{"L0.ssm": state["L0.ssm"].to(torch.bfloat16)})
    with pytest.raises(TypeError, match="dtype"):
        H.import_state(R["qwen3_next"], model, bad, PROMPT_LEN)
    with pytest.raises(KeyError, match="L9.k"):
        H.import_state(R["qwen3_next"], model, dict(state, **{"L9.k": state["L3.k"]}), PROMPT_LEN)
    with pytest.raises(TypeError, match="DynamicSlidingWindowLayer"):
        llama = H.build_model(R["llama"])
        H.export_state(R["mistral_sw"], H.build_model(R["mistral_sw"]), H.prefill(llama, _prompt()))
