"""Quantised linear layers against dequantise-then-matmul, grouped experts, and the memory claim."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _numerics_ref import (
    E4M3_ALL_VALUES,
    dequantize_rows,
    fp8_blockwise_dequant,
    random_tensor,
)

from deepinfer_jax.numerics import activation, codecs, qlinear

fp8_linear = jax.jit(
    qlinear.fp8_linear, static_argnames=("block", "activation_cast", "out_dtype", "tile_rows")
)
mxfp4_linear = jax.jit(qlinear.mxfp4_linear, static_argnames=("activation_cast", "out_dtype", "tile_rows"))
grouped_fp8 = jax.jit(qlinear.grouped_fp8_linear, static_argnames=("block", "tile_rows"))
grouped_mxfp4 = jax.jit(qlinear.grouped_mxfp4_linear, static_argnames=("tile_rows",))
quantize_fp8 = jax.jit(codecs.quantize_fp8_blockwise, static_argnums=(1, 2))
quantize_mxfp4 = jax.jit(codecs.quantize_mxfp4)
mxfp8_cast = jax.jit(activation.mxfp8_cast)
v3_cast = jax.jit(activation.fp8_token_block_cast)


def _ref_fp8_weight(q, s, block) -> np.ndarray:
    scales = np.asarray(s)
    scales = scales.view(np.uint8) if scales.dtype != np.float32 else scales
    return fp8_blockwise_dequant(np.asarray(q).view(np.uint8), scales, block).astype(np.float64)


def _ref_mxfp4_weight(packed, scale) -> np.ndarray:
    p = np.asarray(packed)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    return dequantize_rows(codes, np.asarray(scale).view(np.uint8), "mxfp4").astype(np.float64)


def _assert_close(got, x: np.ndarray, w: np.ndarray) -> None:
    """float32 accumulation of K products: |error| <= K * 2^-24 * sum_k |x_k w_k| (recursive-summation bound)."""
    want = x.astype(np.float64) @ w.T
    bound = x.shape[-1] * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"max error {err.max():.3g}, bound {bound[err > bound].min():.3g}"


@pytest.mark.parametrize(
    ("out_dim", "in_dim", "block", "scale_fmt", "tile_rows"),
    [
        (70, 96, (32, 32), "ue8m0", 16),  # 5 tiles, the last one clamped to rows 54..69
        (64, 64, (32, 32), "ue8m0", 256),  # a single tile
        (200, 300, (128, 128), "float32", 64),  # V3: ragged 128-blocks on both axes
    ],
)
def test_fp8_linear_matches_dequantise_then_matmul(out_dim, in_dim, block, scale_fmt, tile_rows):
    rng = np.random.default_rng(0)
    w = random_tensor(rng, (out_dim, in_dim), spread=4)
    x = random_tensor(rng, (2, 3, in_dim), spread=2)
    q, s = quantize_fp8(w, block, scale_fmt)
    y = fp8_linear(x, q, s, block=block, tile_rows=tile_rows)
    assert y.shape == (2, 3, out_dim) and y.dtype == jnp.float32
    _assert_close(y, x, _ref_fp8_weight(q, s, block))


def test_mxfp4_linear_matches_dequantise_then_matmul():
    rng = np.random.default_rng(1)
    w = random_tensor(rng, (48, 64), spread=4)
    x = random_tensor(rng, (5, 64), spread=2)
    packed, scale = quantize_mxfp4(w)
    y = mxfp4_linear(x, packed, scale, tile_rows=16)
    _assert_close(y, x, _ref_mxfp4_weight(packed, scale))


def test_production_mode_casts_the_activation_first():
    rng = np.random.default_rng(2)
    w = random_tensor(rng, (64, 256))
    x = random_tensor(rng, (4, 256), spread=6)
    q, s = quantize_fp8(w, (32, 32), "ue8m0")
    prod = np.asarray(fp8_linear(x, q, s, activation_cast="mxfp8"))
    manual = np.asarray(fp8_linear(np.asarray(mxfp8_cast(x)), q, s))
    np.testing.assert_array_equal(prod, manual)
    assert not np.array_equal(prod, np.asarray(fp8_linear(x, q, s))), "the cast must change something"
    q3, s3 = quantize_fp8(w, (128, 128), "float32")
    v3 = np.asarray(fp8_linear(x, q3, s3, block=(128, 128), activation_cast="fp8_token_block"))
    manual3 = np.asarray(fp8_linear(np.asarray(v3_cast(x)), q3, s3, block=(128, 128)))
    np.testing.assert_array_equal(v3, manual3)
    packed, scale = quantize_mxfp4(w)
    np.testing.assert_array_equal(
        np.asarray(mxfp4_linear(x, packed, scale, activation_cast="mxfp8")),
        np.asarray(mxfp4_linear(np.asarray(mxfp8_cast(x)), packed, scale)),
    )
    yb = fp8_linear(jnp.asarray(x, jnp.bfloat16), q, s, activation_cast="mxfp8")
    assert yb.dtype == jnp.bfloat16
    assert fp8_linear(x, q, s, out_dtype=jnp.bfloat16).dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------------- grouped


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(3)
    w = random_tensor(rng, (3, 40, 64), spread=3)
    x = random_tensor(rng, (7, 64), spread=2)
    q, s = quantize_fp8(w, (32, 32), "ue8m0")
    packed, scale = quantize_mxfp4(w)
    fp8_ref = np.stack([_ref_fp8_weight(q[e], s[e], (32, 32)) for e in range(3)])
    fp4_ref = np.stack([_ref_mxfp4_weight(packed[e], scale[e]) for e in range(3)])
    return x, (q, s, fp8_ref), (packed, scale, fp4_ref)


def _check_grouped(y, x, w_ref, ids) -> None:
    y = np.asarray(y)
    for t, e in enumerate(ids):
        if 0 <= e < w_ref.shape[0]:
            _assert_close(y[t : t + 1], x[t : t + 1], w_ref[e])
        else:
            np.testing.assert_array_equal(y[t], 0.0)


def test_grouped_linear_with_expert_ids(experts):
    x, (q, s, fp8_ref), (packed, scale, fp4_ref) = experts
    ids = np.array([2, 0, 1, 2, -1, 0, 3], np.int32)  # -1 and 3 name no expert: zero rows
    _check_grouped(grouped_fp8(x, q, s, expert_ids=ids, tile_rows=16), x, fp8_ref, ids)
    _check_grouped(grouped_mxfp4(x, packed, scale, expert_ids=ids, tile_rows=16), x, fp4_ref, ids)


def test_grouped_linear_with_group_sizes(experts):
    x, (q, s, fp8_ref), (packed, scale, fp4_ref) = experts
    sizes = np.array([2, 0, 3], np.int32)  # tokens 0-1 -> expert 0, 2-4 -> expert 2, 5-6 -> none
    ids = [0, 0, 2, 2, 2, -1, -1]
    np.testing.assert_array_equal(
        np.asarray(qlinear.token_expert_ids(7, 3, group_sizes=sizes)), [0, 0, 2, 2, 2, 3, 3]
    )
    _check_grouped(grouped_fp8(x, q, s, group_sizes=sizes), x, fp8_ref, ids)
    _check_grouped(grouped_mxfp4(x, packed, scale, group_sizes=sizes), x, fp4_ref, ids)


def test_grouped_linear_input_errors(experts):
    x, (q, s, _), _ = experts
    with pytest.raises(ValueError, match="exactly one of expert_ids and group_sizes"):
        qlinear.grouped_fp8_linear(x, q, s)
    with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape \(3,\)"):
        qlinear.grouped_fp8_linear(x, q, s, group_sizes=np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match=r"x must have shape \[tokens, in\]"):
        qlinear.grouped_fp8_linear(x[None], q, s, expert_ids=np.zeros(7, np.int32))


def test_linear_input_errors():
    q, s = quantize_fp8(np.ones((64, 64), np.float32), (32, 32), "ue8m0")
    with pytest.raises(ValueError, match=r"x must have last dimension in_features=64, got shape \(2, 32\)"):
        qlinear.fp8_linear(np.ones((2, 32), np.float32), q, s)
    with pytest.raises(ValueError, match=r"scale must have shape \(2, 2\) for w_q of shape \(64, 64\)"):
        qlinear.fp8_linear(np.ones((2, 64), np.float32), q, s[:1])
    with pytest.raises(ValueError, match="activation_cast must be one of"):
        qlinear.fp8_linear(np.ones((2, 64), np.float32), q, s, activation_cast="int8")
    with pytest.raises(ValueError, match="tile_rows must be a positive int or None, got 0"):
        qlinear.fp8_linear(np.ones((2, 64), np.float32), q, s, tile_rows=0)
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        qlinear.fp8_linear(np.ones((2, 64), np.int32), q, s)


def _loops(fn, *args) -> int:
    """The loops of ``fn``'s jaxpr (the tile loop is one: a scan, or a while)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return text.count(" while[") + text.count(" scan[")


def test_default_tiles_skip_the_loop_for_small_weights_only():
    """``tile_rows=None``: a weight whose float32 decode fits in DEFAULT_TILE_BYTES is one tile without a loop,
    with the tiled result's values (each output is the same dot over ``in``; float32 may reassociate it);
    ``in >= 2048`` keeps tiles of DEFAULT_TILE_ROWS rows, looped."""
    rng = np.random.default_rng(2)
    w = random_tensor(rng, (300, 256), spread=4)
    x = random_tensor(rng, (5, 256), spread=2)
    q, s = quantize_fp8(w, (32, 32), "ue8m0")
    assert _loops(lambda x: qlinear.fp8_linear(x, q, s), x) == 0
    assert _loops(lambda x: qlinear.fp8_linear(x, q, s, tile_rows=128), x) == 1
    whole = fp8_linear(x, q, s)
    _assert_close(whole, x, _ref_fp8_weight(q, s, (32, 32)))
    np.testing.assert_allclose(whole, fp8_linear(x, q, s, tile_rows=128), rtol=1e-6, atol=1e-6)
    packed, scale = quantize_mxfp4(w)
    assert _loops(lambda x: qlinear.mxfp4_linear(x, packed, scale), x) == 0
    _assert_close(mxfp4_linear(x, packed, scale), x, _ref_mxfp4_weight(packed, scale))
    big = jnp.zeros((256, 2048), jnp.uint8), jnp.zeros((8, 64), jnp.float8_e8m0fnu)
    assert qlinear._tile_rows(None, 2048) == qlinear.DEFAULT_TILE_ROWS == 128
    assert _loops(lambda x: qlinear.fp8_linear(x, *big), jnp.zeros((2, 2048), jnp.float32)) == 1


# ---------------------------------------------------------------------------------------------------- memory


def _temp_bytes(fn, *args) -> int:
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes


def test_quantised_linear_never_materialises_the_dequantised_weight():
    out_dim, in_dim = 1024, 2048
    dequantised = out_dim * in_dim * 4  # bytes of the float32 weight the op must not build
    x = jnp.zeros((8, in_dim), jnp.float32)
    s = jnp.zeros((out_dim // 32, in_dim // 32), jnp.float8_e8m0fnu)
    # The naive form is measured too, so this test would notice if the metric stopped seeing materialisation.
    q8 = jnp.zeros((out_dim, in_dim), jnp.float8_e4m3fn)
    naive = _temp_bytes(lambda x, q, s: x @ codecs.dequantize_fp8_blockwise(q, s).T, x, q8, s)
    assert naive >= dequantised
    for storage in (jnp.float8_e4m3fn, jnp.uint8):
        assert _temp_bytes(qlinear.fp8_linear, x, jnp.zeros((out_dim, in_dim), storage), s) < dequantised // 2
    packed = jnp.zeros((out_dim, in_dim // 2), jnp.uint8)
    scale = jnp.zeros((out_dim, in_dim // 32), jnp.float8_e8m0fnu)
    assert _temp_bytes(qlinear.mxfp4_linear, x, packed, scale) < dequantised // 2


def test_grouped_linear_temporary_memory_is_tile_sized():
    experts, out_dim, in_dim = 4, 1024, 2048
    one_expert = out_dim * in_dim * 4
    x, ids = jnp.zeros((8, in_dim), jnp.float32), jnp.zeros((8,), jnp.int32)
    s = jnp.zeros((experts, out_dim // 32, in_dim // 32), jnp.float8_e8m0fnu)

    def grouped(x, q, s, i):
        return qlinear.grouped_fp8_linear(x, q, s, expert_ids=i)

    # uint8 codes: below one dequantised expert. float8 codes: XLA:CPU first copies the stacked codes to
    # bytes (one byte per element), still far below the dequantised stack.
    assert _temp_bytes(grouped, x, jnp.zeros((experts, out_dim, in_dim), jnp.uint8), s, ids) < one_expert
    assert _temp_bytes(grouped, x, jnp.zeros((experts, out_dim, in_dim), jnp.float8_e4m3fn), s, ids) < (
        experts * one_expert // 2
    )
    packed = jnp.zeros((experts, out_dim, in_dim // 2), jnp.uint8)
    scale = jnp.zeros((experts, out_dim, in_dim // 32), jnp.float8_e8m0fnu)
    mx = _temp_bytes(
        lambda x, p, s, i: qlinear.grouped_mxfp4_linear(x, p, s, expert_ids=i), x, packed, scale, ids
    )
    assert mx < one_expert


def test_e4m3_table_sanity_for_the_reference():
    # The reference weights above decode codes through this table; pin two entries by hand.
    assert E4M3_ALL_VALUES[0x7E] == 448.0 and E4M3_ALL_VALUES[0x01] == 2.0**-9
