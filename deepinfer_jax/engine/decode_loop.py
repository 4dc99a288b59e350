"""The decode loop: several decode iterations of a step inside one device call (``scheduler.num_decode_steps``).

When nothing waits for admission and every running request decodes plainly, the scheduler plans a step whose
rows may each run several iterations (:attr:`~deepinfer_jax.engine.plan.ScheduledRow.iterations`, with the
blocks for all of them allocated ahead). :func:`loop_step` runs it as one ``lax.while_loop`` around the engine's
:func:`~deepinfer_jax.engine.step.step` (forward, sample, state update, on every device of the mesh):

* iteration 0 runs the plan as built; iteration ``j > 0`` feeds each row the token it sampled at ``j - 1`` (the
  pending ``-1`` id, read from the slot's state), at position ``start + j``, sampling position ``+ j`` (so
  seeded rows draw the streams a one-token step would), without the plan's block copies and snapshots (the
  scheduler plans those for iteration 0 only);
* after each iteration a row stops on the device when its token is one of its stop ids (EOS unless
  ``ignore_eos``, ``stop_token_ids``), the sampler found no usable logit (``-1``), or its iterations are spent
  (``max_tokens``, ``max_model_len``, ``min_tokens``, the next snapshot); a stopped row runs on as scratch (its
  block table points at the reserved block 0 and its slot at the reserved slot 0, so it writes nothing of
  its sequence's), and the loop ends when every row has stopped or after ``loop_steps`` iterations;
* each iteration's sampler outputs reach the host through an ordered ``io_callback``
  (:class:`LoopStep`): the callback only puts them on a queue (on XLA:CPU it runs inside the loop), and the
  runner processes them -- detokenization, stop strings, streaming -- while the device goes on. A stop string
  the host finds ends the request; the tokens the device sampled after it are dropped.

The outputs equal those of one-token steps token for token: every iteration computes what the plain step
computes for the same rows (same positions, counts, random streams), and a stopped row changes no other row.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from deepinfer_jax.engine.plan import PENDING_TOKEN, StepInputs, StepPlan

__all__ = ["LoopItem", "LoopOutput", "LoopStep", "iteration_inputs", "loop_step"]

# The sampler outputs each iteration hands to the host (StepOutput fields; None ones are left out).
_EMITTED = ("tokens", "logprob", "rank", "top_ids", "top_logprobs", "sum_smaller", "top_sum_smaller")


class LoopOutput(NamedTuple):
    """What a decode-loop call returns besides the cache and state (stacked ``[D, ...]`` where per device).

    Attributes:
      iterations: int32 ``[D]`` the iterations the call ran (the same on every device).
      alive: bool ``[D, S]`` the rows still running after the last one.
      expert_counts: int32 ``[D, Σ P / ep]`` the expert counts summed over the iterations, or ``None``.
    """

    iterations: jax.Array
    alive: jax.Array
    expert_counts: jax.Array | None = None


def iteration_inputs(base: StepInputs, j: jax.Array, alive: jax.Array) -> StepInputs:
    """The inputs of iteration ``j`` of a decode-loop step (``base``: the plan's, iteration 0; module docstring).

    ``alive [D, S]``: the rows still running. A decode-loop plan has one token per row (token ``t`` of row
    ``token_seq[t]``); a stopped row becomes scratch: block table all block 0, slot 0, no sample."""
    s = base.seq_slots.shape[1]
    row = base.token_seq
    real = row < s  # a stopped row's token still runs, on the scratch block and slot
    later = j > 0
    token_ids = jnp.where(later, jnp.where(real, PENDING_TOKEN, 0), base.token_ids).astype(jnp.int32)
    positions = jnp.where(real, base.positions + j, base.positions)
    context_lens = jnp.where(base.seq_slots >= 0, base.context_lens + j, base.context_lens)
    seq_slots = jnp.where(alive | (base.seq_slots < 0), base.seq_slots, 0)
    block_tables = jnp.where(alive[..., None] | (base.seq_slots[..., None] < 0), base.block_tables, 0)
    sampling = base.sampling._replace(position=base.sampling.position + j)
    copies = base.copies
    if copies is not None:
        copies = jax.tree.map(lambda a: jnp.where(later, -1, a), copies)
    snapshots = base.snapshots
    if snapshots is not None:
        snapshots = snapshots.at[:, 2].set(jnp.where(later, -1, snapshots[:, 2]))
    return base._replace(
        token_ids=token_ids,
        positions=positions,
        context_lens=context_lens,
        seq_slots=seq_slots,
        block_tables=block_tables,
        sample=base.sample & alive,
        sampling=sampling,
        copies=copies,
        snapshots=snapshots,
        loop=None,
    )


def loop_step(
    params: Any,
    cache: Any,
    state: Any,
    inputs: StepInputs,
    *,
    loop_steps: int,
    emit: Callable[..., None],
    step_fn: Callable[..., tuple[Any, Any, Any]],
    counts_width: int | None = None,
) -> tuple[Any, Any, LoopOutput]:
    """Run a decode-loop plan's iterations (module docstring) with ``step_fn(params, cache, state, inputs)`` --
    the engine's step with its static options bound -- as one ``lax.while_loop``.

    ``emit(j, outputs, alive, last)`` is the ordered host callback of every iteration: ``outputs`` the step's
    sampler fields (:data:`_EMITTED`), ``alive [D, S]`` the rows that sampled in it, ``last`` whether it is the
    call's final iteration. ``counts_width``: the steps return expert counts of that width per device (summed
    over the iterations into :attr:`LoopOutput.expert_counts`); ``None``: they return none."""
    loop = inputs.loop
    if loop is None:
        raise ValueError("loop_step: the plan has no decode loop (StepInputs.loop is None)")
    if inputs.prompt_targets is not None:
        raise ValueError("loop_step: a decode-loop plan computes no prompt logprobs")
    base = inputs._replace(loop=None)
    d = base.seq_slots.shape[0]
    iterations = loop.iterations
    alive0 = base.sample & (iterations > 0) & (base.seq_slots >= 0)
    counts0 = None if counts_width is None else jnp.zeros((d, counts_width), jnp.int32)

    def cond(carry: Any) -> jax.Array:
        j, _, _, alive, _ = carry
        return (j < loop_steps) & jnp.any(alive)

    def body(carry: Any) -> Any:
        j, cache, state, alive, counts = carry
        cache, state, out = step_fn(params, cache, state, iteration_inputs(base, j, alive))
        tokens = out.tokens
        stopped = jnp.any((tokens[..., None] == loop.stop_ids) & (loop.stop_ids >= 0), axis=-1) | (tokens < 0)
        after = alive & ~stopped & (j + 1 < iterations)
        last = (j + 1 >= loop_steps) | ~jnp.any(after)
        fields = {name: getattr(out, name) for name in _EMITTED if getattr(out, name) is not None}
        io_callback(emit, None, j, fields, alive, last, ordered=True)
        if counts is not None:
            counts = counts + out.expert_counts
        return j + 1, cache, state, after, counts

    j, cache, state, alive, counts = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cache, state, alive0, counts0)
    )
    return cache, state, LoopOutput(jnp.full((d,), j, jnp.int32), alive, counts)


class LoopItem(NamedTuple):
    """One iteration's outputs on the host: its index, the sampler fields (numpy ``[D, S, ...]``), the rows that
    sampled in it and whether it was the call's last."""

    iteration: int
    fields: dict[str, np.ndarray]
    alive: np.ndarray
    last: bool


class LoopChannel:
    """The host end of the decode loop's callbacks: one queue per executor, filled in program order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[LoopItem] = queue.Queue()
        self._lock = threading.Lock()

    def emit(self, j: Any, fields: dict[str, Any], alive: Any, last: Any) -> None:
        """The ``io_callback`` target: copy the iteration's arrays and queue them (nothing else, so the device
        is not held up)."""
        self._queue.put(
            LoopItem(int(j), {k: np.array(v) for k, v in fields.items()}, np.array(alive), bool(last))
        )

    def clear(self) -> None:
        """Drop whatever a failed call left queued."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def get(self, timeout: float) -> LoopItem | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


class LoopStep:
    """A dispatched decode-loop call (:meth:`StepExecutor.run <deepinfer_jax.engine.step.StepExecutor.run>` of a
    plan with ``inputs.loop``): its final :class:`LoopOutput` and the iterations its callbacks deliver."""

    def __init__(self, plan: StepPlan, out: LoopOutput, channel: LoopChannel) -> None:
        self.plan = plan
        self.out = out
        self._channel = channel
        self._done = False

    @property
    def tokens(self) -> jax.Array:
        """What a caller timing the call waits on (the call's iteration count)."""
        return self.out.iterations

    @property
    def expert_counts(self) -> jax.Array | None:
        return self.out.expert_counts

    def items(self, poll_s: float = 0.05) -> Iterator[LoopItem]:
        """The call's iterations in order as their callbacks arrive, up to the last. If the call fails on the
        device, its error is raised here instead of waiting forever."""
        if self._done:
            raise RuntimeError("LoopStep.items: this call's iterations were taken already")
        self._done = True
        expected = 0
        while True:
            item = self._channel.get(poll_s)
            if item is None:
                if self.out.iterations.is_ready():
                    jax.block_until_ready(self.out.iterations)  # raises the device's error, if any
                    item = self._channel.get(poll_s)  # the last callback runs before the call completes
                    if item is None:
                        raise RuntimeError(
                            "decode loop: the call completed without its last iteration's outputs"
                        )
                else:
                    continue
            if item.iteration != expected:
                raise RuntimeError(
                    f"decode loop: iteration {item.iteration} arrived where {expected} was expected (calls out of order)"
                )
            yield item
            if item.last:
                return
            expected += 1
