"""The server load test: many concurrent streaming clients, requests of mixed lengths, some clients hanging up
mid-stream; every answer checked against the offline engine, the cache checked empty afterwards.

:func:`load_requests` draws the workload (a :class:`LoadSpec`): prompt lengths and output lengths uniform in
their ranges, a seed per request, and for a ``disconnect_fraction`` of the requests a chunk count after which
the client closes its stream. :func:`run_load_test` sends them through :func:`deepinfer_jax.bench.http.run_requests`
(closed loop, ``clients`` at once, bounded by ``deadline_s``), checks them with :func:`check_results` and
summarises the timings with :func:`load_summary`.

The check (:class:`LoadCheck`): a request that was not disconnected must end with a finish reason and exactly
the token ids the offline engine (``LLM.generate`` of the same prompt, sampling parameters and seed) gives, with
the usage counting them; a disconnected one must have received a prefix of them. Token equality holds when the
served engine is batch invariant (``batch_invariant=True``): online batches differ from offline ones, and only a
batch-invariant engine makes a request's tokens independent of the requests it shares steps with. The engine-side
checks (every block and slot free afterwards, one finish per request) are the caller's: it holds the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from deepinfer_jax.bench.http import HTTPRequest, HTTPResult, run_requests
from deepinfer_jax.bench.metrics import distribution
from deepinfer_jax.engine.params import SamplingParams

__all__ = ["LoadCheck", "LoadSpec", "check_results", "load_requests", "load_summary", "run_load_test"]


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """A load test's workload.

    Attributes:
      clients: concurrent streaming clients (closed loop: each sends its next request when its last one ends).
      requests: requests in all.
      prompt_len: (min, max) prompt tokens, inclusive.
      max_tokens: (min, max) tokens to generate, inclusive.
      disconnect_fraction: share of the requests whose client hangs up mid-stream.
      seed: draws the workload (prompts, lengths, per-request seeds, who disconnects).
      vocab: token ids of the prompts are drawn from ``[2, vocab)`` (0 and 1: BOS and EOS).
      deadline_s: the whole run is cancelled after this long (what is left reports as not finished).
    """

    clients: int = 64
    requests: int = 512
    prompt_len: tuple[int, int] = (4, 96)
    max_tokens: tuple[int, int] = (2, 48)
    disconnect_fraction: float = 0.125
    seed: int = 0
    vocab: int = 512
    deadline_s: float = 1200.0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"LoadSpec.{name} = {(lo, hi)} must satisfy 1 <= min <= max")
        if self.max_tokens[0] < 2 and self.disconnect_fraction > 0:
            raise ValueError(
                "LoadSpec.max_tokens: a disconnecting client needs at least 2 tokens to hang up between"
            )
        if not 0.0 <= self.disconnect_fraction <= 1.0:
            raise ValueError(f"LoadSpec.disconnect_fraction = {self.disconnect_fraction} must be in [0, 1]")
        if self.clients < 1 or self.requests < 1:
            raise ValueError(
                f"LoadSpec: clients = {self.clients} and requests = {self.requests} must be >= 1"
            )
        if self.vocab < 3:
            raise ValueError(f"LoadSpec.vocab = {self.vocab} must be >= 3")


def load_requests(spec: LoadSpec) -> list[HTTPRequest]:
    """The workload of ``spec``: random prompts and lengths, seeded sampling (temperature 1), EOS ignored so every
    request runs to its length; a disconnecting client hangs up after 1 .. max_tokens - 1 token chunks."""
    rng = np.random.default_rng(spec.seed)
    out = []
    for i in range(spec.requests):
        n = int(rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1))
        m = int(rng.integers(spec.max_tokens[0], spec.max_tokens[1] + 1))
        disconnect = int(rng.integers(1, m)) if rng.random() < spec.disconnect_fraction else None
        out.append(
            HTTPRequest(
                prompt_token_ids=tuple(int(t) for t in rng.integers(2, spec.vocab, n)),
                max_tokens=m,
                seed=spec.seed * 1_000_003 + i,
                disconnect_after=disconnect,
            )
        )
    return out


def offline_params(request: HTTPRequest) -> SamplingParams:
    """The offline sampling parameters of one load-test request (what the server builds from its body)."""
    return SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        max_tokens=request.max_tokens,
        seed=request.seed,
        ignore_eos=request.ignore_eos,
    )


@dataclasses.dataclass
class LoadCheck:
    """What the answers of a load test were, checked against the offline engine.

    ``complete``: requests that ended normally with the offline tokens; ``disconnected``: requests whose client hung
    up (their tokens a prefix of the offline ones); ``problems``: one line per request that broke a rule (lost,
    failed, other tokens, wrong usage), empty when the run holds.
    """

    complete: int = 0
    disconnected: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_results(
    requests: Sequence[HTTPRequest], results: Sequence[HTTPResult], offline: Sequence[Sequence[int]]
) -> LoadCheck:
    """Check each result against the offline tokens of its request (see the module docstring)."""
    check = LoadCheck()
    for i, (request, result, want) in enumerate(zip(requests, results, offline, strict=True)):
        want = list(want)
        got = result.token_ids
        if result.disconnected:
            check.disconnected += 1
            if got != want[: len(got)]:
                check.problems.append(f"request {i}: disconnected after tokens {got} not a prefix of {want}")
            continue
        if not result.complete:
            check.problems.append(f"request {i}: did not complete: {result.error or 'no finish reason'}")
            continue
        if got != want:
            check.problems.append(f"request {i}: tokens {got} differ from the offline engine's {want}")
            continue
        usage = result.usage or {}
        if usage.get("completion_tokens") != len(want) or usage.get("prompt_tokens") != len(
            request.prompt_token_ids
        ):
            check.problems.append(
                f"request {i}: usage {usage} does not count {len(request.prompt_token_ids)} + {len(want)}"
            )
            continue
        expected = "length"
        if result.finish_reason != expected:
            check.problems.append(
                f"request {i}: finish_reason {result.finish_reason!r}, expected {expected!r}"
            )
            continue
        check.complete += 1
    return check


def load_summary(results: Sequence[HTTPResult], start: float, end: float) -> dict[str, Any]:
    """Throughput and latency of a load test, from the client's clocks: requests/s and output tokens/s of the
    completed requests over the whole run, TTFT (send to first token) and TPOT (first to last token, per token
    after the first) distributions in seconds."""
    done = [r for r in results if r.complete]
    span = end - start
    ttft = distribution(r.first_token - r.sent for r in done if r.first_token is not None)
    tpot = distribution(
        (r.finished - r.first_token) / (len(r.token_ids) - 1)
        for r in done
        if r.first_token is not None and r.finished is not None and len(r.token_ids) > 1
    )
    return {
        "requests": len(results),
        "completed": len(done),
        "disconnected": sum(r.disconnected for r in results),
        "duration_seconds": span,
        "requests_per_second": len(done) / span if span > 0 else None,
        "output_tokens_per_second": sum(len(r.token_ids) for r in done) / span if span > 0 else None,
        "ttft_seconds": None if ttft is None else ttft.to_dict(),
        "tpot_seconds": None if tpot is None else tpot.to_dict(),
    }


def run_load_test(
    url: str,
    model: str,
    spec: LoadSpec,
    offline: Callable[[list[list[int]], list[SamplingParams]], Sequence[Sequence[int]]],
    *,
    api_key: str | None = None,
) -> tuple[LoadCheck, dict[str, Any], list[HTTPResult]]:
    """Run ``spec`` against the server at ``url``; ``offline(prompts, params)`` gives the reference token ids of
    each request (``LLM.generate`` on the served engine). Returns the check, the summary and the raw results."""
    requests = load_requests(spec)
    results, start, end = run_requests(
        url, model, requests, concurrency=spec.clients, api_key=api_key, deadline_s=spec.deadline_s
    )
    want = offline([list(r.prompt_token_ids) for r in requests], [offline_params(r) for r in requests])
    return check_results(requests, results, want), load_summary(results, start, end), results
