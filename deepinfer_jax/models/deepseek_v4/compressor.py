"""DeepSeek-V4 KV compressors and the lightning indexer, with their incremental state.

Compressed layers summarise every ``r`` consecutive tokens into one extra key (= value) that all later queries
may attend to, besides their sliding window:

* **HCA** (``heavily_compressed_attention``, ratio ``m'``, 128 in real checkpoints): non-overlapping windows.
  Token ``t`` contributes ``a_t = x_t · wkvᵀ`` and gate logits ``g_t = x_t · wgateᵀ + ape[t mod r]``; entry
  ``w`` is ``Σ_{t in window w} softmax_t(g_t) ⊙ a_t`` (softmax over the window's tokens, per channel).
* **CSA** (``compressed_sparse_attention``, ratio ``m``, 4 in real checkpoints): overlapping windows of width
  ``2r`` and stride ``r``. The projections are twice as wide and hold two series: ``Ca`` (first half) feeds the
  *next* window's entry, ``Cb`` (second half) the current one, so entry ``w`` pools window ``w-1``'s ``Ca`` slots
  with window ``w``'s ``Cb`` slots (window 0 has no predecessor: those slots get weight 0).

Each entry is RMS-normalised (``compressor.norm``) and rotated by the compress RoPE at position ``w · r`` (its
window's first token). A query at position ``p`` may use entry ``w`` only once the window is complete,
``(w + 1) · r ≤ p + 1``. CSA layers add the **lightning indexer**: a second, narrower overlapping compressor
(``index_head_dim``) whose entries are scored against per-head indexer queries,
``I(p, w) = Σ_h wI[p, h] · ReLU(qI[p, h] · kI_w)``, and only the ``index_topk`` best visible entries are attended.

Incremental state (:class:`CompressorState`): the projections of the current, incomplete window (``tail``), the
``Ca`` series of the last complete window (``prev``, overlapping compressors only) and the emitted entries. A
chunk of new tokens is laid out on the window grid behind the tail, every window the chunk completes is pooled
and written, and the new tail / prev are cut out, so token-by-token decode and one full pass emit the same
entries. The hot pieces are registered ops: ``v4_compressor_pool`` (gated pooling) and ``v4_indexer_scores``.

Precision (``ARCHITECTURE.md`` §8): the projections, gates and tails are float32 in both modes (spec §5.2 keeps
compressor projections float32). In the bfloat16 production mode :func:`compress_chunk` rounds the pooled vector
to bfloat16 before the norm (``entry_dtype``) and stores every entry as its cache format's dequantised value
(``cache_cast``: FP4 for attended entries, MXFP4 for indexer keys, spec §12.4), so that whoever reads an entry --
the prefill that wrote it or a later decode step -- reads the same values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer_jax.numerics.activation import kv_cast
from deepinfer_jax.ops import apply_rope, register_impl, register_op, rms_norm, rope_cos_sin
from deepinfer_jax.ops import get as get_op
from deepinfer_jax.ops.ascend import ascend_impl

__all__ = [
    "CompressorState",
    "compress_chunk",
    "compressor_pool",
    "indexer_scores",
    "indexer_select",
    "init_compressor_state",
    "per_row",
    "visible_entries",
]


class CompressorState(NamedTuple):
    """Incremental state of one compressor for a batch of sequences, each at its own position.

    Attributes:
      tail_kv, tail_gate: ``[B, r, F]`` projections (gate without ``ape``) of the tokens of the current,
        incomplete window, by slot within the window (``F = 2W`` when overlapping, else ``W``); slots past
        the tokens seen so far hold stale values that are overwritten before the window completes.
      prev_kv, prev_gate: ``[B, r, W]`` the ``Ca`` series of the last complete window (gate with ``ape``);
        gate ``-inf`` before any window completed (weight 0). Width 0 for non-overlapping compressors.
      entries: ``[B, capacity, W]`` emitted compressed keys (normalised and rotated), in window order.
    """

    tail_kv: jax.Array
    tail_gate: jax.Array
    prev_kv: jax.Array
    prev_gate: jax.Array
    entries: jax.Array


def init_compressor_state(
    batch: int,
    ratio: int,
    width: int,
    capacity: int,
    *,
    overlap: bool,
    dtype: jnp.dtype = jnp.float32,
    entries_dtype: jnp.dtype | None = None,
) -> CompressorState:
    """An empty state: no tokens seen, no entries; ``capacity`` entries of width ``width`` can be stored.

    ``dtype`` is the dtype of the projection tails (``prev_kv`` too); ``entries_dtype`` (default ``dtype``) that
    of the emitted entries, e.g. float32 tails beside bfloat16 entries in production mode.
    """
    feats = 2 * width if overlap else width
    prev_w = width if overlap else 0
    return CompressorState(
        tail_kv=jnp.zeros((batch, ratio, feats), dtype),
        tail_gate=jnp.zeros((batch, ratio, feats), jnp.float32),
        prev_kv=jnp.zeros((batch, ratio, prev_w), dtype),
        prev_gate=jnp.full((batch, ratio, prev_w), -jnp.inf, jnp.float32),
        entries=jnp.zeros((batch, capacity, width), dtype if entries_dtype is None else entries_dtype),
    )


def compressor_pool(kv: jax.Array, gate: jax.Array) -> jax.Array:
    """Gated pooling of windows: ``Σ_slot softmax_slot(gate) ⊙ kv`` over axis ``-2``, softmax in float32.

    ``kv``, ``gate``: ``[..., slots, W]``; slots whose gate is ``-inf`` get weight 0 (a window must have at least
    one finite slot). Returns ``[..., W]`` in ``kv.dtype``.
    """
    if kv.shape != gate.shape:
        raise ValueError(f"compressor_pool: kv {kv.shape} and gate {gate.shape} must have the same shape")
    weights = jax.nn.softmax(gate.astype(jnp.float32), axis=-2)
    return jnp.sum(weights * kv.astype(jnp.float32), axis=-2).astype(kv.dtype)


register_op(
    "v4_compressor_pool",
    compressor_pool,
    doc="DeepSeek-V4 compressor: per-channel softmax-gated pooling of a window's slots",
)


def per_row(value: jax.Array | int, batch: int, *, name: str, caller: str) -> jax.Array:
    """``value`` (an int scalar shared by the batch, or one int per row) as an int32 vector ``[batch]``.

    Only shape and dtype are checked, so traced values pass without a host sync; a scalar is broadcast, which
    makes the shared-position call a special case of the per-row one rather than a second code path.
    """
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(
            f"{caller}: {name} must be an integer scalar or [{batch}] vector, got dtype {value.dtype}"
        )
    if value.shape not in ((), (batch,)):
        raise ValueError(f"{caller}: {name} must be a scalar or a [{batch}] vector, got shape {value.shape}")
    return jnp.broadcast_to(value.astype(jnp.int32), (batch,))


def compress_chunk(
    state: CompressorState,
    kv: jax.Array,
    gate: jax.Array,
    start: jax.Array,
    *,
    ape: jax.Array,
    norm_weight: jax.Array,
    norm_eps: float,
    rope_freqs: jax.Array,
    rope_dim: int,
    lengths: jax.Array | None = None,
    entry_dtype: jnp.dtype | None = None,
    cache_cast: str = "none",
) -> CompressorState:
    """Feed ``S`` new tokens' projections ``kv``/``gate [B, S, F]`` (row ``b`` at positions ``start[b] ..``).

    Every window completed by these tokens is pooled, normalised, rotated to its first position and written to
    ``entries``; the tail and (overlapping) prev series are advanced. ``start`` is a traced int scalar shared by
    the batch or an int vector ``[B]`` with one start per row; ``S`` is static. ``lengths`` (scalar or ``[B]``,
    default ``S``) is how many of a row's tokens are real: the rest is padding that completes no window (its
    slots land in the tail, where the next real tokens overwrite them). ``ape [r, F]`` is the position bias of
    the window slots.

    ``entry_dtype`` (default: ``kv``'s dtype) is the dtype the pooled vector is rounded to before the norm, and
    the norm's output dtype (bfloat16 in production mode). ``cache_cast`` names the round trip of
    :func:`~deepinfer_jax.numerics.activation.kv_cast` applied to each finished entry (after the norm and
    RoPE) before it is stored: ``"none"`` in float32 parity mode.

    Each row is laid out on its own window grid, so rows at different positions (one decoding inside a window
    while another prefills from 0) advance independently; the grid has the same static size for every row
    because it is counted from the window holding the row's start.
    """
    batch, ratio, feats = state.tail_kv.shape
    width = state.entries.shape[-1]
    overlap = state.prev_kv.shape[-1] > 0
    seq = kv.shape[1]
    if kv.shape != (batch, seq, feats) or gate.shape != kv.shape:
        raise ValueError(f"compress_chunk: kv {kv.shape} / gate {gate.shape} must be [{batch}, S, {feats}]")
    if ape.shape != (ratio, feats):
        raise ValueError(f"compress_chunk: ape has shape {ape.shape}, expected ({ratio}, {feats})")
    n_win = seq // ratio + 2  # windows the chunk can touch, counted from the one holding a row's start
    start = per_row(start, batch, name="start", caller="compress_chunk")
    lengths = per_row(seq if lengths is None else lengths, batch, name="lengths", caller="compress_chunk")
    first_win = start // ratio  # [B]
    offset = start % ratio

    def lay_out_row(tail: jax.Array, new: jax.Array, at: jax.Array) -> jax.Array:
        grid = jnp.zeros((n_win * ratio, feats), new.dtype)
        grid = lax.dynamic_update_slice(grid, tail.astype(new.dtype), (0, 0))
        grid = lax.dynamic_update_slice(grid, new, (at, 0))
        return grid.reshape(n_win, ratio, feats)

    lay_out = jax.vmap(lay_out_row)
    win_kv = lay_out(state.tail_kv, kv, offset)
    win_gate_raw = lay_out(state.tail_gate, gate.astype(jnp.float32), offset)
    win_gate = win_gate_raw + ape.astype(jnp.float32)

    pool = get_op("v4_compressor_pool")
    if overlap:
        prev_kv = jnp.concatenate(
            [state.prev_kv[:, None].astype(kv.dtype), win_kv[:, :-1, :, :width]], axis=1
        )
        prev_gate = jnp.concatenate([state.prev_gate[:, None], win_gate[:, :-1, :, :width]], axis=1)
        pooled = pool(
            jnp.concatenate([prev_kv, win_kv[..., width:]], axis=2),
            jnp.concatenate([prev_gate, win_gate[..., width:]], axis=2),
        )
    else:
        pooled = pool(win_kv, win_gate)
    if entry_dtype is not None:
        pooled = pooled.astype(entry_dtype)
    normed = rms_norm(pooled, norm_weight, eps=norm_eps)
    win_index = first_win[:, None] + jnp.arange(n_win, dtype=jnp.int32)  # [B, n_win]
    cos, sin = rope_cos_sin(win_index * ratio, rope_freqs)
    entries_new = kv_cast(apply_rope(normed, cos, sin, rope_dim=rope_dim), cache_cast)  # [B, n_win, W]

    done = (start + lengths) // ratio  # [B] windows complete after this chunk (absolute count)
    capacity = state.entries.shape[1]
    target = jnp.where(win_index < done[:, None], win_index, capacity)  # incomplete windows are dropped
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    entries = state.entries.at[rows, target].set(entries_new.astype(state.entries.dtype), mode="drop")

    def pick(grid: jax.Array, index: jax.Array) -> jax.Array:
        """Window ``index[b]`` of row ``b``'s grid ``[B, n_win, r, F]``."""
        return jnp.take_along_axis(grid, index[:, None, None, None], axis=1)[:, 0]

    tail_win = done - first_win  # [B] index (in the row's grid) of its new incomplete window
    tail_kv = pick(win_kv, tail_win)
    tail_gate = pick(win_gate_raw, tail_win)
    if overlap:
        completed = (tail_win >= 1)[:, None, None]
        last = jnp.maximum(tail_win - 1, 0)
        last_kv = pick(win_kv, last)[..., :width]
        last_gate = pick(win_gate, last)[..., :width]
        prev_kv_out = jnp.where(completed, last_kv.astype(state.prev_kv.dtype), state.prev_kv)
        prev_gate_out = jnp.where(completed, last_gate, state.prev_gate)
    else:
        prev_kv_out, prev_gate_out = state.prev_kv, state.prev_gate
    return CompressorState(
        tail_kv=tail_kv.astype(state.tail_kv.dtype),
        tail_gate=tail_gate,
        prev_kv=prev_kv_out,
        prev_gate=prev_gate_out,
        entries=entries,
    )


def visible_entries(positions: jax.Array, ratio: int, capacity: int) -> jax.Array:
    """``[..., capacity]`` bool: entry ``w`` is complete for a query at ``p`` iff ``w < (p + 1) // r``."""
    limit = (positions.astype(jnp.int32) + 1) // ratio
    return jnp.arange(capacity, dtype=jnp.int32) < limit[..., None]


def indexer_scores(q: jax.Array, keys: jax.Array, weights: jax.Array) -> jax.Array:
    """Lightning-indexer scores ``I[b, s, t] = Σ_h weights[b, s, h] · ReLU(q[b, s, h] · keys[b, t])``, float32.

    ``q [B, S, Hi, Di]``, ``keys [B, T, Di]``, ``weights [B, S, Hi]`` (any positive scale folded in by the
    caller; it does not change which entries win).
    """
    dots = jnp.einsum(
        "bshd,btd->bsht",
        q.astype(jnp.float32),
        keys.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )
    return jnp.einsum(
        "bsht,bsh->bst", jax.nn.relu(dots), weights.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )


register_op(
    "v4_indexer_scores",
    indexer_scores,
    doc="DeepSeek-V4 lightning indexer: head-weighted sum of ReLU(q·k) over compressed keys",
)
register_impl(
    "v4_indexer_scores",
    "pallas_gpu",
    "pallas_kernels.indexer:v4_indexer_scores",
    platforms=("gpu",),
    reason="the Pallas Triton kernel needs the pallas_kernels package",
)
register_impl(
    "v4_indexer_scores", "ascend", ascend_impl("v4_indexer_scores", indexer_scores), platforms=("ascend",)
)


def indexer_select(scores: jax.Array, visible: jax.Array, top_k: int) -> jax.Array:
    """Mask ``[B, S, T]`` of the ``top_k`` highest-scoring visible entries per query (all visible if fewer).

    ``top_k == 0`` selects every visible entry (no sparse selection). Ties go to the lower index
    (``lax.top_k``); the fixtures keep a margin at the boundary so no test depends on it.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"indexer_select: top_k (index_topk) must be an int >= 0, got {top_k!r}")
    capacity = scores.shape[-1]
    if top_k == 0 or top_k >= capacity:
        return visible
    masked = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    values, idx = lax.top_k(masked, top_k)
    valid = values > -jnp.inf
    picked = jax.nn.one_hot(idx, capacity, dtype=jnp.bool_) & valid[..., None]
    return jnp.any(picked, axis=-2) & visible
