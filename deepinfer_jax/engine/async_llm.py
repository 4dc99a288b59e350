"""The online engine: :class:`AsyncLLM` runs an :class:`~deepinfer_jax.engine.llm.LLM`'s engine loop in its own
thread while requests arrive and leave, and streams each request's outputs to an ``asyncio`` consumer.

**One engine loop.** The thread runs the same :meth:`EngineRunner.run <deepinfer_jax.engine.runner.EngineRunner.run>`
as offline :meth:`LLM.generate <deepinfer_jax.engine.llm.LLM.generate>`, with a ``poll`` callback: before every
scheduling round it hands the scheduler the requests that arrived (``add_request``), applies the aborts that came
in (:meth:`Scheduler.abort <deepinfer_jax.engine.scheduler.Scheduler.abort>`: the request's blocks and state slot
are freed at once, between two steps), and streams what the last processed step produced. A busy period ends when
no request is left; the thread then sleeps on its inbox until the next request, so an idle server costs nothing.
The same loop serves one device and any ``(dp, ep)`` mesh (the scheduler routes each request to a device).

**Outputs** follow vLLM's ``SamplingParams.output_kind``: ``CUMULATIVE`` (everything so far, each time),
``DELTA`` (only what is new: text, token ids, logprobs) or ``FINAL_ONLY``. With stop strings, a streamed text
holds back the characters that could still turn into a stop string (the longest stop string minus one), so no
text a stop would cut is ever sent; the final output carries the rest.

**Bounded admission.** At most ``max_num_seqs`` running requests plus ``max_queued_requests`` waiting ones are held
(``server.max_queued_requests``); beyond that :meth:`AsyncLLM.add_request` raises :class:`QueueFullError` at once
(an HTTP server answers 429 with ``Retry-After``). Nothing is queued without bound.

**The LLM stays usable offline.** The engine thread holds :meth:`AsyncLLM.exclusive`'s lock only while it runs
steps; ``with engine.exclusive(): llm.generate(...)`` waits until the engine is idle and keeps new arrivals waiting
until it returns, so offline ``generate`` runs unchanged on the same compiled engine.

Errors: bad input raises ``ValueError``/``TypeError`` from :meth:`~AsyncLLM.add_request` before anything is queued;
a request that fails while running ends alone (``finish_reason="error"``); a step that fails (an XLA error, a bug)
ends the requests it held with ``finish_reason="error"``, the engine recovers as ``LLM.generate`` does (every
block and slot freed, a consumed cache re-created) and serves the next requests; only if that recovery or the loop
itself fails does every unfinished stream raise :class:`EngineDeadError`, and so does every later
``add_request``. ``n > 1`` is refused (one sample per stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from deepinfer_jax.engine.llm import LLM, derive_seed
from deepinfer_jax.engine.params import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    validate_request,
)
from deepinfer_jax.engine.scheduler import Request

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineStats",
    "QueueFullError",
    "RequestStream",
]

PromptInput = str | Sequence[int] | np.ndarray | Mapping[str, Any]
"""A prompt: text (tokenized with BOS, as ``LLM.generate`` does), token ids, or vLLM's prompt dicts
``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` (with an optional ``"prompt"`` text beside the ids)."""


class QueueFullError(RuntimeError):
    """The engine holds as many requests as it may (``max_num_seqs`` running + ``max_queued_requests`` waiting);
    ``retry_after`` is a suggested wait in seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: it failed (the message says why) or it was shut down."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the online engine (what ``/metrics`` reports).

    Attributes:
      running, waiting: requests holding a slot / queued in the scheduler.
      unfinished: requests accepted and not yet finished (running, waiting, or not yet handed to the scheduler).
      cache_blocks_used, cache_blocks_total: usable cache blocks of every device, in use and in all.
      steps, preemptions, wasted_samples: scheduler counters since the engine was built.
      prompt_tokens, generation_tokens: tokens of finished requests (aborted ones included).
      finished: finished requests by ``finish_reason``.
      accepted, refused: requests accepted / refused as over the admission bound.
      step_failures: runs a failed step ended (their requests ended with ``finish_reason="error"``).
      prefix_cache_hit_tokens, prefix_cache_query_tokens: prompt tokens found in / looked up in the prefix cache
        (docs/prefix_cache.md). draft_tokens, accepted_draft_tokens: speculative decoding's counters.
    """

    running: int = 0
    waiting: int = 0
    unfinished: int = 0
    cache_blocks_used: int = 0
    cache_blocks_total: int = 0
    steps: int = 0
    preemptions: int = 0
    wasted_samples: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Mapping[str, int] = dataclasses.field(default_factory=dict)
    accepted: int = 0
    refused: int = 0
    step_failures: int = 0
    prefix_cache_hit_tokens: int | None = None
    prefix_cache_query_tokens: int | None = None
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None

    @property
    def cache_usage(self) -> float:
        """Fraction of the usable cache blocks in use (0 when empty)."""
        return self.cache_blocks_used / self.cache_blocks_total if self.cache_blocks_total else 0.0


_OPTIONAL_COUNTERS = {
    # EngineStats field: the SchedulerStats attribute a later feature adds (read only when it exists).
    "prefix_cache_hit_tokens": "prefix_cache_hits",
    "prefix_cache_query_tokens": "prefix_cache_queries",
    "draft_tokens": "num_draft_tokens",
    "accepted_draft_tokens": "num_accepted_draft_tokens",
}

_STOP = object()
_ABORT_ALL = object()


class RequestStream:
    """The outputs of one request, in order; ``async for out in stream`` (ends after the finished output).

    Built by :meth:`AsyncLLM.add_request`. Leaving the loop early (``break``, an exception, a cancelled task) does
    not abort the request by itself: :meth:`AsyncLLM.generate` does that, or call :meth:`AsyncLLM.abort`.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seed = seed
        self.arrival_time = (
            time.monotonic()
        )  # the scheduler's clock: TTFT counts the wait for the engine thread
        self.finished = False
        """True once the finished output (or an engine failure) has been taken from the stream."""
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Engine-thread state: what has been sent (DELTA slices from here) and the scheduler's request.
        self._request: Request | None = None
        self._sent_tokens = 0
        self._sent_text = 0
        self._sent_first = False
        self._done = False
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Hand an item to the consumer's event loop (called from the engine thread)."""
        with contextlib.suppress(RuntimeError):  # RuntimeError: the consumer's loop is closed, nobody listens
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


class AsyncLLM:
    """An online engine over ``llm``: ``async for out in engine.generate(prompt, params, request_id)``.

    Args:
      llm: the offline engine to serve (its scheduler, compiled step and runner are used as they are).
      max_queued_requests: waiting requests allowed beyond ``max_num_seqs`` running ones (default:
        ``llm.config.server.max_queued_requests``).
      start: start the engine thread now (otherwise call :meth:`start`).

    Multi-process meshes are refused: every process of such a run must see every request, which needs a request
    broadcast this engine does not have yet.
    """

    def __init__(self, llm: LLM, *, max_queued_requests: int | None = None, start: bool = True) -> None:
        if not isinstance(llm, LLM):
            raise TypeError(f"llm must be an LLM, got {type(llm).__name__}")
        if jax.process_count() > 1:
            raise NotImplementedError(
                f"AsyncLLM: a multi-process run ({jax.process_count()} processes) is not supported: every process "
                "would need every request; serve from one process"
            )
        if max_queued_requests is None:
            max_queued_requests = llm.config.server.max_queued_requests
        if isinstance(max_queued_requests, bool) or not isinstance(max_queued_requests, int):
            raise TypeError(f"max_queued_requests must be an int, got {type(max_queued_requests).__name__}")
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests = {max_queued_requests} must be >= 0")
        self.llm = llm
        self.max_queued_requests = max_queued_requests
        sched = llm.scheduler
        self.max_running = sum(d.max_num_seqs for d in sched.devices)
        """Most requests holding a slot at once: ``max_num_seqs`` of the whole engine."""
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # held by the engine thread while it runs steps (see exclusive())
        self._count_lock = threading.Lock()
        self._ids: set[str] = set()  # accepted and not finished (guarded by _count_lock)
        self._refused = 0
        self._accepted = 0
        self._closing = False
        self._error: BaseException | None = None
        self._next_index = itertools.count()
        # Engine-thread state.
        self._tracks: dict[str, RequestStream] = {}
        self._finished_by_reason: dict[str, int] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._failures = 0
        self._stop_seen = False
        self._stats = EngineStats()
        self._update_stats()
        self._thread = threading.Thread(target=self._engine_loop, name="deepinfer-engine", daemon=True)
        self._started = False
        if start:
            self.start()

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._started:
            raise RuntimeError("AsyncLLM.start: the engine thread is already started")
        self._started = True
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """True while the engine thread runs and accepts requests."""
        return self._thread.is_alive() and not self._closing and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop stopped, when it failed."""
        return self._error

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting requests, let the unfinished ones finish (up to ``timeout`` seconds; ``None`` = wait),
        abort the rest, and stop the engine thread. Idempotent."""
        with self._count_lock:
            self._closing = True
        if not self._started:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logging.warning("AsyncLLM: unfinished requests after the %s s drain: aborting them", timeout)
            self._inbox.put(_ABORT_ALL)
            self._thread.join()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[LLM]:
        """Hold the engine while no request runs: ``with engine.exclusive() as llm: llm.generate(...)``.

        Waits until the engine thread is idle; requests that arrive meanwhile wait (and count as queued) until the
        block ends.
        """
        with self._lock:
            yield self.llm

    # ------------------------------------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        """Validate and queue one request; returns its :class:`RequestStream`. Call it from the event loop that
        consumes the stream.

        Raises ``ValueError``/``TypeError`` for bad input (nothing is queued), :class:`QueueFullError` over the
        admission bound and :class:`EngineDeadError` when the engine is not running.
        """
        loop = asyncio.get_running_loop()
        llm = self.llm
        params = llm.default_sampling_params() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or None, got {type(params).__name__}")
        text, ids = self._prompt(prompt)
        cfg = llm.model.config
        arr = validate_request(ids, params, vocab_size=cfg.vocab_size, max_model_len=llm.max_model_len)
        llm.check_replay(params)
        if params.stop and llm.tokenizer is None:
            raise ValueError("sampling_params.stop needs a tokenizer to match text; this model has none")
        if params.n != 1:
            raise ValueError(
                f"sampling_params.n = {params.n}: AsyncLLM streams one sample per request (n = 1); send n requests "
                "with their own seeds instead"
            )
        if params.bad_words and llm.tokenizer is None:
            raise ValueError("sampling_params.bad_words needs a tokenizer; this model has none")
        index = next(self._next_index)
        if request_id is None:
            request_id = f"async-{index}"
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str or None, got {request_id!r}")
        seed = params.seq_seed if params.seq_seed is not None else derive_seed(llm.seed, index)
        stream = RequestStream(request_id, text, arr.tolist(), params, seed, loop)
        with self._count_lock:
            if self._error is not None:
                raise EngineDeadError(f"the engine loop failed: {self._error!r}")
            if self._closing or not self._started:
                raise EngineDeadError("the engine is not running (shut down, or not started)")
            if request_id in self._ids:
                raise ValueError(f"request_id {request_id!r} is already running")
            limit = self.max_running + self.max_queued_requests
            if len(self._ids) >= limit:
                self._refused += 1
                raise QueueFullError(
                    f"the server holds {len(self._ids)} requests, its limit ({self.max_running} running + "
                    f"server.max_queued_requests = {self.max_queued_requests} waiting); retry later"
                )
            self._ids.add(request_id)
            self._accepted += 1
            # Under the lock: a shutdown's stop marker can never overtake an accepted request.
            self._inbox.put(("add", stream))
        return stream

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (``sampling_params.output_kind`` says what each holds); leaving the
        iteration before the finished output (the consumer broke off, was cancelled, or its client disconnected)
        aborts the request and frees its blocks and slot."""
        stream = self.add_request(prompt, sampling_params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort_nowait(stream.request_id)

    async def abort(self, request_id: str) -> None:
        """End a request now (``finish_reason="abort"``): its blocks and slot are freed before the next step."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """:meth:`abort` from any thread; an unknown or finished id is ignored."""
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The engine's latest :class:`EngineStats` (updated by the engine thread between steps)."""
        with self._count_lock:
            accepted, refused, unfinished = self._accepted, self._refused, len(self._ids)
        return dataclasses.replace(self._stats, accepted=accepted, refused=refused, unfinished=unfinished)

    # ------------------------------------------------------------------------------------------- inputs

    def _prompt(self, prompt: Any) -> tuple[str | None, Any]:
        tokenizer = self.llm.tokenizer
        text: str | None = None
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(
                    f"prompt: unknown keys {sorted(unknown)}; expected 'prompt' or 'prompt_token_ids'"
                )
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"prompt['prompt'] must be a str, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                return text, prompt["prompt_token_ids"]
            if text is None:
                raise ValueError("prompt: a dict needs 'prompt' (text) or 'prompt_token_ids'")
            prompt = text
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: the prompt is empty")
            if tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; give prompt_token_ids instead")
            return prompt, tokenizer.encode(prompt, add_bos=True)
        return None, prompt

    # ------------------------------------------------------------------------------------------- engine thread

    def _engine_loop(self) -> None:
        runner = self.llm.runner
        scheduler = self.llm.scheduler
        try:
            while not self._stop_seen:
                item = self._inbox.get()
                with self._lock:
                    self._apply(item)
                    self._drain_inbox()
                    if scheduler.has_unfinished_requests() or self._tracks:
                        try:
                            runner.run(
                                on_finished=self._on_finished,
                                poll=self._poll,
                                keep_outputs=False,
                                progress=self._emit_progress,
                            )
                        except Exception as exc:  # a failed step: recover as LLM.generate does, then serve on
                            self._recover(exc)
                    for stream in list(self._tracks.values()):  # a bug if any: never leave a consumer waiting
                        self._finish_alone(stream, f"request {stream.request_id!r} was lost by the scheduler")
                    self._update_stats()
        except BaseException as exc:  # the loop itself failed: every waiting consumer must hear it
            logging.exception("AsyncLLM: the engine loop failed")
            self._die(exc)

    def _recover(self, exc: Exception) -> None:
        """A run failed (a step raised): the requests it held end with ``finish_reason="error"`` naming the
        failure, the engine is made usable again by ``LLM``'s own recovery (every request aborted, every block
        and slot freed, a consumed cache re-created), and the loop serves the next requests. When the recovery
        itself fails, the loop dies (:class:`EngineDeadError`)."""
        logging.exception("AsyncLLM: an engine step failed; ending the requests it held")
        self.llm._recover(exc)
        self._failures += 1
        for stream in list(self._tracks.values()):
            self._finish_alone(
                stream, f"the engine step failed ({type(exc).__name__}: {exc}); the engine recovered"
            )

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._apply(item)

    def _poll(self) -> bool:
        """Before every scheduling round: stream what the last step produced, take arrivals and aborts."""
        self._emit_progress()
        self._drain_inbox()
        self._update_stats()
        return False  # the run ends when no request is left; the thread then waits on the inbox

    def _apply(self, item: Any) -> None:
        if item is _STOP:
            self._stop_seen = True
        elif item is _ABORT_ALL:
            for request_id in list(self._tracks):
                self._abort(request_id)
        elif item[0] == "add":
            self._add(item[1])
        else:
            self._abort(item[1])

    def _add(self, stream: RequestStream) -> None:
        scheduler = self.llm.scheduler
        self._tracks[stream.request_id] = stream
        try:
            scheduler.add_request(
                stream.request_id,
                stream.prompt_token_ids,
                stream.params,
                seed=stream.seed,
                prompt=stream.prompt,
                arrival_time=stream.arrival_time,
            )
        except (ValueError, TypeError) as exc:  # validated before; anything left ends this request alone
            self._finish_alone(stream, f"request {stream.request_id!r} was refused by the scheduler: {exc}")
            return
        with contextlib.suppress(KeyError):  # KeyError: it can never fit and finished at once
            stream._request = scheduler.get_request(stream.request_id)

    def _abort(self, request_id: str) -> None:
        output = self.llm.scheduler.abort(request_id)
        if output is not None:
            self._on_finished(output)

    def _finish_alone(self, stream: RequestStream, error: str) -> None:
        completion = CompletionOutput(0, "", [], None, None, finish_reason="error", error=error)
        metrics = RequestMetrics(arrival_time=stream.arrival_time, finish_time=time.monotonic())
        metrics.num_prompt_tokens = len(stream.prompt_token_ids)
        out = RequestOutput(
            stream.request_id, stream.prompt, stream.prompt_token_ids, [completion], None, metrics
        )
        out.finished = True
        self._on_finished(out)

    def _on_finished(self, output: RequestOutput) -> None:
        stream = self._tracks.pop(output.request_id, None)
        completion = output.outputs[0]
        reason = completion.finish_reason or "error"
        self._finished_by_reason[reason] = self._finished_by_reason.get(reason, 0) + 1
        self._prompt_tokens += len(output.prompt_token_ids)
        self._generation_tokens += len(completion.token_ids)
        if stream is None:
            return
        stream._done = True
        with self._count_lock:
            self._ids.discard(stream.request_id)
        self._update_stats()  # a consumer that sees its final output sees the engine without it
        kind = stream.params.output_kind
        if kind is RequestOutputKind.DELTA:
            stream._put(
                self._delta(stream, output, completion.text, completion.token_ids, completion.logprobs)
            )
        else:
            stream._put(output)

    def _emit_progress(self) -> None:
        for stream in self._tracks.values():
            req = stream._request
            kind = stream.params.output_kind
            if req is None or kind is RequestOutputKind.FINAL_ONLY:
                continue
            tokens = req.output_token_ids
            if len(tokens) == stream._sent_tokens:
                continue
            # Hold back what a stop string could still cut (never below what was sent).
            text = req.text[: max(len(req.text) - stream._holdback, stream._sent_text)]
            if kind is RequestOutputKind.DELTA:
                stream._put(self._delta(stream, self._view(stream, req), text, tokens, req.logprobs))
            else:
                snapshot = req.to_output(final=False)
                snapshot.outputs[0].text = text
                stream._sent_tokens = len(tokens)
                stream._put(snapshot)

    @staticmethod
    def _view(stream: RequestStream, req: Request) -> RequestOutput:
        """The running request's fields a delta is cut from, without copying its lists."""
        completion = CompletionOutput(0, req.text, req.output_token_ids, req.cumulative_logprob, req.logprobs)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=stream.prompt_token_ids,
            outputs=[completion],
            prompt_logprobs=req.prompt_logprobs,
            metrics=dataclasses.replace(req.metrics),
            finished=False,
        )

    @staticmethod
    def _delta(
        stream: RequestStream, output: RequestOutput, text: str, token_ids: list[int], logprobs: Any
    ) -> RequestOutput:
        """What is new in ``output`` since the last output sent on ``stream`` (and mark it sent)."""
        start, n = stream._sent_tokens, len(token_ids)
        c = output.outputs[0]
        delta = CompletionOutput(
            index=c.index,
            text=text[stream._sent_text :],
            token_ids=list(token_ids[start:n]),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=None if logprobs is None else list(logprobs[start:n]),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            error=c.error,
        )
        stream._sent_tokens = n
        stream._sent_text = max(len(text), stream._sent_text)
        first = not stream._sent_first
        stream._sent_first = True
        prompt_logprobs = output.prompt_logprobs if first else None
        return RequestOutput(
            request_id=output.request_id,
            prompt=output.prompt,
            prompt_token_ids=stream.prompt_token_ids,
            outputs=[delta],
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            metrics=output.metrics,
            finished=output.finished,
        )

    def _update_stats(self) -> None:
        sched = self.llm.scheduler
        devices = sched.devices
        total = sum(d.blocks.capacity for d in devices)
        free = sum(d.blocks.num_free for d in devices)
        counters = sched.stats
        optional = {
            name: getattr(counters, attr) if hasattr(counters, attr) else None
            for name, attr in _OPTIONAL_COUNTERS.items()
        }
        self._stats = EngineStats(
            running=sched.num_running,
            waiting=sched.num_waiting,
            cache_blocks_used=total - free,
            cache_blocks_total=total,
            steps=max(d.stats.num_steps for d in devices),
            preemptions=counters.num_preemptions,
            wasted_samples=counters.num_wasted_samples,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            finished=dict(self._finished_by_reason),
            step_failures=self._failures,
            **optional,
        )

    def _die(self, exc: BaseException) -> None:
        with self._count_lock:
            self._error = exc
            self._ids.clear()
        error = EngineDeadError(f"the engine loop failed: {exc!r}")
        pending = list(self._tracks.values())
        self._tracks.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple) and item[0] == "add":
                pending.append(item[1])
        for stream in pending:
            stream._put(error)
