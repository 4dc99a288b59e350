"""The host loop around the jitted step: schedule, dispatch, and process the previous step's tokens.

The loop keeps one step in flight (ARCHITECTURE §4): it schedules and dispatches step N+1, and only then reads
step N's sampled tokens back and hands them to the scheduler. Step N+1 never needs them on the host -- a
decode row's input is the ``-1`` "pending" id, which the device resolves from its own state -- so the host's
bookkeeping (detokenization, stop checks, freeing blocks) overlaps the device's work. When nothing new can be
scheduled (everything waits for in-flight tokens) the oldest step is processed first.

The same loop serves one device and any ``(dp, ep)`` mesh: a step is one
:class:`~deepinfer_jax.engine.plan.StepPlan` over every device, and its results come back as arrays with a
leading device axis that the scheduler hands to each device. With an expert balancer (EPLB, ``ep > 1``), each
step also returns its expert counts, and the balancer re-places expert slots between steps.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from deepinfer_jax.engine.mesh_eplb import MeshExpertBalancer
from deepinfer_jax.engine.params import RequestOutput
from deepinfer_jax.engine.plan import StepPlan
from deepinfer_jax.engine.scheduler import Scheduler
from deepinfer_jax.engine.step import SplitStep, StepExecutor, StepOutput
from deepinfer_jax.parallel.mesh import mesh_sizes

__all__ = ["EngineRunner", "InFlight", "RunStats", "RunnerOptions", "SpecCounters"]


@dataclasses.dataclass
class RunStats:
    """Counters of one :meth:`EngineRunner.run` call.

    Attributes:
      steps, prompt_tokens, generated_tokens, seconds, compile_count, compile_seconds: what ran and how long
        (``seconds`` includes the compile time; the rates of :meth:`summary` do not).
      compile_cache_hits: of ``compile_count``, the compilations served from the persistent compilation cache.
      dp, ep: the mesh.
      placeholder_plans: per-device parts of steps that were all padding (a device with nothing to run while
        others ran).
      eplb_rearrangements: expert re-placements done during the run (EPLB).
      moe_lb: ``Σ max / Σ mean`` rows per EP rank over the run's steps and MoE layers (1.0 = even; ``None``:
        not measured, or no token routed).
      prefix_queries, prefix_hits: prompt tokens looked up in the prefix cache at admission and those found
        cached (docs/prefix_cache.md); snapshots, snapshot_restores: window-state snapshots written and restored.
      loop_steps, loop_iterations: decode-loop calls (``scheduler.num_decode_steps > 1``; each counts as one of
        ``steps``) and the decode iterations they ran.
    """

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    compile_count: int = 0
    compile_seconds: float = 0.0
    compile_cache_hits: int = 0
    dp: int = 1
    ep: int = 1
    placeholder_plans: int = 0
    eplb_rearrangements: int = 0
    moe_lb: float | None = None
    spec_rows: int = 0
    spec_emitted: int = 0
    verified_at: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()
    confidence_error_sum: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    snapshots: int = 0
    snapshot_restores: int = 0
    loop_steps: int = 0
    loop_iterations: int = 0

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prefix cache hits over queried prompt tokens (``None``: nothing was looked up)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    @property
    def confidence_error(self) -> float | None:
        """Mean ``|acceptance probability - confidence|`` per verified draft; ``None`` without drafts."""
        verified = sum(self.verified_at)
        return self.confidence_error_sum / verified if verified else None

    @property
    def acceptance_rates(self) -> tuple[float, ...]:
        """Speculative decoding: ``accepted@k / verified@k`` for each draft position ``k`` (empty without drafts)."""
        return tuple(a / v if v else 0.0 for a, v in zip(self.accepted_at, self.verified_at, strict=True))

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a decode row with drafts emitted on average (``1 + accepted / rows``); ``None`` without drafts."""
        return self.spec_emitted / self.spec_rows if self.spec_rows else None

    @property
    def verified_per_step(self) -> float | None:
        """Drafts a decode row verified on average (``Σ verified / rows``, rows left without drafts included);
        ``None`` without drafts."""
        return sum(self.verified_at) / self.spec_rows if self.spec_rows else None

    @property
    def run_seconds(self) -> float:
        """The run's time less its compile time."""
        return max(self.seconds - self.compile_seconds, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over :attr:`run_seconds` (0 for an empty run)."""
        run = self.run_seconds
        return self.generated_tokens / run if run > 0 else 0.0

    def summary(self, num_requests: int) -> str:
        """One line: requests, tokens, tokens/s and compile time (and the mesh, when it has several devices).

        The rate is over the run's time less its compile time: a first run that spends most of its time compiling
        reports how fast it generated, not how long it compiled."""
        rate = self.tokens_per_second
        cached = f", {self.compile_cache_hits} from the cache" if self.compile_cache_hits else ""
        line = (
            f"{num_requests} requests, {self.prompt_tokens} prompt + {self.generated_tokens} generated tokens in "
            f"{self.seconds:.2f} s ({rate:.1f} tokens/s excluding compilation), {self.steps} steps, "
            f"{self.compile_count} compilations ({self.compile_seconds:.2f} s{cached})"
        )
        if self.spec_rows:
            rates = "/".join(f"{r:.2f}" for r in self.acceptance_rates)
            line += (
                f", speculative: {self.verified_per_step:.2f} drafts verified per decode row, mean accepted length "
                f"{self.mean_accepted_length:.2f}, acceptance per position {rates}, confidence error "
                f"{self.confidence_error:.3f}"
            )
        if self.loop_steps:
            line += (
                f", decode loop: {self.loop_steps} calls of {self.loop_iterations / self.loop_steps:.1f} "
                "iterations on average"
            )
        if self.prefix_queries:
            line += (
                f", prefix cache: {self.prefix_hits} of {self.prefix_queries} prompt tokens cached "
                f"({100 * (self.prefix_hit_rate or 0.0):.1f}%)"
            )
        if self.dp * self.ep == 1:
            return line
        extra = ""
        if self.moe_lb is not None:
            extra = f", moe_lb {self.moe_lb:.3f}, {self.eplb_rearrangements} expert re-placements"
        return (
            f"{line} on {self.dp * self.ep} devices (dp={self.dp} x ep={self.ep}, "
            f"{self.placeholder_plans} placeholder plans{extra})"
        )


class InFlight(NamedTuple):
    """A dispatched step: its outputs and the expert placements it ran with (EPLB's snapshot, or ``None``)."""

    out: StepOutput | SplitStep
    """The step's outputs; a :class:`SplitStep` until the runner dispatched its sample half (``_finish``)."""
    snapshot: Any
    dispatched: float = 0.0
    """``time.perf_counter()`` when the step was dispatched."""

    @property
    def tokens(self) -> jax.Array:
        """The step's sampled tokens (what a caller timing the step waits on)."""
        return self.out.tokens


def _to_host(x: jax.Array) -> np.ndarray:
    """All of a global array on this host: every process reads every device's rows (SPMD: each process's
    schedulers then make the same decisions). An explicit transfer (the transfer guard allows it)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return multihost_utils.process_allgather(x, tiled=True)


def _tree_to_host(tree: Any) -> Any:
    """:func:`_to_host` of every leaf; one ``jax.device_get`` for a fully addressable tree (its copies overlap)."""
    leaves = jax.tree.leaves(tree)
    if all(x.is_fully_addressable for x in leaves):
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.tree.map(_to_host, tree)


class SpecCounters(NamedTuple):
    """The scheduler's speculative-decoding counters at one moment (summed over devices)."""

    rows: int = 0
    emitted: int = 0
    verified_at: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()
    confidence_error_sum: float = 0.0

    def since(self, before: SpecCounters) -> SpecCounters:
        """What was counted after ``before`` (per-position lists elementwise; ``before``'s may be shorter)."""

        def minus(after: tuple[int, ...], earlier: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(a - (earlier[i] if i < len(earlier) else 0) for i, a in enumerate(after))

        return SpecCounters(
            self.rows - before.rows,
            self.emitted - before.emitted,
            minus(self.verified_at, before.verified_at),
            minus(self.accepted_at, before.accepted_at),
            self.confidence_error_sum - before.confidence_error_sum,
        )

    def record(self, stats: RunStats) -> RunStats:
        """``stats`` with its speculative fields set to these counts."""
        stats.spec_rows, stats.spec_emitted = self.rows, self.emitted
        stats.verified_at, stats.accepted_at = self.verified_at, self.accepted_at
        stats.confidence_error_sum = self.confidence_error_sum
        return stats


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """How the loop runs (the config fields of the same names, docs/config.md).

    Attributes:
      async_scheduling: dispatch step N+1 before reading step N's tokens (False: process every step first).
      stats_log_interval_steps: steps between statistics log lines (<= 0: none).
      gc_interval_steps: > 0: automatic garbage collection off during a run, a collection every this many steps.
      transfer_guard: implicit host<->device transfers during a run are errors (``jax.transfer_guard``).
    """

    async_scheduling: bool = True
    stats_log_interval_steps: int = 0
    gc_interval_steps: int = 0
    transfer_guard: bool = False


@contextlib.contextmanager
def _manual_gc(interval: int) -> Iterator[None]:
    if interval <= 0:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class EngineRunner:
    """Drives a :class:`Scheduler` and a :class:`StepExecutor` until every request has finished.

    Args:
      scheduler: the engine's scheduler (owns requests, blocks and slots of every device).
      executor: the device step (owns every device's cache and per-slot state).
      balancer: EPLB for a mesh with ``ep > 1`` (the executor must return expert counts), or ``None``.
      options: :class:`RunnerOptions` (default: asynchronous, no statistics lines, Python's own GC, no guard).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepExecutor,
        *,
        balancer: MeshExpertBalancer | None = None,
        options: RunnerOptions | None = None,
    ) -> None:
        if scheduler.num_devices != executor.num_devices:
            raise ValueError(
                f"EngineRunner: a scheduler of {scheduler.num_devices} devices for a mesh of "
                f"{executor.num_devices} devices"
            )
        if balancer is not None and not executor.returns_expert_counts:
            raise ValueError("EngineRunner: a balancer needs an executor built with expert_counts=True")
        self.scheduler = scheduler
        self.executor = executor
        self.balancer = balancer
        self.options = options or RunnerOptions()
        self.placeholder_plans = 0
        """Per-device placeholder parts dispatched so far."""
        self._last_done = 0.0
        # During run: where a decode loop's iterations deliver their outputs before the call's last one.
        self._early: Callable[[list[RequestOutput]], None] | None = None
        self.loop_steps = 0
        """Decode-loop calls processed so far."""
        self.loop_iterations = 0
        """Decode iterations those calls ran."""

    def _dispatch(self, plan: StepPlan) -> InFlight:
        start = time.perf_counter()
        out = self.executor.run(plan)
        self.placeholder_plans += plan.num_placeholders
        return InFlight(out, None if self.balancer is None else self.balancer.snapshot(), start)

    def _streams_before_dispatch(self, step: InFlight) -> bool:
        """``step`` is a decode-loop call that streams its iterations through host callbacks on devices whose next
        dispatch waits for such a call to have run (XLA:CPU: ``StepExecutor.callbacks_hold_dispatch``): the
        runner processes it before it dispatches the next step, so its iterations are processed while it runs
        instead of after. Elsewhere the next step is dispatched first and the call processed while that runs."""
        return bool(
            getattr(step.out, "streams", False) and getattr(self.executor, "callbacks_hold_dispatch", False)
        )

    def _finish(self, plan: StepPlan, step: InFlight) -> InFlight:
        """A step dispatched in two halves (its plan has deferred grammar masks): fill the masks now that every
        step before it has been processed, and dispatch its sample half. Other steps are returned as they are."""
        if not isinstance(step.out, SplitStep):
            return step
        self.scheduler.fill_deferred_masks(plan)
        return step._replace(out=self.executor.finish(step.out))

    def _process_loop(self, plan: StepPlan, step: InFlight) -> list[RequestOutput]:
        """A decode-loop call: hand the scheduler each iteration as its callback delivers it (while the device
        runs the next ones); what finishes before the last iteration is delivered at once (``_early``)."""
        loop = step.out
        outputs: list[RequestOutput] = []
        self.loop_steps += 1
        for item in loop.items():
            self.loop_iterations += 1
            f = item.fields
            got = self.scheduler.process_outputs(
                plan,
                f["tokens"],
                iteration=item.iteration,
                last=item.last,
                alive=item.alive,
                logprob=f.get("logprob"),
                rank=f.get("rank"),
                top_ids=f.get("top_ids"),
                top_logprobs=f.get("top_logprobs"),
                sum_smaller=f.get("sum_smaller"),
                top_sum_smaller=f.get("top_sum_smaller"),
                num_accepted=f.get("num_accepted"),
                confidences=f.get("confidences"),
                confidence_error=f.get("confidence_error"),
                drafts=f.get("drafts"),
                num_drafts=f.get("num_drafts"),
            )
            if item.last or self._early is None:
                outputs.extend(got)
            else:
                self._early(got)
        self._last_done = time.perf_counter()
        if self.balancer is not None and loop.expert_counts is not None:
            self._balance(plan, loop.expert_counts, step.snapshot)
        return outputs

    def _balance(self, plan: StepPlan, expert_counts: jax.Array, snapshot: Any) -> None:
        counts = _to_host(expert_counts)
        if self.balancer is not None and self.balancer.observe(
            counts, prefill=plan.is_prefill, snapshot=snapshot
        ):
            # The next dispatch takes the re-placed slots; the step in flight keeps the arrays it was given.
            # The new placements travel to the devices: an intended transfer.
            with jax.transfer_guard("allow"):
                self.executor.params = self.balancer.rearrange(self.executor.params)

    def _process(self, plan: StepPlan, step: InFlight) -> list[RequestOutput]:
        if plan.inputs.loop is not None:
            return self._process_loop(plan, step)
        out = step.out
        host = _tree_to_host(out._replace(logits=None, expert_counts=None))
        done = time.perf_counter()
        # The step ran from its dispatch, or from the previous step's end if that came later.
        observe = getattr(self.scheduler, "observe_step", None)
        if observe is not None:
            observe(plan, (done - max(step.dispatched, self._last_done)) * 1000.0)
        self._last_done = done
        finished = self.scheduler.process_outputs(
            plan,
            host.tokens,
            logprob=host.logprob,
            rank=host.rank,
            top_ids=host.top_ids,
            top_logprobs=host.top_logprobs,
            prompt_logprobs=host.prompt,
            sum_smaller=host.sum_smaller,
            top_sum_smaller=host.top_sum_smaller,
            num_accepted=host.num_accepted,
            confidences=host.confidences,
            confidence_error=host.confidence_error,
            drafts=host.drafts,
            num_drafts=host.num_drafts,
        )
        if self.balancer is not None and out.expert_counts is not None:
            self._balance(plan, out.expert_counts, step.snapshot)
        return finished

    def spec_counters(self) -> SpecCounters:
        """The scheduler's speculative-decoding counters so far (summed over devices)."""
        st = getattr(self.scheduler, "stats", None)
        if st is None or not hasattr(st, "num_spec_rows"):
            return SpecCounters()
        return SpecCounters(
            st.num_spec_rows,
            st.num_spec_emitted,
            tuple(st.verified_at),
            tuple(st.accepted_at),
            st.confidence_error_sum,
        )

    def _prefix_counters(self) -> tuple[int, int, int, int]:
        st = getattr(self.scheduler, "stats", None)
        if st is None or not hasattr(st, "prefix_cache_queries"):
            return (0, 0, 0, 0)
        return (st.prefix_cache_queries, st.prefix_cache_hits, st.num_snapshots, st.num_snapshot_restores)

    def _periodic(self, stats: RunStats, start: float) -> None:
        """The statistics line and the garbage collection due after this many steps."""
        opts, n = self.options, stats.steps
        if opts.gc_interval_steps > 0 and n % opts.gc_interval_steps == 0:
            gc.collect()
        if opts.stats_log_interval_steps > 0 and n % opts.stats_log_interval_steps == 0:
            sched = self.scheduler
            free = sum(d.blocks.num_free for d in sched.devices)
            total = sum(d.blocks.capacity for d in sched.devices)
            rate = stats.generated_tokens / max(time.perf_counter() - start, 1e-9)
            logging.info(
                "engine: %d steps, %d running, %d waiting, %d of %d cache blocks in use, %.1f generated tokens/s "
                "(finished requests)",
                n,
                sched.num_running,
                sched.num_waiting,
                total - free,
                total,
                rate,
            )

    def run(
        self,
        on_finished: Callable[[RequestOutput], None] | None = None,
        *,
        poll: Callable[[], bool] | None = None,
        keep_outputs: bool = True,
        progress: Callable[[], None] | None = None,
    ) -> tuple[list[RequestOutput], RunStats]:
        """Run until no request is unfinished; returns the finished outputs and the run's stats.

        ``on_finished`` is called once per finished request as soon as it finishes (progress bars, or a server
        handing each output to its client). ``keep_outputs=False`` returns an empty list instead of every finished
        output (a long-lived caller that takes them through ``on_finished`` does not keep them all in memory).

        ``poll`` makes the loop serve requests that arrive while it runs (an online client, e.g. the request-rate
        benchmark): it is called before every scheduling round, may add requests to the scheduler, and returns
        True while more requests are still to come. The loop then keeps going even when nothing is queued or
        running; ``poll`` should wait for the next arrival itself when the engine is idle, or the loop spins.

        A decode-loop step (``scheduler.num_decode_steps > 1``) delivers its iterations one at a time while the
        device runs the rest: the requests that finish in an iteration reach ``on_finished`` at once, and
        ``progress`` (when given) is called after each iteration, so a streaming caller can emit the new tokens
        (a scheduling round, and so ``poll``, comes only after the call's last iteration).
        """
        dp, ep = mesh_sizes(self.executor.mesh)
        stats = RunStats(dp=dp, ep=ep)
        compiles, compile_s = self.executor.compile_count, self.executor.compile_seconds
        cache_hits = self.executor.compile_cache_hits
        placeholders = self.placeholder_plans
        spec_before = self.spec_counters()
        prefix_before = self._prefix_counters()
        loops_before = (self.loop_steps, self.loop_iterations)
        balancer = self.balancer
        peak, mean = (balancer.total_peak, balancer.total_mean) if balancer is not None else (0.0, 0.0)
        replaced = balancer.rearrangements if balancer is not None else 0
        start = time.perf_counter()
        finished: list[RequestOutput] = []
        in_flight: collections.deque[tuple[StepPlan, InFlight]] = collections.deque()

        def take(outputs: list[RequestOutput]) -> None:
            for output in outputs:
                if output.finished:
                    if keep_outputs:
                        finished.append(output)
                    stats.generated_tokens += sum(len(c.token_ids) for c in output.outputs)
                    stats.prompt_tokens += len(output.prompt_token_ids)
                    if on_finished is not None:
                        on_finished(output)

        def more() -> bool:
            # poll first, every round: what it adds joins the very next step.
            incoming = poll() if poll is not None else False
            return incoming or self.scheduler.has_unfinished_requests() or bool(in_flight)

        def early(outputs: list[RequestOutput]) -> None:
            take(outputs)
            if progress is not None:
                progress()

        self._early = early
        opts = self.options
        depth = 1 if opts.async_scheduling else 0  # steps left in flight while the next one is scheduled
        guard = jax.transfer_guard("disallow") if opts.transfer_guard else contextlib.nullcontext()
        try:
            with guard, _manual_gc(opts.gc_interval_steps):
                take(self.scheduler.take_ready_outputs())
                while more():
                    plan = self.scheduler.schedule()
                    if plan is not None:
                        if in_flight and self._streams_before_dispatch(in_flight[0][1]):
                            # The dispatch would wait for this call anyway: take its iterations as they arrive,
                            # while it runs (streaming), then dispatch the step planned meanwhile.
                            oldest, step = in_flight.popleft()
                            take(self._process(oldest, self._finish(oldest, step)))
                        in_flight.append((plan, self._dispatch(plan)))
                        stats.steps += 1
                        self._periodic(stats, start)
                    if in_flight and (plan is None or len(in_flight) > depth):
                        oldest, step = in_flight.popleft()
                        take(self._process(oldest, self._finish(oldest, step)))
                    elif plan is None:
                        take(self.scheduler.take_ready_outputs())
                        if (
                            not in_flight
                            and self.scheduler.has_unfinished_requests()
                            and not getattr(self.scheduler, "num_compiling", 0)
                        ):
                            raise RuntimeError(
                                "the scheduler has unfinished requests but can schedule nothing and has nothing in "
                                "flight"
                            )
                    if in_flight:
                        # A step split for deferred masks: every step before it is processed now (one in flight).
                        in_flight[0] = (in_flight[0][0], self._finish(*in_flight[0]))
        finally:
            self._early = None
        stats.seconds = time.perf_counter() - start
        stats.compile_count = self.executor.compile_count - compiles
        stats.compile_seconds = self.executor.compile_seconds - compile_s
        stats.compile_cache_hits = self.executor.compile_cache_hits - cache_hits
        stats.placeholder_plans = self.placeholder_plans - placeholders
        self.spec_counters().since(spec_before).record(stats)
        stats.loop_steps = self.loop_steps - loops_before[0]
        stats.loop_iterations = self.loop_iterations - loops_before[1]
        now = self._prefix_counters()
        (stats.prefix_queries, stats.prefix_hits, stats.snapshots, stats.snapshot_restores) = (
            a - b for a, b in zip(now, prefix_before, strict=True)
        )
        if balancer is not None:
            stats.eplb_rearrangements = balancer.rearrangements - replaced
            if balancer.total_mean > mean:
                stats.moe_lb = (balancer.total_peak - peak) / (balancer.total_mean - mean)
        return finished, stats
