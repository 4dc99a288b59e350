"""Engram (spec/model.md §9): compression map, layout (primes, multipliers), n-grams, hashing, embed and gate.

Every device function is checked against a slower re-derivation of the spec formula written here: NumPy int64
for the hash, per-stream loops in float64 for the gate, ml_dtypes for the FP8 table.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models

from deepinfer_jax.config import load_model_config
from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.deepseek_v4.engram import (
    CompressionMap,
    EngramLayout,
    engram_embed,
    engram_gate,
    engram_layer,
    engram_multipliers,
    engram_table_sizes,
    hash_rows,
    next_prime,
    ngram_ids,
)
from deepinfer_jax.numerics.host import quantize_fp8_blockwise
from deepinfer_jax.text.synthetic import build_synthetic_tokenizer

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.fixture(scope="module")
def tiny():
    return load_model_config(CONFIGS / "tiny_v41.yaml")


@pytest.fixture(scope="module")
def synthetic_512():
    return Tokenizer.from_str(build_synthetic_tokenizer(512))


# ------------------------------------------------------------------------- independent re-derivations


def spec_key(decoded: str, raw: str) -> str:
    """§9.1 step 2-3, with Python's unicodedata (independent of the tokenizers normalizers)."""
    if "\ufffd" in decoded:
        return raw
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", decoded))
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn").lower()
    text = re.sub(r"[ \t\r\n]+", " ", text)
    if text != " ":
        text = text.strip()
    return text or decoded


def spec_compression(tokenizer: Tokenizer) -> tuple[list[int], int]:
    seen: dict[str, int] = {}
    out = []
    for i in range(tokenizer.get_vocab_size()):
        key = spec_key(tokenizer.decode([i], skip_special_tokens=False), tokenizer.id_to_token(i))
        if key not in seen:
            seen[key] = len(seen)
        out.append(seen[key])
    return out, len(seen)


def spec_rows(ngrams: np.ndarray, mult, sizes) -> np.ndarray:
    """§9.3 in NumPy int64: XOR-accumulated products, mod each prime, plus the (order, head) offset."""
    flat = [p for order in sizes for p in order]
    offsets = np.concatenate([[0], np.cumsum(flat)[:-1]])
    heads = len(sizes[0])
    g = ngrams.astype(np.int64)
    h = g[..., 0] * np.int64(mult[0])
    out = np.zeros((*g.shape[:-1], len(sizes), heads), np.int64)
    for n in range(1, g.shape[-1]):
        h = np.bitwise_xor(h, g[..., n] * np.int64(mult[n]))
        for j in range(heads):
            out[..., n - 1, j] = h % sizes[n - 1][j] + offsets[(n - 1) * heads + j]
    return out


def naive_is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


# ------------------------------------------------------------------------------------ compression map


def small_tokenizer() -> Tokenizer:
    """A word-level vocabulary with case, accent and whitespace variants, so that keys merge."""
    words = [
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜▁pad▁｜>",
        "Café",
        "cafe",
        "CAFÉ",
        "café",
        "The",
        "the",
        "THE",
        " ",
        "\t\n",
        "  ",
        " the ",
        "naïve",
        "Naive",
        "ﬁ",  # NFKC folds the ligature to "fi"
        "fi",
        "Zürich",
        "zurich",
        "x",
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="x"))
    tok.add_special_tokens([AddedToken(w, special=True) for w in words[:3]])
    return tok


def test_compression_merges_case_accent_and_whitespace_variants():
    tok = small_tokenizer()
    cmap = CompressionMap.from_tokenizer(tok)
    expected, size = spec_compression(tok)
    assert cmap.table.tolist() == expected and cmap.size == size
    # By hand: the three special tokens stay distinct; café ×4, the ×4 (" the " strips), spaces ×3,
    # naive ×2, fi ×2, zurich ×2 merge.
    assert cmap.table.tolist() == [0, 1, 2, 3, 3, 3, 3, 4, 4, 4, 5, 5, 5, 4, 6, 6, 7, 7, 8, 8, 9]
    assert cmap.size == 10


def test_compression_of_the_synthetic_tokenizer(synthetic_512):
    cmap = CompressionMap.from_tokenizer(synthetic_512)
    expected, size = spec_compression(synthetic_512)
    assert cmap.table.tolist() == expected
    assert cmap.size == size == 412  # the tiny model's engram_compressed_vocab_size
    assert cmap.table[2] == 2  # <｜▁pad▁｜> keeps its own id
    # Byte symbols >= 0x80 are partial UTF-8 on their own: keyed by their raw spelling, never merged.
    high_bytes = cmap.table[10 + 0x80 : 10 + 0x100]
    assert len(set(high_bytes.tolist())) == 128


def test_compression_from_path_and_wrapper(tmp_path, synthetic_512):
    path = tmp_path / "tokenizer.json"
    path.write_text(build_synthetic_tokenizer(512), encoding="utf-8")

    class Wrapper:
        backend = synthetic_512

    base = CompressionMap.from_tokenizer(synthetic_512).table
    assert np.array_equal(CompressionMap.from_tokenizer(path).table, base)
    assert np.array_equal(CompressionMap.from_tokenizer(tmp_path).table, base)
    assert np.array_equal(CompressionMap.from_tokenizer(Wrapper()).table, base)
    with pytest.raises(TypeError, match="tokenizer: expected"):
        CompressionMap.from_tokenizer(42)
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        CompressionMap.from_tokenizer(tmp_path / "missing")


@pytest.mark.parametrize(
    ("table", "error", "match"),
    [
        ([0, 1, 3], ValueError, "dense"),
        ([0, -1], ValueError, "negative"),
        ([[0, 1]], TypeError, "1-D integer"),
        ([0.0, 1.0], TypeError, "1-D integer"),
    ],
)
def test_explicit_table_is_validated(table, error, match):
    with pytest.raises(error, match=match):
        CompressionMap.from_table(table)


def test_host_mapping_refuses_out_of_range_ids():
    cmap = CompressionMap.from_table(np.arange(4) // 2)
    assert cmap([0, 3]).tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"raw token id 4: outside \[0, 4\)"):
        cmap([4])


# --------------------------------------------------------------------------------------------- layout


def test_spec_15_2_primes(tiny):
    sizes = engram_table_sizes((0, 2), 3, 2, 1000)
    assert sizes == (((1009, 1013), (1019, 1021)), ((1031, 1033), (1039, 1049)))
    layout = EngramLayout.from_config(tiny, CompressionMap.from_table(np.arange(512)))
    assert layout.num_rows == (4062, 4152) == tiny.engram_num_embeddings
    assert layout.offsets(1) == ((0, 1031), (2064, 3103))
    assert layout.embed_width == 512


def test_spec_15_2_multipliers_with_identity_table(tiny):
    cfg = tiny.with_hf_overrides({"engram_compressed_vocab_size": 512})
    layout = EngramLayout.from_config(cfg, CompressionMap.from_table(np.arange(512)))
    # Recomputed here with NumPy, as §15.2 asks.
    bound = (np.iinfo(np.int64).max // 512) // 2
    expected = tuple(
        tuple(
            int(v)
            for v in np.random.default_rng(10007 * layer).integers(0, bound, size=3, dtype=np.int64) * 2 + 1
        )
        for layer in (0, 2)
    )
    assert layout.multipliers == expected
    # ...which are the example values printed in §15.2 (and, for layer 1, in §15.3's tiny-xcheck).
    assert expected == (
        (11474481670680735, 4860045374305909, 738113388524411),
        (14807183965884349, 7179874451713115, 4383153767543747),
    )
    assert engram_multipliers((1,), 3, 512) == ((14831304026200453, 936705081716061, 6959601268494069),)
    assert all(m % 2 == 1 for row in layout.multipliers for m in row)


def test_tiny_layout_from_its_tokenizer(tiny, synthetic_512):
    layout = EngramLayout.from_config(tiny, CompressionMap.from_tokenizer(synthetic_512))
    assert layout.compressed_vocab_size == 412 and layout.pad_id == 2
    assert layout.num_rows == (4062, 4152)  # the primes do not depend on Vc


def test_layout_refuses_config_mismatches(tiny, synthetic_512):
    cmap = CompressionMap.from_tokenizer(synthetic_512)
    with pytest.raises(ConfigValueError, match=r"engram_compressed_vocab_size = 512: .* has 412 ids") as info:
        EngramLayout.from_config(tiny.with_hf_overrides({"engram_compressed_vocab_size": 512}), cmap)
    assert "tiny_v41.yaml" in str(info.value)
    with pytest.raises(ConfigValueError, match=r"engram_num_embeddings = \[4062, 4100\].*\[4062, 4152\]"):
        EngramLayout.from_config(tiny.with_hf_overrides({"engram_num_embeddings": [4062, 4100]}), cmap)
    with pytest.raises(ConfigValueError, match=r"engram_head_dim = 100: must be a multiple of 32"):
        EngramLayout.from_config(tiny.with_hf_overrides({"engram_head_dim": 100}), cmap)
    with pytest.raises(ConfigValueError, match=r"engram_vocab_size = 600000000: gives a table of \d+ rows"):
        EngramLayout.from_config(tiny.with_hf_overrides({"engram_vocab_size": 600_000_000}), cmap)
    with pytest.raises(ValueError, match=r"covers 20 raw ids; the model.s text_config\.vocab_size is 512"):
        EngramLayout.from_config(tiny, CompressionMap.from_table(np.arange(20)))


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=200_000))
def test_next_prime_property(n):
    p = next_prime(n)
    assert p > n and naive_is_prime(p)
    assert not any(naive_is_prime(k) for k in range(n + 1, p))


def test_next_prime_at_large_sizes():
    # Around real table sizes (~1e8) and the 2^31 limit.
    assert next_prime(10**8) == 100000007
    assert next_prime(2**31 - 2) == 2**31 - 1


# -------------------------------------------------------------------------------- n-grams and hashing


def spec_ngrams(seq: list[int], nmax: int, pad: int) -> np.ndarray:
    return np.array([[seq[p - r] if p - r >= 0 else pad for r in range(nmax)] for p in range(len(seq))])


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.integers(0, 99), min_size=1, max_size=12),
    st.integers(0, 12),
    st.integers(2, 4),
)
def test_ngram_ids_chunked_equal_full(seq, cut, nmax):
    cut = min(cut, len(seq))
    pad = 7
    full, _ = ngram_ids(jnp.asarray([seq]), None, max_ngram_size=nmax, pad_id=pad)
    assert np.array_equal(np.asarray(full[0]), spec_ngrams(seq, nmax, pad))
    first, hist = ngram_ids(jnp.asarray([seq[:cut]]), None, max_ngram_size=nmax, pad_id=pad)
    pieces = [np.asarray(first[0])]
    for token in seq[cut:]:  # then token by token, as decode does
        step, hist = ngram_ids(jnp.asarray([[token]]), hist, max_ngram_size=nmax, pad_id=pad)
        pieces.append(np.asarray(step[0]))
    assert np.array_equal(np.concatenate(pieces), np.asarray(full[0]))


def test_ngram_ids_history_shape_is_checked():
    with pytest.raises(ValueError, match=r"history: expected shape \(1, 2\)"):
        ngram_ids(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 3), jnp.int32), max_ngram_size=3, pad_id=0)


HASH_CASES = {
    # (compressed vocab, table base size, heads, Nmax): tiny sizes; real-like ones (products of ~63 bits,
    # primes near 2e8, offsets near 2^31); a vocabulary near 2^31 (multipliers of ~32 bits, ids of ~31 bits).
    "tiny": (512, 1000, 2, 3),
    "real-like": (129280, 230_000_000, 3, 4),
    "huge-vocab": (2**31 - 1, 50_000, 2, 4),
}


@pytest.mark.parametrize("case", sorted(HASH_CASES))
def test_hash_rows_match_int64(case):
    vc, base, heads, nmax = HASH_CASES[case]
    layer_ids = (1, 14)
    sizes = engram_table_sizes(layer_ids, nmax, heads, base)
    layout = EngramLayout(
        layer_ids=layer_ids,
        max_ngram_size=nmax,
        n_heads=heads,
        head_dim=32,
        compressed_vocab_size=vc,
        pad_id=0,
        sizes=sizes,
        multipliers=engram_multipliers(layer_ids, nmax, vc),
    )
    rng = np.random.default_rng(0)
    grams = rng.integers(0, vc, size=(3, 50, nmax))
    grams[0, 0] = vc - 1  # the largest product
    grams[0, 1] = 0
    fn = jax.jit(hash_rows, static_argnums=(1, 2))
    for slot in (0, 1):
        got = np.asarray(fn(jnp.asarray(grams, jnp.int32), layout, slot))
        want = spec_rows(grams, layout.multipliers[slot], sizes[slot])
        assert got.dtype == np.int32 and np.array_equal(got, want)
        assert got.min() >= 0 and got.max() < layout.num_rows[slot]


# ------------------------------------------------------------------------------- embedding and gate


def random_table(rng, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    codes = rng.integers(0, 256, size=(rows, width)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    scales = rng.integers(110, 135, size=(rows, width // 32)).astype(np.uint8)
    return codes, scales


def spec_dequant_rows(codes, scales, rows):
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    factors = np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1)
    table = values * factors
    return np.concatenate([table[r] for r in rows.reshape(-1)]).reshape(*rows.shape[:-2], -1)


def test_engram_embed_exact():
    rng = np.random.default_rng(1)
    codes, scales = random_table(rng, 97, 64)
    rows = rng.integers(0, 97, size=(2, 5, 2, 3))  # [B, S, orders, heads]
    got = np.asarray(engram_embed(jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(rows, jnp.int32)))
    want = np.stack(
        [np.stack([spec_dequant_rows(codes, scales, rows[b, s]) for s in range(5)]) for b in range(2)]
    )
    assert got.shape == (2, 5, 2 * 3 * 64)
    # Exact: an E4M3 value times a power of two is a float32 number.
    assert np.array_equal(got, want.astype(np.float32))


def spec_gate(R, K, V, wh, we, eps):
    m, H = R.shape
    out = np.empty_like(R)
    for s in range(m):
        rx = 1 / np.sqrt(np.mean(R[s] ** 2) + eps)
        rk = 1 / np.sqrt(np.mean(K[s] ** 2) + eps)
        dot = sum(R[s, d] * wh[s, d] * K[s, d] * we[s, d] for d in range(H)) * rx * rk / np.sqrt(H)
        gamma = 1 / (1 + np.exp(-(np.sign(dot) * np.sqrt(max(abs(dot), 1e-6)))))
        out[s] = R[s] + gamma * V
    return out


def test_engram_gate_against_loops():
    rng = np.random.default_rng(2)
    m, H, eps = 4, 64, 1e-6
    R = rng.normal(size=(3, m, H))
    K = rng.normal(size=(3, m, H))
    K[1, 2] *= 1e-5  # |dot| below the 1e-6 clamp for this stream
    V = rng.normal(size=(3, H))
    wh, we = rng.normal(size=(m, H)), rng.normal(size=(m, H))
    got = np.asarray(
        engram_gate(*(jnp.asarray(a, jnp.float32) for a in (R, K, V, wh, we)), eps=eps), np.float64
    )
    want = np.stack([spec_gate(R[t], K[t], V[t], wh, we, eps) for t in range(3)])
    # float32 arithmetic on O(1) values over 64-term sums: 1e-5 covers the rounding with margin.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_engram_layer_end_to_end(tiny, synthetic_512):
    """Hash -> table -> FP8 wkv -> gate for a few tokens, against a NumPy re-derivation of the whole §9."""
    cfg = tiny
    layout = EngramLayout.from_config(cfg, CompressionMap.from_tokenizer(synthetic_512))
    cmap = CompressionMap.from_tokenizer(synthetic_512)
    slot = layout.slot(2)
    m, H = cfg.hc_mult, cfg.hidden_size
    rng = np.random.default_rng(3)
    codes, scales = random_table(rng, layout.num_rows[slot], layout.head_dim)
    w = rng.normal(size=((m + 1) * H, layout.embed_width)).astype(np.float32) / np.sqrt(layout.embed_width)
    wq, ws = quantize_fp8_blockwise(w)
    wh, we = rng.normal(size=(m, H)), rng.normal(size=(m, H))
    params = {
        "embed": {"weight": jnp.asarray(codes), "scale": jnp.asarray(scales)},
        "wkv": {"weight": jnp.asarray(wq.view(np.uint8)), "scale": jnp.asarray(ws.view(np.uint8))},
        "q_weight": jnp.asarray(wh, jnp.float32),
        "k_weight": jnp.asarray(we, jnp.float32),
    }
    raw = rng.integers(0, cfg.vocab_size, size=(1, 6))
    R = rng.normal(size=(1, 6, m, H))

    comp = cmap(raw)
    grams, _ = ngram_ids(jnp.asarray(comp), None, max_ngram_size=layout.max_ngram_size, pad_id=layout.pad_id)
    rows = hash_rows(grams, layout, slot)
    layer = jax.jit(engram_layer, static_argnames=("eps", "numerics"))
    got = layer(
        params,
        jnp.asarray(R, jnp.float32),
        rows,
        eps=cfg.rms_norm_eps,
        numerics=LinearNumerics(block=(32, 32)),
    )

    # Re-derivation: spec n-grams and rows, dequantised table and weight, float64 projection and gate.
    spec_g = spec_ngrams(comp[0].tolist(), layout.max_ngram_size, layout.pad_id)
    spec_r = spec_rows(spec_g, layout.multipliers[slot], layout.sizes[slot])
    w_deq = wq.astype(np.float64) * np.repeat(np.repeat(ws.astype(np.float64), 32, 0), 32, 1)
    want = []
    for t in range(6):
        kv = (spec_dequant_rows(codes, scales, spec_r[t][None])[0] @ w_deq.T).reshape(m + 1, H)
        want.append(spec_gate(R[0, t], kv[:m], kv[m], wh, we, cfg.rms_norm_eps))
    # float32 GEMM over 512 terms and the gate: 1e-4 absolute on O(1) outputs.
    np.testing.assert_allclose(np.asarray(got[0], np.float64), np.stack(want), rtol=1e-4, atol=1e-4)
