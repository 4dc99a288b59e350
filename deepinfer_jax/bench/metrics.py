"""Benchmark metrics from per-request timestamps: throughput, TTFT, TPOT and per-sequence speed.

Definitions (all times in seconds of one clock):

* **TTFT** (time to first token): ``first_token_time - arrival_time``. The engine stamps the first token when it
  reaches the host, so this includes the readback.
* **TPOT** (time per output token after the first): ``(finish_time - first_token_time) / (n - 1)`` for a
  request with ``n >= 2`` output tokens; requests with one token have no TPOT and are left out of it.
* **Per-sequence tokens/s** (what one user sees while its answer streams): ``1 / TPOT``; the end-to-end rate
  ``n / (finish_time - arrival_time)`` is reported beside it.
* **Throughput**: total prompt (input) and generated (output) tokens divided by the run's wall time.

Percentiles use numpy's default linear interpolation between order statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["PERCENTILES", "Distribution", "RequestTiming", "RunMetrics", "distribution", "run_metrics"]

PERCENTILES: tuple[int, ...] = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class Distribution:
    """Summary of a sample: count, mean, min, max and the :data:`PERCENTILES` (``p50``, ``p90``, ``p99``)."""

    count: int
    mean: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float

    def to_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def distribution(values: Iterable[float]) -> Distribution | None:
    """The :class:`Distribution` of ``values``; ``None`` for an empty sample (nothing to summarise)."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return None
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"distribution: values must be finite, got {arr[~np.isfinite(arr)][:3].tolist()}")
    p50, p90, p99 = (float(np.percentile(arr, q)) for q in PERCENTILES)
    return Distribution(int(arr.size), float(arr.mean()), float(arr.min()), float(arr.max()), p50, p90, p99)


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    """Timestamps and token counts of one finished request (e.g. from ``RequestOutput.metrics``)."""

    arrival_time: float
    first_token_time: float
    finish_time: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if not self.arrival_time <= self.first_token_time <= self.finish_time:
            raise ValueError(
                "RequestTiming: expected arrival_time <= first_token_time <= finish_time, got "
                f"{self.arrival_time}, {self.first_token_time}, {self.finish_time}"
            )
        if self.output_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError(
                f"RequestTiming: prompt_tokens ({self.prompt_tokens}) and output_tokens ({self.output_tokens}) "
                "must be >= 1"
            )

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.output_tokens - 1)

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time

    @classmethod
    def from_output(cls, output: Any) -> RequestTiming:
        """From an engine ``RequestOutput`` (its ``metrics`` record)."""
        m = output.metrics
        if m.first_token_time is None or m.finish_time is None:
            raise ValueError(
                f"request {output.request_id}: it has not finished (no first-token or finish time)"
            )
        return cls(
            m.arrival_time,
            m.first_token_time,
            m.finish_time,
            len(output.prompt_token_ids),
            len(output.outputs[0].token_ids),
        )


@dataclasses.dataclass(frozen=True)
class RunMetrics:
    """Metrics of one measured run (see the module docstring for the definitions)."""

    num_requests: int
    wall_seconds: float
    input_tokens: int
    output_tokens: int
    input_tokens_per_s: float
    output_tokens_per_s: float
    ttft: Distribution
    tpot: Distribution | None
    seq_tokens_per_s: Distribution | None
    seq_e2e_tokens_per_s: Distribution
    latency: Distribution

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, Distribution) else v
        return out


def run_metrics(timings: Sequence[RequestTiming], wall_seconds: float) -> RunMetrics:
    """Summarise one run of ``timings`` that took ``wall_seconds``."""
    if not timings:
        raise ValueError("run_metrics: no request timings (a run needs at least one request)")
    if not wall_seconds > 0:
        raise ValueError(f"run_metrics: wall_seconds must be > 0, got {wall_seconds}")
    inp = sum(t.prompt_tokens for t in timings)
    out = sum(t.output_tokens for t in timings)
    tpots = [t.tpot for t in timings if t.tpot is not None]
    ttft = distribution(t.ttft for t in timings)
    latency = distribution(t.latency for t in timings)
    e2e = distribution(t.output_tokens / t.latency for t in timings if t.latency > 0)
    assert ttft is not None and latency is not None and e2e is not None
    return RunMetrics(
        num_requests=len(timings),
        wall_seconds=float(wall_seconds),
        input_tokens=inp,
        output_tokens=out,
        input_tokens_per_s=inp / wall_seconds,
        output_tokens_per_s=out / wall_seconds,
        ttft=ttft,
        tpot=distribution(tpots),
        seq_tokens_per_s=distribution(1.0 / x for x in tpots if x > 0),
        seq_e2e_tokens_per_s=e2e,
        latency=latency,
    )
