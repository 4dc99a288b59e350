"""The benchmark harness behind ``deepinfer-jax bench`` and ``deepinfer-jax sweep``.

A :class:`Workload` names the requests; :func:`run_benchmark` warms the engine up, times ``generate`` runs
(optionally alternating with a baseline process such as transformers ``generate`` in its own venv) and returns
a JSON-able report: throughput, TTFT/TPOT distributions, per-sequence speed, KV bytes per token, compile
counts, host vs wait time per step and the engine/baseline ratio. A workload with a ``request_rate`` runs
online instead: its requests enter the running engine at seeded Poisson (or gamma) arrival times
(:func:`run_online`), and the report adds the drawn and achieved request rates. See docs/benchmarks.md.
"""

from deepinfer_jax.bench.metrics import Distribution, RequestTiming, RunMetrics, distribution, run_metrics
from deepinfer_jax.bench.online import OnlineRun, run_online
from deepinfer_jax.bench.runner import EngineBench, ModelNotSupportedError, run_benchmark
from deepinfer_jax.bench.workload import LengthDist, Request, Workload, parse_length_dist

__all__ = [
    "Distribution",
    "EngineBench",
    "LengthDist",
    "ModelNotSupportedError",
    "OnlineRun",
    "Request",
    "RequestTiming",
    "RunMetrics",
    "Workload",
    "distribution",
    "parse_length_dist",
    "run_benchmark",
    "run_metrics",
    "run_online",
]
