"""``GET /metrics``: Prometheus text of the server and its engine.

Counters and gauges of the engine are read from :meth:`AsyncLLM.stats
<deepinfer_jax.engine.async_llm.AsyncLLM.stats>` at scrape time; per-request latencies (TTFT, TPOT, end to end,
from the engine's own timestamps) and HTTP requests by route and status are recorded as they happen. Each server
has its own registry, so several servers in one process (tests) do not share numbers. Prefix-cache and
speculative-decoding counters appear once the engine reports them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from deepinfer_jax.engine.async_llm import AsyncLLM
from deepinfer_jax.engine.params import RequestOutput

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


class _EngineCollector:
    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        gauges = {
            "deepinfer_requests_running": ("requests holding a state slot", s.running),
            "deepinfer_requests_waiting": ("requests queued in the scheduler", s.waiting),
            "deepinfer_requests_unfinished": ("requests accepted and not finished", s.unfinished),
            "deepinfer_kv_cache_blocks_used": (
                "usable cache blocks in use, all devices",
                s.cache_blocks_used,
            ),
            "deepinfer_kv_cache_blocks_total": ("usable cache blocks, all devices", s.cache_blocks_total),
            "deepinfer_kv_cache_usage_ratio": ("fraction of the usable cache blocks in use", s.cache_usage),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters: dict[str, tuple[str, Any]] = {
            "deepinfer_requests_accepted": ("requests accepted by the engine", s.accepted),
            "deepinfer_requests_refused": ("requests refused over the admission bound (429)", s.refused),
            "deepinfer_prompt_tokens": ("prompt tokens of finished requests", s.prompt_tokens),
            "deepinfer_generation_tokens": ("generated tokens of finished requests", s.generation_tokens),
            "deepinfer_engine_steps": ("engine steps", s.steps),
            "deepinfer_preemptions": ("requests preempted for recompute", s.preemptions),
            "deepinfer_engine_step_failures": (
                "runs a failed step ended (the engine recovered; their requests ended with an error)",
                s.step_failures,
            ),
            "deepinfer_prefix_cache_hit_tokens": (
                "prompt tokens read from the prefix cache",
                s.prefix_cache_hit_tokens,
            ),
            "deepinfer_prefix_cache_query_tokens": (
                "prompt tokens looked up in the prefix cache",
                s.prefix_cache_query_tokens,
            ),
            "deepinfer_spec_draft_tokens": ("speculative draft tokens proposed", s.draft_tokens),
            "deepinfer_spec_accepted_tokens": ("speculative draft tokens accepted", s.accepted_draft_tokens),
        }
        for name, (doc, value) in counters.items():
            if value is not None:
                yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily(
            "deepinfer_requests_finished", "finished requests by finish reason", labels=["finish_reason"]
        )
        for reason in ("stop", "length", "abort", "error"):
            finished.add_metric([reason], s.finished.get(reason, 0))
        yield finished


class ServerMetrics:
    """The registry of one server: engine state at scrape time, latencies and HTTP requests as they happen."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))  # type: ignore[arg-type]
        self.http_requests = Counter(
            "deepinfer_http_requests",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds",
            "arrival to first token (the engine's clock)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "deepinfer_time_per_output_token_seconds",
            "time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "deepinfer_e2e_request_latency_seconds",
            "arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Histogram(
            "deepinfer_request_prompt_tokens",
            "prompt tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.generation_tokens = Histogram(
            "deepinfer_request_generation_tokens",
            "generated tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )

    def observe(self, output: RequestOutput) -> None:
        """Record a request's latencies when its finished output passes (other outputs are ignored)."""
        if not output.finished:
            return
        m = output.metrics
        if m.first_token_time is not None:
            self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
        n = m.num_generated_tokens
        if m.finish_time is not None:
            self.e2e.observe(max(m.finish_time - m.arrival_time, 0.0))
            if m.first_token_time is not None and n > 1:
                self.tpot.observe(max(m.finish_time - m.first_token_time, 0.0) / (n - 1))
        self.prompt_tokens.observe(m.num_prompt_tokens)
        self.generation_tokens.observe(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
