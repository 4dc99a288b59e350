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
* each iteration's sampler outputs are kept in a buffer of the call, and every ``stream_interval`` iterations
  (and after the last) an ordered ``io_callback`` hands the iterations since the previous one to the host
  (:class:`LoopStep`): the callback only puts them on a queue (on XLA:CPU it runs inside the loop), and the
  runner processes them -- detokenization, stop strings, streaming -- while the device goes on (on XLA:CPU a
  call has run by the time its dispatch returns: the executor dispatches it from a worker thread, and the
  runner processes its iterations before it dispatches the next step). A stop string
  the host finds ends the request; the tokens the device sampled after it are dropped. A callback has a fixed
  cost (about 0.5 ms on the 2-core CPU machine, docs/benchmarks.md), which the interval spreads.

In a speculative engine an iteration is one speculative step (verify, accept, draft; ``engine/spec_step.py``):
from iteration 1 on a row feeds its pending token and the pool's drafts at the plan's lower-bound positions and
the device places it at its slot's ``next_pos``; it stops on a stop id among the tokens it emitted, and once its
true length reaches its request's ``max_total_len`` (``LoopInputs.limits``). Iteration 0 always runs, so a call
whose rows the tokens in flight completed still reports its one, last, iteration.

The outputs equal those of one-token steps token for token: every iteration computes what the plain step
computes for the same rows (same positions, counts, random streams), and a stopped row changes no other row.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from deepinfer_jax.engine.plan import PENDING_TOKEN, StepInputs, StepPlan
from deepinfer_jax.engine.spec_step import DRAFT_TOKEN

__all__ = [
    "LoopChannel",
    "LoopItem",
    "LoopOutput",
    "LoopStep",
    "PackedLayout",
    "iteration_inputs",
    "loop_step",
]


class LoopOutput(NamedTuple):
    """What a decode-loop call returns besides the cache and state (stacked ``[D, ...]`` where per device).

    Attributes:
      iterations: int32 ``[D]`` the iterations the call ran (the same on every device).
      alive: bool ``[D, S]`` the rows still running after the last one.
      expert_counts: int32 ``[D, Σ P / ep]`` the expert counts summed over the iterations, or ``None``.
      payload: without callbacks (``stream_interval = 0``): every iteration's packed rows (:class:`PackedLayout`;
        the same payload repeated on every device); ``None`` when callbacks deliver them.
    """

    iterations: jax.Array
    alive: jax.Array
    expert_counts: jax.Array | None = None
    payload: jax.Array | None = None


def iteration_inputs(base: StepInputs, j: jax.Array, alive: jax.Array) -> StepInputs:
    """The inputs of iteration ``j`` of a decode-loop step (``base``: the plan's, iteration 0; module docstring).

    ``alive [D, S]``: the rows still running. A plain decode-loop plan has one token per row (token ``t`` of row
    ``token_seq[t]``), advanced by one position per iteration. A speculative plan's row feeds its pending token
    and its drafts (``1 + n`` tokens) at the host's lower-bound positions: from iteration 1 on every row is
    ``shifted`` (the device places it at its slot's ``next_pos``), its first token is the pending ``-1`` and the
    others the pool's drafts (``-2``). A stopped row becomes scratch: block table all block 0, slot 0, no
    sample."""
    s = base.seq_slots.shape[1]
    row = base.token_seq
    real = row < s  # a stopped row's token still runs, on the scratch block and slot
    later = j > 0
    spec = base.spec
    sampling = base.sampling
    if spec is None:
        token_ids = jnp.where(later, jnp.where(real, PENDING_TOKEN, 0), base.token_ids).astype(jnp.int32)
        positions = jnp.where(real, base.positions + j, base.positions)
        context_lens = jnp.where(base.seq_slots >= 0, base.context_lens + j, base.context_lens)
        sampling = sampling._replace(position=sampling.position + j)
    else:
        first = jnp.take_along_axis(base.query_start, jnp.where(real, row, 0), axis=1)
        t = jnp.arange(base.token_ids.shape[1], dtype=jnp.int32)[None]
        marker = jnp.where(t == first, PENDING_TOKEN, DRAFT_TOKEN)
        token_ids = jnp.where(later, jnp.where(real, marker, 0), base.token_ids).astype(jnp.int32)
        positions, context_lens = base.positions, base.context_lens
        spec = spec._replace(shifted=jnp.where(later, base.seq_slots >= 0, spec.shifted))
    seq_slots = jnp.where(alive | (base.seq_slots < 0), base.seq_slots, 0)
    block_tables = jnp.where(alive[..., None] | (base.seq_slots[..., None] < 0), base.block_tables, 0)
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
        spec=spec,
        loop=None,
    )


def _next_pos(state: Any, seq_slots: jax.Array) -> jax.Array:
    """``[D, S]`` the position of each row's pending token on the device (speculative state)."""
    slots = jnp.clip(seq_slots, 0, state.next_pos.shape[1] - 1)
    return jnp.take_along_axis(state.next_pos, slots, axis=1)


def loop_step(
    params: Any,
    cache: Any,
    state: Any,
    inputs: StepInputs,
    *,
    loop_steps: int,
    channel: LoopChannel,
    step_fn: Callable[..., tuple[Any, Any, Any]],
    counts_width: int | None = None,
    stream_interval: int = 1,
    num_logprobs: int = 0,
    sum_smaller: bool = False,
) -> tuple[Any, Any, LoopOutput]:
    """Run a decode-loop plan's iterations (module docstring) with ``step_fn(params, cache, state, inputs)`` --
    the engine's step with its static options bound -- as one ``lax.while_loop``.

    The ordered host callback (``channel``'s :meth:`LoopChannel.emitter`) is made after every ``stream_interval``
    iterations and after the call's final one, with one int32 payload: :class:`PackedLayout`'s header, then the
    call's buffer of iteration rows (one argument: each argument of a host callback costs tens of microseconds
    on the host).
    ``counts_width``: the steps return expert counts of that width per device (summed over the iterations into
    :attr:`LoopOutput.expert_counts`); ``None``: they return none. ``num_logprobs`` and ``sum_smaller`` are the
    step's (the widths of its sampler fields)."""
    loop = inputs.loop
    if loop is None:
        raise ValueError("loop_step: the plan has no decode loop (StepInputs.loop is None)")
    if inputs.prompt_targets is not None:
        raise ValueError("loop_step: a decode-loop plan computes no prompt logprobs")
    if not 0 <= stream_interval <= loop_steps:
        raise ValueError(
            f"loop_step: stream_interval = {stream_interval} must be in [0, loop_steps = {loop_steps}]"
        )
    base = inputs._replace(loop=None)
    d, s = base.seq_slots.shape
    iterations = loop.iterations
    alive0 = base.sample & (iterations > 0) & (base.seq_slots >= 0)
    k = 0
    if base.spec is not None:
        k = int(state.drafts.shape[-1])
        # A row whose in-flight tokens completed it already (the host ends it when they arrive) runs as scratch.
        alive0 = alive0 & (_next_pos(state, base.seq_slots) + 1 < loop.limits)
    counts0 = None if counts_width is None else jnp.zeros((d, counts_width), jnp.int32)
    layout = PackedLayout(d, s, num_logprobs, sum_smaller, k)
    emit = channel.emitter(layout) if stream_interval else None
    buffer0 = jnp.zeros((loop_steps, d, s, layout.width), jnp.int32)

    def cond(carry: Any) -> jax.Array:
        # Iteration 0 always runs (and reports): a speculative call whose rows all finished with the tokens of
        # the call before it runs them as scratch, and the host still gets the call's one, last, iteration.
        j, _, _, alive, *_ = carry
        return (j == 0) | ((j < loop_steps) & jnp.any(alive))

    def body(carry: Any) -> Any:
        j, cache, state, alive, counts, buffer = carry
        cache, state, out = step_fn(params, cache, state, iteration_inputs(base, j, alive))
        # [D, S, E]: a speculative row emits its accepted drafts and the bonus token, in order (E = K + 1); a
        # plain row is a run of one (E = 1). A row stops on a stop id or an unusable logit (a token below 0)
        # among its emitted tokens.
        tokens = out.tokens if k else out.tokens[..., None]
        emitted = jnp.arange(k + 1, dtype=jnp.int32) <= (out.num_accepted[..., None] if k else 0)
        hit = jnp.any(
            (tokens[..., None] == loop.stop_ids[:, :, None]) & (loop.stop_ids[:, :, None] >= 0), axis=-1
        )
        stopped = jnp.any(emitted & (hit | (tokens < 0)), axis=-1)
        if k:  # the host knows a speculative row's length only as a lower bound while the call runs
            stopped = stopped | (_next_pos(state, base.seq_slots) + 1 >= loop.limits)
        after = alive & ~stopped & (j + 1 < iterations)
        last = (j + 1 >= loop_steps) | ~jnp.any(after)
        buffer = buffer.at[j].set(layout.pack(out, alive))
        first = j - j % stream_interval

        def flush() -> None:
            header = jnp.stack([loop.call[0], first, j + 1 - first, last.astype(jnp.int32)]).astype(jnp.int32)
            io_callback(emit, None, jnp.concatenate([header, buffer.reshape(-1)]), ordered=True)

        if stream_interval:
            jax.lax.cond(last | ((j + 1) % stream_interval == 0), flush, lambda: None)
        if counts is not None:
            counts = counts + out.expert_counts
        return j + 1, cache, state, after, counts, buffer

    j, cache, state, alive, counts, buffer = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cache, state, alive0, counts0, buffer0)
    )
    payload = None
    if (
        not stream_interval
    ):  # no callbacks: the call returns its iterations' rows for the host to read after it
        header = jnp.stack([loop.call[0], jnp.int32(0), j, jnp.int32(1)]).astype(jnp.int32)
        payload = jnp.broadcast_to(jnp.concatenate([header, buffer.reshape(-1)]), (d, 4 + buffer.size))
    return cache, state, LoopOutput(jnp.full((d,), j, jnp.int32), alive, counts, payload)


class PackedLayout(NamedTuple):
    """How a decode loop packs one iteration's sampler outputs into int32 rows ``[D, S, width]`` (float32 values
    as their bits): the row's alive flag, then per emitted position (1, or ``K + 1`` in a speculative engine)
    the token, its rank, its logprob, ``n`` alternatives' ids and logprobs and (with ``sum_smaller``) the
    token's and the alternatives' CDFs; a speculative engine adds each row's accepted and verified draft
    counts, its confidence error, its next drafts' confidences and the drafts. A payload is ``(call, first,
    count, last)`` followed by the call's whole ``[loop_steps, D, S, width]`` buffer."""

    d: int
    s: int
    n: int
    sum_smaller: bool
    k: int = 0

    def fields(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """``(name, per-row shape, float)`` of every packed field, in order (the step's output names)."""
        e = (self.k + 1,) if self.k else ()
        out = [
            ("tokens", e, False),
            ("rank", e, False),
            ("logprob", e, True),
            ("top_ids", (*e, self.n), False),
            ("top_logprobs", (*e, self.n), True),
        ]
        if self.sum_smaller:
            out += [("sum_smaller", e, True), ("top_sum_smaller", (*e, self.n), True)]
        if self.k:
            out += [
                ("num_accepted", (), False),
                ("num_drafts", (), False),
                ("confidence_error", (), True),
                ("confidences", (self.k,), True),
                ("drafts", (self.k,), False),
            ]
        return out

    @property
    def width(self) -> int:
        return 1 + sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in self.fields())

    def pack(self, out: Any, alive: jax.Array) -> jax.Array:
        parts = [alive.astype(jnp.int32).reshape(self.d, self.s, 1)]
        for name, shape, is_float in self.fields():
            x = getattr(out, name)
            if is_float:
                x = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
            size = int(np.prod(shape, dtype=np.int64))
            parts.append(x.astype(jnp.int32).reshape(self.d, self.s, size))
        return jnp.concatenate(parts, axis=-1)

    def unpack(self, payload: np.ndarray) -> tuple[int, int, int, bool, dict[str, np.ndarray], np.ndarray]:
        """``(call, first, count, last, fields [count, D, S, ...], alive [count, D, S])`` of a payload (numpy)."""
        call, first, count, last = (int(x) for x in payload[:4])
        rows = payload[4:].reshape(-1, self.d, self.s, self.width)[first : first + count]
        fields = {}
        offset = 1
        for name, shape, is_float in self.fields():
            size = int(np.prod(shape, dtype=np.int64))
            a = np.ascontiguousarray(rows[..., offset : offset + size]).reshape(*rows.shape[:3], *shape)
            fields[name] = a.view(np.float32) if is_float else a
            offset += size
        return call, first, count, bool(last), fields, rows[..., 0].astype(np.bool_)


class LoopItem(NamedTuple):
    """One iteration's outputs on the host: its index, the sampler fields (numpy ``[D, S, ...]``), the rows that
    sampled in it, whether it was the call's last, and the call's number."""

    iteration: int
    fields: dict[str, np.ndarray]
    alive: np.ndarray
    last: bool
    call: int = 0


class LoopChannel:
    """The host end of the decode loop's callbacks: one queue per executor, filled in program order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[LoopItem] = queue.Queue()
        self._lock = threading.Lock()

    def emitter(self, layout: PackedLayout) -> Callable[[Any], None]:
        """The ``io_callback`` target of a compiled loop of this ``layout``: unpack the payload and queue one item
        per iteration (nothing else, so the device is not held up long)."""

        def emit(payload: Any) -> None:
            call, first, count, last, fields, alive = layout.unpack(np.asarray(payload))
            for i in range(count):
                item = LoopItem(
                    first + i, {k: v[i] for k, v in fields.items()}, alive[i], last and i == count - 1, call
                )
                self._queue.put(item)

        return emit

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

    def __init__(
        self,
        plan: StepPlan,
        out: LoopOutput | concurrent.futures.Future[Any],
        channel: LoopChannel,
        layout: PackedLayout,
        call: int,
    ) -> None:
        self.plan = plan
        self.call = call
        # A call with host callbacks is dispatched from the executor's worker thread: its outputs arrive as the
        # Future of (cache, state, LoopOutput).
        self._future = out if isinstance(out, concurrent.futures.Future) else None
        self._out = None if self._future is not None else out
        self.streams = self._future is not None or out.payload is None
        """Whether the call's iterations arrive through host callbacks (else all at once when it is done)."""
        self._channel = channel
        self._layout = layout
        self._done = False

    @property
    def out(self) -> LoopOutput:
        """The call's :class:`LoopOutput` (waits for the dispatch of a call the worker thread runs)."""
        if self._out is None:
            self._out = self._future.result()[2]
        return self._out

    @property
    def tokens(self) -> jax.Array:
        """What a caller timing the call waits on (the call's iteration count)."""
        return self.out.iterations

    @property
    def expert_counts(self) -> jax.Array | None:
        return self.out.expert_counts

    def items(self, poll_s: float = 0.05) -> Iterator[LoopItem]:
        """The call's iterations in order as their callbacks arrive, up to the last (without callbacks: all of them
        once the call is done). If the call fails on the device, its error is raised here instead of waiting
        forever."""
        if self._done:
            raise RuntimeError("LoopStep.items: this call's iterations were taken already")
        self._done = True
        if not self.streams:  # no callbacks: every iteration once the call is done
            _, first, count, _, fields, alive = self._layout.unpack(
                np.asarray(jax.device_get(self.out.payload))[0]
            )
            for i in range(count):
                yield LoopItem(first + i, {k: v[i] for k, v in fields.items()}, alive[i], i == count - 1)
            return
        expected = 0
        while True:
            item = self._channel.get(poll_s)
            if item is None:
                if self._future is not None and not self._future.done():
                    continue  # still running (a failed dispatch raises once it is done, just below)
                if self.out.iterations.is_ready():
                    jax.block_until_ready(self.out.iterations)  # raises the device's error, if any
                    item = self._channel.get(poll_s)  # the last callback runs before the call completes
                    if item is None:
                        raise RuntimeError(
                            "decode loop: the call completed without its last iteration's outputs"
                        )
                else:
                    continue
            if item.call < self.call:
                continue  # an earlier call the host gave up on (a failed run) delivered it late
            if item.call != self.call or item.iteration != expected:
                raise RuntimeError(
                    f"decode loop: iteration {item.iteration} of call {item.call} arrived where iteration {expected} of "
                    f"call {self.call} was expected (calls out of order)"
                )
            yield item
            if item.last:
                return
            expected += 1
