"""DeepSeek-V4.1 over paged caches and state slots: the cached, incremental path of one engine step.

The full-prefix forward (:mod:`deepinfer_jax.models.deepseek_v4.v41_model`) recomputes every key of a sequence;
this module runs the same model over one flat ragged batch (prefill chunks and decode tokens of many sequences
mixed, each row at its own positions) and keeps what later steps need (``spec/engine.md`` §6.3,
``spec/model.md`` §12.3.4, §14):

* **Window rings** ``[num_slots, W, ...]``, one per backbone layer (a window is never shared): each token reads
  its own row's positions ``p - W + 1 .. p`` through :func:`~deepinfer_jax.cache.ragged.history` (this step's
  keys or the ring), then each row's last ``W`` keys are stored (no rollback margin: nothing speculates yet).
* **Compressed keys** ``k̃`` in pages ``[num_blocks, block // r, ...]`` owned by each KV *source* layer, and
  **indexer keys** ``k̃i`` in pages owned by each index-K source; consumers own no storage and read (alias) their
  source's pages. An entry is written by the token that completes it (:func:`emitting_tokens`), in the same
  step before any layer reads it; visibility (``j < (p + 1) // r``) keeps later entries of the same chunk from
  earlier tokens.
* **C2 pending state**: the float32 projections ``(a, g)`` of the last ``r`` tokens of each ratio-2 KV source, a
  per-slot ring; the token closing a pair pools its predecessor's projections with its own.
* **Engram history**: the last ``Nmax - 1`` compressed ids of each sequence, a per-slot ring, so the n-grams of
  a chunk see the tokens before it (:func:`~deepinfer_jax.models.deepseek_v4.engram.ngram_ids`).

Within a step the values a source layer produces for its consumers travel in :class:`_StepCross`, as
:class:`~deepinfer_jax.models.deepseek_v4.v41_attention.CrossLayer` does in the full forward: the YOCO shared
hidden of this step's tokens, the pre-RoPE ``P`` of the entries emitted in this step (for the indexer keys), the
top-k selection as compressed indices ``[T, k]`` and the candidate-block mask ``[T, NB]``.

The hot paths are registry ops (the engine's op selection picks their implementations): window and selected
entries through ``v4_sparse_attention`` over the stored records, ``Sel(p)`` of index sources through the
streaming ``v4_indexer_topk`` (the candidate source, which needs its whole score row for ``Cand(p)``, scores one
page at a time with ``v4_indexer_scores``), compressed entries through ``v4_compress_store`` (ratio 2) or
``kv_store_records`` (C1, indexer keys), the mHC Sinkhorn through ``mhc_sinkhorn``.

Temporary memory follows what each token reads: its window ``[T, W, ...]``, its ``k`` selected entries, and the
indexer keys or compressed keys one page at a time while scoring or attending to every visible entry
(:mod:`deepinfer_jax.cache.paged_walk`). Only score rows are materialised, never the keys of the context: the
streaming indexer's running top-k and one chunk, and the candidate source's ``[T, entries]``.

Numerics are the model's: the projections, pooling op, indexer query and scores, candidate blocks, sink softmax,
grouped output projection, mHC, Engram and MoE are the model modules' own functions, so in float32 parity mode
each row's logits equal the full forward's up to float32 reassociation. ``cache_dtype="quantized"`` stores the
production formats of ``ARCHITECTURE.md`` §8 as encoded records (``uint8``; MXFP8 window, FP4 or MXFP8
compressed, MXFP4 indexer keys, :mod:`deepinfer_jax.numerics.kv_records`), and every reader -- the step that
wrote a key as well as later ones -- uses the decoded value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from deepinfer_jax.cache.paged_walk import (
    attend_dense,
    emitting_tokens,
    finish_softmax,
    merge_softmax,
    paged_scores,
    topk_entries,
    walk_pages,
)
from deepinfer_jax.cache.ragged import (
    RaggedMeta,
    compressed_slots,
    history,
    page_rows,
    replay_bounded,
    replay_compact,
    ring_write,
    rowwise_meta,
)
from deepinfer_jax.cache.stores import CompressedCache, KeyStore, key_cache_storage, key_store
from deepinfer_jax.models.common.embedding import embed_tokens, lm_head
from deepinfer_jax.models.common.linear import LinearNumerics, linear
from deepinfer_jax.models.deepseek_v4 import family_v41
from deepinfer_jax.models.deepseek_v4.attention import grouped_output_projection
from deepinfer_jax.models.deepseek_v4.compressor import visible_entries
from deepinfer_jax.models.deepseek_v4.dspark import (
    ContextKeys,
    DSparkStatic,
    context_keys,
    draft_hidden,
    target_features,
)
from deepinfer_jax.models.deepseek_v4.engram import engram_layer, hash_rows, ngram_ids
from deepinfer_jax.models.deepseek_v4.mhc import hc_collapse, hc_expand, hc_head, hc_mixes
from deepinfer_jax.models.deepseek_v4.plan_v41 import V41LayerPlan
from deepinfer_jax.models.deepseek_v4.v41_attention import V41AttentionSpec
from deepinfer_jax.models.deepseek_v4.v41_compressor import (
    candidate_blocks,
    compress_kv,
    indexer_keys,
    indexer_query,
    indexer_scores,
)
from deepinfer_jax.models.deepseek_v4.v41_model import V41Static, moe_layer
from deepinfer_jax.models.paged import CacheLayout, PagedModel
from deepinfer_jax.ops import apply_rope, rms_norm, rope_cos_sin
from deepinfer_jax.ops import get as get_op
from deepinfer_jax.ops.sparse_attention import entry_slots
from deepinfer_jax.ops.tiling import rowwise, rowwise_carry

__all__ = ["V41PagedModel", "cache_storage", "paged_model"]

Params = Mapping[str, Any]
_MODES = ("float32", "bfloat16")
_REPLAY_MODES = ("off", "mask", "compact")


# ------------------------------------------------------------------------------------- per-step cross


class _StepCross(NamedTuple):
    """What source layers hand to later layers within one step (the ragged :class:`CrossLayer`).

    Attributes:
        shared_hidden: ``ĥ [T, H]`` of this step's tokens (the attention-norm output of ``n_prefill_layer``).
        emitted: int32 ``[E]`` the tokens that complete a compressed entry of the current KV segment
            (``T`` = none), and ``pre_rope`` ``P [E, D]`` of those entries.
        selection: ``[T, k]`` compressed indices selected by the current index source (``-1`` = none).
        candidates: ``[T, NB]`` candidate-block mask of the candidate source.
    """

    shared_hidden: jax.Array | None = None
    emitted: jax.Array | None = None
    pre_rope: jax.Array | None = None
    selection: jax.Array | None = None
    candidates: jax.Array | None = None


def _at(values: jax.Array, index: jax.Array, fill: Any = 0) -> jax.Array:
    """``values[index]`` along axis 0 with out-of-range indices reading ``fill``."""
    return values.at[index].get(mode="fill", fill_value=fill)


def _rotate_at(x: jax.Array, positions: jax.Array, freqs: jax.Array, rope_dim: int) -> jax.Array:
    """RoPE of ``x [N, D]`` (one vector per row) at ``positions [N]`` on its last ``rope_dim`` dims."""
    cos, sin = rope_cos_sin(positions, freqs)
    return apply_rope(x, cos, sin, rope_dim=rope_dim)


# ------------------------------------------------------------------------------------------ the model


@dataclasses.dataclass(frozen=True)
class V41PagedModel(PagedModel):
    """DeepSeek-V4.1 as the engine step runs it (module docstring).

    Attributes:
        static: the model's :class:`~deepinfer_jax.models.deepseek_v4.v41_model.V41Static` (plan, attention
            specs, numerics, Engram layout) in the precision mode ``dtype``.
        block_size: tokens per cache block (a multiple of every compress ratio: a page holds ``block / r``
            compressed entries).
        dtype: the precision mode, ``"float32"`` (parity) or ``"bfloat16"`` (production).
        cache_dtype: ``"float32"`` / ``"bfloat16"`` (unquantised keys of that dtype) or ``"quantized"`` (the
            production record formats).
        head_dim, index_head_dim, use_fp4: the cache widths and the compressed format.
        dspark: the DSpark drafter's statics when the engine drafts with it (``None``: no drafts). Its block size
            ``B`` is the margin every per-slot ring gets (``W + B`` window and draft rings, ``r + B`` C2 pending,
            ``Nmax - 1 + B`` Engram history): a step writes at most ``B`` positions past the last token it keeps,
            and the rejected ones must not overwrite a position a later step reads (docs/speculative.md).
        replay, replay_keep: SWA bounded replay (``scheduler.yoco_truncation`` / ``yoco_keep_tokens``,
            docs/models_v41.md): ``"off"``, ``"mask"`` (every row computed, the consumer layers' windows narrowed to
            ``RaggedMeta.replay_from``) or ``"compact"`` (the consumer layers run only on the kept rows, at most
            ``min(T, S * replay_keep)`` of them); a static option, so each mode compiles its own steps.
    """

    static: V41Static
    block_size: int
    dtype: str
    cache_dtype: str
    head_dim: int
    index_head_dim: int
    use_fp4: bool
    dspark: DSparkStatic | None = None
    replay: str = "off"
    replay_keep: int = 0

    @classmethod
    def create(
        cls,
        model: Any,
        *,
        block_size: int,
        dtype: str,
        cache_dtype: str,
        draft_tokens: int = 0,
        replay: str = "off",
        replay_keep: int = 0,
    ) -> V41PagedModel:
        """The paged model of a loaded V4.1 model (``load_model``'s result), refusing what it cannot page.

        ``draft_tokens > 0`` builds the DSpark drafter into the step (``dspark_block_size`` drafts per block; the
        engine verifies the first ``draft_tokens`` of them, at most the block size).

        Raises:
            TypeError: ``block_size`` is not an int.
            ValueError: a ``dtype`` outside ``("float32", "bfloat16")``, a ``cache_dtype`` outside ``("auto",
                "float32", "bfloat16", "quantized")``, parameters assembled
                in another precision mode, a ``block_size`` that some compress ratio does not divide, or
                ``draft_tokens`` for a model without a drafter or above its block size, a ``replay`` outside
                ``("off", "mask", "compact")``, or bounded replay on a model without YOCO consumer layers or with
                ``replay_keep`` below ``sliding_window + ring margin``.
        """
        if dtype not in _MODES:
            raise ValueError(f"dtype: {dtype!r} is not a precision mode; expected one of {_MODES}")
        cache_dtype = key_cache_storage("deepseek_v41", dtype, cache_dtype)
        cfg = model.config
        mode = family_v41.precision_mode(model.params)
        if mode != dtype:
            raise ValueError(f"dtype: {dtype!r}, but the model's parameters were assembled in {mode!r} mode")
        static = family_v41.static_for(cfg, dtype)
        dspark = None
        if draft_tokens:
            dspark = DSparkStatic.from_config(cfg, static)
            if draft_tokens > dspark.block_size:
                raise ValueError(
                    f"speculative.num_draft_tokens = {draft_tokens}: the DSpark drafter proposes "
                    f"dspark_block_size = {dspark.block_size} tokens per step; use at most that"
                )
        out = cls(
            static=static,
            block_size=block_size,
            dtype=dtype,
            cache_dtype=cache_dtype,
            head_dim=int(cfg.head_dim),
            index_head_dim=int(cfg.index_head_dim or 0),
            use_fp4=cfg.use_fp4_sparse_kv is not False,
            dspark=dspark,
            replay=replay,
            replay_keep=int(replay_keep) if replay != "off" else 0,
        )
        out.check_block_size(block_size)
        out._check_replay()
        return out

    def _check_replay(self) -> None:
        if self.replay not in _REPLAY_MODES:
            raise ValueError(
                f"scheduler.yoco_truncation: {self.replay!r} is not a mode; expected one of {_REPLAY_MODES}"
            )
        if self.replay == "off":
            return
        if not any(lp.yoco_consumer for lp in self.layers):
            raise ValueError(
                f"scheduler.yoco_truncation = {self.replay!r}: this model has no YOCO consumer layers"
            )
        needed = self.window + self.ring_margin
        if self.replay_keep < needed:
            raise ValueError(
                f"scheduler.yoco_keep_tokens = {self.replay_keep}: must be >= sliding_window + ring margin = "
                f"{self.window} + {self.ring_margin} = {needed}"
            )
        if self.replay == "compact":
            npl = min(lp.layer for lp in self.layers if lp.yoco_consumer)
            late = [lp.layer for lp in self.layers if lp.has_engram and lp.layer >= npl]
            if late:
                raise ValueError(
                    f"scheduler.yoco_truncation = 'compact': Engram layers {late} lie in the YOCO consumer half "
                    f"(from layer {npl}); compaction needs them on the prefill side"
                )

    # -------------------------------------------------------------------------------- static facts

    @property
    def vocab_size(self) -> int:
        return int(self.static.vocab_size)

    @property
    def layers(self) -> tuple[V41LayerPlan, ...]:
        return self.static.plan.layers

    def check_block_size(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise TypeError(f"block_size: expected an int, got {type(block_size).__name__} ({block_size!r})")
        for lp in self.layers:
            if lp.ratio and block_size % lp.ratio:
                raise ValueError(
                    f"block_size = {block_size}: compress_ratios[{lp.layer}] = {lp.ratio} must divide the cache "
                    "block (a page holds block_size / ratio compressed entries)"
                )

    @functools.cached_property
    def kv_sources(self) -> tuple[int, ...]:
        """Layers owning compressed-key pages, in layer order."""
        return tuple(lp.layer for lp in self.layers if lp.is_kv_source)

    @functools.cached_property
    def index_k_sources(self) -> tuple[int, ...]:
        """Layers owning indexer-key pages, in layer order."""
        return tuple(lp.layer for lp in self.layers if lp.is_index_k_source)

    @functools.cached_property
    def pending_sources(self) -> tuple[int, ...]:
        """Ratio-2 KV sources: they keep the projections of an incomplete pair in the state slot."""
        return tuple(lp.layer for lp in self.layers if lp.is_kv_source and lp.ratio > 1)

    @property
    def window(self) -> int:
        return int(self.static.attention[0].window)

    @property
    def engram_depth(self) -> int:
        """Compressed ids each token's n-grams look back (``Nmax - 1``); 0 without Engram."""
        return 0 if self.static.engram is None else self.static.engram.max_ngram_size - 1

    @property
    def ring_margin(self) -> int:
        """Extra positions of every per-slot ring: the drafter's block size ``B`` (0 without drafts)."""
        return 0 if self.dspark is None else self.dspark.block_size

    @property
    def window_ring(self) -> int:
        """Positions a window (and draft context-key) ring holds: ``W + B``."""
        return self.window + self.ring_margin

    @property
    def production(self) -> bool:
        return self.cache_dtype == "quantized"

    def _store(self, kind: str, width: int, cast: str) -> KeyStore:
        # Unquantised keys keep the mode's own round trip, applied before they are stored.
        return key_store(kind, width, self.cache_dtype, cast=cast, use_fp4=self.use_fp4)

    @functools.cached_property
    def window_store(self) -> KeyStore:
        return self._store("window", self.head_dim, self.static.casts.window_keys)

    @functools.cached_property
    def compressed_store(self) -> KeyStore:
        return self._store("compressed", self.head_dim, self.static.casts.compressed_keys)

    @functools.cached_property
    def indexer_store(self) -> KeyStore:
        if (
            not self.index_k_sources
        ):  # a model without indexer keys stores none; the placeholder is never read
            return KeyStore(self.index_head_dim, "float32")
        return self._store("indexer", self.index_head_dim, self.static.casts.indexer)

    def _ratio(self, layer: int) -> int:
        return self.layers[layer].ratio

    # ---------------------------------------------------------------------------------- memory plan

    def layout(self) -> CacheLayout:
        wnd, cmp, idx = self.window_store, self.compressed_store, self.indexer_store
        kv_block = sum((self.block_size // self._ratio(s)) * cmp.item_bytes for s in self.kv_sources)
        ik_block = sum((self.block_size // self._ratio(s)) * idx.item_bytes for s in self.index_k_sources)
        num_layers = len(self.layers)
        margin = self.ring_margin
        window_slot = num_layers * self.window_ring * wnd.item_bytes
        pending_slot = sum(2 * (self._ratio(s) + margin) * self.head_dim * 4 for s in self.pending_sources)
        engram_slot = (self.engram_depth + margin) * 4 if self.engram_depth else 0
        draft_layers = 0 if self.dspark is None else self.dspark.num_layers
        draft_slot = draft_layers * self.window_ring * self.head_dim * jnp.dtype(self.dtype).itemsize
        if self.production:
            kinds = [f"window {wnd.describe()}", f"compressed {cmp.describe()}"]
            kinds += [f"indexer {idx.describe()}"] if self.index_k_sources else []
            dtype = f"records ({', '.join(kinds)})"
        else:
            dtype = self.cache_dtype

        def owners(layers: tuple[int, ...]) -> str:
            ratios = sorted({self._ratio(s) for s in layers})
            return f"{len(layers)} owning layer(s) {list(layers)}, ratio(s) {ratios}"

        lines = [
            f"window ring: {self.window_ring} positions x {wnd.item_bytes} B ({wnd.describe()}, {self.head_dim} values) per layer, "
            f"{num_layers} layers (every layer owns its window) = {window_slot} B per slot",
            f"compressed keys: {cmp.item_bytes} B per entry ({cmp.describe()}, {self.head_dim} values), block / ratio entries per "
            f"page, {owners(self.kv_sources)} (consumers alias them) = {kv_block} B per block",
        ]
        if self.index_k_sources:
            lines.append(
                f"indexer keys: {idx.item_bytes} B per entry ({idx.describe()}, {self.index_head_dim} values), "
                f"{owners(self.index_k_sources)} = {ik_block} B per block"
            )
        if self.pending_sources:
            lines.append(
                f"C2 pending state: float32 (a, g) of the last ratio tokens x {self.head_dim}, "
                f"{len(self.pending_sources)} ratio-2 KV source(s) {list(self.pending_sources)} = {pending_slot} B "
                "per slot"
            )
        if self.engram_depth:
            lines.append(
                f"Engram history: the last {self.engram_depth + margin} compressed ids (int32) = {engram_slot} B "
                "per slot"
            )
        if draft_layers:
            lines.append(
                f"DSpark context keys: {self.window_ring} positions x {self.head_dim} values ({self.dtype}), "
                f"{draft_layers} draft layer(s) = {draft_slot} B per slot"
            )
        if margin:
            lines.append(f"every ring holds {margin} positions more (the drafts a step may reject)")
        return CacheLayout(
            block_size=self.block_size,
            bytes_per_block=kv_block + ik_block,
            bytes_per_slot=window_slot + pending_slot + engram_slot + draft_slot,
            dtype=dtype,
            lines=tuple(lines),
        )

    # ---------------------------------------------------------------------------------------- cache

    def init_cache(self, num_blocks: int, num_slots: int) -> CompressedCache:
        """Zeroed caches: window rings, compressed / indexer pages, C2 pending rings, Engram history."""
        wnd, cmp, idx = self.window_store, self.compressed_store, self.indexer_store

        margin = self.ring_margin

        def pending(layer: int) -> tuple[jax.Array, jax.Array]:
            return tuple(
                jnp.zeros((num_slots, self._ratio(layer) + margin, self.head_dim), jnp.float32)
                for _ in range(2)
            )

        draft_layers = 0 if self.dspark is None else self.dspark.num_layers
        return CompressedCache(
            window=tuple(wnd.zeros(num_slots, self.window_ring) for _ in self.layers),
            kv=tuple(cmp.zeros(num_blocks, self.block_size // self._ratio(s)) for s in self.kv_sources),
            ik=tuple(idx.zeros(num_blocks, self.block_size // self._ratio(s)) for s in self.index_k_sources),
            state=tuple(pending(s) for s in self.pending_sources),
            engram=(
                jnp.zeros((num_slots, self.engram_depth + margin), jnp.int32) if self.engram_depth else None
            ),
            draft=tuple(
                jnp.zeros((num_slots, self.window_ring, self.head_dim), jnp.dtype(self.dtype))
                for _ in range(draft_layers)
            ),
        )

    # -------------------------------------------------------------------------------------- forward

    def _backbone(
        self,
        params: Any,
        cache: Any,
        token_ids: jax.Array,
        meta: RaggedMeta,
        tile: int | None,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[jax.Array, jax.Array, CompressedCache, dict[int, jax.Array]]:
        """Every layer over the flat batch: ``(streams [T, m, H], carried pre-mix [T, m], cache, captured)``.

        ``captured`` maps each layer of ``capture_layers`` to the float32 mean over streams of the state entering
        its attention mixes, after Engram (the DSpark target feature before its rounding, as the full forward's
        ``forward_with_features`` captures it)."""
        st = self.static
        if len(params["layers"]) != len(self.layers):
            raise ValueError(f"params: {len(params['layers'])} layers, the plan has {len(self.layers)}")
        engram_ring, draft_rings = cache.engram, cache.draft
        cache = {name: list(getattr(cache, name)) for name in ("window", "kv", "ik", "state")}
        tokens = meta.num_tokens
        m = st.hc_mult
        x = embed_tokens(params["embed"], token_ids, dtype=jnp.dtype(st.dtype))
        streams = jnp.broadcast_to(x[:, None, :], (tokens, m, x.shape[-1]))  # §6.2
        carried_pre = jnp.broadcast_to(jax.nn.one_hot(0, m, dtype=jnp.float32), (tokens, m))
        grams = None
        if st.engram is not None:
            grams, engram_ring = self._engram_ngrams(params, token_ids, engram_ring, meta)
        cross = _StepCross()
        captured: dict[int, jax.Array] = {}
        replay = self.replay if meta.replay_from is not None else "off"
        full: tuple[RaggedMeta, jax.Array] | None = None  # compact replay: the full layout's meta and ĥ
        gather = before = None
        for lp, spec, p in zip(self.layers, st.attention, params["layers"], strict=True):
            if replay == "compact" and lp.captures_shared_hidden:
                # SWA bounded replay, compact: ĥ of every row (the consumer half's compressed keys are written
                # from it over the whole chunk), then the consumer layers run on the kept rows only.
                hat = rowwise(lambda s, c, p=p: self._attention_input(p, s, c), tile, streams, carried_pre)
                full = (meta, hat)
                size = min(tokens, meta.num_rows * self.replay_keep)
                meta, gather = replay_compact(meta, size)
                before = (streams, carried_pre)
                streams, carried_pre = _at(streams, gather), _at(carried_pre, gather)
                cross = _StepCross(shared_hidden=hat)
            if lp.has_engram:
                assert grams is not None and st.engram is not None and lp.engram_slot is not None
                rows = hash_rows(grams, st.engram, lp.engram_slot)
                streams = rowwise(
                    lambda s, r, p=p: engram_layer(p["engram"], s, r, eps=st.eps, numerics=st.numerics),
                    tile,
                    streams,
                    rows,
                )
            if lp.layer in capture_layers:
                captured[lp.layer] = rowwise(
                    lambda s: jnp.mean(s.astype(jnp.float32), axis=-2), tile, streams
                )
            streams, carried_pre, cross, cache = self._attention_sublayer(
                p, lp, spec, streams, carried_pre, cross, cache, meta, tile, replay=replay, full=full
            )
            streams, carried_pre = rowwise(
                lambda s, c, p=p: self._ffn_sublayer(p, s, c), tile, streams, carried_pre
            )
        if gather is not None:
            # Back to the full layout: kept rows get their consumer-half result, dropped rows keep the state they
            # entered the consumer half with (nothing reads them: they are neither sampled nor stored).
            streams = before[0].at[gather].set(streams, mode="drop")
            carried_pre = before[1].at[gather].set(carried_pre, mode="drop")
            for layer in captured:
                if self.layers[layer].yoco_consumer:
                    c = captured[layer]
                    captured[layer] = (
                        jnp.zeros((tokens, *c.shape[1:]), c.dtype).at[gather].set(c, mode="drop")
                    )
        out = CompressedCache(
            **{k: tuple(v) for k, v in cache.items()}, engram=engram_ring, draft=draft_rings
        )
        return streams, carried_pre, out, captured

    def _collapse(self, params: Params, s: jax.Array, c: jax.Array) -> jax.Array:
        """The LM head's input before the final norm (§6.5)."""
        st = self.static
        if st.hc_shifted:
            return hc_collapse(s, c)  # the last FFN's own pre-mix
        return hc_head(s, **params["hc_head"], hc_eps=st.hc_eps, norm_eps=st.eps)

    def _logits(self, params: Params, h: jax.Array) -> jax.Array:
        """Float32 logits of LM-head inputs ``h`` (the final norm, then the head)."""
        return lm_head(rms_norm(h, params["norm"], eps=self.static.eps), params["head"])

    def forward(
        self,
        params: Any,
        cache: Any,
        token_ids: jax.Array,
        meta: RaggedMeta,
        *,
        tile: int | None,
        logit_index: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """Logits of each row's last token (or of the tokens ``logit_index``) and the updated caches
        (``PagedModel.forward``)."""
        streams, carried_pre, cache, _ = self._backbone(params, cache, token_ids, meta, tile)
        last = meta.last_token() if logit_index is None else logit_index

        def head(s: jax.Array, c: jax.Array) -> jax.Array:
            return self._logits(params, self._collapse(params, s, c))

        logits = rowwise(head, tile, streams[last], carried_pre[last])
        return logits, cache

    # ---------------------------------------------------------------------------------------- DSpark

    @property
    def num_draft_layers(self) -> int:
        return 0 if self.dspark is None else self.dspark.num_layers

    @property
    def draft_kind(self) -> str:
        return "dspark"

    def forward_hidden(
        self, params: Any, cache: Any, token_ids: jax.Array, meta: RaggedMeta, *, tile: int | None
    ) -> tuple[jax.Array, Any]:
        """The LM head's input (pre-norm) of every token; with the drafter, every token's context keys
        (target features -> ``main_proj`` / ``main_norm`` -> each draft layer's ``wkv`` / ``kv_norm``, RoPE at the
        token's position, the mode's draft-key cast) are written to the draft layers' rings at its position."""
        capture = () if self.dspark is None else self.dspark.target_layer_ids
        streams, carried_pre, cache, captured = self._backbone(params, cache, token_ids, meta, tile, capture)
        hidden = rowwise(lambda s, c: self._collapse(params, s, c), tile, streams, carried_pre)
        if self.dspark is not None:
            ds = self.dspark

            def keys(phi: jax.Array, pos: jax.Array) -> tuple[jax.Array, ...]:
                ctx = context_keys(params, phi[None], static=ds, positions=pos[None])
                return tuple(k[0] for k in ctx.keys)

            phi = target_features(captured, static=ds)  # [T, T·H]
            new = rowwise(keys, tile, phi, meta.positions)  # one [T, D] per draft layer
            # Under bounded replay the target features of rows below the bound are not the model's (compact mode
            # does not compute them); the drafter reads only the last W positions, all kept, so they are not
            # stored.
            store = replay_bounded(meta)[0] if self.replay != "off" else meta
            rings = tuple(
                ring_write(ring, k.astype(ring.dtype), store)
                for ring, k in zip(cache.draft, new, strict=True)
            )
            cache = cache._replace(draft=rings)
        return hidden, cache

    def head(self, params: Any, hidden: jax.Array, *, tile: int | None) -> jax.Array:
        return rowwise(lambda h: self._logits(params, h), tile, hidden)

    def dspark_block(
        self,
        params: Any,
        cache: Any,
        golden: jax.Array,
        last_pos: jax.Array,
        slots: jax.Array,
        *,
        tile: int | None,
    ) -> jax.Array:
        """The drafter's collapsed, pre-norm hidden ``h [S, B, H]`` of each row's block ``[g, noise × (B−1)]`` at
        positions ``p+1 … p+B`` (``golden [S]`` = ``g``, ``last_pos [S]`` = ``p``, the last position the row
        keeps), over the context keys of ``max(0, p−W+1) … p`` read from the slot's draft rings (``slots [S]``;
        rows with a negative slot read nothing and their output is unused).

        In batch-invariant mode (``tile``) the rows run one at a time, so a row's drafts do not depend on the
        rest of its batch."""
        ds = self.dspark
        assert ds is not None
        w, ring_len = self.window, self.window_ring
        num_slots = cache.draft[0].shape[0]
        pos = last_pos[:, None] - w + 1 + jnp.arange(w, dtype=jnp.int32)[None]  # [S, W]
        safe = jnp.where(slots >= 0, slots, num_slots)[:, None]
        ring_index = jnp.mod(pos, ring_len)
        ctx = tuple(r.at[safe, ring_index].get(mode="fill", fill_value=0) for r in cache.draft)
        noise = jnp.full((golden.shape[0], ds.block_size - 1), ds.noise_token_id, jnp.int32)
        block = jnp.concatenate([golden[:, None].astype(jnp.int32), noise], axis=1)

        def one(b: jax.Array, c: tuple[jax.Array, ...], cp: jax.Array, p: jax.Array) -> jax.Array:
            return draft_hidden(params, ContextKeys(keys=c, positions=cp), b, p, static=ds)

        positions = jnp.where(slots[:, None] >= 0, pos, -1)
        if tile is None:
            return one(block, ctx, positions, last_pos)
        return jax.lax.map(
            lambda t: one(t[0][None], tuple(x[None] for x in t[1]), t[2][None], t[3][None])[0],
            (block, ctx, positions, last_pos),
        )

    def dspark_logits(
        self, params: Any, h: jax.Array, prev: jax.Array, *, tile: int | None
    ) -> tuple[jax.Array, jax.Array]:
        """Row ``i`` of the block: ``(logits [S, V] float32, raw confidence [S])`` from its hidden ``h [S, H]``
        and the token before it ``prev [S]`` (§11.2 step 4: the LM head on the normed hidden plus the Markov
        term; the confidence head on ``[h ; markov_embed[prev]]`` before its temperature)."""
        last = params["mtp"][-1]
        eps = self.static.eps

        def row(hh: jax.Array, pv: jax.Array) -> tuple[jax.Array, jax.Array]:
            markov = embed_tokens(last["markov_embed"], pv)
            logits = lm_head(rms_norm(hh, last["norm"], eps=eps), params["head"]) + lm_head(
                markov, last["markov_head"]
            )
            raw = lm_head(jnp.concatenate([hh, markov.astype(hh.dtype)], axis=-1), last["confidence"])[..., 0]
            return logits, raw

        return rowwise(row, tile, h, prev)

    # ---------------------------------------------------------------------------------------- Engram

    def _engram_ngrams(
        self, params: Params, token_ids: jax.Array, ring: jax.Array, meta: RaggedMeta
    ) -> tuple[jax.Array, jax.Array]:
        """N-gram ids ``[T, Nmax]`` of every token with its row's earlier compressed ids, and the new ring."""
        layout = self.static.engram
        assert layout is not None
        table = params.get("engram_compress")
        if table is None or table.shape != (self.vocab_size,):
            raise ValueError(
                "params['engram_compress']: Engram layers need the raw -> compressed id table of §9.1 with shape "
                f"({self.vocab_size},), got {None if table is None else table.shape}"
            )
        compressed = jnp.take(table, token_ids, axis=0).astype(jnp.int32)
        items, present = history(ring, compressed, meta, layout.max_ngram_size)
        before = jnp.where(present[:, :-1], items[:, :-1], layout.pad_id)  # positions p-Nmax+1 .. p-1
        grams, _ = ngram_ids(
            compressed[:, None], before, max_ngram_size=layout.max_ngram_size, pad_id=layout.pad_id
        )
        return grams[:, 0], ring_write(ring, compressed, meta, after=items)

    # ------------------------------------------------------------------------------------ sub-layers

    def _mix(
        self, streams: jax.Array, hc: Mapping[str, jax.Array], carried_pre: jax.Array
    ) -> tuple[jax.Array, Any]:
        """The HC mixes of a sub-layer and the read ``x`` (the shifted schedule reads the carried pre-mix)."""
        st = self.static
        mix = hc_mixes(streams, **hc, hc_eps=st.hc_eps, sinkhorn_iters=st.hc_sinkhorn_iters, norm_eps=st.eps)
        return hc_collapse(streams, carried_pre if st.hc_shifted else mix.pre), mix

    def _attention_input(self, p: Params, streams: jax.Array, carried_pre: jax.Array) -> jax.Array:
        """``x̂``, the attention-norm output of a layer (of ``n_prefill_layer``: the shared hidden ``ĥ``)."""
        x, _ = self._mix(streams, p["hc_attn"], carried_pre)
        return rms_norm(x, p["attn_norm"], eps=self.static.eps)

    def _ffn_sublayer(
        self, p: Params, streams: jax.Array, carried_pre: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        st = self.static
        x, mix = self._mix(streams, p["hc_ffn"], carried_pre)
        y = moe_layer(p["ffn"], rms_norm(x, p["ffn_norm"], eps=st.eps)[None], st)[0]
        return hc_expand(streams, y, mix.post, mix.comb), mix.pre

    def _attention_sublayer(
        self,
        p: Params,
        lp: V41LayerPlan,
        spec: V41AttentionSpec,
        streams: jax.Array,
        carried_pre: jax.Array,
        cross: _StepCross,
        cache: dict[str, Any],
        meta: RaggedMeta,
        tile: int | None,
        *,
        replay: str = "off",
        full: tuple[RaggedMeta, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array, _StepCross, dict[str, Any]]:
        """One layer's attention sub-layer (§6.4 around §7.11) over the flat batch.

        SWA bounded replay (``replay`` not ``"off"``, consumer layers only): each token's window is narrowed to
        positions ``>= replay_from`` of its row and tokens below that bound store no window key. In compact mode
        ``meta`` is the compact layout and ``full`` the full layout's meta and ``ĥ``: the compressed (and indexer)
        keys are written from ``ĥ`` over every row of the chunk, as without truncation."""
        st = self.static
        a = p["attn"]
        freqs = spec.freqs()
        cos, sin = rope_cos_sin(meta.positions, freqs)

        def project(s: jax.Array, c: jax.Array, cs: jax.Array, sn: jax.Array) -> tuple[jax.Array, ...]:
            x, mix = self._mix(s, p["hc_attn"], c)
            x_hat = rms_norm(x, p["attn_norm"], eps=st.eps)
            q_latent = rms_norm(linear(x_hat, a["wq_a"], st.numerics), a["q_norm"], eps=spec.eps)
            q = linear(q_latent, a["wq_b"], st.numerics).reshape(-1, spec.heads, spec.head_dim)
            q = apply_rope(q, cs, sn, rope_dim=spec.rope_dim)
            kv = rms_norm(linear(x_hat, a["wkv"], st.numerics), a["kv_norm"], eps=spec.eps)
            kv = apply_rope(kv, cs, sn, rope_dim=spec.rope_dim)
            return mix.pre, mix.post, mix.comb, x_hat, q_latent, q, kv

        pre, post, comb, x_hat, q_latent, q, kv = rowwise(project, tile, streams, carried_pre, cos, sin)
        if lp.captures_shared_hidden and full is None:
            cross = cross._replace(shared_hidden=x_hat)

        # Window keys (§7.2): this step's keys as stored (records or values), then the row's last W stored. The
        # attention ops read them in their stored format.
        wnd = self.window_store
        new = wnd.encode(kv)
        ring = cache["window"][lp.layer]
        stored, present = history(ring, new, meta, spec.window)
        store_meta = meta
        if replay != "off" and lp.yoco_consumer:
            store_meta, bound = replay_bounded(meta)
            seen = meta.positions[:, None] - spec.window + 1 + jnp.arange(spec.window, dtype=jnp.int32)[None]
            present = present & (seen >= bound[:, None])
        cache["window"][lp.layer] = ring_write(ring, new, store_meta, after=stored)

        scale = spec.head_dim**-0.5
        # Batch-invariant mode runs the attention in fixed tiles too (rowwise_meta): its contractions are
        # otherwise sized by the step's token count, and XLA:CPU's result for a token then depends on it.
        if not lp.is_compressed:

            def window_only(m: RaggedMeta, t: tuple[jax.Array, ...]) -> jax.Array:
                qq, window, mask = t
                return get_op("v4_sparse_attention")(
                    qq, window, mask, a["sinks"], scale=scale, window_format=wnd.op_format
                )

            out = rowwise_meta(window_only, tile, meta, (q, stored, present))
        else:
            if lp.is_kv_source or lp.is_index_k_source:
                if full is not None and lp.yoco_consumer:
                    # Compact replay: every row's compressed keys, from ĥ (= x̂ of n_prefill_layer).
                    cross, cache = self._compressed_writes(p, lp, spec, full[1], cross, cache, full[0], tile)
                else:
                    cross, cache = self._compressed_writes(p, lp, spec, x_hat, cross, cache, meta, tile)

            def compressed(m: RaggedMeta, t: tuple[Any, ...]) -> tuple[Any, ...]:
                xh, ql, qq, window, mask, selection, candidates = t
                local = cross._replace(selection=selection, candidates=candidates)
                o, local = self._compressed_attention(
                    p, lp, spec, xh, ql, qq, window, mask, local, cache, m, None
                )
                return o, local.selection, local.candidates

            token_inputs = (x_hat, q_latent, q, stored, present, cross.selection, cross.candidates)
            out, selection, candidates = rowwise_meta(compressed, tile, meta, token_inputs)
            cross = cross._replace(selection=selection, candidates=candidates)

        def finish(o: jax.Array, cs: jax.Array, sn: jax.Array) -> jax.Array:
            o = apply_rope(o, cs, sn, rope_dim=spec.rope_dim, inverse=True)
            return grouped_output_projection(
                o[None], a["wo_a"], a["wo_b"], groups=spec.o_groups, rank=spec.o_rank, numerics=st.numerics
            )[0]

        y = rowwise(finish, tile, out, cos, sin)
        return hc_expand(streams, y, post, comb), pre, cross, cache

    # ------------------------------------------------------------------------- compressed entries

    def _compressed_writes(
        self,
        p: Params,
        lp: V41LayerPlan,
        spec: V41AttentionSpec,
        x_hat: jax.Array,
        cross: _StepCross,
        cache: dict[str, Any],
        meta: RaggedMeta,
        tile: int | None,
    ) -> tuple[_StepCross, dict[str, Any]]:
        """A KV source's new compressed keys and an index-K source's new indexer keys, written to their pages.

        Every write goes through a store op: ``v4_compress_store`` (pooling to records, ratio-2 sources) or
        ``kv_store_records`` (C1 keys, indexer keys), at the flat page row of each emitted entry.
        """
        ratio, freqs = spec.ratio, spec.freqs()
        emitted = emitting_tokens(meta, ratio) if lp.is_kv_source else cross.emitted
        if emitted is None:
            raise ValueError(
                f"layer {lp.layer} reads the compressed keys of layer {lp.kv_source}, which has not run in this step"
            )
        entry_pos = _at(meta.positions, emitted)  # [E] the emitting token's position p = (c + 1)·r − 1
        entry_rope = (entry_pos + 1 - ratio).astype(jnp.int32)  # c·r: the entry's first position
        num_blocks = jax.tree.leaves(cache["kv"])[0].shape[0]
        _, _, blocks, offsets = compressed_slots(meta, ratio, self.block_size, num_blocks)
        slots = page_rows(
            _at(blocks, emitted, fill=num_blocks), _at(offsets, emitted), self.block_size // ratio, num_blocks
        )  # [E] flat page rows, -1 = nothing to write

        if lp.is_kv_source:
            u = x_hat
            if lp.compressor_input == "shared":
                if cross.shared_hidden is None:
                    raise ValueError(
                        f"layer {lp.layer}: the YOCO shared hidden has not been produced in this step"
                    )
                u = cross.shared_hidden
            slot = self.kv_sources.index(lp.layer)
            cache["kv"][slot], pre_rope = self._compress(
                p["attn"]["compressor"],
                lp,
                spec,
                u,
                emitted,
                entry_rope,
                slots,
                cache["kv"][slot],
                cache,
                meta,
                tile,
            )
            cross = cross._replace(emitted=emitted, pre_rope=pre_rope)

        if lp.is_index_k_source:
            if cross.pre_rope is None:
                raise ValueError(
                    f"layer {lp.layer}: no pre-RoPE compressed KV from layer {lp.kv_source} this step"
                )
            ip = p["attn"]["indexer"]
            idx = self.indexer_store

            def project(pr: jax.Array) -> jax.Array:
                # Rotation at position 0 (an exact identity) and no cast: the entry's own RoPE and the
                # indexer cast follow below, at the entry's position.
                return indexer_keys(
                    pr[:, None],
                    ip["wk"],
                    ip["k_norm"],
                    ratio=ratio,
                    eps=spec.eps,
                    rope_freqs=freqs,
                    rope_dim=spec.rope_dim,
                    cast="none",
                )[:, 0]

            def indexer_entry(pr: jax.Array, er: jax.Array) -> jax.Array:
                return idx.op_values(_rotate_at(project(pr), er, freqs, spec.rope_dim))

            ki = rowwise(indexer_entry, tile, cross.pre_rope, entry_rope)
            slot = self.index_k_sources.index(lp.layer)
            cache["ik"][slot] = get_op("kv_store_records")(
                cache["ik"][slot], ki, slots, key_format=idx.op_format
            )
        return cross, cache

    def _compress(
        self,
        cp: Params,
        lp: V41LayerPlan,
        spec: V41AttentionSpec,
        u: jax.Array,
        emitted: jax.Array,
        entry_rope: jax.Array,
        slots: jax.Array,
        pages: jax.Array,
        cache: dict[str, Any],
        meta: RaggedMeta,
        tile: int | None,
    ) -> tuple[jax.Array, jax.Array]:
        """The entries the tokens ``emitted`` complete (§7.3), rotated to ``entry_rope`` and written at ``slots``:
        ``(pages, P [E, D])`` with ``P`` the pre-RoPE normalised entries (the indexer keys' input)."""
        cmp = self.compressed_store
        freqs = spec.freqs()

        def rotated(pr: jax.Array, er: jax.Array) -> jax.Array:
            return cmp.op_values(_rotate_at(pr, er, freqs, spec.rope_dim))

        if lp.ratio == 1:

            def c1(v: jax.Array) -> jax.Array:
                # A one-token block of C1 is the token itself: compress_kv's P for a [N, 1, H] input.
                return compress_kv(
                    v[:, None],
                    cp["wkv"],
                    None,
                    cp["norm"],
                    ratio=1,
                    eps=spec.eps,
                    rope_freqs=freqs,
                    rope_dim=spec.rope_dim,
                ).pre_rope[:, 0]

            pre_rope = rowwise(c1, tile, _at(u, emitted))
            keys = rowwise(rotated, tile, pre_rope, entry_rope)
            return get_op("kv_store_records")(pages, keys, slots, key_format=cmp.op_format), pre_rope

        dense = LinearNumerics()

        def projections(v: jax.Array) -> tuple[jax.Array, jax.Array]:
            # §5.2: the C2 projections stay float32 (as compress_kv computes them).
            a = linear(v, {"weight": cp["wkv"]}, dense, out_dtype=jnp.float32)
            g = linear(v, {"weight": cp["wgate"]}, dense, out_dtype=jnp.float32)
            return a, g

        a, g = rowwise(projections, tile, u)
        slot = self.pending_sources.index(lp.layer)
        ring = cache["state"][slot]
        (pa, pg), _ = history(ring, (a, g), meta, lp.ratio, index=emitted)  # [E, r, D] each
        cache["state"][slot] = ring_write(ring, (a, g), meta, after=(pa, pg))

        if not cmp.encodes_in_ops:
            # Plain values with the mode's cast (a bfloat16 model over an unquantised cache): the cast sits between
            # the RoPE and the store, so the pooling runs here and only the write is an op.
            def pool(pa: jax.Array, pg: jax.Array) -> jax.Array:
                c = get_op("v4_compressor_pool")(pa, pg).astype(u.dtype)
                return rms_norm(c, cp["norm"], eps=spec.eps, out_dtype=u.dtype)

            pre_rope = rowwise(pool, tile, pa, pg)
            keys = rowwise(rotated, tile, pre_rope, entry_rope)
            return get_op("kv_store_records")(pages, keys, slots, key_format=None), pre_rope

        cos, sin = rope_cos_sin(entry_rope, freqs)

        def compress_store(
            pages: jax.Array, pa: jax.Array, pg: jax.Array, cs: jax.Array, sn: jax.Array, rows: jax.Array
        ) -> tuple[jax.Array, jax.Array]:
            return get_op("v4_compress_store")(
                pages,
                pa,
                pg,
                cp["norm"],
                cs,
                sn,
                rows,
                eps=spec.eps,
                rope_dim=spec.rope_dim,
                key_format=cmp.op_format,
                entry_dtype=u.dtype,
            )

        # Per-entry work runs in the same fixed tiles as per-token work in batch-invariant mode (the entry count
        # follows the step's token count, and XLA:CPU's per-row results may follow the array's size); the tiles
        # write the pages one after the other.
        return rowwise_carry(compress_store, tile, pages, pa, pg, cos, sin, slots, fills=(0, 0, 0, 0, -1))

    # -------------------------------------------------------------------------- compressed attention

    def _compressed_attention(
        self,
        p: Params,
        lp: V41LayerPlan,
        spec: V41AttentionSpec,
        x_hat: jax.Array,
        q_latent: jax.Array,
        q: jax.Array,
        window: jax.Array,
        window_present: jax.Array,
        cross: _StepCross,
        cache: dict[str, Any],
        meta: RaggedMeta,
        tile: int | None,
    ) -> tuple[jax.Array, _StepCross]:
        """Sink attention over the window (``window``: the stored keys) plus the selected (or, without an indexer,
        all visible) entries."""
        ratio = spec.ratio
        a = p["attn"]
        wnd, cmp = self.window_store, self.compressed_store
        kv_pages = cache["kv"][self.kv_sources.index(lp.kv_source)]
        scale = spec.head_dim**-0.5
        if not lp.uses_indexer:
            # index_topk = 0: every visible compressed key, one page at a time, merged with the window.
            def body(i: Any, entries: jax.Array, index: jax.Array, visible: jax.Array, state: Any) -> Any:
                keys = cmp.decode(entries, x_hat.dtype)
                return merge_softmax(state, attend_dense(q, keys, visible, scale=scale))

            state = attend_dense(q, wnd.decode(window, x_hat.dtype), window_present, scale=scale)
            state = walk_pages(kv_pages, meta, body, state, ratio=ratio, block_size=self.block_size)
            return finish_softmax(state, a["sinks"]).astype(q.dtype), cross

        if lp.is_index_source:
            cross = self._select(p, lp, spec, x_hat, q_latent, cross, cache, meta, tile)
        if cross.selection is None:
            raise ValueError(f"layer {lp.layer}: no top-k selection from layer {lp.index_source} this step")
        # The selected compressed indices [T, k] as flat rows of the KV source's pages (-1: none, padding).
        slots = entry_slots(
            cross.selection,
            meta.block_tables,
            meta.row,
            entries_per_block=self.block_size // ratio,
            valid=meta.valid,
        )
        out = get_op("v4_sparse_attention")(
            q,
            window,
            window_present,
            a["sinks"],
            kv_pages,
            slots,
            scale=scale,
            window_format=wnd.op_format,
            compressed_format=cmp.op_format,
        )
        return out, cross

    def _select(
        self,
        p: Params,
        lp: V41LayerPlan,
        spec: V41AttentionSpec,
        x_hat: jax.Array,
        q_latent: jax.Array,
        cross: _StepCross,
        cache: dict[str, Any],
        meta: RaggedMeta,
        tile: int | None,
    ) -> _StepCross:
        """An index source's ``Sel(p)`` (and the candidate source's ``Cand(p)``).

        Index sources other than the candidate source select with op ``v4_indexer_topk`` (streaming over the
        pages: no score row of the whole context); the candidate source needs the block scores of the whole row
        for ``Cand(p)``, so it scores one page at a time into ``[T, entries]`` and takes the top-k of that row.
        """
        st = self.static
        ratio, ip = spec.ratio, p["attn"]["indexer"]

        def query(ql: jax.Array, xh: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
            qi, wi = indexer_query(
                ql[None],
                xh[None],
                ip["wq_b"],
                ip["weights_proj"],
                pos[None],
                n_heads=spec.index_heads,
                rope_freqs=spec.freqs(),
                rope_dim=spec.rope_dim,
                numerics=st.numerics,
                ratio=ratio,
                cast=spec.casts.indexer,
            )
            return qi[0], wi[0]

        qi, wi = rowwise(query, tile, q_latent, x_hat, meta.positions)  # [T, Hi, Di], [T, Hi]
        idx = self.indexer_store
        pages = cache["ik"][self.index_k_sources.index(lp.index_k_source)]
        score_dtype = jnp.dtype(spec.score_dtype)

        if not lp.is_candidate_source:
            candidates, block = None, None
            if lp.is_candidate_consumer:
                if cross.candidates is None:
                    raise ValueError(
                        f"layer {lp.layer}: no candidate blocks from layer {lp.candidate_source} this step"
                    )
                assert spec.candidate_block_size is not None
                candidates, block = cross.candidates, spec.candidate_block_size
            limit = jnp.where(meta.valid, (meta.positions + 1) // ratio, 0)  # visible entries (§7.4)
            selection = get_op("v4_indexer_topk")(
                qi,
                wi,
                pages,
                meta.block_tables,
                meta.row,
                limit,
                k=spec.index_topk,
                key_format=idx.op_format,
                score_dtype=score_dtype,
                candidates=candidates,
                candidate_block_size=block,
            )
            return cross._replace(selection=selection)

        def score(entries: jax.Array) -> jax.Array:
            keys = idx.decode(entries, qi.dtype)  # [T, E, Di]
            return indexer_scores(qi[:, None], keys, wi[:, None], score_dtype=score_dtype)[:, 0]

        scores = paged_scores(pages, meta, score, ratio=ratio, block_size=self.block_size, dtype=score_dtype)
        num = scores.shape[-1]
        allowed = visible_entries(meta.positions, ratio, num) & meta.valid[:, None]
        masked = jnp.where(allowed, scores, jnp.asarray(-jnp.inf, scores.dtype))
        cross = cross._replace(selection=topk_entries(masked, spec.index_topk))
        assert spec.candidate_block_size is not None and spec.candidate_topk_blocks is not None
        cand = candidate_blocks(
            scores,
            meta.positions,
            ratio=ratio,
            block_size=spec.candidate_block_size,
            topk_blocks=spec.candidate_topk_blocks,
        )
        return cross._replace(candidates=cand)


def cache_storage(dtype: str, kv_cache_dtype: str = "auto") -> str:
    """The key storage for precision ``dtype`` and the ``kv_cache_dtype`` setting (``ValueError`` naming the
    value and the choices)."""
    return key_cache_storage("deepseek_v41", dtype, kv_cache_dtype)


def paged_model(
    model: Any,
    *,
    block_size: int,
    dtype: str,
    kv_cache_dtype: str = "auto",
    draft_tokens: int = 0,
    replay: str = "off",
    replay_keep: int = 0,
) -> V41PagedModel:
    """The engine's view of a loaded V4.1 model (``load_model``'s result); ``draft_tokens > 0`` runs its DSpark
    drafter in the step; ``replay`` / ``replay_keep`` select SWA bounded replay (``V41PagedModel``)."""
    return V41PagedModel.create(
        model,
        block_size=block_size,
        dtype=dtype,
        cache_dtype=kv_cache_dtype,
        draft_tokens=draft_tokens,
        replay=replay,
        replay_keep=replay_keep,
    )
