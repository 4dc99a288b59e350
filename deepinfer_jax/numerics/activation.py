"""Activation quantise-dequantise casts (``spec/model.md`` §12.2, §12.4, §16) and the switch that selects them.

A DeepSeek production forward rounds activations through low-precision formats at fixed points: every input of
an FP8/FP4 GEMM goes through the MXFP8 activation cast (V4/V4.1) or a per-token-per-128 FP8 cast (V3); keys
read back from the caches are the cache format's dequantised values; indexer queries and keys go through
MXFP4. These functions compute exactly those round trips (codes are never kept), in the input's dtype, so a
model can apply them where the reference rounds. :class:`CastPolicy` switches them together: all off in the
float32 parity mode, all on in the bfloat16 production mode (``ARCHITECTURE.md`` §8), and individually
overridable for debugging.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from deepinfer_jax.numerics.codecs import quantize_dequantize_groups
from deepinfer_jax.numerics.formats import FP4_E4M3_16, MXFP4, MXFP8, QuantScheme

ActivationCastKind = Literal["none", "mxfp8", "fp8_token_block"]
"""GEMM-input casts: none (weight-only), MXFP8 per 32 channels (V4/V4.1), FP8 per token per block (V3)."""
KVCastKind = Literal["none", "mxfp8", "fp4_e4m3", "mxfp4"]
"""Cache read-back casts: none, MXFP8 (window/draft keys), FP4 + E4M3 per 16 (compressed), MXFP4 (indexer)."""

ACTIVATION_CAST_KINDS: tuple[str, ...] = get_args(ActivationCastKind)
KV_CAST_KINDS: tuple[str, ...] = get_args(KVCastKind)
V3_ACTIVATION_BLOCK = 128


def _float_input(x: jax.Array, name: str = "x") -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{name} must have a channel axis, got a scalar")
    return x


def mxfp8_cast(x: jax.Array, group_size: int = 32) -> jax.Array:
    """MXFP8 round trip along the last axis: E4M3 codes, one power-of-two scale per ``group_size`` channels."""
    scheme = MXFP8 if group_size == MXFP8.group_size else QuantScheme("e4m3", "ue8m0", group_size)
    return quantize_dequantize_groups(_float_input(x), scheme)


def mxfp4_cast(x: jax.Array, group_size: int = 32) -> jax.Array:
    """MXFP4 round trip along the last axis (indexer queries and keys, §12.3.3)."""
    scheme = MXFP4 if group_size == MXFP4.group_size else QuantScheme("e2m1", "ue8m0", group_size)
    return quantize_dequantize_groups(_float_input(x), scheme)


def fp4_e4m3_cast(x: jax.Array) -> jax.Array:
    """FP4 round trip with E4M3 per-16 scales along the last axis (compressed keys, §12.3.2)."""
    return quantize_dequantize_groups(_float_input(x), FP4_E4M3_16)


def fp8_token_block_cast(x: jax.Array, block: int = V3_ACTIVATION_BLOCK) -> jax.Array:
    """DeepSeek-V3 activation round trip: E4M3 with a float32 scale ``amax/448`` per token per ``block``."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    return quantize_dequantize_groups(_float_input(x), QuantScheme("e4m3", "float32", block))


def activation_cast(x: jax.Array, kind: str, block: int = V3_ACTIVATION_BLOCK) -> jax.Array:
    """Apply the GEMM-input cast ``kind`` (one of :data:`ACTIVATION_CAST_KINDS`) to ``x``."""
    if kind == "none":
        return jnp.asarray(x)
    if kind == "mxfp8":
        return mxfp8_cast(x)
    if kind == "fp8_token_block":
        return fp8_token_block_cast(x, block)
    raise ValueError(f"activation cast kind must be one of {ACTIVATION_CAST_KINDS}, got {kind!r}")


def kv_cast(x: jax.Array, kind: str) -> jax.Array:
    """Apply the cache read-back cast ``kind`` (one of :data:`KV_CAST_KINDS`) along the last axis of ``x``."""
    if kind == "none":
        return jnp.asarray(x)
    if kind == "mxfp8":
        return mxfp8_cast(x)
    if kind == "fp4_e4m3":
        return fp4_e4m3_cast(x)
    if kind == "mxfp4":
        return mxfp4_cast(x)
    raise ValueError(f"KV cast kind must be one of {KV_CAST_KINDS}, got {kind!r}")


_FAMILIES = ("deepseek_v3", "deepseek_v4", "deepseek_v41")
_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class CastPolicy:
    """Which quantise-dequantise round trips of §12.4 a forward applies, one switch per rounding point.

    ``gemm_input``: cast of every activation entering an FP8/FP4 weight GEMM (§12.2 / §16).
    ``window_keys``, ``compressed_keys``, ``draft_keys``: the cache format keys are read back in.
    ``indexer``: cast of indexer queries and keys.
    """

    gemm_input: ActivationCastKind = "none"
    window_keys: KVCastKind = "none"
    compressed_keys: KVCastKind = "none"
    indexer: KVCastKind = "none"
    draft_keys: KVCastKind = "none"

    def __post_init__(self) -> None:
        if self.gemm_input not in ACTIVATION_CAST_KINDS:
            raise ValueError(
                f"CastPolicy.gemm_input must be one of {ACTIVATION_CAST_KINDS}, got {self.gemm_input!r}"
            )
        for field in ("window_keys", "compressed_keys", "indexer", "draft_keys"):
            value = getattr(self, field)
            if value not in KV_CAST_KINDS:
                raise ValueError(f"CastPolicy.{field} must be one of {KV_CAST_KINDS}, got {value!r}")

    @classmethod
    def for_mode(cls, family: str, dtype: str, use_fp4_sparse_kv: bool = True) -> CastPolicy:
        """The policy of a precision mode: ``"float32"`` parity (all off) or ``"bfloat16"`` production.

        Production V4/V4.1 applies every round trip of §12.4; production V3 casts GEMM inputs per token per
        128 and keeps its bf16 latent cache unquantised.
        """
        family = str(getattr(family, "value", family))
        if family not in _FAMILIES:
            raise ValueError(f"family must be one of {_FAMILIES}, got {family!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        if dtype == "float32":
            return cls()
        if family == "deepseek_v3":
            return cls(gemm_input="fp8_token_block")
        return cls(
            gemm_input="mxfp8",
            window_keys="mxfp8",
            compressed_keys="fp4_e4m3" if use_fp4_sparse_kv else "mxfp8",
            indexer="mxfp4",
            draft_keys="mxfp8",
        )

    def cast_gemm_input(self, x: jax.Array) -> jax.Array:
        return activation_cast(x, self.gemm_input)

    def cast_window_keys(self, x: jax.Array) -> jax.Array:
        return kv_cast(x, self.window_keys)

    def cast_compressed_keys(self, x: jax.Array) -> jax.Array:
        return kv_cast(x, self.compressed_keys)

    def cast_indexer(self, x: jax.Array) -> jax.Array:
        return kv_cast(x, self.indexer)

    def cast_draft_keys(self, x: jax.Array) -> jax.Array:
        return kv_cast(x, self.draft_keys)
