"""Reference quantised linear layers: ``y = x · Wᵀ`` with ``W`` kept in its checkpoint format.

The weight is never dequantised as a whole (unless it is small). A loop over tiles of ``tile_rows`` output rows
decodes one tile (codes times block scales, exactly the values
:func:`~deepinfer_jax.numerics.codecs.dequantize_fp8_blockwise` produces), multiplies it with the activations,
and writes that slice of the output; the temporary memory is one float32 tile, not one float32 weight. The last
tile is clamped to end at the last row, so it may recompute a few rows that an earlier tile already wrote -- with
identical values, which makes any row count work without padding or copying the stored weight.

``tile_rows=None`` (the default) takes as many rows as fit in :data:`DEFAULT_TILE_BYTES` of float32, and never
fewer than :data:`DEFAULT_TILE_ROWS`: a weight that fits in one tile is decoded and multiplied without a loop
(the tiny models' weights; a step of tiny-v41 then compiles about 10% faster on XLA:CPU, docs/benchmarks.md),
a weight of ``in >= 2048`` columns keeps tiles of 128 rows, and a larger one with fewer columns (the real
models' low-rank projections) gets 1 MiB tiles of more rows.

Modes (``ARCHITECTURE.md`` §8): with ``activation_cast="none"`` the activations are used as given (float32
parity mode, weight-only quantisation); ``"mxfp8"`` (V4/V4.1) or ``"fp8_token_block"`` (V3) first applies the
activation round trip of the production mode. Accumulation is float32 at the highest matmul precision.

The grouped forms serve routed experts ``[E, out, in]``: every token names its expert (``expert_ids``) or tokens
come sorted by expert with ``group_sizes``. They loop over experts and skip those that received no token; each
expert's GEMM runs over all tokens and keeps its own rows. That is the CPU-friendly reference (``lax.ragged_dot``
needs far more temporary memory on XLA:CPU); kernels replace it on accelerators.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics.activation import ACTIVATION_CAST_KINDS, V3_ACTIVATION_BLOCK, activation_cast
from deepinfer_jax.numerics.codecs import (
    apply_scales,
    check_block,
    fp8_scale_scheme,
    scale_grid_shape,
)
from deepinfer_jax.numerics.elements import as_uint8, e2m1_decode, e4m3_decode, unpack_nibbles
from deepinfer_jax.numerics.formats import MXFP4

DEFAULT_TILE_ROWS = 128
"""The fewest output rows of a tile when ``tile_rows`` is ``None``."""

DEFAULT_TILE_BYTES = 1 << 20
"""The decoded float32 tile's size bound when ``tile_rows`` is ``None`` (above ``DEFAULT_TILE_ROWS`` rows)."""

# (expert index, first row, tile rows) -> dequantised float32 tile [tile rows, padded in]
_TileDecoder = Callable[[jax.Array, jax.Array, int], jax.Array]


def _tile_rows(tile_rows: int | None, padded_in: int) -> int:
    """The rows of one tile: ``tile_rows``, or for ``None`` the rows of :data:`DEFAULT_TILE_BYTES` of float32
    (at least :data:`DEFAULT_TILE_ROWS`)."""
    if tile_rows is None:
        return max(DEFAULT_TILE_ROWS, DEFAULT_TILE_BYTES // (4 * max(padded_in, 1)))
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows must be a positive int or None, got {tile_rows!r}")
    return tile_rows


def _prepare_x(x: jax.Array, in_features: int, kind: str, block: int) -> tuple[jax.Array, jnp.dtype]:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")
    if x.ndim == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x must have last dimension in_features={in_features}, got shape {x.shape}")
    if kind not in ACTIVATION_CAST_KINDS:
        raise ValueError(f"activation_cast must be one of {ACTIVATION_CAST_KINDS}, got {kind!r}")
    return activation_cast(x, kind, block=block).astype(jnp.float32), x.dtype


def _matmul_tiles(x2d: jax.Array, decode: _TileDecoder, expert: jax.Array, rows: int, tile: int) -> jax.Array:
    """``x2d [T, K] · W[expert]ᵀ`` -> ``[T, rows]`` float32, one decoded tile of output rows at a time."""
    if rows == 0:
        return jnp.zeros((x2d.shape[0], 0), jnp.float32)
    tile = min(tile, rows)
    num_tiles = -(-rows // tile)

    def product(start: jax.Array, n: int) -> jax.Array:
        """``x2d`` times the decoded rows ``[start, start + n)``: ``[T, n]`` float32."""
        w = decode(expert, start, n)
        dims = (((1,), (1,)), ((), ()))
        return lax.dot_general(
            x2d, w, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )

    if num_tiles == 1:  # the whole weight in one tile: no loop (smaller programs, faster compiles)
        return product(jnp.int32(0), rows)

    def body(i: jax.Array, y: jax.Array) -> jax.Array:
        start = jnp.minimum(i * tile, rows - tile)
        return lax.dynamic_update_slice(y, product(start, tile), (jnp.int32(0), start))

    y0 = jnp.zeros((x2d.shape[0], rows), jnp.float32)
    return lax.fori_loop(0, num_tiles, body, y0)


def _fp8_decoder(w_q: jax.Array, scale: jax.Array, block: tuple[int, int]) -> tuple[_TileDecoder, int]:
    """Tile decoder of FP8 weights ``[E, out, in]`` with block scales ``[E, OB, IB]``; returns (decoder, padded in)."""
    b0, b1 = block
    scheme = fp8_scale_scheme(scale, block)
    # Slice bytes, not float8: XLA:CPU supports float8 only in converts and would widen the whole weight to
    # float16 before the loop. Reinterpreting float8 storage as uint8 still costs one byte copy of the
    # quantised weight on XLA:CPU (a quarter of the float32 size); uint8 storage costs nothing.
    codes = as_uint8(w_q, "w_q")
    cols = codes.shape[-1]
    num_col_blocks = scale.shape[-1]
    padded = num_col_blocks * b1

    def decode(expert: jax.Array, start: jax.Array, tile: int) -> jax.Array:
        q = lax.dynamic_slice(codes, (expert, start, jnp.int32(0)), (1, tile, cols))[0]
        if padded != cols:
            q = jnp.pad(q, ((0, 0), (0, padded - cols)))
        values = e4m3_decode(q).reshape(tile, num_col_blocks, b1)
        row_blocks = (start + jnp.arange(tile, dtype=jnp.int32)) // b0
        s = jnp.take(lax.dynamic_index_in_dim(scale, expert, axis=0, keepdims=False), row_blocks, axis=0)
        return apply_scales(values, s[..., None], scheme).reshape(tile, padded)

    return decode, padded


def _mxfp4_decoder(packed: jax.Array, scale: jax.Array) -> tuple[_TileDecoder, int]:
    """Tile decoder of MXFP4 weights ``[E, out, in/2]`` with scales ``[E, out, in/32]``."""
    codes = as_uint8(packed, "packed")
    scale_bytes = as_uint8(scale, "scale")
    half, num_groups = codes.shape[-1], scale_bytes.shape[-1]
    cols = half * 2

    def decode(expert: jax.Array, start: jax.Array, tile: int) -> jax.Array:
        zero = jnp.int32(0)
        p = lax.dynamic_slice(codes, (expert, start, zero), (1, tile, half))[0]
        s = lax.dynamic_slice(scale_bytes, (expert, start, zero), (1, tile, num_groups))[0]
        values = e2m1_decode(unpack_nibbles(p)).reshape(tile, num_groups, MXFP4.group_size)
        return apply_scales(values, s[..., None], MXFP4).reshape(tile, cols)

    return decode, cols


def _check_fp8_weight(w_q: jax.Array, scale: jax.Array, block: tuple[int, int], grouped: bool) -> None:
    want = 3 if grouped else 2
    what = "[E, out, in]" if grouped else "[out, in]"
    if w_q.ndim != want:
        raise ValueError(f"w_q must have shape {what}, got shape {w_q.shape}")
    expected = scale_grid_shape(w_q.shape, block)
    if scale.shape != expected:
        raise ValueError(
            f"scale must have shape {expected} for w_q of shape {w_q.shape} and block {block}, got {scale.shape}"
        )


def _check_mxfp4_weight(packed: jax.Array, scale: jax.Array, grouped: bool) -> None:
    want = 3 if grouped else 2
    what = "[E, out, in/2]" if grouped else "[out, in/2]"
    if packed.ndim != want:
        raise ValueError(f"packed must have shape {what}, got shape {packed.shape}")
    cols = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], cols // MXFP4.group_size)
    if cols % MXFP4.group_size or scale.shape != expected:
        raise ValueError(
            f"scale must have shape {expected} for packed of shape {packed.shape} "
            f"(in = {cols}, a multiple of {MXFP4.group_size}), got {scale.shape}"
        )


def _dense(
    x: jax.Array,
    decode: _TileDecoder,
    rows: int,
    padded_in: int,
    out_dtype: jnp.dtype | None,
    in_dtype: jnp.dtype,
    tile_rows: int | None,
) -> jax.Array:
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if padded_in != x2d.shape[-1]:
        x2d = jnp.pad(x2d, ((0, 0), (0, padded_in - x2d.shape[-1])))
    y = _matmul_tiles(x2d, decode, jnp.int32(0), rows, _tile_rows(tile_rows, padded_in))
    return y.reshape(*lead, rows).astype(out_dtype or in_dtype)


def fp8_linear(
    x: jax.Array,
    w_q: jax.Array,
    scale: jax.Array,
    *,
    block: tuple[int, int] = (32, 32),
    activation_cast: str = "none",
    activation_block: int = V3_ACTIVATION_BLOCK,
    out_dtype: jnp.dtype | None = None,
    tile_rows: int | None = None,
) -> jax.Array:
    """``x [..., in] · Wᵀ`` for a block-scaled FP8 weight ``w_q [out, in]`` -> ``[..., out]``.

    ``scale`` is UE8M0 (``float8_e8m0fnu``/``uint8``) or float32 ``scale_inv`` on the ceil-div grid of
    ``block``. ``activation_cast`` selects weight-only (``"none"``) or production numerics; ``out_dtype``
    defaults to ``x``'s dtype.
    """
    block = check_block(block)
    w_q, scale = jnp.asarray(w_q), jnp.asarray(scale)
    _check_fp8_weight(w_q, scale, block, grouped=False)
    xf, in_dtype = _prepare_x(x, w_q.shape[1], activation_cast, activation_block)
    decode, padded = _fp8_decoder(w_q[None], scale[None], block)
    return _dense(xf, decode, w_q.shape[0], padded, out_dtype, in_dtype, tile_rows)


def mxfp4_linear(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    *,
    activation_cast: str = "none",
    activation_block: int = V3_ACTIVATION_BLOCK,
    out_dtype: jnp.dtype | None = None,
    tile_rows: int | None = None,
) -> jax.Array:
    """``x [..., in] · Wᵀ`` for an MXFP4 weight (``packed [out, in/2]``, ``scale [out, in/32]``) -> ``[..., out]``."""
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    _check_mxfp4_weight(packed, scale, grouped=False)
    xf, in_dtype = _prepare_x(x, packed.shape[1] * 2, activation_cast, activation_block)
    decode, cols = _mxfp4_decoder(packed[None], scale[None])
    return _dense(xf, decode, packed.shape[0], cols, out_dtype, in_dtype, tile_rows)


def token_expert_ids(
    num_tokens: int,
    num_experts: int,
    expert_ids: jax.Array | None = None,
    group_sizes: jax.Array | None = None,
) -> jax.Array:
    """Per-token expert index ``int32 [T]`` from exactly one of ``expert_ids`` or ``group_sizes``.

    With ``group_sizes [E]`` tokens are sorted by expert: the first ``group_sizes[0]`` belong to expert 0,
    and so on; tokens past ``sum(group_sizes)`` get ``E`` (no expert, zero output). Ids outside ``[0, E)``
    likewise produce zero rows.
    """
    if (expert_ids is None) == (group_sizes is None):
        raise ValueError("exactly one of expert_ids and group_sizes must be given")
    if expert_ids is not None:
        ids = jnp.asarray(expert_ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape != (num_tokens,):
            raise ValueError(
                f"expert_ids must be an integer array of shape ({num_tokens},), got {ids.dtype} {ids.shape}"
            )
        return ids.astype(jnp.int32)
    sizes = jnp.asarray(group_sizes)
    if not jnp.issubdtype(sizes.dtype, jnp.integer) or sizes.shape != (num_experts,):
        raise ValueError(
            f"group_sizes must be an integer array of shape ({num_experts},), got {sizes.dtype} {sizes.shape}"
        )
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(num_tokens, dtype=jnp.int32), side="right").astype(jnp.int32)


def _grouped(
    x: jax.Array,
    decode: _TileDecoder,
    num_experts: int,
    rows: int,
    padded_in: int,
    ids: jax.Array,
    out_dtype: jnp.dtype | None,
    in_dtype: jnp.dtype,
    tile_rows: int | None,
) -> jax.Array:
    tile_rows = _tile_rows(tile_rows, padded_in)
    if padded_in != x.shape[-1]:
        x = jnp.pad(x, ((0, 0), (0, padded_in - x.shape[-1])))

    def body(e: jax.Array, y: jax.Array) -> jax.Array:
        mask = ids == e

        def run(y: jax.Array) -> jax.Array:
            return jnp.where(mask[:, None], _matmul_tiles(x, decode, e, rows, tile_rows), y)

        return lax.cond(jnp.any(mask), run, lambda y: y, y)

    y = lax.fori_loop(0, num_experts, body, jnp.zeros((x.shape[0], rows), jnp.float32))
    return y.astype(out_dtype or in_dtype)


def _check_tokens(x: jax.Array) -> None:
    if jnp.ndim(x) != 2:
        raise ValueError(f"x must have shape [tokens, in], got shape {jnp.shape(x)}")


def grouped_fp8_linear(
    x: jax.Array,
    w_q: jax.Array,
    scale: jax.Array,
    *,
    expert_ids: jax.Array | None = None,
    group_sizes: jax.Array | None = None,
    block: tuple[int, int] = (32, 32),
    activation_cast: str = "none",
    activation_block: int = V3_ACTIVATION_BLOCK,
    out_dtype: jnp.dtype | None = None,
    tile_rows: int | None = None,
) -> jax.Array:
    """Per-token expert GEMM ``y[t] = x[t] · W[id(t)]ᵀ`` for FP8 experts ``w_q [E, out, in]`` -> ``[T, out]``."""
    block = check_block(block)
    w_q, scale = jnp.asarray(w_q), jnp.asarray(scale)
    _check_tokens(x)
    _check_fp8_weight(w_q, scale, block, grouped=True)
    num_experts, rows, cols = w_q.shape
    ids = token_expert_ids(jnp.shape(x)[0], num_experts, expert_ids, group_sizes)
    xf, in_dtype = _prepare_x(x, cols, activation_cast, activation_block)
    decode, padded = _fp8_decoder(w_q, scale, block)
    return _grouped(xf, decode, num_experts, rows, padded, ids, out_dtype, in_dtype, tile_rows)


def grouped_mxfp4_linear(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    *,
    expert_ids: jax.Array | None = None,
    group_sizes: jax.Array | None = None,
    activation_cast: str = "none",
    activation_block: int = V3_ACTIVATION_BLOCK,
    out_dtype: jnp.dtype | None = None,
    tile_rows: int | None = None,
) -> jax.Array:
    """Per-token expert GEMM for MXFP4 experts ``packed [E, out, in/2]``, ``scale [E, out, in/32]`` -> ``[T, out]``."""
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    _check_tokens(x)
    _check_mxfp4_weight(packed, scale, grouped=True)
    num_experts, rows, half = packed.shape
    ids = token_expert_ids(jnp.shape(x)[0], num_experts, expert_ids, group_sizes)
    xf, in_dtype = _prepare_x(x, half * 2, activation_cast, activation_block)
    decode, cols = _mxfp4_decoder(packed, scale)
    return _grouped(xf, decode, num_experts, rows, cols, ids, out_dtype, in_dtype, tile_rows)
