"""The device side of one engine step: a jitted forward over a ragged batch and paged caches, then sampling.

One call of the step (ARCHITECTURE §4) takes the parameters, the model's caches, the per-slot sampling state
and the arrays of a :class:`~deepinfer_jax.engine.plan.StepPlan`, and

1. **assembles** the token ids: ``-1`` entries are replaced by the token the owning slot sampled last step
   (read from the state), so step N+1 can be dispatched before step N's tokens reach the host;
2. runs the **model** over all tokens at once -- prefill chunks and decode tokens of many sequences mixed in
   one flat batch -- through the family's :class:`~deepinfer_jax.engine.paged_model.PagedModel` (DeepSeek-V3:
   paged latent cache, ``engine/paged_v3.py``; V4 and V4.1: paged compressed entries plus window rings and
   compression state in state slots), which returns the logits of each row's last token;
3. records every input token in its slot's **token counts** (prompt positions flag the id, later positions
   count it as generated; a row starting at position 0 first clears its slot), so the penalties see exactly
   the tokens before the one being sampled, also after a recompute;
4. **samples** the rows with :func:`deepinfer_jax.sampling.sample` (temperature 0: exact argmax, lowest id on
   ties, no random numbers);
5. **advances the state**: the sampled token of each sampling row becomes its slot's ``last_token``.

Cache and state are donated, so the step updates them in place and only small per-row results (tokens,
logprobs) travel back. :class:`StepExecutor` compiles the step once per ``(tokens, sequences)`` bucket when
the bucket is first used (ahead of time, so a shape outside the compiled set fails loudly instead of
recompiling) and counts compilations and their time.

Batch-invariant mode runs every per-token computation (projections, MLP/MoE, LM head) in fixed tiles of
:data:`~deepinfer_jax.engine.paged_model.BATCH_INVARIANT_TILE` tokens: on XLA:CPU a float32 matmul row
otherwise depends on how many rows share the matmul, so a request's logits would change with the batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.cache.ragged import make_meta
from deepinfer_jax.engine.paged_model import BATCH_INVARIANT_TILE, PagedModel
from deepinfer_jax.engine.plan import StepPlan
from deepinfer_jax.sampling import (
    SamplingTensors,
    init_token_counts,
    reset_token_counts,
    sample,
    token_logprobs,
    update_token_counts,
)

__all__ = [
    "BATCH_INVARIANT_TILE",
    "CompiledStep",
    "PromptLogprobs",
    "StepExecutor",
    "StepInputs",
    "StepOutput",
    "StepState",
    "init_state",
    "prompt_logprobs",
    "state_bytes",
    "step",
]

Params = dict[str, Any]


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
      prompt: per-token prompt logprobs (:class:`PromptLogprobs`) when the step was run with
        ``num_prompt_logprobs >= 0``; otherwise ``None``.
    """

    tokens: jax.Array
    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    logits: jax.Array | None
    prompt: PromptLogprobs | None = None


class PromptLogprobs(NamedTuple):
    """Log-probabilities of the *next* prompt token at every token of a step (prompt logprobs).

    Token ``t`` of the step, at position ``p``, predicts position ``p + 1``. The host names the prompt token
    at ``p + 1`` in ``prompt_targets [T]`` (``-1`` where there is none: outputs, the prompt's last token,
    requests that did not ask); this reports, from the model's raw logits (log-softmax before any penalty,
    mask or temperature, as vLLM reports prompt logprobs):

    Attributes:
      logprob, rank: ``[T]`` the target's log-probability and 1-based rank (0 where there is no target).
      top_ids, top_logprobs: ``[T, n]`` the ``n`` most probable tokens (ties: lower id first).
    """

    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def prompt_logprobs(
    logits: jax.Array, targets: jax.Array, num_top: int, *, batch_invariant: bool = False
) -> PromptLogprobs:
    """:class:`PromptLogprobs` of float32 ``logits [T, V]`` for ``targets [T]`` (``-1`` = none), through the
    sampler's :func:`~deepinfer_jax.sampling.token_logprobs` (ranks and ties as for sampled tokens)."""
    has = targets >= 0
    lp = token_logprobs(
        logits, jnp.where(has, targets, 0), num_logprobs=num_top, batch_invariant=batch_invariant
    )
    return PromptLogprobs(
        jnp.where(has, lp.logprob, 0.0),
        jnp.where(has, lp.rank, 0).astype(jnp.int32),
        lp.top_ids.astype(jnp.int32),
        lp.top_logprobs,
    )


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


def step(
    params: Params,
    cache: Any,
    state: StepState,
    inputs: StepInputs,
    sampling: SamplingTensors,
    prompt_lens: jax.Array,
    prompt_targets: jax.Array | None = None,
    *,
    model: PagedModel,
    num_logprobs: int = 0,
    num_prompt_logprobs: int = -1,
    batch_invariant: bool = False,
    return_logits: bool = False,
) -> tuple[Any, StepState, StepOutput]:
    """One engine step (module docstring): ``(cache, state, StepOutput)``.

    ``sampling`` holds the ``S`` rows' sampling parameters (padding rows neutral); ``prompt_lens [S]`` each
    row's prompt length (positions below it are prompt tokens for the penalties). With ``batch_invariant``
    every per-token computation runs in tiles of :data:`BATCH_INVARIANT_TILE` rows and the sampler in its
    batch-invariant mode, so a row's logits and token are bitwise the same in any batch. With
    ``num_prompt_logprobs >= 0`` the model returns the logits of every token and the step reports
    :class:`PromptLogprobs` for ``prompt_targets [T]`` with that many alternatives. ``model``,
    ``num_logprobs``, ``num_prompt_logprobs``, ``batch_invariant`` and ``return_logits`` are static under jit.
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

    meta = make_meta(
        inputs.token_seq,
        inputs.positions,
        inputs.query_start,
        inputs.context_lens,
        inputs.seq_slots,
        inputs.block_tables,
    )
    tile = BATCH_INVARIANT_TILE if batch_invariant else None
    prompt_out = None
    if num_prompt_logprobs >= 0:
        if prompt_targets is None:
            raise ValueError("step: num_prompt_logprobs >= 0 needs prompt_targets [T]")
        every = jnp.arange(num_tokens, dtype=jnp.int32)
        all_logits, cache = model.forward(params, cache, token_ids, meta, tile=tile, logit_index=every)
        prompt_out = prompt_logprobs(
            all_logits, prompt_targets, num_prompt_logprobs, batch_invariant=batch_invariant
        )
        logits = all_logits[meta.last_token()]
    else:
        logits, cache = model.forward(params, cache, token_ids, meta, tile=tile)  # [S, V] float32
    row_counts = counts[jnp.clip(inputs.seq_slots, 0, num_slots - 1)]
    out = sample(logits, sampling, row_counts, num_logprobs=num_logprobs, batch_invariant=batch_invariant)
    writes = inputs.sample & (inputs.seq_slots >= 0)
    target = jnp.where(writes, inputs.seq_slots, num_slots)
    last_tokens = state.last_tokens.at[target].set(jnp.where(out.ok, out.tokens, 0), mode="drop")
    tokens = jnp.where(out.ok, out.tokens, -1).astype(jnp.int32)
    result = StepOutput(
        tokens,
        out.logprob,
        out.rank,
        out.top_ids,
        out.top_logprobs,
        logits if return_logits else None,
        prompt_out,
    )
    return cache, StepState(last_tokens, counts), result


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=getattr(x, "sharding", None))


class CompiledStep:
    """What every step executor shares: the checked sizes, the jitted step and its ahead-of-time variants.

    ``step_fn`` is :func:`step` or a wrapper with the same arguments (the mesh step); ``static`` adds its own
    static keyword arguments (``model`` is always one). The variant key is ``(T, S, mask width, num_logprobs,
    prompt-logprob width)``, read at axis ``lead`` of the inputs (1 when they carry a leading device axis). A
    shape outside the compiled set compiles once, counted, instead of recompiling silently. Subclasses create
    ``self.cache`` and ``self.state`` and dispatch through :meth:`_dispatch`.

    Attributes:
      compile_count: compilations done so far (one per variant used).
      compile_seconds: total wall time spent compiling.
    """

    cache: Any
    state: Any

    def __init__(
        self,
        step_fn: Callable[..., Any],
        params: Params,
        model: PagedModel,
        *,
        num_blocks: int,
        num_slots: int,
        max_blocks_per_seq: int,
        return_logits: bool,
        batch_invariant: bool,
        static: dict[str, Any] | None = None,
        lead: int = 0,
    ) -> None:
        if not isinstance(model, PagedModel):
            raise TypeError(f"model: expected a PagedModel, got {type(model).__name__}")
        for name, value, low in (
            ("max_blocks_per_seq", max_blocks_per_seq, 1),
            ("num_blocks", num_blocks, 2),
            ("num_slots", num_slots, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        self.params = params
        self.model = model
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = max_blocks_per_seq
        self.vocab_size = int(model.vocab_size)
        self._static = {"model": model, **(static or {})}
        self._lead = lead
        self._jitted = jax.jit(
            step_fn,
            static_argnames=(
                *self._static,
                "num_logprobs",
                "num_prompt_logprobs",
                "batch_invariant",
                "return_logits",
            ),
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

    def _executable(self, args: tuple[Any, ...], num_logprobs: int, num_prompt_logprobs: int) -> Any:
        inputs, sampling = args[0], args[1]
        lead = self._lead
        key = (
            int(inputs.token_ids.shape[lead]),
            int(inputs.seq_slots.shape[lead]),
            int(sampling.masked_ids.shape[lead + 1]),
            num_logprobs,
            num_prompt_logprobs,
        )
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                start = time.perf_counter()
                fn = self._jitted.lower(
                    self.params,
                    jax.tree.map(_struct, self.cache),
                    jax.tree.map(_struct, self.state),
                    *jax.tree.map(_struct, args),
                    **self._static,
                    num_logprobs=num_logprobs,
                    num_prompt_logprobs=num_prompt_logprobs,
                    batch_invariant=self._batch_invariant,
                    return_logits=self._return_logits,
                ).compile()
                self.compile_seconds += time.perf_counter() - start
                self.compile_count += 1
                self._compiled[key] = fn
        return fn

    def _dispatch(self, args: tuple[Any, ...], num_logprobs: int, num_prompt_logprobs: int) -> StepOutput:
        """Run the variant for ``args`` on the held cache and state (both donated and replaced)."""
        fn = self._executable(args, num_logprobs, num_prompt_logprobs)
        self.cache, self.state, out = fn(self.params, self.cache, self.state, *args)
        return out


class StepExecutor(CompiledStep):
    """Runs :func:`step` for one model and one cache, compiling each ``(T, S)`` bucket once, on first use.

    Holds the device cache and state between calls (they are donated to every step and replaced by its
    outputs). :meth:`run` dispatches a step and returns its :class:`StepOutput` without waiting for it, so the
    caller can build and dispatch the next step before reading this one's tokens. Compilation is counted as
    :class:`CompiledStep` describes.
    """

    def __init__(
        self,
        params: Params,
        model: PagedModel,
        *,
        num_blocks: int,
        num_slots: int,
        max_blocks_per_seq: int,
        return_logits: bool = False,
        batch_invariant: bool = False,
        cache_sharding: Any = None,
    ) -> None:
        super().__init__(
            step,
            params,
            model,
            num_blocks=num_blocks,
            num_slots=num_slots,
            max_blocks_per_seq=max_blocks_per_seq,
            return_logits=return_logits,
            batch_invariant=batch_invariant,
        )
        self.cache = model.init_cache(num_blocks, num_slots, cache_sharding)
        self.state = init_state(num_slots, self.vocab_size)

    def run(
        self,
        plan: StepPlan,
        sampling: SamplingTensors | None = None,
        prompt_lens: np.ndarray | None = None,
        *,
        num_logprobs: int = 0,
        prompt_targets: np.ndarray | None = None,
        num_prompt_logprobs: int = 0,
    ) -> StepOutput:
        """Dispatch one step for ``plan``; returns its (not yet materialised) outputs.

        ``sampling`` defaults to greedy rows; ``prompt_lens`` (int32 ``[S]``) defaults to the context lengths
        (every input token counts as prompt for the penalties). ``num_logprobs`` is the number of top
        alternatives to report (each distinct value is its own compiled variant: round it to a few values).
        ``prompt_targets`` (int32 ``[T]``, the next prompt token of each token or ``-1``) turns on prompt
        logprobs with ``num_prompt_logprobs`` alternatives (its own compiled variant of the bucket).
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
        args: tuple[Any, ...] = (StepInputs.from_plan(plan, self.max_blocks_per_seq), sampling, prompt_lens)
        variant = -1
        if prompt_targets is not None:
            prompt_targets = np.asarray(prompt_targets, np.int32)
            if prompt_targets.shape != (plan.padded_tokens,):
                raise ValueError(
                    f"prompt_targets: shape {prompt_targets.shape}, expected ({plan.padded_tokens},)"
                )
            args = (*args, prompt_targets)
            variant = int(num_prompt_logprobs)
        return self._dispatch(args, int(num_logprobs), variant)

    def reset_state(self) -> None:
        """Zero the per-slot state; the cache needs no reset (every read is preceded by its write)."""
        self.state = init_state(int(self.state.last_tokens.shape[0]), self.vocab_size)
