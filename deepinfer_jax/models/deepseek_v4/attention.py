"""DeepSeek-V4 attention: one shared K=V head, partial interleaved RoPE, per-head sinks, grouped output projection.

Per layer (model.md §7, transformers' ``DeepseekV4Attention``), for normalised inputs ``x [B, S, H]``:

1. queries: ``q_res = RMSNorm(x · wq_aᵀ; q_norm)``, ``q = q_res · wq_bᵀ`` split into heads, each head
   RMS-normalised without a weight (V4's ``q_b_norm``), RoPE on the **last** ``qk_rope_head_dim`` channels;
2. one key/value vector per token: ``kv = RMSNorm(x · wkvᵀ; kv_norm)``, rotated the same way; a query sees the
   last ``sliding_window`` tokens (itself included);
3. compressed layers add the compressor's entries (:mod:`.compressor`): all visible ones (HCA), or the lightning
   indexer's top-k (CSA);
4. softmax over the keys plus one learnable "sink" logit per head that takes probability mass but has no value;
5. since values carry RoPE too, the output's rope slice is rotated back with the conjugate at the query position;
6. heads are cut into ``o_groups`` consecutive groups, each projected to ``o_lora_rank`` by its block of ``wo_a``,
   and the concatenation mapped back to ``H`` by ``wo_b``.

Sliding-window-only layers use the main RoPE; compressed layers, their compressors and the indexer query use the
compress RoPE (YaRN, no magnitude factor). The sliding window is kept incrementally as a ring buffer of the last
``sliding_window`` keys (:class:`AttentionState`), so decode cost does not grow with the sequence.

Precision follows the input: float32 ``x`` runs the parity mode, bfloat16 ``x`` the production mode (bf16
activations at the spec's rounding points, sink softmax in float32). The quantise-dequantise round trips of spec
§12.4 come from ``AttentionSpec.casts``: window keys are MXFP8-rounded right after RoPE -- before they are used
by the current chunk *and* before they enter the ring, so prefill and later decode steps attend to the same
values --, compressed entries are stored FP4-rounded, indexer keys and queries MXFP4-rounded, and indexer scores
are materialised in ``score_dtype``. All off (``CastPolicy()``) in parity mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from deepinfer_jax.models.common.linear import LinearNumerics, linear, linear_format
from deepinfer_jax.models.deepseek_v4.compressor import (
    CompressorState,
    compress_chunk,
    indexer_select,
    init_compressor_state,
    per_row,
    visible_entries,
)
from deepinfer_jax.numerics.activation import CastPolicy, kv_cast
from deepinfer_jax.ops import apply_rope, register_impl, register_op, rms_norm, rope_cos_sin
from deepinfer_jax.ops import get as get_op
from deepinfer_jax.ops.ascend import ascend_impl

__all__ = [
    "AttentionProjections",
    "AttentionSpec",
    "AttentionState",
    "attention_layer",
    "grouped_output_projection",
    "init_attention_state",
    "project_attention",
    "sink_attention",
    "sink_attention_weights",
]

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static shape facts of one attention layer (hashable: it is part of the traced program's structure).

    ``rope_freqs`` is the per-pair frequency table of the layer's RoPE (main or compress) as a tuple, so the spec
    stays hashable; ``ratio`` is 0 for sliding-window-only layers. ``casts`` is the precision mode's
    :class:`~deepinfer_jax.numerics.activation.CastPolicy` (window / compressed / indexer round trips) and
    ``score_dtype`` the dtype indexer scores are materialised in (bfloat16 in production mode, spec §7.4).
    """

    kind: str
    heads: int
    head_dim: int
    rope_dim: int
    window: int
    o_groups: int
    o_rank: int
    eps: float
    rope_freqs: tuple[float, ...]
    ratio: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    casts: CastPolicy = dataclasses.field(default_factory=CastPolicy)
    score_dtype: str = "float32"

    def freqs(self) -> jax.Array:
        return jnp.asarray(np.asarray(self.rope_freqs, np.float32))


class AttentionState(NamedTuple):
    """Incremental state of one layer: the window ring ``[B, W, D]`` and the compressor states (or ``None``)."""

    window: jax.Array
    compressor: CompressorState | None
    indexer: CompressorState | None


def init_attention_state(
    spec: AttentionSpec, batch: int, max_len: int, dtype: Any = jnp.float32
) -> AttentionState:
    """Empty state for sequences of up to ``max_len`` tokens.

    ``dtype`` is the activation dtype: the window ring and the compressed entries hold keys of that dtype. The
    compressor tails hold float32 projections whatever the mode (bfloat16 entries sit beside float32 tails).
    """
    compressor = indexer = None
    if spec.kind != SLIDING:
        capacity = max_len // spec.ratio + 1
        overlap = spec.kind == CSA
        tails = jnp.promote_types(dtype, jnp.float32)
        compressor = init_compressor_state(
            batch, spec.ratio, spec.head_dim, capacity, overlap=overlap, dtype=tails, entries_dtype=dtype
        )
        if spec.kind == CSA:
            indexer = init_compressor_state(
                batch, spec.ratio, spec.index_dim, capacity, overlap=True, dtype=tails, entries_dtype=dtype
            )
    return AttentionState(
        window=jnp.zeros((batch, spec.window, spec.head_dim), dtype), compressor=compressor, indexer=indexer
    )


def sink_attention(
    q: jax.Array, kv: jax.Array, mask: jax.Array, sinks: jax.Array, *, scale: float
) -> jax.Array:
    """Softmax attention of ``q [B, S, Hq, D]`` over shared keys = values ``kv [B, T, D]`` with per-head sinks.

    ``mask [B, S, T]`` (True = may attend). Each head's softmax runs over its masked logits plus the sink logit
    ``sinks[h]``, whose probability is dropped (it has no value vector), so the output weights sum to < 1. All in
    float32; returns ``[B, S, Hq, D]`` in ``q.dtype``. Every row must keep at least one key (its own token).
    """
    logits = jnp.einsum(
        "bshd,btd->bsht", q.astype(jnp.float32), kv.astype(jnp.float32), precision=lax.Precision.HIGHEST
    ) * jnp.float32(scale)
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    sink = sinks.astype(jnp.float32)[None, None, :]
    peak = jnp.maximum(jnp.max(logits, axis=-1), sink)
    probs = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(probs, axis=-1) + jnp.exp(sink - peak)
    out = jnp.einsum("bsht,btd->bshd", probs, kv.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return (out / denom[..., None]).astype(q.dtype)


def sink_attention_weights(
    q: jax.Array, kv: jax.Array, mask: jax.Array, sinks: jax.Array, *, scale: float
) -> jax.Array:
    """The weights :func:`sink_attention` gives each key: float32 ``[B, S, Hq, T]``, zero where masked.

    A row sums to less than one by the sink's share, so ``einsum("bsht,btd->bshd", weights, kv)`` is the
    attention output. For inspecting a layer's attention pattern (``taps`` of the V4.1 forward), not for the
    forward itself.
    """
    logits = jnp.einsum(
        "bshd,btd->bsht", q.astype(jnp.float32), kv.astype(jnp.float32), precision=lax.Precision.HIGHEST
    ) * jnp.float32(scale)
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    sink = sinks.astype(jnp.float32)[None, None, :]
    peak = jnp.maximum(jnp.max(logits, axis=-1), sink)
    probs = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(probs, axis=-1) + jnp.exp(sink - peak)
    return probs / denom[..., None]


register_op(
    "v4_sink_attention",
    sink_attention,
    doc="DeepSeek-V4 attention core: one shared K=V head, boolean mask, per-head sink logits",
)
register_impl(
    "v4_sink_attention",
    "pallas_gpu",
    "pallas_kernels.sparse_attention:v4_sink_attention",
    platforms=("gpu",),
    reason="the Pallas Triton kernel needs the pallas_kernels package",
)
register_impl(
    "v4_sink_attention", "ascend", ascend_impl("v4_sink_attention", sink_attention), platforms=("ascend",)
)


def _row_block(
    p: Mapping[str, jax.Array], lo: int, hi: int, numerics: LinearNumerics
) -> dict[str, jax.Array]:
    """Rows ``[lo, hi)`` of a linear weight dict (its scale rows too), for one group of ``wo_a``."""
    fmt = linear_format(p)
    if fmt == "dense":
        return {"weight": p["weight"][lo:hi]}
    if fmt == "fp8":
        rows = numerics.fp8_block()[0]
        if lo % rows or hi % rows:
            raise ValueError(
                f"wo_a: o_lora_rank group rows [{lo}, {hi}) are not aligned to the FP8 block of {rows} rows"
            )
        return {"weight": p["weight"][lo:hi], "scale": p["scale"][lo // rows : hi // rows]}
    return {"packed": p["packed"][lo:hi], "scale": p["scale"][lo:hi]}


def grouped_output_projection(
    o: jax.Array,
    wo_a: Mapping[str, jax.Array],
    wo_b: Mapping[str, jax.Array],
    *,
    groups: int,
    rank: int,
    numerics: LinearNumerics,
) -> jax.Array:
    """``o [B, S, Hq, D]`` -> ``[B, S, H]``: consecutive heads form ``groups`` groups, each projected to ``rank``
    by its own rows of ``wo_a [groups·rank, (Hq/groups)·D]``, then ``wo_b`` mixes the ``groups·rank`` values."""
    b, s, heads, d = o.shape
    if heads % groups:
        raise ValueError(f"grouped_output_projection: o_groups {groups} does not divide {heads} heads")
    per = (heads // groups) * d
    grouped = o.reshape(b, s, groups, per)
    z = [
        linear(grouped[:, :, g], _row_block(wo_a, g * rank, (g + 1) * rank, numerics), numerics)
        for g in range(groups)
    ]
    return linear(jnp.concatenate(z, axis=-1), wo_b, numerics)


class AttentionProjections(NamedTuple):
    """Everything one attention layer projects from its normalised input (:func:`project_attention`).

    Attributes:
      q: queries ``[..., Hq, D]``, head-normalised and rotated.
      kv: the shared key/value ``[..., D]``, normalised and rotated (before any cache cast).
      a, g: the compressor's float32 projections and gate logits ``[..., F]`` (compressed layers; else None).
      ia, ig: the indexer compressor's (CSA layers; else None).
      qi: indexer queries ``[..., Hi, Di]``, rotated and cast as the mode's indexer policy says (CSA).
      w: float32 indexer head weights ``[..., Hi]`` with transformers' scales folded in (CSA).
    """

    q: jax.Array
    kv: jax.Array
    a: jax.Array | None = None
    g: jax.Array | None = None
    ia: jax.Array | None = None
    ig: jax.Array | None = None
    qi: jax.Array | None = None
    w: jax.Array | None = None


def project_attention(
    p: Mapping[str, Any],
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    spec: AttentionSpec,
    numerics: LinearNumerics,
) -> AttentionProjections:
    """The projections of one attention layer for normalised inputs ``x [..., H]`` at the positions of
    ``cos``/``sin`` ``[..., rope_dim / 2]``: what the full forward and the engine's paged forward both need.

    1. ``q_res = RMSNorm(x · wq_aᵀ; q_norm)``, ``q = q_res · wq_bᵀ`` split into heads, each head RMS-normalised
       without a weight, RoPE on the last ``rope_dim`` channels; ``kv = RMSNorm(x · wkvᵀ; kv_norm)``, rotated.
    2. Compressed layers: the compressor's float32 projections ``x · wkvᵀ`` and gate logits ``x · wgateᵀ``.
    3. CSA layers: the same for the indexer's own compressor, the indexer queries ``q_res · wq_bᵀ`` (rotated,
       cast by the mode's indexer policy) and the head weights. transformers' positive scales (``Di^-1/2`` on
       the dots, ``Hi^-1/2`` on the weights) change no selection but are kept so the scores themselves can be
       compared; the weights are a projection output like any other, rounded to the activation dtype (a no-op
       in parity mode) before the scale.
    """
    lead = x.shape[:-1]
    q_res = rms_norm(linear(x, p["wq_a"], numerics), p["q_norm"], eps=spec.eps)
    q = linear(q_res, p["wq_b"], numerics).reshape(*lead, spec.heads, spec.head_dim)
    q = apply_rope(rms_norm(q, None, eps=spec.eps), cos, sin, rope_dim=spec.rope_dim)
    kv = rms_norm(linear(x, p["wkv"], numerics), p["kv_norm"], eps=spec.eps)
    kv = apply_rope(kv, cos, sin, rope_dim=spec.rope_dim)
    if spec.kind == SLIDING:
        return AttentionProjections(q, kv)
    cp = p["compressor"]
    a = linear(x, cp["wkv"], numerics, out_dtype=jnp.float32)
    g = linear(x, cp["wgate"], numerics, out_dtype=jnp.float32)
    if spec.kind != CSA:
        return AttentionProjections(q, kv, a, g)
    ip = p["indexer"]
    ia = linear(x, ip["compressor"]["wkv"], numerics, out_dtype=jnp.float32)
    ig = linear(x, ip["compressor"]["wgate"], numerics, out_dtype=jnp.float32)
    qi = linear(q_res, ip["wq_b"], numerics).reshape(*lead, spec.index_heads, spec.index_dim)
    qi = kv_cast(apply_rope(qi, cos, sin, rope_dim=spec.rope_dim), spec.casts.indexer)
    scale = (spec.index_dim**-0.5) * (spec.index_heads**-0.5)
    w = linear(x, ip["weights_proj"], numerics, out_dtype=jnp.float32)
    w = w.astype(x.dtype).astype(jnp.float32) * jnp.float32(scale)
    return AttentionProjections(q, kv, a, g, ia, ig, qi, w)


def _window_keys(
    ring: jax.Array, kv: jax.Array, start: jax.Array, positions: jax.Array, lengths: jax.Array, window: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keys ``[B, W + S, D]`` (ring, then the new tokens), their mask ``[B, S, W + S]`` and the updated ring.

    ``start``/``lengths`` are ``[B]`` and ``positions`` ``[B, S]``: every row has its own ring positions. Only a
    row's last ``min(lengths[b], W)`` real tokens are written; padding past ``lengths[b]`` leaves the ring alone
    (and, lying after every real query, is never attended by one).
    """
    batch, seq = positions.shape
    slots = jnp.arange(window, dtype=jnp.int32)
    # Ring slot s holds the latest position q < start with q ≡ s (mod W); none yet when q < 0.
    ring_pos = start[:, None] - 1 - jnp.mod(start[:, None] - 1 - slots, window)
    key_pos = jnp.concatenate([ring_pos, positions], axis=1)[:, None, :]
    q_pos = positions[:, :, None]
    mask = (key_pos >= 0) & (key_pos <= q_pos) & (key_pos > q_pos - window)
    keys = jnp.concatenate([ring, kv.astype(ring.dtype)], axis=1)
    index = jnp.arange(seq, dtype=jnp.int32)[None, :]
    # The last W real tokens have distinct slots; everything else is sent out of range and dropped.
    write = (index < lengths[:, None]) & (index >= lengths[:, None] - window)
    new_slots = jnp.where(write, jnp.mod(positions, window), window)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    ring = ring.at[rows, new_slots].set(kv.astype(ring.dtype), mode="drop")
    return keys, mask, ring


def attention_layer(
    p: Mapping[str, Any],
    x: jax.Array,
    start: jax.Array,
    state: AttentionState,
    spec: AttentionSpec,
    numerics: LinearNumerics,
    *,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, AttentionState]:
    """One attention sub-layer over ``S`` new tokens at positions ``start ..``; returns ``(y [B, S, H], state)``.

    ``start`` is an int scalar shared by the batch or an int vector ``[B]`` (row ``b`` at ``start[b] ..``);
    ``lengths`` (scalar or ``[B]``, default ``S``) counts each row's real tokens, the rest being padding whose
    outputs are meaningless and which leaves the state as if it had not been fed.

    ``p`` holds ``wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sinks`` and, for compressed layers,
    ``compressor`` (``wkv, wgate, ape, norm``) and, for CSA layers, ``indexer`` (``wq_b, weights_proj`` and its
    own ``compressor``). ``x`` is the attention-normalised input.
    """
    b, s, _ = x.shape
    start = per_row(start, b, name="start", caller="attention_layer")
    lengths = per_row(s if lengths is None else lengths, b, name="lengths", caller="attention_layer")
    positions = start[:, None] + jnp.arange(s, dtype=jnp.int32)  # [B, S]
    freqs = spec.freqs()
    cos, sin = rope_cos_sin(positions, freqs)  # [B, S, rope_dim/2]
    pr = project_attention(p, x, cos, sin, spec, numerics)
    q = pr.q
    # §12.4 item 2: the window cache's format is what every reader sees, the current chunk included.
    kv = kv_cast(pr.kv, spec.casts.window_keys)

    keys, mask, ring = _window_keys(state.window, kv, start, positions, lengths, spec.window)
    compressor_state, indexer_state = state.compressor, state.indexer
    if spec.kind != SLIDING:
        if compressor_state is None:
            raise ValueError(f"attention_layer: a {spec.kind} layer needs a compressor state")
        cp = p["compressor"]
        compressor_state = compress_chunk(
            compressor_state,
            pr.a,
            pr.g,
            start,
            ape=cp["ape"],
            norm_weight=cp["norm"],
            norm_eps=spec.eps,
            rope_freqs=freqs,
            rope_dim=spec.rope_dim,
            lengths=lengths,
            entry_dtype=x.dtype,
            cache_cast=spec.casts.compressed_keys,
        )
        entries = compressor_state.entries
        selected = visible_entries(positions, spec.ratio, entries.shape[1])  # [B, S, capacity]
        if spec.kind == CSA:
            if indexer_state is None:
                raise ValueError(
                    "attention_layer: a compressed_sparse_attention layer needs an indexer state"
                )
            icp = p["indexer"]["compressor"]
            indexer_state = compress_chunk(
                indexer_state,
                pr.ia,
                pr.ig,
                start,
                ape=icp["ape"],
                norm_weight=icp["norm"],
                norm_eps=spec.eps,
                rope_freqs=freqs,
                rope_dim=spec.rope_dim,
                lengths=lengths,
                entry_dtype=x.dtype,
                cache_cast=spec.casts.indexer,
            )
            scores = get_op("v4_indexer_scores")(pr.qi, indexer_state.entries, pr.w)
            scores = scores.astype(spec.score_dtype)
            selected = indexer_select(scores, selected, spec.index_topk)
        keys = jnp.concatenate([keys, entries.astype(keys.dtype)], axis=1)
        mask = jnp.concatenate([mask, selected], axis=2)

    out = get_op("v4_sink_attention")(q, keys, mask, p["sinks"], scale=spec.head_dim**-0.5)
    out = apply_rope(out, cos, sin, rope_dim=spec.rope_dim, inverse=True)
    y = grouped_output_projection(
        out, p["wo_a"], p["wo_b"], groups=spec.o_groups, rank=spec.o_rank, numerics=numerics
    )
    return y, AttentionState(window=ring, compressor=compressor_state, indexer=indexer_state)
