"""Online benchmark runs: requests enter the running engine at their arrival times (continuous batching).

An offline run hands every request to ``generate`` at once, so the engine sees the whole workload from its first
step and TTFT measures only the engine. A server sees requests arrive one by one while earlier ones are running;
how long a new request waits before its prefill is scheduled is then part of its TTFT. :func:`run_online`
reproduces that without a server: it drives the engine's own host loop
(:meth:`~deepinfer_jax.engine.runner.EngineRunner.run` with a ``poll`` callback) and, before every scheduling
round, hands the scheduler (``scheduler.add_request``) each request whose arrival time has passed. Requests are
stamped with their *drawn* arrival time, not with the moment the loop noticed them, so a request that arrives
while a step runs is charged the wait until the next round -- as a server's queue would charge it.

Everything runs on the engine's clock (``time.monotonic``, the scheduler's default), so arrival, first-token
and finish times of the outputs can be compared directly. When nothing is queued or running, the loop sleeps
until the next arrival instead of spinning. The engine runs one loop on every mesh, so online runs work on one
device and on a ``(dp, ep)`` mesh alike (the router places each arrival on a device).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_jax.bench.metrics import Distribution, distribution
from deepinfer_jax.engine.llm import LLM, derive_seed
from deepinfer_jax.engine.params import RequestOutput, SamplingParams, validate_request
from deepinfer_jax.engine.runner import RunStats

__all__ = ["OnlineRun", "run_online"]

_RUN_IDS = itertools.count()
"""Numbers the online runs of this process, so request ids never collide with a previous run's."""


@dataclasses.dataclass(frozen=True)
class OnlineRun:
    """What one online run returns.

    Attributes:
      outputs: the finished requests, in the order of the prompts given.
      stats: the runner's counters of the run.
      start: the engine clock at arrival offset 0.
      arrivals: each request's arrival time (``start`` + its offset): the ``arrival_time`` it was stamped with.
      admitted: the engine clock when the loop handed each request to the scheduler (``>=`` its arrival).
      end: the engine clock when the last request had finished and the loop had returned.
    """

    outputs: list[RequestOutput]
    stats: RunStats
    start: float
    arrivals: tuple[float, ...]
    admitted: tuple[float, ...]
    end: float

    @property
    def wall_seconds(self) -> float:
        """From the first arrival to the end of the run: the time throughput is measured over."""
        return self.end - self.start

    @property
    def admission_delay(self) -> Distribution | None:
        """How long after arriving each request waited for the loop's next round (part of its TTFT)."""
        return distribution(a - t for a, t in zip(self.admitted, self.arrivals))

    def summary(self, request_rate: float | None, burstiness: float) -> dict[str, Any]:
        """The request-rate numbers of the run (JSON-able).

        ``drawn_request_rate`` is the rate of this draw of arrivals (``(n - 1) / (last - first arrival)``),
        ``achieved_request_rate`` the rate at which requests really entered the engine (the same over the
        admission times; lower when steps are long enough to delay admissions), and ``request_throughput`` the
        finished requests per second of the run's wall time (vLLM's "request throughput").
        """
        n = len(self.arrivals)

        def rate(times: Sequence[float]) -> float | None:
            span = times[-1] - times[0]
            return (n - 1) / span if n > 1 and span > 0 else None

        delay = self.admission_delay
        return {
            "request_rate": request_rate,
            "burstiness": burstiness,
            "drawn_request_rate": rate(self.arrivals),
            "achieved_request_rate": rate(self.admitted),
            "request_throughput": n / self.wall_seconds,
            "arrival_span_seconds": self.arrivals[-1] - self.arrivals[0],
            "admission_delay": None if delay is None else delay.to_dict(),
        }


def run_online(
    llm: LLM,
    prompt_token_ids: Sequence[Sequence[int]],
    sampling_params: Sequence[SamplingParams],
    arrival_offsets: Sequence[float],
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> OnlineRun:
    """Serve ``prompt_token_ids`` arriving at ``arrival_offsets`` (seconds from now) through ``llm``'s engine.

    Every request is validated before the first one is admitted (bad input raises and nothing runs); afterwards
    ``llm.last_stats`` holds the run's counters, as after ``generate``. Request
    ``i`` gets the sampling seed ``generate`` would give it as the ``i``-th prompt of one call
    (:func:`~deepinfer_jax.engine.llm.derive_seed`) unless its parameters set ``seq_seed``, so an online run
    samples the same tokens as the offline run of the same requests.

    Args:
      llm: the engine.
      prompt_token_ids: one list of ids per request.
      sampling_params: one per request.
      arrival_offsets: non-decreasing offsets in seconds, one per request.
      sleep: how the loop waits for the next arrival when the engine is idle.
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt_token_ids: the list of prompts is empty")
    for name, seq in (("sampling_params", sampling_params), ("arrival_offsets", arrival_offsets)):
        if len(seq) != n:
            raise ValueError(f"{name}: {len(seq)} entries for {n} prompts; give one per prompt")
    offsets = [float(x) for x in arrival_offsets]
    for i, x in enumerate(offsets):
        if not (x >= 0.0 and math.isfinite(x)) or (i and x < offsets[i - 1]):
            raise ValueError(
                f"arrival_offsets[{i}] = {x}: offsets must be finite, >= 0 and non-decreasing "
                f"(the previous one is {offsets[i - 1] if i else None})"
            )
    cfg = llm.model.config
    arrays = []
    for i, (ids, p) in enumerate(zip(prompt_token_ids, sampling_params)):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}]: expected a SamplingParams, got {type(p).__name__}")
        arrays.append(
            validate_request(ids, p, vocab_size=cfg.vocab_size, max_model_len=llm.max_model_len, index=i)
        )
        if p.stop and llm.tokenizer is None:
            raise ValueError(f"request {i}: sampling_params.stop needs a tokenizer; this model has none")
    run_id = next(_RUN_IDS)
    request_ids = [f"online-{run_id}-{i}" for i in range(n)]
    seeds = [
        p.seq_seed if p.seq_seed is not None else derive_seed(llm.seed, i)
        for i, p in enumerate(sampling_params)
    ]
    scheduler = llm.scheduler
    clock = time.monotonic  # the scheduler's clock: its metrics and our arrival stamps must share it
    start = clock()
    arrivals = [start + x for x in offsets]
    admitted = [0.0] * n
    next_i = 0

    def admit_due() -> None:
        nonlocal next_i
        now = clock()
        while next_i < n and arrivals[next_i] <= now:
            i = next_i
            scheduler.add_request(
                request_ids[i], arrays[i], sampling_params[i], seed=seeds[i], arrival_time=arrivals[i]
            )
            admitted[i] = now
            next_i += 1

    def poll() -> bool:
        admit_due()
        while next_i < n and not scheduler.has_unfinished_requests():
            # Nothing to run until the next arrival: wait for it rather than spin the host loop.
            sleep(max(0.0, arrivals[next_i] - clock()))
            admit_due()
        return next_i < n

    outputs, stats = llm.runner.run(poll=poll)
    llm.last_stats = stats
    end = clock()
    by_id = {o.request_id: o for o in outputs}
    missing = [rid for rid in request_ids if rid not in by_id]
    if missing:
        raise RuntimeError(
            f"online run: the engine returned no output for {len(missing)} request(s): {missing[:3]}"
        )
    return OnlineRun(
        outputs=[by_id[rid] for rid in request_ids],
        stats=stats,
        start=start,
        arrivals=tuple(arrivals),
        admitted=tuple(admitted),
        end=end,
    )
