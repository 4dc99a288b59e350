"""``POST /v1/completions``: OpenAI's legacy text completions (the recipe has no request type for it).

A prompt is a string, a list of strings, a list of token ids or a list of such lists; each prompt is one engine
request and one choice (``index`` in prompt order). Text prompts start with BOS, as :meth:`LLM.generate
<deepinfer_jax.engine.llm.LLM.generate>` encodes them, but are encoded as plain text
(:meth:`Tokenizer.encode_plain <deepinfer_jax.text.Tokenizer.encode_plain>`): a special-token spelling a client
sends stays text. The completion text is the engine's incremental detokenization (special tokens left out, a
matched stop string cut), streamed as it grows.

Fields: ``model``, ``prompt``, ``max_tokens`` (default 16, as OpenAI's), ``temperature``, ``top_p``, ``n`` (choices
per prompt, each its own engine request; with a ``seed``, sample ``j`` draws with ``derive_seed(seed, j)`` as
``LLM.generate`` seeds its ``n`` samples),
``stream``, ``stream_options.include_usage``, ``logprobs`` (0-20 alternatives), ``echo`` (the prompt before the
completion; with ``logprobs``, the prompt tokens' logprobs too), ``stop``, ``seed``, ``presence_penalty``,
``frequency_penalty``, ``best_of`` (1), ``user`` (ignored), and the vLLM-style extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``allowed_token_ids``, ``bad_words``,
``golden_token_ids`` and ``return_token_ids`` (each choice then carries its ``token_ids`` and
``prompt_token_ids``); ``logit_bias`` (token id: bias in [-100, 100], OpenAI's range). ``suffix`` is refused
(400).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from deepinfer_jax.engine.async_llm import QueueFullError, RequestStream
from deepinfer_jax.engine.params import (
    MAX_N,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    derive_seed,
    validate_request,
)
from deepinfer_jax.server.errors import APIError, check_fields, param_of
from deepinfer_jax.server.protocols import ServingContext

__all__ = ["CompletionJob", "completion_json", "completion_sse", "prepare_completion"]

_FIELDS = (
    "model", "stream", "temperature", "top_p", "seed", "n", "max_tokens", "stop", "presence_penalty",
    "frequency_penalty", "echo", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
    "stop_token_ids", "golden_token_ids", "return_token_ids", "logit_bias", "allowed_token_ids", "bad_words",
)  # fmt: skip
_SAMPLING = (
    "temperature", "top_p", "seed", "max_tokens", "stop", "presence_penalty", "frequency_penalty", "top_k",
    "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "golden_token_ids", "logit_bias",
    "allowed_token_ids", "bad_words",
)  # fmt: skip


@dataclasses.dataclass
class CompletionJob:
    """A checked completions request: ``n`` choices per prompt (choice ``p * n + j`` is sample ``j`` of prompt
    ``p``, OpenAI's order)."""

    completion_id: str
    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None
    return_token_ids: bool
    n: int = 1

    def sample_params(self, j: int) -> SamplingParams:
        """Sample ``j``'s parameters: with a seed and ``n > 1``, sample ``j`` draws with ``derive_seed(seed, j)``,
        as ``LLM.generate`` seeds the ``n`` samples of one request, so the same seed gives the same choices."""
        p = self.params
        if self.n == 1 or p.seq_seed is None:
            return p
        return p.replace(seed=derive_seed(p.seq_seed, j))


def _prompts(ctx: ServingContext, prompt: Any) -> list[tuple[str | None, list[int]]]:
    def ids_of(value: Any, where: str) -> list[int]:
        if not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise APIError(400, f"{where} must be a non-empty list of token ids (integers)", param="prompt")
        return list(value)

    tokenizer = ctx.engine.llm.tokenizer

    def text_of(value: str, where: str) -> tuple[str, list[int]]:
        if not value:
            raise APIError(400, f"{where} is empty; a prompt needs at least one token", param="prompt")
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: give the prompt as token ids", param="prompt")
        return value, tokenizer.encode_plain(value, add_bos=True)

    if prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return [text_of(prompt, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(
            400,
            "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
            param="prompt",
        )
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [(None, ids_of(prompt, "prompt"))]
    out: list[tuple[str | None, list[int]]] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(text_of(item, f"prompt[{i}]"))
        elif isinstance(item, list):
            out.append((None, ids_of(item, f"prompt[{i}]")))
        else:
            raise APIError(
                400,
                f"prompt[{i}] must be a string or a list of token ids, got {type(item).__name__}",
                param="prompt",
            )
    return out


def prepare_completion(ctx: ServingContext, body: Any) -> CompletionJob:
    """Check one completions body; every refusal is an :class:`APIError` raised before the engine sees it."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_fields(body, _FIELDS)
    ctx.check_model(body)
    if body.get("best_of") not in (None, 1):
        raise APIError(400, f"best_of = {body['best_of']!r}: only 1 is supported", param="best_of")
    n = 1 if body.get("n") is None else body["n"]
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n = {n} must be in [1, {MAX_N}]", param="n")
    if body.get("suffix") is not None:
        raise APIError(
            400, "suffix is not supported (insertion needs a fill-in-the-middle model)", param="suffix"
        )
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)):
        raise APIError(
            400, f"'logprobs' must be an integer (0-20) or null, got {logprobs!r}", param="logprobs"
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    echo = bool(body.get("echo") or False)
    values: dict[str, Any] = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    values.setdefault("max_tokens", 16)
    values["logprobs"] = logprobs
    if echo and logprobs is not None:
        values["prompt_logprobs"] = logprobs
    values["output_kind"] = RequestOutputKind.DELTA
    try:
        params = SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc).replace("SamplingParams.", ""), param=param_of(str(exc))) from None
    prompts = _prompts(ctx, body.get("prompt"))
    llm = ctx.engine.llm
    for i, (_, ids) in enumerate(prompts):
        try:
            validate_request(
                ids, params, vocab_size=llm.model.config.vocab_size, max_model_len=llm.max_model_len
            )
            llm.check_replay(params)
        except (TypeError, ValueError) as exc:
            where = "" if len(prompts) == 1 else f"prompt[{i}]: "
            raise APIError(400, f"{where}{exc}", param=param_of(str(exc)) or "prompt") from None
    if params.stop and llm.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer; this model has none", param="stop")
    return CompletionJob(
        completion_id=f"cmpl-{uuid.uuid4().hex}",
        prompts=prompts,
        params=params,
        stream=bool(body.get("stream") or False),
        include_usage=bool(options.get("include_usage") or False),
        echo=echo,
        logprobs=logprobs,
        return_token_ids=bool(body.get("return_token_ids") or False),
        n=n,
    )


def start_streams(ctx: ServingContext, job: CompletionJob) -> list[RequestStream]:
    """One engine request per choice (``n`` per prompt); if the engine refuses one, those already queued are
    aborted."""
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(job.prompts):
            prompt = {"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text}
            for j in range(job.n):
                k = i * job.n + j
                streams.append(
                    ctx.engine.add_request(prompt, job.sample_params(j), f"{job.completion_id}-{k}")
                )
    except QueueFullError:
        for stream in streams:
            ctx.engine.abort_nowait(stream.request_id)
        raise
    return streams


# ------------------------------------------------------------------------------------------- output


class _Choice:
    """One choice's running state: text so far (for ``text_offset``) and token counts."""

    def __init__(self, ctx: ServingContext, job: CompletionJob, index: int) -> None:
        self.ctx = ctx
        self.job = job
        self.index = index
        self.offset = 0
        self.completion_tokens = 0
        self.prompt = index // job.n
        # A prompt counts once in the usage, whatever its n.
        self.prompt_tokens = len(job.prompts[self.prompt][1]) if index % job.n == 0 else 0
        self.started = False
        self.finish_reason: str | None = None
        self.stop_reason: Any = None

    def _logprobs(
        self, ids: list[int], entries: list[dict[int, Logprob] | None], texts: list[str]
    ) -> dict[str, Any]:
        n = self.job.logprobs or 0
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        special = self.ctx.special_ids
        for token, entry, text in zip(ids, entries, texts):
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += 0 if token in special else len(text)  # special tokens are not in the text
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry[token].logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:n]
            out["top_logprobs"].append({self._text(t, lp): lp.logprob for t, lp in ranked})
        return out

    def _text(self, token: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        tokenizer = self.ctx.engine.llm.tokenizer
        return "" if tokenizer is None else tokenizer.decode([token])

    def piece(self, output: RequestOutput) -> dict[str, Any]:
        """The choice's part of one chunk (or, for a FINAL-like accumulation, of the response)."""
        completion = output.outputs[0]
        text = completion.text
        logprobs = None
        want = self.job.logprobs is not None
        prompt_part: dict[str, Any] | None = None
        first = not self.started
        if first:
            self.started = True
            prompt_text, prompt_ids = self.job.prompts[self.prompt]
            if self.job.echo:
                if prompt_text is None:
                    tokenizer = self.ctx.engine.llm.tokenizer
                    prompt_text = (
                        "" if tokenizer is None else tokenizer.decode(prompt_ids, skip_special_tokens=True)
                    )
                text = prompt_text + text
                if want:
                    entries = output.prompt_logprobs or [None] * len(prompt_ids)
                    texts = [self._text(t, (e or {}).get(t)) for t, e in zip(prompt_ids, entries)]
                    prompt_part = self._logprobs(prompt_ids, entries, texts)
        if want:
            entries = completion.logprobs or [None] * len(completion.token_ids)
            texts = [self._text(t, (e or {}).get(t)) for t, e in zip(completion.token_ids, entries)]
            logprobs = self._logprobs(completion.token_ids, entries, texts)
            if prompt_part is not None:
                logprobs = {k: prompt_part[k] + logprobs[k] for k in logprobs}
        self.completion_tokens += len(completion.token_ids)
        piece: dict[str, Any] = {
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason if output.finished else None,
        }
        if output.finished:
            self.finish_reason = completion.finish_reason
            piece["stop_reason"] = completion.stop_reason
        if self.job.return_token_ids:
            piece["token_ids"] = list(completion.token_ids)
            if first:
                piece["prompt_token_ids"] = list(self.job.prompts[self.prompt][1])
        return piece


def _usage(choices: list[_Choice]) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _failure(output: RequestOutput) -> APIError:
    c = output.outputs[0]
    if c.finish_reason == "abort":
        return APIError(503, "the request was aborted (the server is shutting down)", type="server_error")
    return APIError(500, f"the request failed while running: {c.error}", type="server_error")


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every stream's outputs as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except BaseException as exc:  # handed to the consumer
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _abort_unfinished(ctx: ServingContext, streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.finished:
            ctx.engine.abort_nowait(stream.request_id)


async def completion_json(
    ctx: ServingContext,
    job: CompletionJob,
    streams: list[RequestStream],
    on_output: Callable[[RequestOutput], None] | None = None,
) -> str:
    """The response of a non-streaming completions request."""
    choices = [_Choice(ctx, job, i) for i in range(len(streams))]
    pieces: list[dict[str, Any] | None] = [None] * len(streams)
    try:
        async for i, output in _merged(streams):
            if on_output is not None:
                on_output(output)
            if output.finished and output.outputs[0].finish_reason not in ("stop", "length"):
                raise _failure(output)
            piece = choices[i].piece(output)
            acc = pieces[i]
            if acc is None:
                pieces[i] = piece
            else:
                acc["text"] += piece["text"]
                acc["finish_reason"] = piece["finish_reason"]
                if "stop_reason" in piece:
                    acc["stop_reason"] = piece["stop_reason"]
                if piece["logprobs"] is not None:
                    for k, v in piece["logprobs"].items():
                        acc["logprobs"][k] += v
                if "token_ids" in piece:
                    acc["token_ids"] += piece["token_ids"]
    finally:
        _abort_unfinished(ctx, streams)
    body = {
        "id": job.completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.served_model_name,
        "system_fingerprint": None,
        "choices": pieces,
        "usage": _usage(choices),
    }
    return json.dumps(body)


async def completion_sse(
    ctx: ServingContext,
    job: CompletionJob,
    streams: list[RequestStream],
    on_output: Callable[[RequestOutput], None] | None = None,
) -> AsyncIterator[str]:
    """The SSE text of a streaming completions request (``data: {chunk}`` lines, then ``data: [DONE]``)."""
    choices = [_Choice(ctx, job, i) for i in range(len(streams))]
    created = int(time.time())
    left = len(streams)

    def chunk(pieces: list[dict[str, Any]], usage: dict[str, int] | None) -> str:
        body = {
            "id": job.completion_id,
            "object": "text_completion",
            "created": created,
            "model": ctx.served_model_name,
            "system_fingerprint": None,
            "choices": pieces,
            "usage": usage,
        }
        return f"data: {json.dumps(body)}\n\n"

    try:
        async for i, output in _merged(streams):
            if on_output is not None:
                on_output(output)
            if output.finished and output.outputs[0].finish_reason not in ("stop", "length"):
                error = _failure(output)
                yield f"data: {json.dumps(error.body())}\n\n"
                break
            piece = choices[i].piece(output)
            if output.finished:
                left -= 1
            # Usage counts in the final chunk: the one that finishes the last choice.
            yield chunk([piece], _usage(choices) if left == 0 else None)
        else:
            if job.include_usage:
                yield chunk([], _usage(choices))
        yield "data: [DONE]\n\n"
    finally:
        _abort_unfinished(ctx, streams)
