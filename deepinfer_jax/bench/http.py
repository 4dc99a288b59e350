"""Benchmark clients over HTTP: a workload's requests sent to a running server's ``/v1/completions``, streamed.

``deepinfer-jax bench --url http://127.0.0.1:PORT`` runs a :class:`~deepinfer_jax.bench.workload.Workload` through
a server (``deepinfer-jax serve`` or any server of the OpenAI completions API that takes token-id prompts) instead
of an in-process engine, with the same requests, arrival times and metrics as an in-process run, so online and
offline numbers come from one harness. Each request is one streaming completion (``prompt`` as token ids,
``return_token_ids`` to get the ids back, ``ignore_eos`` as the workload says); its times are taken on the
client: *arrival* is when it was due to be sent, *first token* when the first chunk carrying a token arrived,
*finish* when the stream ended. So TTFT includes the HTTP round trip and any queueing in the server.

:func:`run_requests` drives the clients: open loop (each request sent at its arrival offset) or closed loop
(``concurrency`` clients, each sending its next request when the previous one ends). A request may disconnect
on purpose after a number of token chunks (:attr:`HTTPRequest.disconnect_after`, the load test's aborts). Every
run is bounded: a ``deadline_s`` cancels whatever is still running, which is then reported as not finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx2

from deepinfer_jax.bench.metrics import distribution

__all__ = ["HTTPRequest", "HTTPResult", "online_summary", "run_requests", "server_info"]


@dataclasses.dataclass(frozen=True)
class HTTPRequest:
    """One streaming completion to send.

    Attributes:
      prompt_token_ids: the prompt.
      max_tokens: tokens to generate.
      seed: the request's sampling seed (``None``: the server's).
      disconnect_after: close the connection after this many chunks that carry tokens (``None``: read to the end).
      temperature, top_p, top_k, ignore_eos: sampling.
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    seed: int | None = None
    disconnect_after: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = True

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(self.prompt_token_ids),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "ignore_eos": self.ignore_eos,
        }
        if self.top_k != -1:
            body["top_k"] = self.top_k
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclasses.dataclass
class HTTPResult:
    """What one request got back (client-side ``time.monotonic`` times).

    ``finish_reason`` is the server's (``None`` when the stream did not end normally); ``disconnected`` is True
    when the client closed the stream on purpose; ``error`` holds an HTTP or stream error.
    """

    index: int
    due: float = 0.0
    sent: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    token_chunks: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    disconnected: bool = False
    status: int | None = None
    error: str | None = None

    @property
    def complete(self) -> bool:
        """The stream ended with a finish reason and no error."""
        return self.finish_reason is not None and self.error is None and not self.disconnected


def server_info(url: str, api_key: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """The first model a server lists (``GET /v1/models``): its ``id`` and, from deepinfer-jax, ``vocab_size``
    and ``max_model_len``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx2.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=timeout)
        response.raise_for_status()
        data = response.json().get("data") or []
    except (httpx2.HTTPError, ValueError) as exc:
        raise RuntimeError(f"{url}: cannot list the server's models (GET /v1/models): {exc}") from None
    if not data:
        raise RuntimeError(f"{url}: /v1/models lists no model")
    return dict(data[0])


async def _one(
    client: httpx2.AsyncClient, url: str, model: str, index: int, request: HTTPRequest, due: float
) -> HTTPResult:
    result = HTTPResult(index, due=due, sent=time.monotonic())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=request.body(model)) as response:
            result.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    break
                if chunk.get("usage"):
                    result.usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    if ids:
                        if result.first_token is None:
                            result.first_token = time.monotonic()
                        result.token_ids += ids
                        result.token_chunks += 1
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                        result.finished = time.monotonic()
                if request.disconnect_after is not None and result.token_chunks >= request.disconnect_after:
                    if result.finish_reason is None:
                        result.disconnected = True
                    break
    except (httpx2.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _run(
    url: str,
    model: str,
    requests: Sequence[HTTPRequest],
    *,
    arrivals: Sequence[float] | None,
    concurrency: int | None,
    api_key: str | None,
    deadline_s: float | None,
) -> tuple[list[HTTPResult], float, float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    n = len(requests)
    width = concurrency if concurrency is not None else n
    limits = httpx2.Limits(max_connections=width + 4, max_keepalive_connections=width + 4)
    timeout = httpx2.Timeout(None if deadline_s is None else deadline_s, connect=30.0)
    results: list[HTTPResult | None] = [None] * n
    async with httpx2.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        start = time.monotonic()

        async def open_loop(i: int) -> None:
            due = start + (arrivals[i] if arrivals is not None else 0.0)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            results[i] = await _one(client, url, model, i, requests[i], due)

        async def closed_loop(queue: asyncio.Queue[int]) -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results[i] = await _one(client, url, model, i, requests[i], time.monotonic())

        if concurrency is None:
            tasks = [asyncio.ensure_future(open_loop(i)) for i in range(n)]
        else:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(n):
                queue.put_nowait(i)
            tasks = [asyncio.ensure_future(closed_loop(queue)) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        end = time.monotonic()
    out = [
        r if r is not None else HTTPResult(i, error="not finished before the deadline")
        for i, r in enumerate(results)
    ]
    return out, start, end


def run_requests(
    url: str,
    model: str,
    requests: Sequence[HTTPRequest],
    *,
    arrivals: Sequence[float] | None = None,
    concurrency: int | None = None,
    api_key: str | None = None,
    deadline_s: float | None = 600.0,
) -> tuple[list[HTTPResult], float, float]:
    """Send ``requests`` to ``url``; returns their results (in request order) and the run's start and end
    (``time.monotonic``).

    Open loop with ``arrivals`` (offsets in seconds; all at once when neither is given), closed loop with
    ``concurrency`` clients. ``deadline_s`` bounds the whole run.
    """
    if arrivals is not None and concurrency is not None:
        raise ValueError("run_requests: give arrivals (open loop) or concurrency (closed loop), not both")
    if arrivals is not None and len(arrivals) != len(requests):
        raise ValueError(f"arrivals: {len(arrivals)} offsets for {len(requests)} requests")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency = {concurrency} must be >= 1")
    return asyncio.run(
        _run(
            url.rstrip("/"),
            model,
            requests,
            arrivals=arrivals,
            concurrency=concurrency,
            api_key=api_key,
            deadline_s=deadline_s,
        )
    )


def online_summary(
    results: Sequence[HTTPResult], start: float, end: float, request_rate: float | None, burstiness: float
) -> dict[str, Any]:
    """The request-rate numbers of an open-loop run, with the keys of an in-process online run's summary
    (``admission_delay``: how long after its arrival time each request was really sent)."""
    n = len(results)
    due = sorted(r.due for r in results)
    sent = sorted(r.sent for r in results)

    def rate(times: Sequence[float]) -> float | None:
        span = times[-1] - times[0] if times else 0.0
        return (n - 1) / span if n > 1 and span > 0 else None

    delay = distribution(max(r.sent - r.due, 0.0) for r in results)
    return {
        "request_rate": request_rate,
        "burstiness": burstiness,
        "drawn_request_rate": rate(due),
        "achieved_request_rate": rate(sent),
        "request_throughput": sum(r.complete for r in results) / (end - start),
        "arrival_span_seconds": due[-1] - due[0] if due else 0.0,
        "admission_delay": None if delay is None else delay.to_dict(),
    }
