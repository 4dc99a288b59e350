"""The device side of one engine step: one ``shard_map`` over the mesh, a ragged forward and sampling per device.

The engine always runs on a ``(dp, ep)`` mesh; one device is the ``(1, 1)`` mesh. :func:`step` is one
``jax.shard_map`` over it: every array but the parameters has a leading device axis, and each device runs
:func:`device_step` on its own part of the :class:`~deepinfer_jax.engine.plan.StepInputs`, its cache shard and
its state shard. Parameters are replicated except routed-expert slots laid out over ``ep``
(:mod:`deepinfer_jax.parallel.manual`), whose MoE dispatch and combine are the step's only collectives; on one
device (or with ``ep = 1``) the experts are local and the lowered step has no collective at all.

:func:`device_step`, for one device's tokens:

1. **assembles** the token ids: ``-1`` entries are replaced by the token the owning slot sampled last step
   (read from the state), so step N+1 can be dispatched before step N's tokens reach the host;
2. records every input token in its slot's **token counts** (prompt positions flag the id, later positions
   count it as generated; a row starting at position 0 first clears its slot), so the penalties see exactly
   the tokens before the one being sampled, also after a recompute;
3. runs the **model** over all tokens at once -- prefill chunks and decode tokens of many sequences mixed in
   one flat batch -- through the family's :class:`~deepinfer_jax.models.paged.PagedModel`, which returns the
   logits of each row's last token (of every token when the step computes prompt logprobs);
4. **samples** the rows with :func:`deepinfer_jax.sampling.sample` (temperature 0: exact argmax, lowest id on
   ties, no random numbers);
5. **advances the state**: the sampled token of each sampling row becomes its slot's ``last_token``.

Cache and state are donated, so the step updates them in place and only small per-row results (tokens,
logprobs) travel back. :class:`StepExecutor` compiles the step once per variant when it is first used (ahead
of time, so a shape outside the compiled set fails loudly instead of recompiling) and counts compilations.

Batch-invariant mode runs every per-token computation in fixed tiles of
:data:`~deepinfer_jax.ops.tiling.BATCH_INVARIANT_TILE` tokens (:mod:`deepinfer_jax.ops.tiling`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.cache.prefix import Gathered
from deepinfer_jax.cache.ragged import make_meta
from deepinfer_jax.engine.plan import StepInputs, StepPlan
from deepinfer_jax.models.paged import PagedModel, copy_rows
from deepinfer_jax.ops import compile_cache
from deepinfer_jax.ops.selection import OpSelection, use_selection
from deepinfer_jax.ops.tiling import BATCH_INVARIANT_TILE, token_scope
from deepinfer_jax.parallel.manual import expert_count_layout, expert_counts, manual_params, param_specs
from deepinfer_jax.parallel.mesh import ALL_AXES, mesh_sizes
from deepinfer_jax.parallel.model_parallel import place_on_mesh
from deepinfer_jax.sampling import (
    init_token_counts,
    reset_token_counts,
    sample,
    token_logprobs,
    update_token_counts,
)

__all__ = [
    "DEVICE_SPEC",
    "PromptLogprobs",
    "SamplerOptions",
    "SplitStep",
    "StepExecutor",
    "StepOutput",
    "StepState",
    "device_step",
    "init_state",
    "prompt_logprobs",
    "state_bytes",
    "step",
]

Params = dict[str, Any]

DEVICE_SPEC = PartitionSpec(ALL_AXES)
"""The leading device axis of every per-device array (plans, caches, state, outputs), spread over the mesh."""


class SamplerOptions(NamedTuple):
    """Engine-wide sampler settings, static arguments of the step.

    Attributes:
      logprobs_mode: what reported logprobs are (``LLM(logprobs_mode=)``; vLLM's four values,
        :data:`~deepinfer_jax.sampling.LOGPROBS_MODES`).
      force_top_k: > 0: every row samples among its top-k logits (``sampling.force_top_k``).
      sum_smaller: report each logprob's inclusive CDF (``sampling.compute_sum_smaller_probs``).
    """

    logprobs_mode: str = "raw_logprobs"
    force_top_k: int = 0
    sum_smaller: bool = False


class StepState(NamedTuple):
    """Per-slot device state carried from step to step (donated; stacked ``[D, ...]`` over the mesh).

    Attributes:
      last_tokens: int32 ``[num_slots]``: the token each slot sampled most recently (what a ``-1`` input
        reads).
      token_counts: int32 ``[num_slots, V]``: per-slot prompt flags and generated counts
        (:mod:`deepinfer_jax.sampling.counts`) for the repetition, presence and frequency penalties.
      next_pos, drafts, draft_logprobs: speculative engines only (``None`` otherwise): the position of each
        slot's pending token (int32 ``[num_slots]``), its ``K`` draft tokens for the next verification (int32
        ``[num_slots, K]``), the log-distributions they were drawn from (float32 ``[num_slots, K, V]``) and
        their confidences (float32 ``[num_slots, K]``).
    """

    last_tokens: jax.Array
    token_counts: jax.Array
    next_pos: jax.Array | None = None
    drafts: jax.Array | None = None
    draft_logprobs: jax.Array | None = None
    draft_conf: jax.Array | None = None


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


class StepOutput(NamedTuple):
    """What a step returns to the host: small per-row arrays only (stacked ``[D, ...]`` over the mesh).

    Attributes:
      tokens: int32 ``[S]`` the token sampled for each row (meaningful where the plan's ``sample`` is true);
        ``-1`` where the sampler found the row's logits unusable (the host ends that request with an error).
      logprob, rank: ``[S]`` the sampled token's reported log-probability and 1-based rank.
      top_ids, top_logprobs: ``[S, n]`` the ``n`` most probable alternatives (``n = num_logprobs``).
      logits: float32 ``[S, V]`` the sampled rows' logits, only when the executor was built with
        ``return_logits=True`` (tests and debugging); otherwise ``None``.
      prompt: per-token prompt logprobs (:class:`PromptLogprobs`) when the step computes them; else ``None``.
      sum_smaller, top_sum_smaller: ``[S]`` / ``[S, n]`` the sampled token's and the alternatives' inclusive
        CDF in the processed distribution (``sampling.compute_sum_smaller_probs``; zeros otherwise).
      expert_counts: int32 ``[Σ P / ep]`` the rows each local expert slot received in every slot-layout MoE
        layer (layers side by side in the order of :func:`~deepinfer_jax.parallel.manual.expert_count_layout`)
        when the step was built with ``counts=True``; else ``None``.
      num_accepted: speculative engines: int32 ``[S]`` drafts each row accepted; ``tokens`` (and the logprob
        fields) are then ``[S, K + 1]``, the row's accepted drafts followed by its bonus token (-1 after it).
      accept_prob: speculative engines: float32 ``[S, K]`` each verify row's acceptance probability.
      confidences: speculative engines: float32 ``[S, K]`` the confidence of each of the row's next drafts
        (variable-length verification plans with their cumulative products).
      confidence_error: speculative engines: float32 ``[S]`` ``Σ |acceptance probability - confidence|`` over
        the row's verified drafts.
      drafts: speculative engines: int32 ``[S, K]`` the drafts each sampling row left in its slot's pool for the
        next step (-1 elsewhere): the host builds a constrained request's verify-row masks from them.
      num_drafts: speculative engines: int32 ``[S]`` the drafts each row verified (the device's split under
        variable length, ``SpecInputs.realloc``).
    """

    tokens: jax.Array
    logprob: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    logits: jax.Array | None = None
    prompt: PromptLogprobs | None = None
    expert_counts: jax.Array | None = None
    sum_smaller: jax.Array | None = None
    top_sum_smaller: jax.Array | None = None
    num_accepted: jax.Array | None = None
    accept_prob: jax.Array | None = None
    confidences: jax.Array | None = None
    confidence_error: jax.Array | None = None
    drafts: jax.Array | None = None
    num_drafts: jax.Array | None = None


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


def init_state(num_slots: int, vocab_size: int, num_draft_tokens: int = 0) -> StepState:
    """A fresh state for ``num_slots`` state slots (slot ids as the block/slot manager hands them out), with the
    draft pool of ``num_draft_tokens`` drafts per slot when the engine speculates."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots: expected a positive int, got {num_slots!r}")
    state = StepState(
        last_tokens=jnp.zeros((num_slots,), jnp.int32), token_counts=init_token_counts(num_slots, vocab_size)
    )
    k = num_draft_tokens
    if k:
        state = state._replace(
            next_pos=jnp.zeros((num_slots,), jnp.int32),
            drafts=jnp.zeros((num_slots, k), jnp.int32),
            draft_logprobs=jnp.zeros((num_slots, k, vocab_size), jnp.float32),
            draft_conf=jnp.zeros((num_slots, k), jnp.float32),
        )
    return state


def state_bytes(num_slots: int, vocab_size: int, num_draft_tokens: int = 0) -> int:
    """Device bytes of :func:`init_state` (memory planning reserves them before sizing the cache)."""
    k = num_draft_tokens
    return num_slots * 4 * (1 + vocab_size + (1 + 2 * k + k * vocab_size if k else 0))


def device_step(
    params: Params,
    cache: Any,
    state: StepState,
    inputs: StepInputs,
    *,
    model: PagedModel,
    num_logprobs: int = 0,
    num_prompt_logprobs: int = -1,
    batch_invariant: bool = False,
    return_logits: bool = False,
    sampler: SamplerOptions | None = None,
    num_draft_tokens: int = 0,
    confidence_temperature: tuple[float, ...] = (1.0,),
    stage: str = "all",
    carry: Any = None,
) -> tuple[Any, StepState, Any]:
    """One device's part of a step (module docstring): ``(cache, state, StepOutput)``.

    ``stage`` splits the step in two for plans whose grammar masks are filled after dispatch
    (:attr:`~deepinfer_jax.engine.plan.StepPlan.deferred_masks`): ``"forward"`` applies the plan's copies and
    runs the model, returning ``(cache, state, carry)`` (the logits, or for speculative engines what
    verification and drafting need of the forward); ``"sample"`` takes that ``carry`` and the plan's filled
    masks and does the rest, returning what ``"all"`` returns. The two halves compute exactly what the whole
    step computes.

    ``inputs`` are this device's arrays (no device axis). With ``batch_invariant`` every per-token computation
    runs in tiles of :data:`BATCH_INVARIANT_TILE` rows and the sampler in its batch-invariant mode, so a row's
    logits and token are bitwise the same in any batch. With ``num_prompt_logprobs >= 0`` the model returns the
    logits of every token and the step reports :class:`PromptLogprobs` for ``inputs.prompt_targets`` with that
    many alternatives. ``sampler`` holds the engine-wide sampler settings (:class:`SamplerOptions`).
    """
    sampler = sampler or SamplerOptions()
    if stage not in ("all", "forward", "sample"):
        raise ValueError(f"stage: expected 'all', 'forward' or 'sample', got {stage!r}")
    if inputs.copies is not None and stage != "sample":  # forks: copy-on-write blocks and cloned slots first
        c = inputs.copies
        cache = model.copy_cache(cache, c.block_src, c.block_dst, c.slot_src, c.slot_dst)
        state = StepState(*(None if a is None else copy_rows(a, c.slot_src, c.slot_dst) for a in state))
    if num_draft_tokens:
        from deepinfer_jax.engine.spec_step import spec_device_step

        cache, state, spec_out = spec_device_step(
            params,
            cache,
            state,
            inputs,
            model=model,
            num_draft_tokens=num_draft_tokens,
            num_logprobs=num_logprobs,
            num_prompt_logprobs=num_prompt_logprobs,
            batch_invariant=batch_invariant,
            sampler=sampler,
            tile=BATCH_INVARIANT_TILE if batch_invariant else None,
            confidence_temperature=confidence_temperature,
            stage=stage,
            carry=carry,
        )
        if stage == "forward":
            return cache, state, spec_out
        return (
            cache,
            state,
            StepOutput(
                spec_out["tokens"],
                spec_out["logprob"],
                spec_out["rank"],
                spec_out["top_ids"],
                spec_out["top_logprobs"],
                prompt=spec_out["prompt"],
                num_accepted=spec_out["num_accepted"],
                accept_prob=spec_out["accept_prob"],
                confidences=spec_out["confidences"],
                confidence_error=spec_out["confidence_error"],
                drafts=spec_out["drafts"],
                num_drafts=spec_out["num_drafts"],
            ),
        )
    num_seqs = inputs.seq_slots.shape[0]
    num_tokens = inputs.token_ids.shape[0]
    num_slots = state.last_tokens.shape[0]
    if stage == "sample":  # the forward half ran: its logits, and the counts it recorded in the state
        logits, prompt_out = carry
        state, result = _sample_rows(
            logits, prompt_out, state, inputs, num_logprobs, batch_invariant, return_logits, sampler
        )
        return cache, state, result
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
    counts = update_token_counts(counts, token_slots, token_ids, inputs.positions < inputs.prompt_lens[row])

    meta = make_meta(
        inputs.token_seq,
        inputs.positions,
        inputs.query_start,
        inputs.context_lens,
        inputs.seq_slots,
        inputs.block_tables,
        inputs.snapshots,
        inputs.replay_from,
    )
    tile = BATCH_INVARIANT_TILE if batch_invariant else None
    prompt_out = None
    if num_prompt_logprobs >= 0:
        if inputs.prompt_targets is None:
            raise ValueError("step: num_prompt_logprobs >= 0 needs prompt_targets [T]")
        every = jnp.arange(num_tokens, dtype=jnp.int32)
        all_logits, cache = model.forward(params, cache, token_ids, meta, tile=tile, logit_index=every)
        prompt_out = prompt_logprobs(
            all_logits, inputs.prompt_targets, num_prompt_logprobs, batch_invariant=batch_invariant
        )
        logits = all_logits[meta.last_token()]
    else:
        logits, cache = model.forward(params, cache, token_ids, meta, tile=tile)  # [S, V] float32
    state = state._replace(token_counts=counts)
    if stage == "forward":
        return cache, state, (logits, prompt_out)
    state, result = _sample_rows(
        logits, prompt_out, state, inputs, num_logprobs, batch_invariant, return_logits, sampler
    )
    return cache, state, result


def _sample_rows(
    logits: jax.Array,
    prompt_out: PromptLogprobs | None,
    state: StepState,
    inputs: StepInputs,
    num_logprobs: int,
    batch_invariant: bool,
    return_logits: bool,
    sampler: SamplerOptions,
) -> tuple[StepState, StepOutput]:
    """The plain step's second half: sample every row from its ``logits [S, V]`` (the counts in ``state``
    already hold the step's input tokens) and record the sampled tokens as the slots' ``last_tokens``."""
    num_slots = state.last_tokens.shape[0]
    counts = state.token_counts
    row_counts = counts[jnp.clip(inputs.seq_slots, 0, num_slots - 1)]
    out = sample(
        logits,
        inputs.sampling,
        row_counts,
        num_logprobs=num_logprobs,
        batch_invariant=batch_invariant,
        logprobs_mode=sampler.logprobs_mode,
        force_top_k=sampler.force_top_k,
        sum_smaller=sampler.sum_smaller,
    )
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
        sum_smaller=out.sum_smaller if sampler.sum_smaller else None,
        top_sum_smaller=out.top_sum_smaller if sampler.sum_smaller else None,
    )
    return state._replace(last_tokens=last_tokens), result


def step(
    params: Params,
    cache: Any,
    state: StepState,
    inputs: StepInputs,
    *,
    mesh: Mesh,
    model: PagedModel,
    num_logprobs: int = 0,
    num_prompt_logprobs: int = -1,
    batch_invariant: bool = False,
    return_logits: bool = False,
    counts: bool = False,
    selection: OpSelection | None = None,
    sampler: SamplerOptions | None = None,
    num_draft_tokens: int = 0,
    confidence_temperature: tuple[float, ...] = (1.0,),
    stage: str = "all",
    carry: Any = None,
) -> tuple[Any, StepState, Any]:
    """One engine step on every device of ``mesh`` at once: :func:`device_step` inside one ``jax.shard_map``.

    Every array but ``params`` has a leading device axis of ``dp * ep`` entries, spread over the mesh
    (:data:`DEVICE_SPEC`): ``cache``, ``state``, ``inputs`` and the outputs. ``params`` is replicated except the
    routed-expert slots of :func:`~deepinfer_jax.parallel.shard_model_params`. The keyword arguments are static.
    With ``counts`` the output's ``expert_counts`` holds every device's rows per local slot, ``int32
    [dp * ep, Σ P / ep]`` (device ``d`` holds slots ``(d % ep) * P / ep`` onwards; padding tokens are not
    routed, so not counted): one array, so reading a step's counts is one transfer. ``selection`` is the op
    selection every registry call of the step follows (:mod:`deepinfer_jax.ops.selection`; ``None``: each op's
    automatic choice). ``stage`` / ``carry``: the two halves of a step whose grammar masks are filled after
    dispatch (:func:`device_step`); the ``"forward"`` half returns ``(cache, state, carry)``, with every device's
    expert counts so far in the carry, and the ``"sample"`` half adds its own.
    """
    _, ep = mesh_sizes(mesh)  # a (dp, ep) mesh, or a ValueError naming its axes
    layout = expert_count_layout(params, ep) if counts else ()

    def body(params: Any, cache: Any, state: Any, inputs: Any, *rest: Any) -> tuple[Any, Any, Any]:
        one = jax.tree.map(lambda a: a[0], (cache, state, inputs))
        held = jax.tree.map(lambda a: a[0], rest[0]) if rest else (None, None)
        valid = one[2].token_seq < one[2].seq_slots.shape[0]
        with use_selection(selection), token_scope(valid) as scope:
            cache, state, out = device_step(
                manual_params(params, mesh),
                *one,
                model=model,
                num_logprobs=num_logprobs,
                num_prompt_logprobs=num_prompt_logprobs,
                batch_invariant=batch_invariant,
                return_logits=return_logits,
                sampler=sampler,
                num_draft_tokens=num_draft_tokens,
                confidence_temperature=confidence_temperature,
                stage=stage,
                carry=held[0],
            )
        if stage == "forward":
            out = (out, expert_counts(scope, layout) if counts else None)
        elif counts:
            mine = expert_counts(scope, layout)
            out = out._replace(expert_counts=mine if held[1] is None else mine + held[1])
        return jax.tree.map(lambda a: a[None], (cache, state, out))

    # check_vma is off for the reason ep_moe_experts gives: op moe_experts skips experts without rows through
    # a lax.cond whose branches differ in which mesh axes their values vary over.
    specs = (param_specs(params), DEVICE_SPEC, DEVICE_SPEC, DEVICE_SPEC)
    args = (params, cache, state, inputs)
    if stage == "sample":
        if carry is None:
            raise ValueError("step: stage 'sample' needs the carry of stage 'forward'")
        specs, args = (*specs, DEVICE_SPEC), (*args, carry)
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=DEVICE_SPEC, check_vma=False)
    return fn(*args)


class PackedLayout(NamedTuple):
    """Where each leaf of a :class:`StepInputs` lies in the packed host buffers (static: part of the variant).

    ``leaves[i] = (group, offset, shape)``: leaf ``i`` is columns ``offset : offset + prod(shape[1:])`` of
    packed buffer ``group`` (one ``[D, N]`` buffer per dtype, in ``dtypes`` order), reshaped to ``shape``.
    """

    treedef: Any
    dtypes: tuple[str, ...]
    leaves: tuple[tuple[int, int, tuple[int, ...]], ...]


def pack_inputs(inputs: StepInputs) -> tuple[tuple[np.ndarray, ...], PackedLayout]:
    """The plan's many small arrays as one ``[D, N]`` buffer per dtype, so a step copies a few buffers.

    Each copy to the devices has a fixed host cost (about half a millisecond through ``jax.device_put`` on a
    loaded CPU): twenty leaves cost more than the step itself on small models. The step unpacks them with static
    slices (:func:`unpack_inputs`), which XLA folds into the consumers.
    """
    leaves, treedef = jax.tree.flatten(inputs)
    groups: dict[str, list[np.ndarray]] = {}
    offsets: dict[str, int] = {}
    where = []
    for leaf in leaves:
        a = np.asarray(leaf)
        key = a.dtype.str
        flat = a.reshape(a.shape[0], -1)
        group = groups.setdefault(key, [])
        where.append((key, offsets.get(key, 0), a.shape))
        offsets[key] = offsets.get(key, 0) + flat.shape[1]
        group.append(flat)
    dtypes = tuple(groups)
    index = {k: i for i, k in enumerate(dtypes)}
    packed = tuple(np.concatenate(groups[k], axis=1) if len(groups[k]) > 1 else groups[k][0] for k in dtypes)
    layout = PackedLayout(treedef, dtypes, tuple((index[k], off, tuple(shape)) for k, off, shape in where))
    return packed, layout


def unpack_inputs(packed: tuple[Any, ...], layout: PackedLayout) -> StepInputs:
    """The :class:`StepInputs` that :func:`pack_inputs` packed (static slices and reshapes)."""
    leaves = []
    for group, offset, shape in layout.leaves:
        width = int(np.prod(shape[1:], dtype=np.int64))
        leaves.append(packed[group][:, offset : offset + width].reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)


def packed_step(
    params: Any,
    cache: Any,
    state: StepState,
    packed: tuple[Any, ...],
    *carry: Any,
    layout: PackedLayout,
    loop_steps: int = 1,
    stream_interval: int = 1,
    channel: Any = None,
    **static: Any,
):
    """:func:`step` over inputs packed by :func:`pack_inputs` (what :class:`StepExecutor` compiles); the
    ``"sample"`` half of a split step also takes the ``"forward"`` half's carry. Stage ``"loop"`` runs a
    decode-loop plan's iterations (:func:`~deepinfer_jax.engine.decode_loop.loop_step`, at most ``loop_steps``,
    handed to the host through ``channel`` every ``stream_interval`` iterations)."""
    if static.get("stage") == "loop":
        from deepinfer_jax.engine.decode_loop import loop_step

        if channel is None:
            raise ValueError("packed_step: stage 'loop' needs the host channel of its callbacks")
        static = {**static, "stage": "all"}
        width = None
        if static.get("counts"):
            _, ep = mesh_sizes(static["mesh"])
            width = sum(w for _, w in expert_count_layout(params, ep))
        return loop_step(
            params,
            cache,
            state,
            unpack_inputs(packed, layout),
            loop_steps=loop_steps,
            channel=channel,
            step_fn=functools.partial(step, **static),
            counts_width=width,
            stream_interval=stream_interval,
            num_logprobs=static.get("num_logprobs", 0),
            sum_smaller=bool(static["sampler"].sum_smaller) if static.get("sampler") is not None else False,
        )
    return step(
        params, cache, state, unpack_inputs(packed, layout), carry=carry[0] if carry else None, **static
    )


def _static_key(options: dict[str, Any]) -> str:
    """Everything static a step is traced with, as text (the trace cache's key, with the source fingerprint and
    the arguments' shapes and shardings): the op selection by its settings, the rest by ``repr``."""
    parts = []
    for name, value in sorted(options.items()):
        if isinstance(value, OpSelection):
            value = (value.platform, value.backend, dict(value.overrides), value.strict, value.interpret)
        parts.append(f"{name}={value!r}")
    return "\n".join(parts)


class SplitStep:
    """A step dispatched in two halves (:meth:`StepExecutor.run` of a plan with deferred masks): the plan, and the
    device values its forward half left for the sample half (``None`` once :meth:`StepExecutor.finish` ran)."""

    def __init__(self, plan: StepPlan, carry: Any) -> None:
        self.plan = plan
        self.carry = carry


class StepExecutor:
    """Runs :func:`step` for one model on one mesh, compiling each variant once, on first use.

    Holds every device's cache and state, stacked on a leading device axis and spread over the mesh (donated to
    every step and replaced by its outputs). :meth:`run` dispatches a step and returns its :class:`StepOutput`
    without waiting for it, so the caller can build and dispatch the next step before reading this one's tokens.
    The variant key is the plan's ``(T, S, mask width, num_logprobs, prompt-logprob width)``
    (:attr:`~deepinfer_jax.engine.plan.StepPlan.variant`); each is compiled ahead of time when first needed.

    Args:
      params: the parameters laid out on ``mesh`` (replicated, routed experts possibly in ``ep``-sharded slots).
      model: the family's :class:`~deepinfer_jax.models.paged.PagedModel`.
      mesh: the ``(dp, ep)`` mesh (``(1, 1)`` for one device).
      num_blocks, num_slots: each device's cache blocks and state slots.
      max_blocks_per_seq: block-table width.
      return_logits: every step also returns the sampled rows' logits (tests and debugging).
      batch_invariant: the batch-invariant mode of :func:`device_step`.
      expert_counts: every step also returns its per-layer expert counts (EPLB and ``moe_lb`` read them).
      selection: the op selection the step is compiled under (``ops.backend`` / ``ops.overrides``,
        :func:`~deepinfer_jax.ops.selection.resolve_selection`); ``None`` = every op's automatic choice.
      sampler: the engine-wide :class:`SamplerOptions`.
      stream_interval: a decode-loop step hands its iterations' outputs to the host every this many iterations
        (``scheduler.decode_stream_interval``; at most the loop's bound); 0: no host callbacks, the host reads them
        all when the call is done.

    Attributes:
      compile_count: compilations done so far (one per variant used).
      compile_seconds: total wall time spent compiling.
      compile_cache_hits: compilations of the step served from the persistent compilation cache
        (``ops.compile_cache``; counted from JAX's cache events during the executor's own compiles).
      on_compile: called as ``on_compile(T, S)`` just before a step variant of bucket ``(T, S)`` compiles and
        ``on_compile(None, None)`` after (progress displays say "compiling step T×S"); ``None`` = nothing.
    """

    def __init__(
        self,
        params: Params,
        model: PagedModel,
        mesh: Mesh,
        *,
        num_blocks: int,
        num_slots: int,
        max_blocks_per_seq: int,
        return_logits: bool = False,
        batch_invariant: bool = False,
        expert_counts: bool = False,
        selection: OpSelection | None = None,
        sampler: SamplerOptions | None = None,
        num_draft_tokens: int = 0,
        confidence_temperature: tuple[float, ...] = (1.0,),
        stream_interval: int = 1,
    ) -> None:
        if not isinstance(model, PagedModel):
            raise TypeError(f"model: expected a PagedModel, got {type(model).__name__}")
        for name, value, low in (
            ("max_blocks_per_seq", max_blocks_per_seq, 1),
            ("num_blocks", num_blocks, 2),
            ("num_slots", num_slots, 1),
            ("stream_interval", stream_interval, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        dp, ep = mesh_sizes(mesh)
        self.params = params
        self.model = model
        self.mesh = mesh
        self.num_devices = dp * ep
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.max_blocks_per_seq = max_blocks_per_seq
        self.vocab_size = int(model.vocab_size)
        self.returns_expert_counts = bool(expert_counts)
        self._static = {
            "mesh": mesh,
            "model": model,
            "batch_invariant": bool(batch_invariant),
            "return_logits": bool(return_logits),
            "counts": self.returns_expert_counts,
            "selection": selection,
            "sampler": sampler or SamplerOptions(),
            "num_draft_tokens": int(num_draft_tokens),
            "confidence_temperature": tuple(float(t) for t in confidence_temperature),
        }
        self.num_draft_tokens = int(num_draft_tokens)
        self.stream_interval = stream_interval
        """Decode loops hand their iterations to the host every this many (and after the last)."""
        self._sharding = NamedSharding(mesh, DEVICE_SPEC)
        self._compiled: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()
        self.compile_count = 0
        self.compile_seconds = 0.0
        self.compile_cache_hits = 0
        self.on_compile: Callable[[int | None, int | None], None] | None = None
        self._split: SplitStep | None = None
        from deepinfer_jax.engine.decode_loop import LoopChannel

        self._loop_channel = LoopChannel()
        self._loop_calls = 0
        # A decode loop with host callbacks is dispatched from this one worker thread (_call): on XLA:CPU the
        # dispatch of a program that holds a host callback returns only once the program has run, and the host
        # must process the previous call meanwhile. The call's cache and state arrive with it (_settle).
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Any] | None = None
        self.callbacks_hold_dispatch = all(d.platform == "cpu" for d in np.asarray(mesh.devices).flat)
        """Whether the devices' dispatch of a program with a host callback returns only once it has run (XLA:CPU
        in jax 0.12): the next dispatch then waits for such a call anyway, so the runner processes the call's
        iterations as they arrive, before it dispatches the next step (``EngineRunner.run``)."""
        self.settle_seconds = 0.0
        """Time the caller's thread waited for such calls to finish (device time; the bench harness's wait)."""
        self._cache: Any = None
        self._state: Any = None
        self.cache = self._stacked(lambda: model.init_cache(num_blocks, num_slots))
        self.state = self._stacked(lambda: init_state(num_slots, self.vocab_size, self.num_draft_tokens))
        # Prefix caching's host tier: every device's blocks / slots gathered or written at once (vmap over D).
        self._reader = jax.jit(jax.vmap(model.read_cache))
        self._writer = jax.jit(jax.vmap(model.write_cache), donate_argnums=(0,))

    @property
    def cache(self) -> Any:
        """Every device's paged cache (after the step dispatched last: waits for a call still running)."""
        self._settle()
        return self._cache

    @cache.setter
    def cache(self, value: Any) -> None:
        self._settle()
        self._cache = value

    @property
    def state(self) -> Any:
        """Every device's per-slot state (after the step dispatched last: waits for a call still running)."""
        self._settle()
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._settle()
        self._state = value

    def _settle(self) -> None:
        """Take the cache and state of the call the worker thread still runs, once it has run (its error, if it
        failed, is raised here once; the cache and state are then the consumed inputs, which :meth:`recover`
        replaces)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            start = time.perf_counter()
            try:
                self._cache, self._state, _ = pending.result()
            finally:
                self.settle_seconds += time.perf_counter() - start

    @property
    def compiled_buckets(self) -> tuple[tuple[int, int], ...]:
        """The ``(T, S)`` buckets compiled so far (a bucket may have variants by mask width and logprobs)."""
        return tuple(sorted({key[0][:2] for key in self._compiled}))

    def _stacked(self, make: Callable[[], Any]) -> Any:
        """``make()``'s pytree once per device, stacked on a leading device axis and created in place, sharded."""
        d = self.num_devices
        return jax.jit(
            lambda: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (d, *a.shape)), make()),
            out_shardings=self._sharding,
        )()

    def _place(self, inputs: Any) -> Any:
        """The packed numpy buffers as global arrays on a mesh spanning processes: each process copies its own
        shards (make_array_from_callback), explicit, but the guard cannot tell."""
        with jax.transfer_guard("allow"):
            return jax.tree.map(lambda a: place_on_mesh(a, self._sharding), inputs)

    def _executable(
        self, plan: StepPlan, inputs: Any, layout: PackedLayout, stage: str = "all", carry: Any = None
    ) -> Any:
        key = (plan.variant, layout, stage)
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                tokens, seqs = plan.variant[:2]
                if self.on_compile is not None:
                    self.on_compile(tokens, seqs)
                before = compile_cache.counters()
                start = time.perf_counter()
                structs = (
                    jax.tree.map(compile_cache.struct_of, self.params),
                    jax.tree.map(compile_cache.struct_of, self.cache),
                    jax.tree.map(compile_cache.struct_of, self.state),
                    jax.tree.map(
                        lambda a: jax.ShapeDtypeStruct(
                            np.shape(a), jnp.result_type(a), sharding=self._sharding
                        ),
                        inputs,
                    ),
                )
                if carry is not None:
                    structs = (*structs, jax.tree.map(compile_cache.struct_of, carry))
                options = {
                    **self._static,
                    "layout": layout,
                    "num_logprobs": plan.num_logprobs,
                    "num_prompt_logprobs": plan.num_prompt_logprobs,
                    "stage": stage,
                }
                if stage == "loop":
                    options.update(
                        loop_steps=plan.loop_steps,
                        stream_interval=min(self.stream_interval, plan.loop_steps),
                        channel=self._loop_channel,
                    )
                fn = compile_cache.compile_traced(
                    functools.partial(packed_step, **options),
                    structs,
                    static_key=_static_key(options),
                    donate_argnums=(1, 2),
                )
                seconds = time.perf_counter() - start
                self.compile_seconds += seconds
                self.compile_count += 1
                # The step's lowering compiles one program (nested jits are inlined): a hit is this step's.
                hit = min(1, (compile_cache.counters() - before).hits)
                self.compile_cache_hits += hit
                logging.info(
                    "compiled step %d×%d %s%s in %.2f s%s",
                    tokens,
                    seqs,
                    plan.variant[2:],
                    ""
                    if stage == "all"
                    else f" (decode loop of {plan.loop_steps})"
                    if stage == "loop"
                    else f" ({stage} half)",
                    seconds,
                    " (persistent cache hit)" if hit else "",
                )
                self._compiled[key] = fn
                if self.on_compile is not None:
                    self.on_compile(None, None)
        return fn

    def _host_transfers(self, plan: StepPlan) -> None:
        """Prefix caching's host tier (docs/prefix_cache.md): gather the blocks and snapshots the plan evicts into
        host entries, then write the ones its hits bring back, before the step runs. Both are dispatched without
        waiting (the gathered arrays start copying to the host at once, and an entry becomes numpy the first time
        it is read), so no step waits on them."""
        batches = [b for b in plan.batches if b is not None]
        if not any(b.host_saves or b.host_loads for b in batches):
            return
        d = self.num_devices
        for field in ("host_saves", "host_loads"):
            items = [[] if b is None else getattr(b, field) for b in plan.batches]
            blocks = [[(e, i) for e, i, _ in part if i >= 0] for part in items]
            slots = [[(e, i) for e, _, i in part if i >= 0] for part in items]
            kb, ks = (
                max(1, 1 << max(max(len(x) for x in group) - 1, 0).bit_length()) for group in (blocks, slots)
            )
            ids = np.full((2, d, max(kb, ks)), -1, np.int32)
            for dev in range(d):
                for j, (_, i) in enumerate(blocks[dev]):
                    ids[0, dev, j] = i
                for j, (_, i) in enumerate(slots[dev]):
                    ids[1, dev, j] = i
            block_ids, slot_ids = self._place((ids[0, :, :kb], ids[1, :, :ks]))
            axis = self.model.block_axis
            if field == "host_saves":
                data = self._reader(self.cache, block_ids, slot_ids)
                for leaf in jax.tree.leaves(data):
                    leaf.copy_to_host_async()
                gathered = (Gathered(data[0]), Gathered(data[1]))
                for dev in range(d):
                    for j, (entry, _) in enumerate(blocks[dev]):
                        entry.attach(gathered[0], (dev, j), axis)
                    for j, (entry, _) in enumerate(slots[dev]):
                        entry.attach(gathered[1], (dev, j), 0)
                continue
            shapes = jax.eval_shape(self._reader, self.cache, block_ids, slot_ids)
            host = tuple(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), part) for part in shapes)
            for part, group, ax in ((0, blocks, axis), (1, slots, 0)):
                for dev in range(d):
                    for j, (entry, _) in enumerate(group[dev]):

                        def put(
                            buf: np.ndarray, x: np.ndarray, dev: int = dev, j: int = j, ax: int = ax
                        ) -> None:
                            index = (dev,) + (slice(None),) * ax + (j,)
                            buf[index] = x

                        jax.tree.map(put, host[part], entry.numpy())
            self.cache = self._writer(self.cache, block_ids, slot_ids, self._place(host))

    def run(self, plan: StepPlan) -> Any:
        """Dispatch one step for ``plan``; returns its stacked outputs (``[D, S, ...]``) without waiting.

        A plan with :attr:`~deepinfer_jax.engine.plan.StepPlan.deferred_masks` dispatches only the step's
        forward half and returns a :class:`SplitStep`: fill the masks, then :meth:`finish` it (before any other
        step is dispatched) for the outputs. A decode-loop plan (``inputs.loop``) returns a
        :class:`~deepinfer_jax.engine.decode_loop.LoopStep`, whose iterations arrive through host callbacks."""
        self._host_transfers(plan)
        if plan.num_devices != self.num_devices:
            raise ValueError(f"plan: {plan.num_devices} devices, but the mesh has {self.num_devices}")
        if plan.max_blocks_per_seq != self.max_blocks_per_seq:
            raise ValueError(
                f"plan: block tables of width {plan.max_blocks_per_seq}, the executor's is {self.max_blocks_per_seq}"
            )
        if plan.inputs.loop is not None:
            if plan.deferred_masks:
                raise ValueError("plan: a decode-loop step cannot have deferred grammar masks")
            from deepinfer_jax.engine.decode_loop import LoopStep, PackedLayout

            self._loop_calls += (
                1  # numbers the call's host callbacks (LoopStep drops a failed call's late ones)
            )
            plan.inputs.loop.call[:] = self._loop_calls
            streams = min(self.stream_interval, plan.loop_steps) > 0
            if streams:  # host callbacks: dispatched from the worker thread (see __init__)
                out = self._call(plan, "loop", background=True)
            else:
                self.cache, self.state, out = self._call(plan, "loop")
            sum_smaller = self._static["sampler"].sum_smaller
            k = 0 if plan.inputs.spec is None else int(self._static.get("num_draft_tokens", 0))
            layout = PackedLayout(self.num_devices, plan.padded_seqs, plan.num_logprobs, bool(sum_smaller), k)
            return LoopStep(plan, out, self._loop_channel, layout, self._loop_calls)
        if plan.deferred_masks:
            self.cache, self.state, carry = self._call(plan, "forward")
            self._split = SplitStep(plan, carry)
            return self._split
        self.cache, self.state, out = self._call(plan, "all")
        return out

    def finish(self, split: SplitStep) -> StepOutput:
        """Dispatch the sample half of a step :meth:`run` split, with its plan's masks as they are now; returns
        the step's outputs without waiting."""
        if split is not self._split or split.carry is None:
            raise ValueError("StepExecutor.finish: not the split step in flight (or finished already)")
        carry, split.carry, self._split = split.carry, None, None
        self.cache, self.state, out = self._call(split.plan, "sample", carry)
        return out

    def _call(self, plan: StepPlan, stage: str, carry: Any = None, *, background: bool = False) -> Any:
        """Dispatch ``stage`` of ``plan``'s step; returns ``(cache, state, out)``. ``background``: dispatch it
        from the worker thread and return the ``Future`` of that triple, which becomes this executor's cache
        and state when anything reads them next (:meth:`_settle`)."""
        if self._split is not None:
            raise RuntimeError("StepExecutor: a split step's sample half must be dispatched first (finish)")
        packed, layout = pack_inputs(plan.inputs)
        if self._sharding.is_fully_addressable:
            # The compiled call copies the numpy buffers to their input sharding in its own (C++) dispatch: about
            # 1 ms per step cheaper on XLA:CPU than a jax.device_put before it. This copy is the step's input,
            # so it is allowed here; the transfer guard still catches every other implicit transfer of the loop.
            args, guard = packed, jax.transfer_guard_host_to_device("allow")
        else:
            args, guard = self._place(packed), contextlib.nullcontext()
        fn = self._executable(plan, args, layout, stage, carry)  # compiled here, on the caller's thread
        inputs = (self.params, self.cache, self.state, args) + (() if carry is None else (carry,))

        def dispatch() -> Any:
            with guard:
                return fn(*inputs)

        if not background:
            return dispatch()
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deepinfer-dispatch")
        self._pending = self._worker.submit(dispatch)
        return self._pending

    def recover(self) -> bool:
        """After a failed run: make the cache and the per-slot state usable again. They are kept when they are
        intact (the failure happened on the host); when a failed step consumed them (donated buffers deleted, or
        arrays carrying the device error) both are created afresh. Returns True when they were re-created. A step
        split in two whose sample half was not dispatched is dropped (its requests end with the failure)."""
        self._split = None
        # A call still running finishes first (its callbacks with it); if it failed, it consumed its inputs,
        # which are checked below.
        with contextlib.suppress(Exception):
            self._settle()
        self._loop_channel.clear()
        try:
            leaves = jax.tree.leaves((self.cache, self.state))
            if any(leaf.is_deleted() for leaf in leaves):
                raise RuntimeError("a failed step consumed the cache")
            jax.block_until_ready(leaves)
        except Exception:
            self.cache = self._stacked(lambda: self.model.init_cache(self.num_blocks, self.num_slots))
            self.reset_state()
            return True
        return False

    def release(self) -> None:
        """Drop the cache, the state and the compiled steps (``LLM.close``); the executor cannot run afterwards."""
        with contextlib.suppress(Exception):  # what a failed call left is deleted below all the same
            self._settle()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for leaf in jax.tree.leaves((self.cache, self.state)):
            if not leaf.is_deleted():
                leaf.delete()
        self.cache = self.state = None
        self._split = None
        self._compiled.clear()

    def reset_state(self) -> None:
        """Zero every device's per-slot state; the caches need no reset (every read follows its write)."""
        self.state = self._stacked(lambda: init_state(self.num_slots, self.vocab_size, self.num_draft_tokens))
