"""RoPE / YaRN against hand-computed values and independent NumPy transcriptions written here."""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.ops import (
    RopeParams,
    YarnParams,
    apply_rope,
    rope_cos_sin,
    rope_frequencies,
    yarn_correction_range,
    yarn_magnitude,
    yarn_mscale,
    yarn_softmax_scale_correction,
)

BF16 = ml_dtypes.bfloat16

# V4.1 tiny config (model.md §15): compressed layers use base 160000 with YaRN factor 4 over 512 positions.
V41_YARN = YarnParams(factor=4.0, original_max_position_embeddings=512, beta_fast=32, beta_slow=1)


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


# ------------------------------------------------------------------ independent NumPy twins (float64)


def _yarn_freqs_twin(dim, base, factor, orig, beta_fast, beta_slow):
    """model.md §5.3 written out in float64, independently of the implementation."""
    half = np.arange(dim // 2, dtype=np.float64)
    base_freq = base ** (-2.0 * half / dim)
    if factor is None:
        return base_freq

    def rotations_to_index(beta):
        return dim * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(rotations_to_index(beta_fast)), 0)
    hi = min(math.ceil(rotations_to_index(beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((half - lo) / (hi - lo), 0.0, 1.0)
    return base_freq / factor * ramp + base_freq * (1.0 - ramp)


def _rotate_twin(x, positions, freqs, rope_dim, sign=1.0):
    """Complex-number form of the interleaved rotation: (z[2i] + i·z[2i+1]) · exp(±i·p·f_i), float64."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    z = x[..., d - rope_dim :]
    zc = z[..., 0::2] + 1j * z[..., 1::2]
    theta = np.asarray(positions, np.float64)[:, None] * np.asarray(freqs, np.float64)
    if x.ndim == theta.ndim + 1:
        theta = theta[:, None, :]
    rot = zc * np.exp(sign * 1j * theta)
    out = x.copy()
    out[..., d - rope_dim :: 2] = rot.real
    out[..., d - rope_dim + 1 :: 2] = rot.imag
    return out


# ------------------------------------------------------------------ frequencies


def test_frequencies_without_yarn_by_hand():
    # f_i = 10000^(-2i/8) = 10^(-i): [1, 0.1, 0.01, 0.001]
    f = rope_frequencies(8, 10000.0)
    assert f.dtype == np.float32 and f.shape == (4,)
    # float32 power and reciprocal: within a few ulp (1 ulp ≈ 6e-8 relative)
    np.testing.assert_allclose(f, [1.0, 0.1, 0.01, 0.001], rtol=1e-6)


def test_yarn_correction_range_by_hand():
    # dim 64, base 160000, original length 512:
    #   corr(32) = 64 · ln(512 / (32·2π)) / (2 · ln 160000) = 64 · 0.934712 / 23.965858 = 2.4961 -> floor 2
    #   corr(1)  = 64 · ln(512 / (2π))    / (2 · ln 160000) = 64 · 4.400447 / 23.965858 = 11.7514 -> ceil 12
    assert yarn_correction_range(64, 160000.0, V41_YARN) == (2.0, 12.0)


def test_yarn_blend_hand_checked_entries():
    f = rope_frequencies(64, 160000.0, V41_YARN).astype(np.float64)
    base = 160000.0 ** (-2.0 * np.arange(32) / 64)
    # i <= low = 2 keeps the original frequency; i >= high = 12 is divided by the factor 4;
    # i = 7 sits halfway up the ramp ((7 - 2) / (12 - 2) = 0.5): f · (0.5/4 + 0.5) = 0.625 · f.
    rtol = 2e-6  # float32 power, reciprocal and the blend's 3 roundings
    assert f[0] == 1.0
    np.testing.assert_allclose(f[:3], base[:3], rtol=rtol)
    np.testing.assert_allclose(f[7], 0.625 * base[7], rtol=rtol)
    np.testing.assert_allclose(f[12:], base[12:] / 4.0, rtol=rtol)


@pytest.mark.parametrize(
    ("dim", "base", "factor", "orig", "beta_fast", "beta_slow"),
    [
        (64, 160000.0, 4.0, 512, 32, 1),  # V4.1 tiny
        (64, 10000.0, 40.0, 4096, 32, 1),  # DeepSeek-V3
        (16, 10000.0, 8.0, 2048, 16, 2),
        (8, 10000.0, 2.0, 4, 32, 1),  # both bounds clamp to 0: low == high, the 0.001 nudge
        (128, 1e6, 1.5, 32768, 64, 0.5),
        (
            16,
            100.0,
            4.0,
            4096,
            32,
            1,
        ),  # high = 12 lies past the last ramp index 7: the clamp is dim-1, not dim/2-1
    ],
)
def test_yarn_blend_matches_float64_twin(dim, base, factor, orig, beta_fast, beta_slow):
    yarn = YarnParams(factor, orig, beta_fast=beta_fast, beta_slow=beta_slow)
    got = rope_frequencies(dim, base, yarn)
    want = _yarn_freqs_twin(dim, base, factor, orig, beta_fast, beta_slow)
    assert got.dtype == np.float32
    # the implementation is float32 throughout: a few roundings of ~6e-8 each (power, reciprocal, blend)
    np.testing.assert_allclose(got, want, rtol=2e-6)


def test_low_equals_high_nudge():
    # dim 8, base 1e4, original length 4: corr(32) = -1.70 -> floor -2 -> clamp 0; corr(1) = -0.196 -> ceil 0;
    # equal bounds -> high = 0.001, so the ramp is a step: index 0 keeps f, every other index gets f / 2.
    yarn = YarnParams(factor=2.0, original_max_position_embeddings=4)
    assert yarn_correction_range(8, 10000.0, yarn) == (0.0, 0.001)
    f = rope_frequencies(8, 10000.0, yarn)
    np.testing.assert_allclose(f, [1.0, 0.05, 0.005, 0.0005], rtol=1e-6)


# ------------------------------------------------------------------ magnitudes (V3) and their absence (V4.1)


def test_v3_mscale_values():
    m = 0.1 * math.log(40) + 1  # 1.3688879454...
    assert yarn_mscale(40, 1.0) == pytest.approx(m, rel=1e-15)
    assert yarn_mscale(40, 0.5) == pytest.approx(0.05 * math.log(40) + 1, rel=1e-15)
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(0.5, 1.0) == 1.0
    # V3 has mscale = mscale_all_dim = 1: the cos/sin factor is exactly 1, the softmax scale gets m²
    assert yarn_magnitude(40, 1.0, 1.0) == 1.0
    assert yarn_softmax_scale_correction(40, 1.0) == pytest.approx(m * m, rel=1e-15)
    assert yarn_magnitude(40, 1.0, 0.5) == pytest.approx(m / (0.05 * math.log(40) + 1), rel=1e-15)
    v3 = YarnParams(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)
    assert v3.magnitude == 1.0 and v3.softmax_scale_correction == pytest.approx(1.8738542, rel=1e-7)


def test_v41_has_no_magnitude_scaling():
    assert V41_YARN.magnitude == 1.0  # exactly: no mscale keys means a factor of 1 (model.md §5.3)
    assert V41_YARN.softmax_scale_correction == 1.0
    assert yarn_softmax_scale_correction(4.0, 0) == 1.0


def test_rope_params_from_duck_typed_config():
    v3_cfg = types.SimpleNamespace(
        theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
        attention_factor=None,
    )
    v3 = RopeParams.from_config(v3_cfg)
    assert v3.yarn == YarnParams(40.0, 4096, 32, 1, 1.0, 1.0)
    assert v3.magnitude == 1.0
    assert v3.softmax_scale_correction == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    plain = RopeParams.from_config(types.SimpleNamespace(**{**vars(v3_cfg), "factor": None}))
    assert plain.yarn is None and plain.magnitude == 1.0 and plain.softmax_scale_correction == 1.0
    np.testing.assert_array_equal(plain.frequencies(8), rope_frequencies(8, 10000.0))
    # missing betas take the YaRN defaults; an explicit attention_factor replaces the mscale ratio
    cfg = types.SimpleNamespace(
        **{**vars(v3_cfg), "beta_fast": None, "beta_slow": None, "attention_factor": 0.5}
    )
    p = RopeParams.from_config(cfg)
    assert (p.yarn.beta_fast, p.yarn.beta_slow, p.magnitude) == (32.0, 1.0, 0.5)
    with pytest.raises(ValueError, match="needs original_max_position_embeddings, got None"):
        RopeParams.from_config(
            types.SimpleNamespace(**{**vars(v3_cfg), "original_max_position_embeddings": None})
        )
    with pytest.raises(ValueError, match="rope_type is 'yarn' but factor is None"):
        RopeParams.from_config(types.SimpleNamespace(**{**vars(v3_cfg), "factor": None, "rope_type": "yarn"}))
    with pytest.raises(TypeError, match="lacks attributes beta_fast"):
        RopeParams.from_config(
            types.SimpleNamespace(theta=1e4, factor=None, original_max_position_embeddings=None)
        )


def test_rope_params_from_the_config_packages_rope_config():
    model_cfg = pytest.importorskip("deepinfer_jax.config.model")
    v3 = model_cfg.RopeConfig(
        theta=10000.0,
        rope_type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    p = RopeParams.from_config(v3)
    assert p.yarn == YarnParams(40.0, 4096, 32.0, 1.0, 1.0, 1.0) and p.magnitude == 1.0
    assert RopeParams.from_config(model_cfg.RopeConfig(theta=160000.0)) == RopeParams(160000.0)
    with pytest.raises(ValueError, match="theta is None"):
        RopeParams.from_config(model_cfg.RopeConfig(theta=None))


def test_cos_sin_tables():
    freqs = rope_frequencies(8, 10000.0)
    pos = jnp.array([0, 1, 5, 100], jnp.int32)
    cos, sin = rope_cos_sin(pos, freqs)
    assert cos.shape == sin.shape == (4, 4) and cos.dtype == jnp.float32
    theta = np.array([0, 1, 5, 100], np.float64)[:, None] * freqs.astype(np.float64)
    # θ = p·f is rounded to float32 first (up to 100 · 6e-8 = 6e-6 rad), then cos/sin add an ulp
    np.testing.assert_allclose(_np(cos), np.cos(theta), atol=1e-5)
    np.testing.assert_allclose(_np(sin), np.sin(theta), atol=1e-5)
    cos2, sin2 = rope_cos_sin(pos, freqs, attention_factor=1.5)
    np.testing.assert_allclose(_np(cos2), 1.5 * _np(cos), rtol=1e-7)
    np.testing.assert_allclose(_np(cos2) ** 2 + _np(sin2) ** 2, 2.25, rtol=1e-6)
    # an extra leading axis (a batch of position rows) is carried through
    cos3, _ = rope_cos_sin(pos.reshape(2, 2), freqs)
    np.testing.assert_array_equal(_np(cos3).reshape(4, 4), _np(cos))


# ------------------------------------------------------------------ application


@pytest.fixture(scope="module")
def qk():
    """Random [tokens=6, heads=3, D=24] query/key rows with a 16-wide rope tail, and their positions."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 3, 24)).astype(np.float32)
    k = rng.standard_normal((6, 3, 24)).astype(np.float32)
    positions = np.array([0, 1, 2, 7, 30, 63], np.int32)
    return q, k, positions


ROPE_DIM = 16


def _tables(positions, dim=ROPE_DIM, yarn=V41_YARN):
    return rope_cos_sin(jnp.asarray(positions), rope_frequencies(dim, 160000.0, yarn))


def test_apply_matches_complex_twin(qk):
    q, _, positions = qk
    cos, sin = _tables(positions)
    got = _np(apply_rope(jnp.asarray(q), cos, sin, rope_dim=ROPE_DIM))
    want = _rotate_twin(q, positions, rope_frequencies(ROPE_DIM, 160000.0, V41_YARN), ROPE_DIM)
    # float32 angles (≤ 63 · 6e-8 rad error), cos/sin and a multiply-add per output: ~1e-5 on O(1) values
    np.testing.assert_allclose(got, want, atol=2e-5)
    want_inv = _rotate_twin(q, positions, rope_frequencies(ROPE_DIM, 160000.0, V41_YARN), ROPE_DIM, sign=-1.0)
    np.testing.assert_allclose(
        _np(apply_rope(jnp.asarray(q), cos, sin, rope_dim=ROPE_DIM, inverse=True)), want_inv, atol=2e-5
    )


def test_pairs_are_interleaved_on_the_last_channels():
    # one token, D = 6, rope_dim = 4, a quarter turn on pair 0 and half a turn on pair 1 (cos/sin by hand)
    x = jnp.array([[10.0, 20.0, 1.0, 2.0, 3.0, 4.0]], jnp.float32)
    cos = jnp.array([[0.0, -1.0]], jnp.float32)
    sin = jnp.array([[1.0, 0.0]], jnp.float32)
    # pair (1, 2) -> (1·0 − 2·1, 1·1 + 2·0) = (−2, 1); pair (3, 4) -> (−3, −4); first two channels untouched
    np.testing.assert_array_equal(
        _np(apply_rope(x, cos, sin, rope_dim=4)), [[10.0, 20.0, -2.0, 1.0, -3.0, -4.0]]
    )
    # the conjugate turns the other way: (1, 2) -> (2, −1)
    np.testing.assert_array_equal(
        _np(apply_rope(x, cos, sin, rope_dim=4, inverse=True)), [[10.0, 20.0, 2.0, -1.0, -3.0, -4.0]]
    )


def test_position_zero_is_identity(qk):
    q, _, _ = qk
    cos, sin = _tables(np.zeros(6, np.int32))
    np.testing.assert_array_equal(_np(apply_rope(jnp.asarray(q), cos, sin, rope_dim=ROPE_DIM)), q)


def test_rotation_preserves_pair_norms(qk):
    q, _, positions = qk
    cos, sin = _tables(positions)
    out = _np(apply_rope(jnp.asarray(q), cos, sin, rope_dim=ROPE_DIM))

    def pair_norms(a):
        tail = a[..., -ROPE_DIM:].astype(np.float64)
        return np.hypot(tail[..., 0::2], tail[..., 1::2])

    # cos² + sin² = 1 to float32 rounding; a few ulp on O(1) values
    np.testing.assert_allclose(pair_norms(out), pair_norms(q), rtol=1e-6, atol=1e-6)


def test_inverse_undoes_apply(qk):
    q, _, positions = qk
    cos, sin = _tables(positions)
    back = apply_rope(
        apply_rope(jnp.asarray(q), cos, sin, rope_dim=ROPE_DIM), cos, sin, rope_dim=ROPE_DIM, inverse=True
    )
    # two float32 rotations with the same tables: each output picks up a couple of roundings (~1e-7 relative)
    np.testing.assert_allclose(_np(back), q, rtol=1e-6, atol=1e-6)


def test_non_rope_channels_are_untouched(qk):
    q, _, positions = qk
    cos, sin = _tables(positions)
    out = _np(apply_rope(jnp.asarray(q), cos, sin, rope_dim=ROPE_DIM))
    np.testing.assert_array_equal(out[..., : 24 - ROPE_DIM], q[..., : 24 - ROPE_DIM])
    assert np.any(out[1:, :, -ROPE_DIM:] != q[1:, :, -ROPE_DIM:])


def test_scores_depend_only_on_relative_position(qk):
    q, k, _ = qk
    freqs = rope_frequencies(ROPE_DIM, 160000.0, V41_YARN)
    qv, kv = q[0, 0, -ROPE_DIM:], k[0, 0, -ROPE_DIM:]

    def score(p, s):
        cq, sq = rope_cos_sin(jnp.array([p]), freqs)
        ck, sk = rope_cos_sin(jnp.array([s]), freqs)
        rq = apply_rope(jnp.asarray(qv)[None], cq, sq, rope_dim=ROPE_DIM)
        rk = apply_rope(jnp.asarray(kv)[None], ck, sk, rope_dim=ROPE_DIM)
        return float(jnp.vdot(rq, rk))

    # positions up to 70: float32 angles are off by ≤ 70 · 6e-8 rad, so scores of O(|q||k|) agree to ~1e-5 · |q||k|
    tol = 2e-5 * float(np.linalg.norm(qv) * np.linalg.norm(kv))
    for p, s in [(5, 2), (9, 9), (3, 11)]:
        ref = score(p, s)
        for shift in (1, 17, 59):
            assert abs(score(p + shift, s + shift) - ref) < tol
    assert abs(score(5, 2) - score(6, 2)) > 100 * tol  # and it does depend on the offset


def test_layouts_tokens_only_and_batched_heads(qk):
    q, _, positions = qk
    cos, sin = _tables(positions)
    per_head = np.stack(
        [_np(apply_rope(jnp.asarray(q[:, h]), cos, sin, rope_dim=ROPE_DIM)) for h in range(3)], 1
    )
    np.testing.assert_array_equal(_np(apply_rope(jnp.asarray(q), cos, sin, rope_dim=ROPE_DIM)), per_head)
    # [batch, tokens, heads, D] with tables [batch, tokens, rope_dim/2]
    qb = np.stack([q, -q])
    cb, sb = jnp.stack([cos, cos]), jnp.stack([sin, sin])
    out = _np(apply_rope(jnp.asarray(qb), cb, sb, rope_dim=ROPE_DIM))
    np.testing.assert_array_equal(out[0], per_head)
    np.testing.assert_array_equal(out[1], -per_head)


def test_full_width_rotation_and_bf16_single_rounding(qk):
    q, _, positions = qk
    freqs = rope_frequencies(24, 10000.0)
    cos, sin = rope_cos_sin(jnp.asarray(positions), freqs)
    qb = q.astype(BF16)
    got = _np(apply_rope(jnp.asarray(qb), cos, sin, rope_dim=24))
    assert got.dtype == BF16
    # twin: rotate the bf16 values in float32 with the same tables, round once
    c, s = _np(cos)[:, None, :], _np(sin)[:, None, :]
    z = qb.astype(np.float32)
    e, o = z[..., 0::2], z[..., 1::2]
    want = np.empty_like(z)
    want[..., 0::2], want[..., 1::2] = e * c - o * s, e * s + o * c
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(BF16).view(np.uint16))


def test_jit(qk):
    q, _, positions = qk
    freqs = rope_frequencies(ROPE_DIM, 160000.0, V41_YARN)

    @jax.jit
    def f(x, pos):
        cos, sin = rope_cos_sin(pos, freqs)
        return apply_rope(x, cos, sin, rope_dim=ROPE_DIM)

    eager_cos, eager_sin = rope_cos_sin(jnp.asarray(positions), freqs)
    np.testing.assert_allclose(
        _np(f(jnp.asarray(q), jnp.asarray(positions))),
        _np(apply_rope(jnp.asarray(q), eager_cos, eager_sin, rope_dim=ROPE_DIM)),
        rtol=1e-6,  # the jitted program fuses table and rotation; its cos/sin may differ from eager by an ulp
        atol=1e-6,
    )


@jax.jit
def _rotate_and_back(x, positions, freqs):
    rope_dim = 2 * freqs.shape[0]
    cos, sin = rope_cos_sin(positions, freqs)
    there = apply_rope(x, cos, sin, rope_dim=rope_dim)
    return there, apply_rope(there, cos, sin, rope_dim=rope_dim, inverse=True)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from(
        [(4, 2, 8, 8), (4, 2, 5, 2), (3, 16, 16)]
    ),  # (..., D, rope_dim): few shapes, few compiles
    start=st.integers(0, 5000),
    theta=st.sampled_from([10000.0, 160000.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_inverse_property(shape, start, theta, seed):
    *lead, d, rope_dim = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, d)).astype(np.float32)
    pos = jnp.arange(start, start + lead[0])
    there, back = _rotate_and_back(jnp.asarray(x), pos, jnp.asarray(rope_frequencies(rope_dim, theta)))
    np.testing.assert_allclose(_np(back), x, rtol=1e-6, atol=2e-6)  # see test_inverse_undoes_apply
    np.testing.assert_array_equal(_np(there)[..., : d - rope_dim], x[..., : d - rope_dim])


# ------------------------------------------------------------------ bad input


def test_bad_parameters():
    with pytest.raises(ValueError, match=r"dim must be a positive even int .* got 7"):
        rope_frequencies(7, 10000.0)
    with pytest.raises(TypeError, match="dim must be an int, got float"):
        rope_frequencies(8.0, 10000.0)
    with pytest.raises(ValueError, match=r"theta must be > 1\.0, got 1\.0"):
        rope_frequencies(8, 1.0)
    with pytest.raises(ValueError, match=r"yarn\.factor must be > 0\.0, got 0"):
        YarnParams(0, 512)
    with pytest.raises(ValueError, match="original_max_position_embeddings must be > 0, got 0"):
        YarnParams(4.0, 0)
    with pytest.raises(ValueError, match=r"yarn.beta_fast \(1\) must be >= yarn.beta_slow \(32\)"):
        YarnParams(4.0, 512, beta_fast=1, beta_slow=32)
    with pytest.raises(ValueError, match=r"rope\.attention_factor must be > 0\.0"):
        RopeParams(10000.0, attention_factor=-1.0)
    with pytest.raises(ValueError, match=r"scale must be > 0\.0, got 0"):
        yarn_mscale(0, 1.0)


def test_bad_apply_input(qk):
    q, _, positions = qk
    cos, sin = _tables(positions)
    x = jnp.asarray(q)
    with pytest.raises(ValueError, match=r"rope_dim must be a positive even int .* got 5"):
        apply_rope(x, cos, sin, rope_dim=5)
    with pytest.raises(ValueError, match=r"rope_dim 32 exceeds the head width 24 of x \(6, 3, 24\)"):
        apply_rope(x, *_tables(positions, dim=32), rope_dim=32)
    with pytest.raises(ValueError, match=r"cos/sin must end in rope_dim/2 = 4, got shape \(6, 8\)"):
        apply_rope(x, cos, sin, rope_dim=8)
    with pytest.raises(ValueError, match=r"must be \[..., tokens, D\] or \[..., tokens, heads, D\]"):
        apply_rope(x[None, None], cos, sin, rope_dim=ROPE_DIM)
    with pytest.raises(ValueError, match="do not broadcast against x"):
        apply_rope(x[:4], cos, sin, rope_dim=ROPE_DIM)
    with pytest.raises(TypeError, match="x must be a floating array"):
        apply_rope(x.astype(jnp.int32), cos, sin, rope_dim=ROPE_DIM)
    with pytest.raises(ValueError, match="must have the same shape"):
        apply_rope(x, cos, sin[:3], rope_dim=ROPE_DIM)
