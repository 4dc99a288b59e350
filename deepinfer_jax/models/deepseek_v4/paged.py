"""DeepSeek-V4 in the engine: the layers of one step over a flat ragged batch, paged entries and state slots.

The V4 model (:mod:`deepinfer_jax.models.deepseek_v4`) keeps, per layer, a window of the last ``W`` keys and,
in compressed layers, one entry per ``r`` tokens (``r = 4`` with the lightning indexer for CSA, ``r = 16``/128
for HCA). Its stateful ``forward_chunk`` holds them per batch row; the engine holds them per sequence, in the
layout of ``spec/engine.md`` §6.3:

* **paged blocks** -- every compressed layer's entries (``block_size / r`` per block and layer) and, for CSA
  layers, the indexer keys; entry ``c`` of a sequence lives at ``block_tables[row, c·r // block]``, offset
  ``(c·r % block) // r`` (:mod:`deepinfer_jax.cache.ragged`);
* **state slots** -- per layer the window ring (``W`` keys, position ``q`` at ``q % W``) and, per compressed
  layer, the compression state: rings of the projections (``kv`` and the gate logits without ``ape``, float32)
  of the last ``r`` tokens (HCA) or ``2r`` tokens (CSA, whose entries pool two overlapping windows), one for the
  attended entries and one for the indexer keys.

A layer of a step (``T`` tokens of many rows, each at its own position, prefill chunks and decode tokens mixed):

1. the mHC mixes, the attention norm and every projection, per token (in fixed tiles in batch-invariant mode);
2. the window keys of each token from this step's keys or the slot's ring
   (:func:`~deepinfer_jax.cache.ragged.history`), then the ring update;
3. compressed layers: the tokens that complete an entry (``(p + 1) % r == 0``, at most ``T // r + S`` of them)
   gather the ``r``/``2r`` projections they pool (:func:`~deepinfer_jax.cache.ragged.history` with ``index=``), and
   op ``v4_compress_store`` pools them, normalises, rotates the entry to its first position, encodes it and writes
   it at its flat page row -- before any query reads, so later tokens of the same step (and the emitting token
   itself) see it, as in the contiguous model;
4. attention with sinks: window-only and CSA layers through op ``v4_sparse_attention`` over the stored window keys
   and, for CSA, the lightning indexer's top-k (op ``v4_indexer_topk`` over the stored indexer keys, streaming over
   the pages; :func:`~deepinfer_jax.ops.sparse_attention.entry_slots` turns the selection into page rows); HCA
   layers as one online softmax over the window and every visible entry, walked page by page
   (:func:`~deepinfer_jax.cache.paged_walk.paged_attend_all`);
5. de-rotation, the grouped output projection, mHC, and the (hash- or score-routed) MoE of the model itself
   (``moe_layer`` on a ``[1, T, H]`` view).

Temporary memory per layer scales with the step's tokens times what each reads (``W`` window keys, ``k``
selected entries, one page while walking or scoring) plus the indexer's running top-k and one scored chunk,
never with the cache.

**Cache formats.** ``cache_dtype="float32"`` / ``"bfloat16"`` store keys unquantised in that dtype (the mode's
own round trips applied first). ``cache_dtype="quantized"`` stores the production records as bytes
(:mod:`deepinfer_jax.numerics.kv_records`): MXFP8 window keys, FP4 (E2M1 + E4M3 per 16) compressed entries and
MXFP4 indexer keys; every reader, the step that wrote a key included, sees its decoded value, which is the
round trip the bfloat16 model applies (spec §12.4). Compression state is float32 in every mode. The ops read and
write the keys in their stored format (``KeyStore.op_format``); unquantised keys with the bfloat16 mode's cache
casts are pooled and cast here and only written by an op (``kv_store_records``), since ``v4_compress_store``
cannot apply a cast between its RoPE and its write.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.cache import paged_walk as pw
from deepinfer_jax.cache.ragged import (
    RaggedMeta,
    compressed_slots,
    history,
    page_rows,
    ring_write,
    rowwise_meta,
)
from deepinfer_jax.cache.stores import CompressedCache, KeyStore, key_cache_storage, key_store
from deepinfer_jax.config.v4 import DeepseekV4Config
from deepinfer_jax.models.common.embedding import embed_tokens, lm_head
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.deepseek_v4.attention import (
    CSA,
    SLIDING,
    AttentionSpec,
    grouped_output_projection,
    project_attention,
)
from deepinfer_jax.models.deepseek_v4.mhc import hc_collapse, hc_expand, hc_head, hc_mixes
from deepinfer_jax.models.deepseek_v4.model import V4Plan, moe_layer, numerics_for
from deepinfer_jax.models.paged import CacheLayout, PagedModel
from deepinfer_jax.ops import apply_rope, rms_norm, rope_cos_sin
from deepinfer_jax.ops import get as get_op
from deepinfer_jax.ops.sparse_attention import entry_slots
from deepinfer_jax.ops.tiling import rowwise

__all__ = ["V4PagedModel", "cache_storage", "paged_model"]

Params = Mapping[str, Any]


def _compressor_feats(spec: AttentionSpec, width: int) -> tuple[int, int]:
    """``(ring length, features)`` of a compressor's projection ring: CSA pools ``2r`` positions of ``2W``."""
    if spec.kind == CSA:
        return 2 * spec.ratio, 2 * width
    return spec.ratio, width


@dataclasses.dataclass(frozen=True)
class V4PagedModel(PagedModel):
    """DeepSeek-V4 over paged compressed entries and per-sequence state slots (module docstring).

    Build it with :meth:`create`. Frozen and hashable: the engine passes it to the jitted step as a static
    argument. Its cache is a :class:`~deepinfer_jax.cache.stores.CompressedCache`: every layer's window ring,
    the pages of every compressed layer (``kv``) and of every CSA layer's indexer (``ik``), and the projection
    rings of every compressor (``state``: each compressed layer's, then each CSA layer's indexer compressor).

    Attributes:
      cfg: the model's :class:`~deepinfer_jax.config.v4.DeepseekV4Config`.
      plan: the :class:`~deepinfer_jax.models.deepseek_v4.model.V4Plan` of the precision mode.
      numerics: its linear numerics.
      block_size: tokens per cache block (every compression ratio divides it).
      cache_dtype: ``"float32"``, ``"bfloat16"`` (unquantised keys) or ``"quantized"`` (production records).
      window, compressed, indexer: how each kind of key is stored (:class:`KeyStore`).
      walk_chunk: block-table columns per iteration of the page walks.
    """

    cfg: DeepseekV4Config
    plan: V4Plan
    numerics: LinearNumerics
    block_size: int
    cache_dtype: str
    window: KeyStore
    compressed: KeyStore
    indexer: KeyStore
    walk_chunk: int = 1

    @classmethod
    def create(cls, model: Any, *, block_size: int, dtype: str, cache_dtype: str) -> V4PagedModel:
        """The engine's view of a loaded V4 model (``load_model``'s result) in precision mode ``dtype``.

        Refuses a ``block_size`` that a layer's compression ratio does not divide and a ``cache_dtype``
        outside ``("auto", "float32", "bfloat16", "quantized")``.
        """
        cfg = model.config
        if not isinstance(cfg, DeepseekV4Config):
            raise TypeError(f"model.config: expected a DeepseekV4Config, got {type(cfg).__name__}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: {dtype!r} is not a precision mode; expected 'float32' or 'bfloat16'")
        cache_dtype = key_cache_storage("deepseek_v4", dtype, cache_dtype)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected an int >= 1, got {block_size!r}")
        plan = V4Plan.from_config(cfg, dtype)
        casts = plan.casts
        head_dim = cfg.head_dim
        index_dim = cfg.index_head_dim or 0
        if cache_dtype == "quantized":
            for field, width, group in (("head_dim", head_dim, 32), ("index_head_dim", index_dim, 32)):
                if width % group:
                    raise ValueError(
                        f"{field} = {width}: the production cache records quantise groups of {group} values; "
                        f"use kv_cache_dtype='float32' for this model"
                    )
        store = functools.partial(key_store, cache_dtype=cache_dtype)
        model_obj = cls(
            cfg=cfg,
            plan=plan,
            numerics=numerics_for(cfg, dtype),
            block_size=block_size,
            cache_dtype=cache_dtype,
            window=store("window", head_dim, cast=casts.window_keys),
            compressed=store("compressed", head_dim, cast=casts.compressed_keys),
            # A model without CSA layers stores no indexer keys; the placeholder is never read.
            indexer=store("indexer", index_dim, cast=casts.indexer) if index_dim else KeyStore(0, "float32"),
        )
        model_obj.check_block_size(block_size)
        return model_obj

    # ------------------------------------------------------------------------------------------ layout

    @property
    def vocab_size(self) -> int:
        return int(self.plan.vocab_size)

    def check_block_size(self, block_size: int) -> None:
        """A block holds whole compressed entries of every layer: each compression ratio must divide it."""
        for i, spec in enumerate(self.plan.attention):
            if spec.ratio and block_size % spec.ratio:
                raise ValueError(
                    f"cache.block_size = {block_size}: layer {i} ({spec.kind}) has compression ratio "
                    f"{spec.ratio}, which does not divide it; use a multiple of {spec.ratio}"
                )

    @functools.cached_property
    def slots(self) -> tuple[tuple[int, int, int, int], ...]:
        """Per layer, where its parts of the :class:`CompressedCache` are: ``(kv page index, indexer page index,
        compressor ring index, indexer compressor ring index)``, ``-1`` where the layer has none."""
        compressed = [i for i, s in enumerate(self.plan.attention) if s.kind != SLIDING]
        sparse = [i for i, s in enumerate(self.plan.attention) if s.kind == CSA]
        return tuple(
            (
                compressed.index(i) if i in compressed else -1,
                sparse.index(i) if i in sparse else -1,
                compressed.index(i) if i in compressed else -1,
                len(compressed) + sparse.index(i) if i in sparse else -1,
            )
            for i in range(len(self.plan.attention))
        )

    def _layer_bytes(self, spec: AttentionSpec) -> tuple[int, int]:
        """``(bytes per block, bytes per slot)`` of one layer."""
        per_slot = spec.window * self.window.item_bytes
        per_block = 0
        if spec.kind != SLIDING:
            entries = self.block_size // spec.ratio
            ring, feats = _compressor_feats(spec, spec.head_dim)
            per_slot += 2 * ring * feats * 4
            per_block += entries * self.compressed.item_bytes
            if spec.kind == CSA:
                ring, feats = _compressor_feats(spec, spec.index_dim)
                per_slot += 2 * ring * feats * 4
                per_block += entries * self.indexer.item_bytes
        return per_block, per_slot

    def layout(self) -> CacheLayout:
        per_block = per_slot = 0
        lines = []
        kinds: dict[tuple[str, int], int] = {}
        for spec in self.plan.attention:
            b, s = self._layer_bytes(spec)
            per_block += b
            per_slot += s
            kinds[(spec.kind, spec.ratio)] = kinds.get((spec.kind, spec.ratio), 0) + 1
        for (kind, ratio), count in kinds.items():
            spec = next(s for s in self.plan.attention if (s.kind, s.ratio) == (kind, ratio))
            b, s = self._layer_bytes(spec)
            text = f"{kind}" + (f" (ratio {ratio})" if ratio else "") + f" x {count}, per layer: window "
            text += f"{spec.window} keys x {self.window.describe()}"
            if kind != SLIDING:
                ring, feats = _compressor_feats(spec, spec.head_dim)
                text += f" + compression state {ring} x 2 x {feats} float32"
                if kind == CSA:
                    ring, feats = _compressor_feats(spec, spec.index_dim)
                    text += f" + indexer state {ring} x 2 x {feats} float32"
            text += f" = {s} B per slot"
            if kind != SLIDING:
                text += f"; {self.block_size // ratio} entries per block x ({self.compressed.describe()}"
                if kind == CSA:
                    text += f" + indexer key {self.indexer.describe()}"
                text += f") = {b} B per block"
            lines.append(text)
        storage = (
            "MXFP8 window, FP4 compressed, MXFP4 indexer"
            if self.cache_dtype == "quantized"
            else self.cache_dtype
        )
        return CacheLayout(
            block_size=self.block_size,
            bytes_per_block=per_block,
            bytes_per_slot=per_slot,
            dtype=storage,
            lines=tuple(lines),
        )

    def init_cache(self, num_blocks: int, num_slots: int) -> CompressedCache:
        """A zeroed :class:`CompressedCache`: window rings ``[num_slots, W, ...]``, pages ``[num_blocks, block / r,
        ...]`` and compressor rings ``[num_slots, R, F]`` (float32)."""
        specs = self.plan.attention
        compressed = [s for s in specs if s.kind != SLIDING]
        sparse = [s for s in specs if s.kind == CSA]

        def rings(spec: AttentionSpec, width: int) -> tuple[jax.Array, jax.Array]:
            ring, feats = _compressor_feats(spec, width)
            return tuple(jnp.zeros((num_slots, ring, feats), jnp.float32) for _ in range(2))

        return CompressedCache(
            window=tuple(self.window.zeros(num_slots, s.window) for s in specs),
            kv=tuple(self.compressed.zeros(num_blocks, self.block_size // s.ratio) for s in compressed),
            ik=tuple(self.indexer.zeros(num_blocks, self.block_size // s.ratio) for s in sparse),
            state=tuple(rings(s, s.head_dim) for s in compressed)
            + tuple(rings(s, s.index_dim) for s in sparse),
        )

    # ------------------------------------------------------------------------------------------ forward

    def forward(
        self,
        params: Any,
        cache: CompressedCache,
        token_ids: jax.Array,
        meta: RaggedMeta,
        *,
        tile: int | None,
        logit_index: jax.Array | None = None,
    ) -> tuple[jax.Array, CompressedCache]:
        """Float32 logits of the tokens ``logit_index`` (default each row's last token) and the updated cache."""
        plan = self.plan
        if len(cache.window) != plan.num_layers:
            raise ValueError(f"cache: {len(cache.window)} layers, the model has {plan.num_layers}")
        act = jnp.dtype(plan.dtype)
        x = embed_tokens(params["embed"], token_ids, dtype=act)  # [T, H]
        streams = jnp.broadcast_to(x[:, None, :], (x.shape[0], plan.hc_mult, x.shape[-1]))
        parts = {name: list(getattr(cache, name)) for name in ("window", "kv", "ik", "state")}
        for i, (spec, lp) in enumerate(zip(plan.attention, params["layers"], strict=True)):
            streams = self._layer(lp, spec, i, streams, token_ids, parts, meta, tile)

        def head(s: jax.Array) -> jax.Array:
            h = hc_head(s, **params["hc_head"], hc_eps=plan.hc_eps, norm_eps=plan.eps)
            return lm_head(rms_norm(h, params["norm"], eps=plan.eps), params["head"])

        index = meta.last_token() if logit_index is None else logit_index
        logits = rowwise(head, tile, streams[index])
        return logits.astype(jnp.float32), CompressedCache(**{k: tuple(v) for k, v in parts.items()})

    def _layer(
        self,
        lp: Params,
        spec: AttentionSpec,
        index: int,
        streams: jax.Array,
        token_ids: jax.Array,
        cache: dict[str, list[Any]],
        meta: RaggedMeta,
        tile: int | None,
    ) -> jax.Array:
        """One decoder layer over the flat batch: ``streams [T, m, H]`` in and out; the layer's parts of ``cache``
        (lists of the :class:`CompressedCache` fields) are updated in place."""
        plan, numerics = self.plan, self.numerics
        hc = {"hc_eps": plan.hc_eps, "sinkhorn_iters": plan.hc_sinkhorn_iters, "norm_eps": plan.eps}
        p = lp["attn"]
        cos, sin = rope_cos_sin(meta.positions, spec.freqs())  # [T, rope_dim / 2]
        compressed = spec.kind != SLIDING
        sparse = spec.kind == CSA
        kv_page, ik_page, ring, index_ring = self.slots[index]

        def project(streams: jax.Array, cos: jax.Array, sin: jax.Array) -> dict[str, Any]:
            mix = hc_mixes(streams, **lp["hc_attn"], **hc)
            x = rms_norm(hc_collapse(streams, mix.pre), lp["attn_norm"], eps=plan.eps)
            pr = project_attention(p, x, cos, sin, spec, numerics)
            return {"post": mix.post, "comb": mix.comb, **pr._asdict()}

        pr = rowwise(project, tile, streams, cos, sin)
        act = pr["q"].dtype

        # Window: this step's keys (as stored) or the slot's ring, for positions p - W + 1 .. p.
        stored_kv = self.window.encode(pr["kv"])
        items, present = history(cache["window"][index], stored_kv, meta, spec.window)
        cache["window"][index] = ring_write(cache["window"][index], stored_kv, meta, after=items)
        scale = spec.head_dim**-0.5

        # Compressed entries completed by this step's tokens are written before anything reads them.
        if compressed:
            cache["state"][ring], cache["kv"][kv_page] = self._compress(
                cache["state"][ring],
                cache["kv"][kv_page],
                pr["a"],
                pr["g"],
                p["compressor"],
                spec,
                meta,
                self.compressed,
                act,
            )
            if sparse:
                cache["state"][index_ring], cache["ik"][ik_page] = self._compress(
                    cache["state"][index_ring],
                    cache["ik"][ik_page],
                    pr["ia"],
                    pr["ig"],
                    p["indexer"]["compressor"],
                    spec,
                    meta,
                    self.indexer,
                    act,
                )

        def attend(m: RaggedMeta, t: dict[str, jax.Array]) -> jax.Array:
            """The read-only attention of tokens ``t``: window (stored keys), compressed entries, sinks."""
            if compressed and not sparse:
                # HCA: every visible entry, one page at a time, in the same online softmax as the window.
                state = pw.attend_dense(
                    t["q"], self.window.decode(t["items"], act), t["present"], scale=scale
                )
                state = pw.merge_softmax(
                    state,
                    pw.paged_attend_all(
                        t["q"],
                        cache["kv"][kv_page],
                        m,
                        ratio=spec.ratio,
                        block_size=self.block_size,
                        scale=scale,
                        chunk=self.walk_chunk,
                        decode=lambda e: self.compressed.decode(e, act),
                    ),
                )
                return pw.finish_softmax(state, p["sinks"]).astype(act)
            pages = slots = None
            if sparse:
                pages = cache["kv"][kv_page]
                slots = self._select(t["qi"], t["w"], cache["ik"][ik_page], spec, m)
            return get_op("v4_sparse_attention")(
                t["q"],
                t["items"],
                t["present"],
                p["sinks"],
                pages,
                slots,
                scale=scale,
                window_format=self.window.op_format,
                compressed_format=self.compressed.op_format,
            )

        token_inputs = {"q": pr["q"], "items": items, "present": present}
        if sparse:
            token_inputs.update(qi=pr["qi"], w=pr["w"])
        # Batch-invariant mode: attention in fixed tiles too (its contractions are otherwise sized by the step).
        attn = rowwise_meta(attend, tile, meta, token_inputs)

        def finish(
            streams: jax.Array,
            attn: jax.Array,
            post: jax.Array,
            comb: jax.Array,
            ids: jax.Array,
            cos: jax.Array,
            sin: jax.Array,
        ) -> jax.Array:
            out = apply_rope(attn[None], cos[None], sin[None], rope_dim=spec.rope_dim, inverse=True)
            y = grouped_output_projection(
                out, p["wo_a"], p["wo_b"], groups=spec.o_groups, rank=spec.o_rank, numerics=numerics
            )[0]
            streams = hc_expand(streams, y, post, comb)
            mix = hc_mixes(streams, **lp["hc_ffn"], **hc)
            xn = rms_norm(hc_collapse(streams, mix.pre), lp["ffn_norm"], eps=plan.eps)
            f = moe_layer(
                lp["ffn"], xn[None], ids[None], plan, numerics, hashed=plan.mlp_types[index] == "hash_moe"
            )[0]
            return hc_expand(streams, f, mix.post, mix.comb)

        return rowwise(finish, tile, streams, attn, pr["post"], pr["comb"], token_ids, cos, sin)

    def _compress(
        self,
        rings: tuple[jax.Array, jax.Array],
        pages: jax.Array,
        kv: jax.Array,
        gate: jax.Array,
        cp: Params,
        spec: AttentionSpec,
        meta: RaggedMeta,
        store: KeyStore,
        act: Any,
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """Emit this step's complete entries of one compressor into ``pages``; advance its projection rings.

        ``kv``/``gate`` ``[T, F]`` are the step's float32 projections (gate without ``ape``). Only the tokens
        that complete an entry gather the positions it pools: HCA the ``r`` positions of its window, CSA the
        ``2r`` of the previous and its own window, the previous one through its first ``W`` channels (the
        ``Ca`` series) and its own through the last ``W`` (``Cb``). Positions before 0 get weight 0 (the first
        CSA entry has no predecessor). Pooled in float32, rounded to the activation dtype, RMS-normalised,
        rotated by the compress RoPE to the window's first position and stored in ``store``'s format.
        """
        ratio = spec.ratio
        kv_ring, gate_ring = rings
        depth, feats = kv_ring.shape[1], kv_ring.shape[2]
        width = feats // 2 if spec.kind == CSA else feats
        emitters = pw.emitting_tokens(meta, ratio)  # [E]
        (hk, hg), present = history((kv_ring, gate_ring), (kv, gate), meta, depth, index=emitters)
        # The first pooled position is a multiple of r, so the slot of position j within its window is j % r.
        ape = jnp.tile(cp["ape"].astype(jnp.float32), (depth // ratio, 1))  # [depth, F]
        hg = jnp.where(present[..., None], hg + ape, -jnp.inf)
        if spec.kind == CSA:
            hk = jnp.concatenate([hk[:, :ratio, :width], hk[:, ratio:, width:]], axis=1)
            hg = jnp.concatenate([hg[:, :ratio, :width], hg[:, ratio:, width:]], axis=1)
        # Padding emitters have no position at all: give them finite gates so no NaN is ever computed.
        hg = jnp.where(jnp.any(present, axis=1)[:, None, None], hg, 0.0)
        safe = jnp.clip(emitters, 0, meta.num_tokens - 1)
        first = ((meta.positions[safe] + 1) // ratio - 1) * ratio
        cos, sin = rope_cos_sin(first, spec.freqs())
        num_blocks = pages.shape[0]
        _, _, blocks, offsets = compressed_slots(meta, ratio, self.block_size, num_blocks)
        slots = page_rows(
            blocks.at[emitters].get(mode="fill", fill_value=num_blocks),
            offsets.at[emitters].get(mode="fill", fill_value=0),
            self.block_size // ratio,
            num_blocks,
        )  # [E] flat page rows, -1 = nothing to write
        if store.encodes_in_ops:
            pages, _ = get_op("v4_compress_store")(
                pages,
                hk,
                hg,
                cp["norm"],
                cos,
                sin,
                slots,
                eps=spec.eps,
                rope_dim=spec.rope_dim,
                key_format=store.op_format,
                entry_dtype=act,
            )
        else:
            # Plain values with the mode's cast (a bfloat16 model over an unquantised cache): the cast sits
            # between the RoPE and the store, so the pooling runs here and only the write is an op.
            pooled = get_op("v4_compressor_pool")(hk, hg).astype(act)  # [E, W]
            normed = rms_norm(pooled, cp["norm"], eps=spec.eps)
            entries = store.op_values(apply_rope(normed, cos, sin, rope_dim=spec.rope_dim))
            pages = get_op("kv_store_records")(pages, entries, slots, key_format=None)
        rings = ring_write((kv_ring, gate_ring), (kv, gate), meta, after=(hk, hg))
        return rings, pages

    def _select(
        self,
        qi: jax.Array,
        weights: jax.Array,
        index_pages: jax.Array,
        spec: AttentionSpec,
        meta: RaggedMeta,
    ) -> jax.Array:
        """CSA: the lightning indexer's ``index_topk`` entries of each token as flat rows of the layer's pages.

        Op ``v4_indexer_topk`` scores the indexer keys in their stored format, streaming over the pages (scores
        materialised in the mode's score dtype, ties to the lower entry); :func:`entry_slots` turns the selected
        compressed indices into page rows (``-1``: none), which ``v4_sparse_attention`` reads directly.
        """
        limit = jnp.where(meta.valid, (meta.positions + 1) // spec.ratio, 0)  # visible entries
        index = get_op("v4_indexer_topk")(
            qi,
            weights,
            index_pages,
            meta.block_tables,
            meta.row,
            limit,
            k=spec.index_topk,
            key_format=self.indexer.op_format,
            score_dtype=spec.score_dtype,
        )
        return entry_slots(
            index,
            meta.block_tables,
            meta.row,
            entries_per_block=self.block_size // spec.ratio,
            valid=meta.valid,
        )


def cache_storage(dtype: str, kv_cache_dtype: str = "auto") -> str:
    """The key storage for precision ``dtype`` and the ``kv_cache_dtype`` setting (``ValueError`` naming the
    value and the choices)."""
    return key_cache_storage("deepseek_v4", dtype, kv_cache_dtype)


def paged_model(
    model: Any, *, block_size: int, dtype: str, kv_cache_dtype: str = "auto", draft_tokens: int = 0
) -> V4PagedModel:
    """The engine's view of a loaded V4 model (``load_model``'s result); it does not draft (``draft_tokens``
    must be 0)."""
    if draft_tokens:
        raise ValueError(f"speculative.num_draft_tokens = {draft_tokens}: the V4 paged model has no drafter")
    return V4PagedModel.create(model, block_size=block_size, dtype=dtype, cache_dtype=kv_cache_dtype)
