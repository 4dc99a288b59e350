"""The host loop around the jitted step: schedule, dispatch, and process the previous step's tokens.

The loop keeps one step in flight (ARCHITECTURE §4): it schedules and dispatches step N+1, and only then reads
step N's sampled tokens back and hands them to the scheduler. Step N+1 never needs them on the host -- a
decode row's input is the ``-1`` "pending" id, which the device resolves from its own state -- so the host's
bookkeeping (detokenization, stop checks, freeing blocks) overlaps the device's work. When nothing new can be
scheduled (everything waits for in-flight tokens) the oldest step is processed first.

Per step the runner turns the scheduler's requests into :class:`~deepinfer_jax.sampling.SamplingTensors`
(their parameters, seeds and the positions of the tokens they sample) and the prompt lengths the penalties
need.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from deepinfer_jax.engine.params import RequestOutput
from deepinfer_jax.engine.plan import StepPlan
from deepinfer_jax.engine.scheduler import Scheduler
from deepinfer_jax.engine.step import StepExecutor, StepOutput
from deepinfer_jax.sampling import SamplingTensors

__all__ = [
    "LOGPROB_VARIANTS",
    "EngineRunner",
    "RunStats",
    "StepArguments",
    "logprob_variant",
    "step_arguments",
]

LOGPROB_VARIANTS: tuple[int, ...] = (0, 5, 20)
"""Top-n widths the step is compiled for; a step reports the smallest that covers every row's ``logprobs``."""


def logprob_variant(requested: int) -> int:
    """The compiled top-n width for a step whose rows ask for at most ``requested`` alternatives."""
    for n in LOGPROB_VARIANTS:
        if requested <= n:
            return n
    raise ValueError(f"logprobs = {requested} exceeds the maximum {LOGPROB_VARIANTS[-1]}")


@dataclasses.dataclass
class RunStats:
    """Counters of one :meth:`EngineRunner.run` call."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    compile_count: int = 0
    compile_seconds: float = 0.0

    def summary(self, num_requests: int) -> str:
        """One line: requests, tokens, tokens/s and compile time."""
        rate = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{num_requests} requests, {self.prompt_tokens} prompt + {self.generated_tokens} generated tokens in "
            f"{self.seconds:.2f} s ({rate:.1f} tokens/s), {self.steps} steps, "
            f"{self.compile_count} compilations ({self.compile_seconds:.2f} s)"
        )


class StepArguments(NamedTuple):
    """What one step needs besides its plan, built on the host from the plan's requests (:func:`step_arguments`).

    Attributes:
      sampling: the rows' :class:`~deepinfer_jax.sampling.SamplingTensors`.
      prompt_lens: int32 ``[S]`` each row's prompt length (0 for padding rows).
      num_logprobs: the compiled top-n width covering every row's ``logprobs``.
      prompt_targets: int32 ``[T]`` the next prompt token of every token whose request asked for prompt
        logprobs (``-1`` elsewhere), or ``None`` when no token of the step needs one.
      num_prompt_logprobs: the compiled width covering every such request's ``prompt_logprobs``.
    """

    sampling: SamplingTensors
    prompt_lens: np.ndarray
    num_logprobs: int
    prompt_targets: np.ndarray | None
    num_prompt_logprobs: int


def step_arguments(
    scheduler: Scheduler,
    plan: StepPlan,
    *,
    vocab_size: int,
    eos_token_ids: Sequence[int] = (),
    num_rows: int | None = None,
) -> StepArguments:
    """The :class:`StepArguments` of ``plan`` (scheduled by ``scheduler``), with ``num_rows`` rows (default the
    plan's ``S``; a mesh step pads every device's rows to its global bucket)."""
    requests = scheduler.rows(plan)
    n = plan.num_seqs
    rows = plan.padded_seqs if num_rows is None else num_rows
    positions = plan.context_lens[:n]
    prompt_lens = np.zeros(rows, np.int32)
    prompt_lens[:n] = [r.prompt_len for r in requests]
    sampling = SamplingTensors.build(
        [r.params for r in requests],
        [r.seed for r in requests],
        positions,
        vocab_size,
        output_lens=np.maximum(positions - prompt_lens[:n], 0),
        eos_token_ids=eos_token_ids,
        num_rows=rows,
    )
    wanted = max((r.params.logprobs or 0 for r in requests), default=0)
    targets, prompt_wanted = _prompt_targets(plan, requests)
    return StepArguments(
        sampling, prompt_lens, logprob_variant(wanted), targets, logprob_variant(prompt_wanted)
    )


def _prompt_targets(plan: StepPlan, requests: Sequence[Any]) -> tuple[np.ndarray | None, int]:
    """The next prompt token of every token whose request asked for prompt logprobs (``-1`` elsewhere), and
    the widest ``prompt_logprobs`` asked; ``(None, 0)`` when no token of the step needs one."""
    targets = None
    wanted = 0
    for i, req in enumerate(requests):
        n = req.params.prompt_logprobs
        if n is None:
            continue
        lo, hi = int(plan.query_start[i]), int(plan.query_start[i + 1])
        pos = plan.positions[lo:hi]
        inside = pos + 1 < req.prompt_len
        if not inside.any():
            continue
        if targets is None:
            targets = np.full(plan.padded_tokens, -1, np.int32)
        targets[lo:hi] = np.where(inside, req.prompt_token_ids[np.minimum(pos + 1, req.prompt_len - 1)], -1)
        wanted = max(wanted, n)
    return targets, wanted


class EngineRunner:
    """Drives a :class:`Scheduler` and a :class:`StepExecutor` until every request has finished.

    Args:
      scheduler: the host scheduler (owns requests, blocks and slots).
      executor: the device step (owns the cache and the per-slot state).
      vocab_size: width of the logits (for the sampling tensors).
      eos_token_ids: masked before a request's ``min_tokens``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepExecutor,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def _dispatch(self, plan: StepPlan) -> StepOutput:
        args = step_arguments(
            self.scheduler, plan, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids
        )
        return self.executor.run(
            plan,
            args.sampling,
            args.prompt_lens,
            num_logprobs=args.num_logprobs,
            prompt_targets=args.prompt_targets,
            num_prompt_logprobs=args.num_prompt_logprobs,
        )

    def _process(self, plan: StepPlan, out: StepOutput) -> list[RequestOutput]:
        tokens = np.asarray(out.tokens)
        prompt = None if out.prompt is None else tuple(np.asarray(a) for a in out.prompt)
        return self.scheduler.process_outputs(
            plan,
            tokens,
            logprob=np.asarray(out.logprob),
            rank=np.asarray(out.rank),
            top_ids=np.asarray(out.top_ids),
            top_logprobs=np.asarray(out.top_logprobs),
            prompt_logprobs=prompt,
        )

    def run(
        self,
        on_finished: Callable[[RequestOutput], None] | None = None,
        *,
        poll: Callable[[], bool] | None = None,
    ) -> tuple[list[RequestOutput], RunStats]:
        """Run until no request is unfinished; returns the finished outputs and the run's stats.

        ``on_finished`` is called once per finished request as soon as it finishes (progress bars).

        ``poll`` makes the loop serve requests that arrive while it runs (an online client, e.g. the request-rate
        benchmark): it is called before every scheduling round, may add requests to the scheduler, and returns
        True while more requests are still to come. The loop then keeps going even when nothing is queued or
        running; ``poll`` should wait for the next arrival itself when the engine is idle, or the loop spins.
        """
        stats = RunStats()
        compiles, compile_s = self.executor.compile_count, self.executor.compile_seconds
        start = time.perf_counter()
        finished: list[RequestOutput] = []
        in_flight: collections.deque[tuple[StepPlan, StepOutput]] = collections.deque()

        def take(outputs: list[RequestOutput]) -> None:
            for output in outputs:
                if output.finished:
                    finished.append(output)
                    stats.generated_tokens += len(output.outputs[0].token_ids)
                    stats.prompt_tokens += len(output.prompt_token_ids)
                    if on_finished is not None:
                        on_finished(output)

        def more() -> bool:
            # poll first, every round: what it adds joins the very next step.
            incoming = poll() if poll is not None else False
            return incoming or self.scheduler.has_unfinished_requests() or bool(in_flight)

        take(self.scheduler.take_ready_outputs())
        while more():
            plan = self.scheduler.schedule()
            if plan is not None:
                in_flight.append((plan, self._dispatch(plan)))
                stats.steps += 1
            if in_flight and (plan is None or len(in_flight) > 1):
                take(self._process(*in_flight.popleft()))
            elif plan is None:
                take(self.scheduler.take_ready_outputs())
                if not in_flight and self.scheduler.has_unfinished_requests():
                    raise RuntimeError(
                        "the scheduler has unfinished requests but can schedule nothing and has nothing in flight"
                    )
        stats.seconds = time.perf_counter() - start
        stats.compile_count = self.executor.compile_count - compiles
        stats.compile_seconds = self.executor.compile_seconds - compile_s
        return finished, stats
