"""Chat Completions, Responses and Messages through ``deepseek-recipe``: request body in, SSE events or one JSON out.

The recipe does every protocol detail: it reads and checks the body (``ChatCompletionRequest``,
``ResponsesRequest``, ``MessagesRequest``), converts it into one DeepSeek conversation with its inference
options (temperature, top-p, token limit, logprobs, seed, the output constraint) and parsing options (thinking
stage, tool-call parsing, stop strings), resolves the token limit against the context
(``resolve_max_tokens``), and turns the engine's token ids back into the protocol's chunks or events (its
``*ChunkGenerator`` inside a ``StreamProcessor``) and the non-streaming response (``*Response.accumulate``).

What this module adds:

* the field checks the recipe's JSON reader reports without the field's name (``check_fields``), the model name
  (404 for another model), ``n`` (Chat Completions: :func:`prepare_all` makes one engine request per choice), the Chat
  Completions spelling ``max_completion_tokens``;
* the sampling fields the recipe does not carry, OpenAI's ``presence_penalty`` / ``frequency_penalty`` and
  Anthropic's ``top_k``, and the vLLM-style extensions ``top_k``, ``min_p``, ``repetition_penalty``,
  ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``allowed_token_ids``, ``bad_words`` and DeepInfer's
  ``golden_token_ids`` (teacher forcing); Chat Completions' ``logit_bias`` (token id: bias in [-100, 100]);
* the output constraint: Chat's ``response_format`` and Responses' ``text.format`` (``json_schema``,
  ``json_object``, and Chat's ``regex``), which the recipe reads into its output constraint (and describes in the
  prompt), become ``SamplingParams.structured_outputs`` (:func:`constraint_params`): a JSON schema, any JSON object
  for ``json_object``, a regex; in thinking mode the grammar applies after the ``</think>`` id, as in ``LLM.chat``.
  A schema or regex llguidance cannot enforce is a 400 naming the field with llguidance's reason, and so is a
  format given with tools (the recipe keeps only the tool-call constraint: the reply could not be held to both).
  Tool calls are not constrained (the model writes DSML freely) and are parsed by token id;
* the prompt encoding with the model's own template and vocabulary (:meth:`ChatEncoder.encode_request
  <deepinfer_jax.text.ChatEncoder.encode_request>`): message text is encoded as plain text, so special-token
  spellings a client types stay text;
* the token feed: every generated id goes to the stream processor as its own ``tokens`` chunk with its logprobs
  (markers are recognised by id only), except the special ids (EOS, BOS, pad), which are counted as tokens but
  carry no text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import deepseek_recipe as recipe

from deepinfer_jax.engine import chat as chat_lib
from deepinfer_jax.engine.async_llm import AsyncLLM, RequestStream
from deepinfer_jax.engine.params import (
    MAX_N,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    derive_seed,
    validate_request,
)
from deepinfer_jax.engine.structured import StructuredOutputsParams
from deepinfer_jax.server.errors import (
    APIError,
    check_fields,
    from_conversion_error,
    from_recipe_value_error,
    param_of,
    with_value,
)
from deepinfer_jax.text.chat import ChatEncoder
from deepinfer_jax.text.output_parser import recipe_tokenizer
from deepinfer_jax.text.tokenizer import DEEPSEEK_EOS_TOKEN

__all__ = [
    "CHAT",
    "MESSAGES",
    "PROTOCOLS",
    "RESPONSES",
    "Prepared",
    "Protocol",
    "ServingContext",
    "constraint_params",
    "generate_json",
    "generate_json_n",
    "generate_sse",
    "generate_sse_n",
    "prepare",
    "prepare_all",
    "sampling_params",
]

_COMMON_FIELDS = ("model", "stream", "temperature", "top_p", "seed", "top_logprobs", "n")
_EXTENSIONS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "golden_token_ids",
    "allowed_token_ids",
    "bad_words",
)


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One recipe protocol: its request and response classes, its id prefix and the fields read here."""

    name: str
    request_cls: Any
    response_cls: Any
    id_prefix: str
    fields: tuple[str, ...]
    extras: tuple[str, ...]
    prompt_field: str

    @property
    def streams_named_events(self) -> bool:
        return self.request_cls is not recipe.ChatCompletionRequest


CHAT = Protocol(
    "chat.completions",
    recipe.ChatCompletionRequest,
    recipe.ChatCompletionResponse,
    "chatcmpl-",
    (*_COMMON_FIELDS, "max_tokens", "max_completion_tokens", "stop", "presence_penalty", "frequency_penalty",
     "logit_bias", *_EXTENSIONS),
    ("presence_penalty", "frequency_penalty", "logit_bias", *_EXTENSIONS),
    "messages",
)  # fmt: skip
RESPONSES = Protocol(
    "responses",
    recipe.ResponsesRequest,
    recipe.ResponsesResponse,
    "resp_",
    (*_COMMON_FIELDS, "max_output_tokens", *_EXTENSIONS),
    _EXTENSIONS,
    "input",
)
MESSAGES = Protocol(
    "messages",
    recipe.MessagesRequest,
    recipe.MessagesResponse,
    "msg_",
    (*_COMMON_FIELDS, "max_tokens", "stop_sequences", *_EXTENSIONS),
    _EXTENSIONS,
    "messages",
)
PROTOCOLS = {p.name: p for p in (CHAT, RESPONSES, MESSAGES)}


@dataclasses.dataclass
class ServingContext:
    """What every request handler needs: the engine, the served name and the text side of the model."""

    engine: AsyncLLM
    served_model_name: str
    encoder: ChatEncoder
    options: recipe.ConversionOptions
    recipe_tokenizer: Any
    special_ids: frozenset[int]
    turn_end_id: int
    created: int

    @classmethod
    def build(cls, engine: AsyncLLM, served_model_name: str, *, default_thinking: bool) -> ServingContext:
        llm = engine.llm
        cfg = llm.model.config
        version = chat_lib.chat_version_for(str(getattr(cfg.family, "value", cfg.family)))
        encoder = chat_lib.chat_encoder(llm.tokenizer, cfg.vocab_size, version)
        model_version = (
            recipe.ModelVersion.DeepseekV41Flash if version == "v41" else recipe.ModelVersion.DeepseekV4Pro
        )
        options = recipe.ConversionOptions(
            default_thinking_mode=default_thinking
        ).with_model_versions_by_name({served_model_name: model_version})
        tokenizer = encoder.tokenizer
        return cls(
            engine=engine,
            served_model_name=served_model_name,
            encoder=encoder,
            options=options,
            recipe_tokenizer=recipe_tokenizer(tokenizer),
            special_ids=tokenizer.special_ids,
            turn_end_id=encoder.marker_ids[DEEPSEEK_EOS_TOKEN],
            created=int(time.time()),
        )

    @property
    def max_model_len(self) -> int:
        return self.engine.llm.max_model_len

    def check_model(self, body: dict[str, Any]) -> None:
        """400 without a model, 404 for another model than the one served."""
        model = body.get("model")
        if model is None:
            raise APIError(400, "'model' is required: the name of the served model", param="model")
        if model != self.served_model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.served_model_name}'",
                param="model",
                code="model_not_found",
            )


@dataclasses.dataclass
class Prepared:
    """A request ready to run: its prompt, its sampling parameters and the recipe's stream processor."""

    protocol: Protocol
    response_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    processor: Any
    want_logprobs: bool
    top_logprobs: int


# ------------------------------------------------------------------------------------------- preparation


_NO_CONSTRAINT = (None, "text")


def _format_field(protocol: Protocol) -> str:
    """The request field that carries the output format: Chat's ``response_format``, Responses' ``text.format``."""
    return "text.format" if protocol is RESPONSES else "response_format"


def _requested_format(protocol: Protocol, body: dict[str, Any]) -> str | None:
    """The ``type`` of the output format the body asks for (``None`` or ``"text"``: free text)."""
    if protocol is CHAT:
        fmt = body.get("response_format")
    elif protocol is RESPONSES:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
    else:
        return None
    return fmt.get("type") if isinstance(fmt, dict) else None


def constraint_params(
    constraint: Any, *, think_end: int | None = None, field: str = "response_format"
) -> dict[str, Any]:
    """The sampling parameters that enforce the recipe's output constraint (its ``kind`` and ``schema``).

    ``json`` with a schema (``json_schema``) or without one (``json_object``: any JSON object) and ``regex``
    become ``structured_outputs`` (:class:`StructuredOutputsParams`, free whitespace allowed in JSON); with
    ``think_end`` (thinking mode: the ``</think>`` id) the grammar applies only after that id, as in ``LLM.chat``,
    so the reasoning stays free. A schema or regex llguidance cannot enforce is a 400 naming ``field`` with
    llguidance's reason. Tool-call constraints (``tool_call``, ``tool_call_required``: the recipe sets one whenever
    tools are given) are not enforced: the prompt tells the model how to call, and the reply's DSML is parsed by
    token id.
    """
    if constraint is None or constraint.kind in ("tool_call", "tool_call_required"):
        return {}
    kind, schema = constraint.kind, constraint.schema
    try:
        if kind == "json" and not schema:
            # OpenAI's JSON mode is an object; the recipe's JSON output parsing blanks a bare scalar reply
            so = StructuredOutputsParams(json={"type": "object"})
        elif kind == "json":
            so = StructuredOutputsParams(json=schema)
        elif kind == "regex":
            so = StructuredOutputsParams(regex=schema)
        else:
            raise APIError(
                400, f"{field}: the output constraint {kind!r} is not supported (json_schema, json_object, regex)",
                param=field,
            )  # fmt: skip
    except ImportError as exc:
        raise APIError(400, f"{field} cannot be enforced by this server: {exc}", param=field) from None
    except (TypeError, ValueError) as exc:
        what = "JSON schema" if kind == "json" else "regex"
        message = str(exc)
        _, sep, tail = message.partition(" is not a valid ")
        # llguidance's reason, without the echo of the whole schema (the client sent it)
        reason = tail.partition(": ")[2].strip() if sep else message.replace("StructuredOutputsParams.", "")
        raise APIError(400, f"{field}: the {what} cannot be enforced: {reason}", param=field) from None
    if think_end is not None:
        so = so.with_trigger((think_end,))
    return {"structured_outputs": so}


def sampling_params(
    ctx: ServingContext, body: dict[str, Any], extras: tuple[str, ...], **values: Any
) -> SamplingParams:
    """:class:`SamplingParams` from ``values`` (what the protocol gave) and the body's ``extras`` fields; a bad
    value is a 400 naming its field. Replies stop at the template's turn end."""
    for name in extras:
        if body.get(name) is not None:
            values[name] = body[name]
    values.setdefault("output_kind", RequestOutputKind.DELTA)
    try:
        params = SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("SamplingParams.", "")
        raise APIError(400, message, param=param_of(str(exc))) from None
    return chat_lib.chat_sampling_params(params, 1, ctx.turn_end_id, ctx.engine.llm.eos_token_ids)[0]


def prepare_all(ctx: ServingContext, protocol: Protocol, body: Any) -> list[Prepared]:
    """:func:`prepare` for each of a Chat Completions request's ``n`` choices (one engine request each, with one
    response id); with a ``seed``, choice ``j`` draws with ``derive_seed(seed, j)``, as ``LLM.generate`` seeds
    the ``n`` samples of one request. Other protocols have no ``n``."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_fields(body, protocol.fields)
    n = 1 if body.get("n") is None else body["n"]
    if protocol is not CHAT and n != 1:
        raise APIError(400, f"n = {n}: {protocol.name} requests have one choice (n = 1)", param="n")
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n = {n} must be in [1, {MAX_N}]", param="n")
    first = prepare(ctx, protocol, {**body, "n": None})
    if n == 1:
        return [first]
    out = [first]
    for _ in range(1, n):
        # The recipe's conversion consumes its request: each choice converts the body again (same prompt).
        out.append(prepare(ctx, protocol, {**body, "n": None}, response_id=first.response_id))
    seed = first.params.seq_seed
    if seed is not None:
        for j, prepared in enumerate(out):
            prepared.params = prepared.params.replace(seed=derive_seed(seed, j))
    return out


def prepare(
    ctx: ServingContext, protocol: Protocol, body: Any, *, response_id: str | None = None
) -> Prepared:
    """Check, convert and encode one request body (a parsed JSON value) as one choice; every refusal is an
    :class:`APIError` raised before the engine sees anything."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_fields(body, protocol.fields)
    ctx.check_model(body)
    if protocol is CHAT and body.get("max_completion_tokens") is not None:
        mct = body["max_completion_tokens"]
        if body.get("max_tokens") not in (None, mct):
            raise APIError(
                400,
                f"max_tokens = {body['max_tokens']} and max_completion_tokens = {mct} differ; give one",
                param="max_completion_tokens",
            )
        body = {**body, "max_tokens": mct}
    try:
        request = protocol.request_cls(body)
        decorate: Callable[[Any], Any] = lambda generator: generator  # noqa: E731
        if protocol is RESPONSES:
            echo = request.echo()
            namespaces = request.namespace_tool_map(ctx.options)
            decorate = lambda g: g.with_echo(echo).with_namespace_tool_map(namespaces)  # noqa: E731
        converted = request.convert(ctx.options)
        inference = converted.inference_options
        parsing = converted.parsing_options
        constraint = inference.output_constraint
        field = _format_field(protocol)
        requested = _requested_format(protocol, body)
        if requested not in _NO_CONSTRAINT and constraint is None:
            raise APIError(400, f"{field} of type {requested!r} is not supported", param=field)
        if requested not in _NO_CONSTRAINT and constraint.kind in ("tool_call", "tool_call_required"):
            raise APIError(
                400,
                f"{field} and tools both constrain the reply, and a reply cannot be held to both; give one, or "
                "set tool_choice to 'none'",
                param=field,
            )
        try:
            encoded = ctx.encoder.encode_request(converted)
        except (TypeError, ValueError) as exc:
            raise APIError(400, f"the conversation cannot be encoded: {exc}") from None
        think_end = ctx.encoder.marker_ids["</think>"] if encoded.thinking else None
        extra = constraint_params(constraint, think_end=think_end, field=field)
        ids = list(encoded.token_ids)
        max_tokens = converted.resolve_max_tokens(len(ids), ctx.max_model_len)
        stream = converted.stream
        stop = list(parsing.stop_sequences)
        logprobs = (inference.top_logprobs or 0) if inference.logprobs else None
        params = sampling_params(
            ctx,
            body,
            protocol.extras,
            temperature=inference.temperature if inference.temperature is not None else 1.0,
            top_p=inference.top_p if inference.top_p is not None else 1.0,
            max_tokens=max_tokens,
            logprobs=logprobs,
            # Responses and Messages have no seed of their own: the body's ``seed`` is an extension there.
            seed=inference.seed if inference.seed is not None else body.get("seed"),
            stop=stop or None,
            **extra,
        )
        response_id = response_id or f"{protocol.id_prefix}{uuid.uuid4().hex}"
        generator = decorate(
            protocol.request_cls.chunk_generator(converted, response_id, ctx.served_model_name)
        )
        processor = recipe.StreamProcessor(generator, parsing, ctx.recipe_tokenizer)
    except recipe.ConversionError as exc:
        error = from_conversion_error(exc)
        if error.param is None and "context length" in error.message:
            error.param = protocol.prompt_field
        raise (error if error.param == protocol.prompt_field else with_value(error, body)) from None
    except APIError:
        raise
    except ValueError as exc:
        raise with_value(from_recipe_value_error(exc), body) from None
    llm = ctx.engine.llm
    try:
        validate_request(ids, params, vocab_size=llm.model.config.vocab_size, max_model_len=ctx.max_model_len)
        llm.check_replay(params)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        raise APIError(400, message, param=param_of(message) or protocol.prompt_field) from None
    return Prepared(
        protocol=protocol,
        response_id=response_id,
        prompt_token_ids=ids,
        params=params,
        stream=stream,
        processor=processor,
        want_logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
    )


# ------------------------------------------------------------------------------------------- generation

_FINISH = {
    "stop": recipe.InferenceFinishReason.Stop,
    "length": recipe.InferenceFinishReason.Length,
}


class _Feed:
    """Feeds one request's engine outputs into its stream processor and collects the protocol's chunks."""

    def __init__(self, ctx: ServingContext, prepared: Prepared) -> None:
        self.ctx = ctx
        self.prepared = prepared
        self.processor = prepared.processor
        self.pushed = 0
        """Generated ids handed to the processor: the completion tokens the usage reports."""

    def json(self, chunk_or_response: Any) -> str:
        """The JSON text of a chunk or response, its usage counting every generated id.

        The recipe counts the ids whose text it emitted, so a reply cut by the token limit inside a character
        would report fewer tokens than the engine generated; the engine's count is the one that is billed.
        """
        text = chunk_or_response.to_json()
        if '"usage":{' not in text:
            return text
        obj = json.loads(text)
        _fix_usage(obj, self.pushed)
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

    def start(self) -> list[Any]:
        usage = recipe.PromptUsage(prompt_tokens=len(self.prepared.prompt_token_ids))
        return self.processor.push(recipe.InferenceChunk.ready(prompt_usage=usage))

    def push(self, output: RequestOutput) -> list[Any]:
        completion = output.outputs[0]
        produced: list[Any] = []
        logprobs = completion.logprobs or itertools.repeat(None)
        special = self.ctx.special_ids
        for token, entry in zip(completion.token_ids, logprobs):
            if self.processor.finished:  # the recipe matched a stop string: nothing more is part of the reply
                break
            self.pushed += 1
            if token in special:
                produced += self.processor.push(recipe.InferenceChunk.text("", 1))
                continue
            chunk_logprobs = None
            if self.prepared.want_logprobs and entry is not None:
                ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                top = [(t, lp.logprob) for t, lp in ranked[: self.prepared.top_logprobs]]
                chunk_logprobs = [(entry[token].logprob, top)]
            produced += self.processor.push(recipe.InferenceChunk.tokens([token], chunk_logprobs))
        return produced

    def finish(self, reason: str) -> list[Any]:
        produced: list[Any] = []
        if not self.processor.finished:
            produced += self.processor.push(recipe.InferenceChunk.finish(_FINISH[reason]))
        produced += self.processor.finish()
        return produced


def _fix_usage(node: Any, completion_tokens: int) -> None:
    """Set the completion / output token counts of every ``usage`` object in ``node`` (and their totals)."""
    if isinstance(node, list):
        for item in node:
            _fix_usage(item, completion_tokens)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key == "usage" and isinstance(value, dict):
            for out_key, in_key in (
                ("completion_tokens", "prompt_tokens"),
                ("output_tokens", "input_tokens"),
            ):
                if out_key in value:
                    value[out_key] = completion_tokens
                    if "total_tokens" in value:
                        value["total_tokens"] = int(value.get(in_key) or 0) + completion_tokens
        else:
            _fix_usage(value, completion_tokens)


def _failure(completion: Any) -> APIError:
    if completion.finish_reason == "abort":
        return APIError(503, "the request was aborted (the server is shutting down)", type="server_error")
    return APIError(500, f"the request failed while running: {completion.error}", type="server_error")


def _sse(protocol: Protocol, feed: _Feed, chunk: Any) -> str:
    name = protocol.response_cls.sse_event_name(chunk)
    data = feed.json(chunk)
    return f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n"


def _sse_error(protocol: Protocol, error: APIError) -> str:
    if protocol.streams_named_events:
        body = {"type": "error", "error": {"type": error.type, "message": error.message}}
        return f"event: error\ndata: {json.dumps(body)}\n\n"
    return f"data: {json.dumps(error.body())}\n\n"


async def generate_sse(
    ctx: ServingContext,
    prepared: Prepared,
    stream: RequestStream,
    on_output: Callable[[RequestOutput], None] | None = None,
) -> AsyncIterator[str]:
    """The SSE text of one streaming request, chunk by chunk (the consumer's cancellation aborts the request)."""
    protocol = prepared.protocol
    feed = _Feed(ctx, prepared)
    finished = False
    try:
        for chunk in feed.start():
            yield _sse(protocol, feed, chunk)
        async for output in stream:
            if on_output is not None:
                on_output(output)
            chunks = feed.push(output)
            completion = output.outputs[0]
            if output.finished:
                finished = True
                if completion.finish_reason in _FINISH:
                    chunks += feed.finish(completion.finish_reason)
                for chunk in chunks:
                    yield _sse(protocol, feed, chunk)
                if completion.finish_reason not in _FINISH:
                    yield _sse_error(protocol, _failure(completion))
                break
            for chunk in chunks:
                yield _sse(protocol, feed, chunk)
            if feed.processor.finished:  # a stop string ended the reply before the engine saw it
                ctx.engine.abort_nowait(stream.request_id)
                finished = True
                for chunk in feed.finish("stop"):
                    yield _sse(protocol, feed, chunk)
                break
        done = protocol.response_cls.sse_done_data()
        if done is not None:
            yield f"data: {done}\n\n"
    finally:
        if not finished:
            ctx.engine.abort_nowait(stream.request_id)


async def generate_json(
    ctx: ServingContext,
    prepared: Prepared,
    stream: RequestStream,
    on_output: Callable[[RequestOutput], None] | None = None,
) -> str:
    """The JSON response of one non-streaming request (an :class:`APIError` when the request failed)."""
    protocol = prepared.protocol
    response = protocol.response_cls(
        prepared.response_id, ctx.served_model_name, int(time.time()), len(prepared.prompt_token_ids), 0
    )
    feed = _Feed(ctx, prepared)
    finished = False
    try:
        for chunk in feed.start():
            response.accumulate(chunk)
        async for output in stream:
            if on_output is not None:
                on_output(output)
            chunks = feed.push(output)
            completion = output.outputs[0]
            if output.finished or feed.processor.finished:
                finished = True
                if output.finished and completion.finish_reason not in _FINISH:
                    raise _failure(completion)
                if not output.finished:
                    ctx.engine.abort_nowait(stream.request_id)
                chunks += feed.finish(completion.finish_reason if output.finished else "stop")
                for chunk in chunks:
                    response.accumulate(chunk)
                break
            for chunk in chunks:
                response.accumulate(chunk)
    finally:
        if not finished:
            ctx.engine.abort_nowait(stream.request_id)
    return feed.json(response)


# ------------------------------------------------------------------------------------------- n choices


async def generate_json_n(
    ctx: ServingContext,
    prepared: list[Prepared],
    streams: list[RequestStream],
    on_output: Callable[[RequestOutput], None] | None = None,
) -> str:
    """The Chat Completions response of ``n`` choices: each choice's own response, merged (choice ``j`` at index
    ``j``; the prompt counted once in the usage)."""
    tasks = [asyncio.ensure_future(generate_json(ctx, p, s, on_output)) for p, s in zip(prepared, streams)]
    try:
        bodies = [json.loads(text) for text in await asyncio.gather(*tasks)]
    finally:
        for task in tasks:
            task.cancel()
    merged = bodies[0]
    merged["choices"] = [{**b["choices"][0], "index": j} for j, b in enumerate(bodies)]
    usage = merged.get("usage")
    if isinstance(usage, dict):
        usage["completion_tokens"] = sum(int(b["usage"]["completion_tokens"]) for b in bodies)
        usage["total_tokens"] = int(usage.get("prompt_tokens") or 0) + usage["completion_tokens"]
    return json.dumps(merged, ensure_ascii=False, separators=(",", ":"))


async def generate_sse_n(
    ctx: ServingContext,
    prepared: list[Prepared],
    streams: list[RequestStream],
    on_output: Callable[[RequestOutput], None] | None = None,
) -> AsyncIterator[str]:
    """The Chat Completions stream of ``n`` choices: every choice's chunks as they come, re-indexed (choice ``j``
    at index ``j``), without their own usage; one usage chunk for the whole request (the prompt counted once),
    then ``[DONE]``."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(j: int) -> None:
        try:
            async for event in generate_sse(ctx, prepared[j], streams[j], on_output):
                await queue.put((j, event))
        finally:
            await queue.put((j, None))

    tasks = [asyncio.ensure_future(pump(j)) for j in range(len(prepared))]
    usages: dict[int, dict[str, Any]] = {}
    head: dict[str, Any] | None = None
    try:
        left = len(tasks)
        while left:
            j, event = await queue.get()
            if event is None:
                left -= 1
                continue
            data = event[6:].strip() if event.startswith("data: ") else None
            if data is None or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                yield event
                continue
            if chunk.get("usage"):
                usages[j] = chunk["usage"]
            chunk["usage"] = None
            head = head or {k: chunk.get(k) for k in ("id", "object", "created", "model")}
            choices = chunk.get("choices") or []
            if not choices:
                continue
            for c in choices:
                c["index"] = j
            yield f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
        if usages and head is not None:
            prompt = int(next(iter(usages.values())).get("prompt_tokens") or 0)
            completion = sum(int(u.get("completion_tokens") or 0) for u in usages.values())
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            if not stream.finished:
                ctx.engine.abort_nowait(stream.request_id)
