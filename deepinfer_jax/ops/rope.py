"""Rotary position embedding with optional YaRN scaling (model.md §5.3, §16), registered as op ``"rope"``.

Three layers, each usable alone:

1. **Frequencies** (:func:`rope_frequencies`): host-side NumPy float32, computed once per layer kind at config
   time. YaRN blends, per frequency, the original value and the value divided by the scaling factor, with a linear
   ramp between two "correction" indices derived from how many rotations a frequency completes over the original
   context length.
2. **Tables** (:func:`rope_cos_sin`): ``cos``/``sin`` of ``θ = p·f`` for the positions of a step, float32, in JAX
   (positions are data). An optional magnitude factor multiplies both tables (DeepSeek-V3's YaRN ``mscale``
   ratio; exactly 1 for V4/V4.1, whose reference passes no magnitude scaling).
3. **Application** (:func:`apply_rope`, the registered op): interleaved (GPT-J) pairs ``(2i, 2i+1)`` on the **last**
   ``rope_dim`` channels of each head vector; ``inverse=True`` rotates by ``-θ`` (the conjugate), which V4.1 uses
   to de-rotate attention outputs.

YaRN has a second, separate effect in DeepSeek-V3: the attention softmax scale is multiplied by
``yarn_mscale(factor, mscale_all_dim)²`` (:func:`yarn_softmax_scale_correction`); the attention module applies it,
this module only computes the factor.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.ops.registry import register_op

# The YaRN paper's (and the reference engine's) defaults for the two correction-range rotation counts.
DEFAULT_BETA_FAST = 32.0
DEFAULT_BETA_SLOW = 1.0


def _check_real(field: str, value: Any, *, low: float | None = None, low_inclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{field} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{field} must be finite, got {value!r}")
    if low is not None and (v < low if low_inclusive else v <= low):
        raise ValueError(f"{field} must be {'>=' if low_inclusive else '>'} {low}, got {value!r}")
    return v


def _check_rope_dim(field: str, dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{field} must be an int, got {type(dim).__name__} {dim!r}")
    if dim <= 0 or dim % 2:
        raise ValueError(f"{field} must be a positive even int (channels rotate in pairs), got {dim}")
    return int(dim)


# ---------------------------------------------------------------------------------------------- magnitude factors


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor ``0.1 · mscale · ln(scale) + 1`` (1 when ``scale <= 1``)."""
    scale = _check_real("scale", scale, low=0.0)
    mscale = _check_real("mscale", mscale)
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_magnitude(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """The cos/sin multiplier ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``.

    A missing (``None``) mscale counts as 0, i.e. a factor of 1, which is how the reference engine reads a YaRN
    block without magnitude keys (and how V4/V4.1 turn the scaling off). DeepSeek-V3 sets both to 1.0, so its
    ratio is exactly 1 as well: V3's YaRN magnitude shows up only in the softmax scale.
    """
    num = yarn_mscale(factor, 0.0 if mscale is None else mscale)
    den = yarn_mscale(factor, 0.0 if mscale_all_dim is None else mscale_all_dim)
    return num / den


def yarn_softmax_scale_correction(factor: float, mscale_all_dim: float | None) -> float:
    """The factor DeepSeek-V3 multiplies its softmax scale by: ``yarn_mscale(factor, mscale_all_dim)²``.

    1 when ``mscale_all_dim`` is missing or zero (V4/V4.1: no correction). For V3 (factor 40, ``mscale_all_dim``
    1.0) this is ``(0.1 · ln 40 + 1)²`` ≈ 1.8739.
    """
    if mscale_all_dim is None or mscale_all_dim == 0:
        return 1.0
    m = yarn_mscale(factor, mscale_all_dim)
    return m * m


# ---------------------------------------------------------------------------------------------- parameters


@dataclasses.dataclass(frozen=True)
class YarnParams:
    """YaRN scaling parameters (the ``rope_scaling`` block of an HF config)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = DEFAULT_BETA_FAST
    beta_slow: float = DEFAULT_BETA_SLOW
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        _check_real("yarn.factor", self.factor, low=0.0)
        orig = self.original_max_position_embeddings
        if isinstance(orig, bool) or not isinstance(orig, numbers.Integral):
            raise TypeError(
                f"yarn.original_max_position_embeddings must be an int, got {type(orig).__name__} {orig!r}"
            )
        if orig <= 0:
            raise ValueError(f"yarn.original_max_position_embeddings must be > 0, got {orig}")
        _check_real("yarn.beta_slow", self.beta_slow, low=0.0)
        _check_real("yarn.beta_fast", self.beta_fast, low=0.0)
        if self.beta_fast < self.beta_slow:
            raise ValueError(
                f"yarn.beta_fast ({self.beta_fast}) must be >= yarn.beta_slow ({self.beta_slow}): the fast "
                "rotation count bounds the low end of the correction range"
            )
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                _check_real(f"yarn.{name}", getattr(self, name))

    @property
    def magnitude(self) -> float:
        """The cos/sin multiplier implied by the mscales (see :func:`yarn_magnitude`)."""
        return yarn_magnitude(self.factor, self.mscale, self.mscale_all_dim)

    @property
    def softmax_scale_correction(self) -> float:
        """See :func:`yarn_softmax_scale_correction`."""
        return yarn_softmax_scale_correction(self.factor, self.mscale_all_dim)


@dataclasses.dataclass(frozen=True)
class RopeParams:
    """Everything a RoPE instance needs except its rotary width.

    ``attention_factor``, when given, is the cos/sin multiplier itself and replaces the one derived from the YaRN
    mscales (the meaning HF configs give the key); ``None`` derives it (1 without YaRN).
    """

    theta: float
    yarn: YarnParams | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        _check_real("rope.theta", self.theta, low=1.0)
        if self.yarn is not None and not isinstance(self.yarn, YarnParams):
            raise TypeError(f"rope.yarn must be a YarnParams or None, got {type(self.yarn).__name__}")
        if self.attention_factor is not None:
            _check_real("rope.attention_factor", self.attention_factor, low=0.0)

    @classmethod
    def from_config(cls, cfg: Any) -> RopeParams:
        """Build from any object with the attributes of ``deepinfer_jax.config``'s RoPE config.

        Reads ``theta``, ``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
        ``mscale``, ``mscale_all_dim`` and ``attention_factor``; YaRN is off when ``factor`` is ``None``. With YaRN
        on, ``original_max_position_embeddings`` is required and missing betas take the YaRN defaults (32, 1).
        An optional ``rope_type`` attribute of ``"yarn"`` requires ``factor``. Unknown (``None``) values that a
        table needs are refused with a ``ValueError``.
        """
        names = (
            "theta",
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
        )
        missing = [n for n in names if not hasattr(cfg, n)]
        if missing:
            raise TypeError(
                f"RopeParams.from_config: {type(cfg).__name__} lacks attributes {', '.join(missing)}"
            )
        if cfg.theta is None:
            raise ValueError("rope: theta is None (unknown in the config); a RoPE instance needs its base")
        if getattr(cfg, "rope_type", None) == "yarn" and cfg.factor is None:
            raise ValueError("rope: rope_type is 'yarn' but factor is None (unknown in the config)")
        yarn = None
        if cfg.factor is not None:
            if cfg.original_max_position_embeddings is None:
                raise ValueError(
                    f"rope: YaRN factor {cfg.factor!r} needs original_max_position_embeddings, got None"
                )
            yarn = YarnParams(
                factor=cfg.factor,
                original_max_position_embeddings=cfg.original_max_position_embeddings,
                beta_fast=DEFAULT_BETA_FAST if cfg.beta_fast is None else cfg.beta_fast,
                beta_slow=DEFAULT_BETA_SLOW if cfg.beta_slow is None else cfg.beta_slow,
                mscale=cfg.mscale,
                mscale_all_dim=cfg.mscale_all_dim,
            )
        return cls(theta=cfg.theta, yarn=yarn, attention_factor=cfg.attention_factor)

    @property
    def magnitude(self) -> float:
        """The cos/sin multiplier: ``attention_factor`` if set, else the YaRN mscale ratio, else 1."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 1.0 if self.yarn is None else self.yarn.magnitude

    @property
    def softmax_scale_correction(self) -> float:
        """Multiplier for the attention softmax scale (DeepSeek-V3's ``mscale²``; 1 without YaRN)."""
        return 1.0 if self.yarn is None else self.yarn.softmax_scale_correction

    def frequencies(self, dim: int) -> np.ndarray:
        """:func:`rope_frequencies` for a rotary width ``dim``."""
        return rope_frequencies(dim, self.theta, self.yarn)

    def cos_sin(self, positions: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
        """:func:`rope_cos_sin` at ``positions`` for a rotary width ``dim``, with this instance's magnitude."""
        return rope_cos_sin(positions, self.frequencies(dim), attention_factor=self.magnitude)


# ---------------------------------------------------------------------------------------------- frequencies


def yarn_correction_range(dim: int, theta: float, yarn: YarnParams) -> tuple[float, float]:
    """The ramp's ``(low, high)`` frequency indices (model.md §5.3).

    ``corr(β)`` is the (fractional) index of the frequency that completes ``β`` rotations over the original
    context; ``low = floor(corr(beta_fast))`` and ``high = ceil(corr(beta_slow))``, clamped to ``[0, dim - 1]``.
    Equal bounds are nudged apart by 0.001 so the ramp never divides by zero.
    """
    dim = _check_rope_dim("dim", dim)
    theta = _check_real("theta", theta, low=1.0)

    def corr(beta: float) -> float:
        return (
            dim
            * math.log(yarn.original_max_position_embeddings / (beta * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = float(max(math.floor(corr(yarn.beta_fast)), 0))
    high = float(min(math.ceil(corr(yarn.beta_slow)), dim - 1))
    if low == high:
        high += 0.001
    return low, high


def rope_frequencies(dim: int, theta: float, yarn: YarnParams | None = None) -> np.ndarray:
    """Per-pair angular frequencies ``f_i = theta^(-2i/dim)``, ``i < dim/2``, optionally YaRN-blended; float32.

    With YaRN, ``f_i' = (f_i / s) · ramp_i + f_i · (1 - ramp_i)``: low indices (fast rotations, many turns over
    the original context) keep their frequency, high indices (slow rotations) are interpolated by the factor
    ``s``, and the ramp between :func:`yarn_correction_range`'s bounds mixes the two. Every array step is float32
    (model.md §5.3); only the two correction bounds are computed in double precision before their floor/ceil.
    """
    dim = _check_rope_dim("dim", dim)
    theta = _check_real("theta", theta, low=1.0)
    if yarn is not None and not isinstance(yarn, YarnParams):
        raise TypeError(f"yarn must be a YarnParams or None, got {type(yarn).__name__}")
    f32 = np.float32
    exponent = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    freqs = f32(1.0) / np.power(f32(theta), exponent, dtype=f32)
    if yarn is None:
        return freqs
    low, high = yarn_correction_range(dim, theta, yarn)
    idx = np.arange(dim // 2, dtype=f32)
    ramp = np.clip((idx - f32(low)) / f32(high - low), f32(0.0), f32(1.0))
    keep = f32(1.0) - ramp
    interpolated = freqs / f32(yarn.factor)
    return (interpolated * (f32(1.0) - keep) + freqs * keep).astype(f32)


# ---------------------------------------------------------------------------------------------- tables


def rope_cos_sin(
    positions: jax.Array, freqs: jax.Array | np.ndarray, *, attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """``cos``/``sin`` tables ``[..., dim/2]`` of ``θ = p · f`` for integer (or float) ``positions [...]``.

    ``θ`` is the float32 product of float32 positions and float32 frequencies (model.md §5.3), so large positions
    lose angle precision exactly as the reference does. ``attention_factor`` scales both tables (the YaRN
    magnitude); exactly 1 leaves them untouched.
    """
    attention_factor = _check_real("attention_factor", attention_factor, low=0.0)
    positions = jnp.asarray(positions)
    if not (jnp.issubdtype(positions.dtype, jnp.integer) or jnp.issubdtype(positions.dtype, jnp.floating)):
        raise TypeError(f"rope_cos_sin: positions must be integer or floating, got dtype {positions.dtype}")
    freqs = jnp.asarray(freqs, dtype=jnp.float32)
    if freqs.ndim != 1:
        raise ValueError(f"rope_cos_sin: freqs must be 1-D [dim/2], got shape {freqs.shape}")
    angles = positions.astype(jnp.float32)[..., None] * freqs
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos = cos * jnp.float32(attention_factor)
        sin = sin * jnp.float32(attention_factor)
    return cos, sin


# ---------------------------------------------------------------------------------------------- application


def apply_rope(
    x: jax.Array, cos: jax.Array, sin: jax.Array, *, rope_dim: int, inverse: bool = False
) -> jax.Array:
    """Rotate interleaved pairs of the last ``rope_dim`` channels of ``x``; the first channels pass through.

    Layout (token-major): ``cos``/``sin`` are ``[..., tokens, rope_dim/2]``; ``x`` is either ``[..., tokens, D]``
    (same rank as the tables: one vector per token) or ``[..., tokens, heads, D]`` (one more axis: the tables
    broadcast over the heads). For pair ``i`` of ``z = x[..., D - rope_dim:]``::

        z'[2i]   = z[2i]·cos_i − z[2i+1]·sin_i
        z'[2i+1] = z[2i]·sin_i + z[2i+1]·cos_i

    with ``sin`` negated when ``inverse`` (the conjugate rotation, which undoes the forward one). The rotation is
    computed in float32 and the result cast back to ``x.dtype`` (one rounding, as in the reference kernel); the
    untouched channels are copied bit for bit.
    """
    rope_dim = _check_rope_dim("rope_dim", rope_dim)
    x = jnp.asarray(x)
    cos = jnp.asarray(cos)
    sin = jnp.asarray(sin)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"apply_rope: x must be a floating array, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"apply_rope: x must be at least [tokens, D], got shape {x.shape}")
    d = x.shape[-1]
    if rope_dim > d:
        raise ValueError(f"apply_rope: rope_dim {rope_dim} exceeds the head width {d} of x {x.shape}")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rope: cos {cos.shape} and sin {sin.shape} must have the same shape")
    if cos.ndim < 1 or cos.shape[-1] != rope_dim // 2:
        raise ValueError(
            f"apply_rope: cos/sin must end in rope_dim/2 = {rope_dim // 2}, got shape {cos.shape}"
        )
    if x.ndim == cos.ndim + 1:  # [..., tokens, heads, D]: broadcast the tables over heads
        cos, sin = cos[..., None, :], sin[..., None, :]
    elif x.ndim != cos.ndim:
        raise ValueError(
            f"apply_rope: x {x.shape} must be [..., tokens, D] or [..., tokens, heads, D] for tables of shape "
            f"{cos.shape} ([..., tokens, rope_dim/2])"
        )
    try:
        batch = jnp.broadcast_shapes(x.shape[:-1], cos.shape[:-1])
    except ValueError:
        batch = None
    if batch != x.shape[:-1]:
        raise ValueError(f"apply_rope: tables {cos.shape} do not broadcast against x {x.shape}")

    cos = cos.astype(jnp.float32)
    sin = sin.astype(jnp.float32)
    if inverse:
        sin = -sin
    z = x[..., d - rope_dim :].astype(jnp.float32).reshape(*x.shape[:-1], rope_dim // 2, 2)
    even, odd = z[..., 0], z[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(*x.shape[:-1], rope_dim).astype(x.dtype)
    if rope_dim == d:
        return rotated
    return jnp.concatenate([x[..., : d - rope_dim], rotated], axis=-1)


register_op(
    "rope",
    apply_rope,
    doc="interleaved RoPE on the last rope_dim channels, optional conjugate (model.md §5.3)",
)
