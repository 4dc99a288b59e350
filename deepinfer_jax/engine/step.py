"""The device side of one engine step for DeepSeek-V3: a jitted forward over a ragged batch and a paged cache.

One call of the step (ARCHITECTURE §4) takes the parameters, the paged latent cache, the per-slot device state
and the arrays of a :class:`~deepinfer_jax.engine.plan.StepPlan`, and

1. **assembles** the token ids: ``-1`` entries are replaced by the token the owning slot sampled last step
   (read from the state), so step N+1 can be dispatched before step N's tokens reach the host;
2. runs the **V3 forward** over all tokens at once -- prefill chunks and decode tokens of many sequences mixed
   in one flat batch -- writing each token's MLA latent into the paged cache at (block table, position) and
   attending blockwise over each sequence's blocks (op ``"paged_mla_attention"``);
3. records every input token in its slot's **token counts** (prompt positions flag the id, later positions
   count it as generated; a row starting at position 0 first clears its slot), so the penalties see exactly
   the tokens before the one being sampled, also after a recompute;
4. computes **logits for the sampled rows only** (the last token of each sequence row) and **samples** them
   with :func:`deepinfer_jax.sampling.sample` (temperature 0: exact argmax, lowest id on ties, no random
   numbers);
5. **advances the state**: the sampled token of each sampling row becomes its slot's ``last_token``.

Cache and state are donated, so the step updates them in place and only small per-row results (tokens,
logprobs) travel back. :class:`StepExecutor` compiles the step once per ``(tokens, sequences)`` bucket when
the bucket is first used (ahead of time, so a shape outside the compiled set fails loudly instead of
recompiling) and counts compilations and their time.

Batch-invariant mode runs every per-token computation (projections, MLP/MoE, LM head) in fixed tiles of
:data:`BATCH_INVARIANT_TILE` tokens: on XLA:CPU a float32 matmul row otherwise depends on how many rows share
the matmul, so a request's logits would change with the batch. Attention is per token already.

The MLP/MoE block is the contiguous model's own (``deepseek_v3.model.feed_forward``), so both paths share one
implementation of DeepSeekMoE.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.cache.paged import LatentCacheSpec, init_latent_cache, slot_mapping, write_tokens
from deepinfer_jax.config.v3 import DeepseekV3Config
from deepinfer_jax.engine.plan import StepPlan
from deepinfer_jax.models.common import embed_tokens, linear, lm_head
from deepinfer_jax.models.deepseek_v3 import model as v3_model
from deepinfer_jax.models.deepseek_v3.attention import mla_project
from deepinfer_jax.ops.registry import select
from deepinfer_jax.sampling import (
    SamplingTensors,
    init_token_counts,
    reset_token_counts,
    sample,
    update_token_counts,
)

__all__ = [
    "BATCH_INVARIANT_TILE",
    "PagedMeta",
    "StepExecutor",
    "StepInputs",
    "StepOutput",
    "StepState",
    "forward_paged",
    "init_state",
    "paged_decoder_layer",
    "state_bytes",
    "step",
]

Params = dict[str, Any]
_HIGHEST = jax.lax.Precision.HIGHEST

BATCH_INVARIANT_TILE = 8
"""Rows per tile of every per-token computation in batch-invariant mode (a row's matmuls then always see the
same shape, so its results are bitwise independent of the batch)."""


class StepState(NamedTuple):
    """Per-slot device state carried from step to step (donated).

    Attributes:
      last_tokens: int32 ``[num_slots]``: the token each slot sampled most recently (what a ``-1`` input
      reads).
      token_counts: int32 ``[num_slots, V]``: per-slot prompt flags and generated counts
        (:mod:`deepinfer_jax.sampling.counts`) for the repetition, presence and frequency penalties.
    """

    last_tokens: jax.Array
    token_counts: jax.Array


class StepInputs(NamedTuple):
    """The arrays of a :class:`StepPlan`, as the jitted step takes them (see the plan for their meaning)."""

    token_ids: jax.Array
    positions: jax.Array
    token_seq: jax.Array
    seq_slots: jax.Array
    query_start: jax.Array
    context_lens: jax.Array
    block_tables: jax.Array
    sample: jax.Array

    @classmethod
    def from_plan(cls, plan: StepPlan, max_blocks_per_seq: int) -> StepInputs:
        """Numpy arrays of ``plan`` with the block tables padded (``-1``) to the executor's fixed width."""
        tables = plan.block_tables
        width = tables.shape[1]
        if width > max_blocks_per_seq:
            used = tables[:, max_blocks_per_seq:]
            if np.any(used >= 0):
                raise ValueError(
                    f"StepPlan.block_tables: width {width} uses entries past max_blocks_per_seq = {max_blocks_per_seq}"
                )
            tables = tables[:, :max_blocks_per_seq]
        elif width < max_blocks_per_seq:
            tables = np.pad(tables, ((0, 0), (0, max_blocks_per_seq - width)), constant_values=-1)
        return cls(
            plan.token_ids,
            plan.positions,
            plan.token_seq,
            plan.seq_slots,
            plan.query_start,
            plan.context_lens,
            np.ascontiguousarray(tables),
            plan.sample,
        )


class StepOutput(NamedTuple):
    """What a step returns to the host: small per-row arrays only.

    Attributes:
      tokens: int32 ``[S]`` the token sampled for each row (meaningful where the plan's ``sample`` is true);
        ``-1`` where the sampler found the row's logits unusable (the host ends that request with an error).
      logprob, rank: ``[S]`` the sampled token's reported log-probability and 1-based rank.
      top_ids, top_logprobs: ``[S, n]`` the ``n`` most probable alternatives (``n = num_logprobs``).
      logits: float32 ``[S, V]`` the sampled rows' logits, only when the executor was built with
        ``return_logits=True`` (tests and debugging); otherwise ``None``.
    """

    tokens: jax.Array
    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    logits: jax.Array | None


@dataclasses.dataclass(frozen=True)
class PagedMeta:
    """Per-step addressing shared by every layer (computed once per step)."""

    blocks: jax.Array  # int32 [T] physical block of each token (num_blocks = padding, dropped)
    offsets: jax.Array  # int32 [T] row inside that block
    token_seq: jax.Array
    positions: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array


def init_state(num_slots: int, vocab_size: int) -> StepState:
    """A fresh state for ``num_slots`` state slots (slot ids as the block/slot manager hands them out)."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots: expected a positive int, got {num_slots!r}")
    return StepState(
        last_tokens=jnp.zeros((num_slots,), jnp.int32), token_counts=init_token_counts(num_slots, vocab_size)
    )


def state_bytes(num_slots: int, vocab_size: int) -> int:
    """Device bytes of :func:`init_state` (memory planning reserves them before sizing the cache)."""
    return num_slots * 4 * (1 + vocab_size)


def _rowwise(fn: Callable[..., Any], tile: int | None, *args: jax.Array) -> Any:
    """``fn(*args)`` for token-major ``args`` (leading axis ``T``), optionally in fixed tiles of rows.

    With a tile, every matmul inside ``fn`` sees the same ``[tile, ...]`` shape whatever ``T`` is, so a row's
    result does not depend on how many other tokens share the step (on XLA:CPU a float32 matmul row does
    otherwise; batch-invariant mode). ``T`` is padded up to a multiple of the tile and the padding cut off.
    """
    if tile is None:
        return fn(*args)
    tokens = args[0].shape[0]
    padded = -(-tokens // tile) * tile

    def split(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, [(0, padded - tokens)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(padded // tile, tile, *a.shape[1:])

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in args))
    return jax.tree.map(lambda a: a.reshape(padded, *a.shape[2:])[:tokens], out)


def _einsum32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """Float32 einsum. Operands are widened first: a product of two bf16 values is exact in float32, so this
    equals a bf16 x bf16 -> f32 dot, which XLA:CPU does not implement for batched dots."""
    return jnp.einsum(
        spec,
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        precision=_HIGHEST,
        preferred_element_type=jnp.float32,
    )


def paged_decoder_layer(
    x: jax.Array,
    p: Params,
    pl: v3_model.V3Plan,
    cos: jax.Array,
    sin: jax.Array,
    cache: jax.Array,
    layer: int,
    meta: PagedMeta,
    *,
    tile: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One V3 decoder layer over the flat batch ``x [T, H]``, its latents written to ``cache[layer]``.

    The same pre-norm residual block as the contiguous-cache model: ``x + attn(norm(x))`` then
    ``x + mlp(norm(x))`` (dense MLP or DeepSeekMoE), with the attention reading the paged cache through op
    ``"paged_mla_attention"``. ``cos``/``sin`` are the ``[T, R/2]`` RoPE tables of the tokens' positions. With
    ``tile``, every per-token computation runs in fixed tiles of that many tokens (:func:`_rowwise`).
    """
    cfg = pl.cfg
    rms_norm = select("rms_norm")
    eps = cfg.rms_norm_eps
    attn = p["attn"]

    def project(x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q_nope, q_pe, c, k_pe = mla_project(
            rms_norm(x, p["input_norm"], eps=eps)[None],
            attn,
            cos[None],
            sin[None],
            num_heads=cfg.num_attention_heads,
            nope_dim=cfg.qk_nope_head_dim,
            rope_dim=cfg.qk_rope_head_dim,
            kv_rank=cfg.kv_lora_rank,
            eps=eps,
            numerics=pl.numerics,
        )
        q_lat = _einsum32("thd,hdc->thc", q_nope[0], attn["w_uk"]).astype(q_nope.dtype)
        return q_lat, q_pe[0], jnp.concatenate([c[0], k_pe[0]], axis=-1)

    def finish(x: jax.Array, o_lat: jax.Array) -> jax.Array:
        out = _einsum32("thc,hvc->thv", o_lat.astype(x.dtype), attn["w_uv"])
        x = x + linear(out.reshape(1, out.shape[0], -1).astype(x.dtype), attn["o_proj"], pl.numerics)[0]
        return x + v3_model.feed_forward(rms_norm(x, p["post_attn_norm"], eps=eps)[None], p["mlp"], pl)[0]

    q_lat, q_pe, entries = _rowwise(project, tile, x, cos, sin)
    cache = write_tokens(cache, layer, entries, meta.blocks, meta.offsets)
    o_lat = select("paged_mla_attention")(
        q_lat,
        q_pe,
        cache,
        layer,
        meta.token_seq,
        meta.positions,
        meta.block_tables,
        meta.context_lens,
        scale=pl.softmax_scale,
    )
    return _rowwise(finish, tile, x, o_lat), cache


def forward_paged(
    params: Params,
    cfg: DeepseekV3Config,
    token_ids: jax.Array,
    cache: jax.Array,
    meta: PagedMeta,
    *,
    tile: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The V3 backbone over a flat ragged batch: final-norm hidden states ``[T, H]`` and the updated cache.

    ``token_ids [T]`` are concrete ids (the step has already resolved pending ``-1`` entries).
    """
    pl = v3_model.plan(cfg, jnp.dtype(params["embed"].dtype).name)
    x = embed_tokens(params["embed"], token_ids, dtype=jnp.dtype(pl.dtype))
    cos, sin = pl.cos_sin(meta.positions)
    for i, layer in enumerate(params["layers"]):
        x, cache = paged_decoder_layer(x, layer, pl, cos, sin, cache, i, meta, tile=tile)
    return select("rms_norm")(x, params["norm"], eps=cfg.rms_norm_eps), cache


def step(
    params: Params,
    cache: jax.Array,
    state: StepState,
    inputs: StepInputs,
    sampling: SamplingTensors,
    prompt_lens: jax.Array,
    *,
    cfg: DeepseekV3Config,
    num_logprobs: int = 0,
    batch_invariant: bool = False,
    return_logits: bool = False,
) -> tuple[jax.Array, StepState, StepOutput]:
    """One engine step (module docstring): ``(cache, state, StepOutput)``.

    ``sampling`` holds the ``S`` rows' sampling parameters (padding rows neutral); ``prompt_lens [S]`` each
    row's prompt length (positions below it are prompt tokens for the penalties). With ``batch_invariant``
    every per-token computation runs in tiles of :data:`BATCH_INVARIANT_TILE` rows and the sampler in its
    batch-invariant mode, so a row's logits and token are bitwise the same in any batch. ``cfg``,
    ``num_logprobs``, ``batch_invariant`` and ``return_logits`` are static under jit.
    """
    num_seqs = inputs.seq_slots.shape[0]
    num_tokens = inputs.token_ids.shape[0]
    num_slots = state.last_tokens.shape[0]
    real = inputs.token_seq < num_seqs
    row = jnp.where(real, inputs.token_seq, 0)
    slot_of_token = jnp.clip(inputs.seq_slots[row], 0, num_slots - 1)
    token_ids = jnp.where(inputs.token_ids < 0, state.last_tokens[slot_of_token], inputs.token_ids)
    token_ids = jnp.where(real, token_ids, 0)

    # Penalty statistics: every input token enters its slot's counts before the row samples.
    starts = inputs.query_start[:-1]
    first_pos = inputs.positions[jnp.clip(starts, 0, num_tokens - 1)]
    fresh = (inputs.query_start[1:] > starts) & (first_pos == 0)
    counts = reset_token_counts(state.token_counts, jnp.where(fresh, inputs.seq_slots, -1))
    token_slots = jnp.where(real, inputs.seq_slots[row], -1)
    counts = update_token_counts(counts, token_slots, token_ids, inputs.positions < prompt_lens[row])

    blocks, offsets = slot_mapping(
        inputs.block_tables, inputs.token_seq, inputs.positions, cache.shape[2], cache.shape[1]
    )
    meta = PagedMeta(
        blocks, offsets, inputs.token_seq, inputs.positions, inputs.block_tables, inputs.context_lens
    )
    tile = BATCH_INVARIANT_TILE if batch_invariant else None
    hidden, cache = forward_paged(params, cfg, token_ids, cache, meta, tile=tile)
    last = jnp.clip(inputs.query_start[1:] - 1, 0, num_tokens - 1)
    logits = _rowwise(lambda h: lm_head(h, params["lm_head"]), tile, hidden[last])  # [S, V] float32
    row_counts = counts[jnp.clip(inputs.seq_slots, 0, num_slots - 1)]
    out = sample(logits, sampling, row_counts, num_logprobs=num_logprobs, batch_invariant=batch_invariant)
    writes = inputs.sample & (inputs.seq_slots >= 0)
    target = jnp.where(writes, inputs.seq_slots, num_slots)
    last_tokens = state.last_tokens.at[target].set(jnp.where(out.ok, out.tokens, 0), mode="drop")
    tokens = jnp.where(out.ok, out.tokens, -1).astype(jnp.int32)
    result = StepOutput(
        tokens, out.logprob, out.rank, out.top_ids, out.top_logprobs, logits if return_logits else None
    )
    return cache, StepState(last_tokens, counts), result


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=getattr(x, "sharding", None))


class StepExecutor:
    """Runs :func:`step` for one model and one cache, compiling each ``(T, S)`` bucket once, on first use.

    Holds the device cache and state between calls (they are donated to every step and replaced by its
    outputs). :meth:`run` dispatches a step and returns its :class:`StepOutput` without waiting for it, so the
    caller can build and dispatch the next step before reading this one's tokens.

    Attributes:
      compile_count: compilations done so far (one per bucket used).
      compile_seconds: total wall time spent compiling.
    """

    def __init__(
        self,
        params: Params,
        cfg: DeepseekV3Config,
        spec: LatentCacheSpec,
        *,
        num_slots: int,
        max_blocks_per_seq: int,
        return_logits: bool = False,
        batch_invariant: bool = False,
        cache_sharding: Any = None,
    ) -> None:
        if cfg.num_layers_total != spec.num_layers:
            raise ValueError(
                f"cache spec: num_layers = {spec.num_layers} but the model caches {cfg.num_layers_total} layers"
            )
        if (
            isinstance(max_blocks_per_seq, bool)
            or not isinstance(max_blocks_per_seq, int)
            or max_blocks_per_seq < 1
        ):
            raise ValueError(f"max_blocks_per_seq: expected a positive int, got {max_blocks_per_seq!r}")
        self.params = params
        self.cfg = cfg
        self.spec = spec
        self.max_blocks_per_seq = max_blocks_per_seq
        self.cache = init_latent_cache(spec, cache_sharding)
        self.vocab_size = int(cfg.vocab_size)
        self.state = init_state(num_slots, self.vocab_size)
        self._jitted = jax.jit(
            step,
            static_argnames=("cfg", "num_logprobs", "batch_invariant", "return_logits"),
            donate_argnums=(1, 2),
        )
        self._return_logits = bool(return_logits)
        self._batch_invariant = bool(batch_invariant)
        self._compiled: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()
        self.compile_count = 0
        self.compile_seconds = 0.0

    @property
    def compiled_buckets(self) -> tuple[tuple[int, int], ...]:
        """The ``(T, S)`` buckets compiled so far (a bucket may have variants by mask width and logprobs)."""
        return tuple(sorted({key[:2] for key in self._compiled}))

    def _executable(self, args: tuple[Any, ...], num_logprobs: int) -> Any:
        inputs, sampling = args[0], args[1]
        key = (
            int(inputs.token_ids.shape[0]),
            int(inputs.seq_slots.shape[0]),
            int(sampling.masked_ids.shape[1]),
            num_logprobs,
        )
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                start = time.perf_counter()
                fn = self._jitted.lower(
                    self.params,
                    _struct(self.cache),
                    jax.tree.map(_struct, self.state),
                    *jax.tree.map(_struct, args),
                    cfg=self.cfg,
                    num_logprobs=num_logprobs,
                    batch_invariant=self._batch_invariant,
                    return_logits=self._return_logits,
                ).compile()
                self.compile_seconds += time.perf_counter() - start
                self.compile_count += 1
                self._compiled[key] = fn
        return fn

    def run(
        self,
        plan: StepPlan,
        sampling: SamplingTensors | None = None,
        prompt_lens: np.ndarray | None = None,
        *,
        num_logprobs: int = 0,
    ) -> StepOutput:
        """Dispatch one step for ``plan``; returns its (not yet materialised) outputs.

        ``sampling`` defaults to greedy rows; ``prompt_lens`` (int32 ``[S]``) defaults to the context lengths
        (every input token counts as prompt for the penalties). ``num_logprobs`` is the number of top
        alternatives to report (each distinct value is its own compiled variant: round it to a few values).
        """
        num_rows = plan.padded_seqs
        if sampling is None:
            sampling = SamplingTensors.build([], [], [], self.vocab_size, num_rows=num_rows)
        if sampling.num_rows != num_rows:
            raise ValueError(f"sampling: {sampling.num_rows} rows, but the plan has S = {num_rows}")
        if prompt_lens is None:
            prompt_lens = plan.context_lens
        prompt_lens = np.asarray(prompt_lens, np.int32)
        if prompt_lens.shape != (num_rows,):
            raise ValueError(f"prompt_lens: shape {prompt_lens.shape}, expected ({num_rows},)")
        args = (StepInputs.from_plan(plan, self.max_blocks_per_seq), sampling, prompt_lens)
        fn = self._executable(args, int(num_logprobs))
        self.cache, self.state, out = fn(self.params, self.cache, self.state, *args)
        return out

    def reset_state(self) -> None:
        """Zero the per-slot state; the cache needs no reset (every read is preceded by its write)."""
        self.state = init_state(int(self.state.last_tokens.shape[0]), self.vocab_size)
