"""The bfloat16 production mode of DeepSeek-V4 (ARCHITECTURE.md §8; spec/model.md §12.2-§12.4) on tiny-v4.

Three kinds of checks:

* **Cast points.** Each round trip of §12.4 is shown where the spec puts it, and nowhere else, by running one
  attention layer twice on the same bf16 input with policies that differ in exactly that switch: the cast run's
  values must equal this file's own ml_dtypes quantise-dequantise of the uncast run's values, bit for bit, and
  everything upstream of the cast point must be unchanged.
* **Incremental equals full.** Stored keys are cast before they are stored, so prefill and decode read the same
  values: chunked prefill + token decode leaves the same window ring and compressed / indexer entries as one pass.
* **bf16 against float32 logits**, with bounds measured and explained below; causality.

tiny-v4 stores its weights unquantised, so no GEMM here takes the MXFP8 activation cast (spec §12.2 applies it to
FP8/FP4 GEMMs only); the V4.1 tests check that cast on real FP8 / MXFP4 weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from quant_reference import (  # tests/quant_reference.py
    assert_tracks_float32,
    check_quantisers_by_hand,
    f32,
    np_fp4_e4m3,
    np_mxfp4,
    np_mxfp8,
)

from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.models.deepseek_v4 import attention as v4_attention
from deepinfer_jax.models.deepseek_v4 import model as v4_model
from deepinfer_jax.models.deepseek_v4.attention import attention_layer, init_attention_state
from deepinfer_jax.models.deepseek_v4.family import plan_for, precision_mode
from deepinfer_jax.numerics.activation import CastPolicy

BF16 = ml_dtypes.bfloat16
MAX_LEN = 64
SEQ = 40
SLIDING, CSA, HCA = 0, 1, 2  # tiny-v4 layer kinds: sliding window, CSA (ratio 4 + indexer), HCA (ratio 16)


# ----------------------------------------------------------------------- independent quantise-dequantise


def test_the_quantisers_here_follow_the_spec_by_hand():
    check_quantisers_by_hand()


# --------------------------------------------------------------------------------------------- set-up


class Bf16Setup:
    def __init__(self) -> None:
        self.model = load_model("tiny-v4", "bfloat16")
        self.params = self.model.params
        self.plan, self.numerics = plan_for(self.model.config, "bfloat16")
        self.full = jax.jit(v4_model.forward_logits, static_argnames=("plan", "numerics"))
        self.chunk = jax.jit(v4_model.forward_chunk, static_argnames=("plan", "numerics"))
        self.layer = jax.jit(attention_layer, static_argnames=("spec", "numerics"))
        self.ids = np.random.default_rng(0).integers(0, 512, (2, 48)).astype(np.int32)
        rng = np.random.default_rng(1)
        self.x = jnp.asarray(rng.standard_normal((1, SEQ, self.plan.hidden)), jnp.bfloat16)


@pytest.fixture(scope="module")
def bf() -> Bf16Setup:
    return Bf16Setup()


def test_bfloat16_mode_loads_and_is_static(bf):
    """``load_model(.., "bfloat16")``: bf16 unquantised weights, float32 norms / mHC / sinks / router; the plan
    carries the mode (hashable: one compiled forward per mode) and the float32 plan stays the parity one."""
    p = bf.params
    assert p["embed"].dtype == jnp.bfloat16 and p["head"].dtype == jnp.bfloat16
    assert precision_mode(p) == "bfloat16"
    layer = p["layers"][CSA]
    assert layer["attn"]["wq_a"]["weight"].dtype == jnp.bfloat16
    for leaf in (
        layer["attn_norm"],
        layer["hc_attn"]["fn"],
        layer["attn"]["sinks"],
        layer["ffn"]["gate"]["weight"],
    ):
        assert leaf.dtype == jnp.float32
    assert bf.plan.dtype == "bfloat16" and bf.plan.casts == CastPolicy.for_mode("deepseek_v4", "bfloat16")
    assert all(spec.casts == bf.plan.casts and spec.score_dtype == "bfloat16" for spec in bf.plan.attention)
    assert bf.numerics.activation_cast == "mxfp8"
    assert plan_for(bf.model.config, "bfloat16") is plan_for(bf.model.config, "bfloat16")
    hash((bf.plan, bf.numerics))
    parity, parity_numerics = plan_for(bf.model.config)
    assert (
        parity.dtype == "float32"
        and parity.casts == CastPolicy()
        and parity_numerics.activation_cast == "none"
    )
    with pytest.raises(ValueError, match=r"dtype: 'float16' is not a precision mode"):
        v4_model.V4Plan.from_config(bf.model.config, "float16")
    with pytest.raises(ValueError, match=r"dtype: 'float16'"):
        load_model("tiny-v4", "float16")


# ----------------------------------------------------------------------------------------- cast points


def _run_layer(bf: Bf16Setup, kind: int, casts: CastPolicy, monkeypatch) -> dict[str, Any]:
    """One attention layer over ``bf.x`` with ``casts``; records what the attention core and the indexer read."""
    seen: dict[str, Any] = {}
    real_get = v4_attention.get_op

    def spy(name: str) -> Any:
        op = real_get(name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen[name] = args
            return op(*args, **kwargs)

        return wrapped

    spec = dataclasses.replace(bf.plan.attention[kind], casts=casts)

    @jax.jit
    def run(p: Any, x: jax.Array) -> dict[str, Any]:
        state = init_attention_state(spec, 1, MAX_LEN, jnp.bfloat16)
        y, new_state = attention_layer(p, x, jnp.int32(0), state, spec, bf.numerics)
        return {"y": y, "state": new_state, **seen}  # the recorded operands come out of the trace too

    monkeypatch.setattr(v4_attention, "get_op", spy)
    try:
        return run(bf.params["layers"][kind]["attn"], bf.x)
    finally:
        monkeypatch.setattr(v4_attention, "get_op", real_get)


def _window_part(run: dict[str, Any], window: int) -> np.ndarray:
    """The current chunk's window keys as the attention core saw them (the ring comes first, W slots)."""
    return f32(run["v4_sink_attention"][1][:, window : window + SEQ])


@pytest.mark.parametrize("kind", [SLIDING, CSA])
def test_window_keys_are_mxfp8_for_the_chunk_and_the_ring(bf, kind, monkeypatch):
    """§12.4 item 2: the keys the current chunk attends to and the keys written to the ring are the MXFP8 round
    trip of the rotated, normalised ``wkv`` output; queries and compressed entries are untouched by that switch."""
    full = bf.plan.casts
    on = _run_layer(bf, kind, full, monkeypatch)
    off = _run_layer(bf, kind, dataclasses.replace(full, window_keys="none"), monkeypatch)
    window = bf.plan.attention[kind].window
    uncast = _window_part(off, window)
    assert not np.array_equal(uncast, np_mxfp8(uncast))  # the round trip does change these values
    np.testing.assert_array_equal(_window_part(on, window), np_mxfp8(uncast))
    ring_off, ring_on = f32(off["state"].window), f32(on["state"].window)
    np.testing.assert_array_equal(ring_on, np_mxfp8(ring_off))
    np.testing.assert_array_equal(
        f32(on["v4_sink_attention"][0]), f32(off["v4_sink_attention"][0])
    )  # queries
    if kind == CSA:
        np.testing.assert_array_equal(
            f32(on["state"].compressor.entries), f32(off["state"].compressor.entries)
        )


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_compressed_entries_are_stored_fp4(bf, kind, monkeypatch):
    """§12.4 item 3: compressed entries are stored (hence read, by prefill and decode alike) as FP4 with E4M3
    per-16 scales; the float32 projection tails they come from are not cast."""
    full = bf.plan.casts
    on = _run_layer(bf, kind, full, monkeypatch)
    off = _run_layer(bf, kind, dataclasses.replace(full, compressed_keys="none"), monkeypatch)
    count = SEQ // bf.plan.attention[kind].ratio
    uncast = f32(off["state"].compressor.entries)[:, :count]
    assert not np.array_equal(uncast, np_fp4_e4m3(uncast))
    np.testing.assert_array_equal(f32(on["state"].compressor.entries)[:, :count], np_fp4_e4m3(uncast))
    np.testing.assert_array_equal(f32(on["state"].compressor.tail_kv), f32(off["state"].compressor.tail_kv))
    np.testing.assert_array_equal(
        _window_part(on, bf.plan.attention[kind].window), _window_part(off, bf.plan.attention[kind].window)
    )


def test_indexer_queries_and_keys_are_mxfp4(bf, monkeypatch):
    """§12.4 item 4: indexer keys are stored and queries scored as MXFP4 (per head, groups of 32); the head
    weights are not cast; scores are materialised in bfloat16 (§7.4)."""
    full = bf.plan.casts
    on = _run_layer(bf, CSA, full, monkeypatch)
    off = _run_layer(bf, CSA, dataclasses.replace(full, indexer="none"), monkeypatch)
    count = SEQ // bf.plan.attention[CSA].ratio
    keys_off = f32(off["state"].indexer.entries)[:, :count]
    np.testing.assert_array_equal(f32(on["state"].indexer.entries)[:, :count], np_mxfp4(keys_off))
    q_on, _, w_on = on["v4_indexer_scores"]
    q_off, _, w_off = off["v4_indexer_scores"]
    assert not np.array_equal(f32(q_off), np_mxfp4(f32(q_off)))
    np.testing.assert_array_equal(f32(q_on), np_mxfp4(f32(q_off)))
    np.testing.assert_array_equal(f32(w_on), f32(w_off))


def test_parity_mode_applies_no_round_trip(bf, monkeypatch):
    """The float32 plan's layers carry ``CastPolicy()``; with it a bf16 layer's window keys are the plain bf16
    values (nothing on the MXFP8 grid is forced)."""
    parity, _ = plan_for(bf.model.config)
    assert all(spec.casts == CastPolicy() and spec.score_dtype == "float32" for spec in parity.attention)
    off = _run_layer(bf, SLIDING, CastPolicy(), monkeypatch)
    keys = _window_part(off, bf.plan.attention[SLIDING].window)
    assert not np.array_equal(keys, np_mxfp8(keys))


# ----------------------------------------------------------------------------- incremental equals full


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_chunked_layer_stores_the_same_keys_as_one_pass(bf, kind):
    """Prefill 21 tokens, a chunk of 9, then 10 single-token decode steps, against one 40-token pass: the
    stored keys (window ring, compressed and indexer entries: values after their round trip) are bit-identical,
    and the outputs agree to bf16 rounding level.

    Why not every output bit for bit: the two runs reduce over different key counts (ring + chunk), so the
    float32 softmax sums associate differently (~1e-7 relative, as in parity mode); the bf16 rounding of an
    attention-output element can then land one ulp apart (2^-8 relative), and the two output projections spread
    that step over the row. Measured: at most 0.005 of the row's largest |y|; asserted 2^-6."""
    spec, p = bf.plan.attention[kind], bf.params["layers"][kind]["attn"]
    fresh = init_attention_state(spec, 1, MAX_LEN, jnp.bfloat16)
    y_full, s_full = bf.layer(p, bf.x, jnp.int32(0), fresh, spec=spec, numerics=bf.numerics)
    ys = []
    state = fresh
    for lo, hi in [(0, 21), (21, 30), *((t, t + 1) for t in range(30, SEQ))]:
        y, state = bf.layer(p, bf.x[:, lo:hi], jnp.int32(lo), state, spec=spec, numerics=bf.numerics)
        ys.append(f32(y))
    np.testing.assert_array_equal(f32(state.window), f32(s_full.window))
    for name in ("compressor", "indexer"):
        if getattr(state, name) is not None:
            np.testing.assert_array_equal(
                f32(getattr(state, name).entries), f32(getattr(s_full, name).entries)
            )
    y_inc, y_ref = np.concatenate(ys, axis=1), f32(y_full)
    row_scale = np.abs(y_ref).max(axis=-1, keepdims=True)
    np.testing.assert_array_less(np.abs(y_inc - y_ref), np.broadcast_to(2.0**-6 * row_scale, y_ref.shape))


def test_chunked_prefill_and_decode_agree_with_the_full_forward(bf):
    """The whole model, prefill 21 + chunk 9 + 10 decode steps against one pass. The stored keys agree (test
    above); the logits differ only by the float32 reassociation noise of the differently shaped reductions,
    amplified where a bf16 or quantisation rounding lands on the other side of a boundary (an MXFP8 / FP4 code,
    or a router / indexer top-k choice with a small gap, can then flip). Measured on this sequence: the first 14
    positions bit-identical, top-1 agreement at 39 of 40 positions (asserted >= 36), median over positions of the
    largest |Δlogit| 0.008 (asserted <= 0.05, against a logit spread of ~1 and a bf16-vs-float32 median of
    ~0.15), one position at 0.93 where a routing choice flips."""
    seq = bf.ids[:1, :SEQ]
    full = f32(bf.full(bf.params, seq, plan=bf.plan, numerics=bf.numerics))[0]
    state = v4_model.init_state(bf.plan, 1, MAX_LEN)
    rows = []
    for lo, hi in [(0, 21), (21, 30), *((t, t + 1) for t in range(30, SEQ))]:
        logits, state = bf.chunk(
            bf.params, seq[:, lo:hi], jnp.int32(lo), state, plan=bf.plan, numerics=bf.numerics
        )
        rows.append(f32(logits)[0])
    inc = np.concatenate(rows)
    per_pos = np.abs(inc - full).max(axis=-1)
    assert (inc.argmax(-1) == full.argmax(-1)).sum() >= 36
    assert np.median(per_pos) <= 0.05


# --------------------------------------------------------------------------------------- whole model


def test_bfloat16_logits_track_float32(bf):
    """bf16 production logits against the float32 parity logits of the same checkpoint (2 x 48 random tokens).

    The two modes differ by design: bf16 rounding at every rounding point (2^-9 relative each) and the window /
    compressed / indexer round trips (MXFP8 ~2.6 % rms per element, FP4 ~10 %). A random-weight tiny model
    amplifies such perturbations through its discrete choices (router and indexer top-k with small gaps, logits
    with small margins): 1 % noise on the float32 embeddings alone changes top-1 at ~20 % of the positions of
    tiny-v41. Measured here: top-1 agreement 0.86, mean |Δ| 0.076, max |Δ| 1.28, per-position correlation 0.99
    (logit std ~1). The bounds below leave room for other BLAS builds while failing any broken wiring (a wrong
    dtype, a misplaced cast or garbage gives agreement near 1/512 and correlation near 0)."""
    parity = load_model("tiny-v4", "float32")
    want = parity.logits(bf.ids)
    got = bf.model.logits(bf.ids)
    assert got.shape[:2] == (2, 48)
    assert_tracks_float32(got, want, top1=0.75, mean=0.15, peak=2.5, corr=0.97)


def test_bfloat16_forward_is_causal(bf):
    """Changing token 30 leaves the bf16 logits of positions 0..29 bit-identical (and changes later ones)."""
    ids = bf.ids[:1, :SEQ].copy()
    base = f32(bf.full(bf.params, ids, plan=bf.plan, numerics=bf.numerics))
    ids[0, 30] = (ids[0, 30] + 7) % 512
    moved = f32(bf.full(bf.params, ids, plan=bf.plan, numerics=bf.numerics))
    np.testing.assert_array_equal(moved[:, :30], base[:, :30])
    assert np.abs(moved[:, 30:] - base[:, 30:]).max() > 1e-2
