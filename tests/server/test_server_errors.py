"""Refusals of the server: authentication on and off, body size limits, bad requests (each with its status, the
field it names and a message naming the value and the limit), the admission bound (429 with ``Retry-After``),
and client disconnects (streaming or not), which abort the request and free its blocks and slot.

A refused request never reaches the engine: the engine's accepted-request counter does not move.
"""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx2
import openai
import pytest
from server_helpers import API_KEY, BODY_LIMIT, assert_engine_empty  # tests/server/server_helpers.py

HELLO = [{"role": "user", "content": "hi"}]
JSON_ASK = [{"role": "user", "content": "answer in json"}]
# A schema the recipe accepts (it is valid JSON Schema) but no value satisfies: llguidance refuses it.
UNSATISFIABLE = {
    "type": "json_schema",
    "json_schema": {
        "name": "n",
        "schema": {
            "type": "object",
            "properties": {"v": {"type": "integer", "minimum": 5, "maximum": 1}},
            "required": ["v"],
        },
    },
}


def _wait_until(predicate, timeout_s: float = 120.0) -> None:
    """Poll ``predicate`` (the engine thread frees aborted requests between steps)."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting for the engine")
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------- authentication


def test_auth_is_required_on_every_route_but_health(keyed_server):
    url = keyed_server.url
    chat = {"model": "tiny-v3", "messages": HELLO, "max_tokens": 1}
    assert httpx2.get(f"{url}/health").status_code == 200  # no key needed
    for headers in (
        {},
        {"Authorization": "Bearer sk-wrong"},
        {"x-api-key": API_KEY[:-1]},
        {"Authorization": API_KEY},
    ):
        for method, route, body in (
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("POST", "/v1/chat/completions", chat),
            ("POST", "/v1/messages", chat),
        ):
            r = httpx2.request(method, f"{url}{route}", json=body, headers=headers)
            assert r.status_code == 401, (route, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    # The right key, as OpenAI's client sends it (Bearer) and as Anthropic's does (x-api-key).
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    assert [m.id for m in good.models.list().data] == ["tiny-v3"]
    assert (
        good.chat.completions.create(model="tiny-v3", messages=HELLO, max_tokens=2).usage.completion_tokens
        == 2
    )
    claude = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=300)
    assert claude.messages.create(model="tiny-v3", max_tokens=2, messages=HELLO).usage.output_tokens == 2


def test_auth_off_needs_no_key(server):
    assert httpx2.get(f"{server.url}/v1/models").status_code == 200
    assert (
        httpx2.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200
    )


# ------------------------------------------------------------------------------------------- body size


def test_oversize_bodies_are_refused_before_they_are_parsed(keyed_server, engine):
    url = f"{keyed_server.url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    accepted = engine.stats().accepted
    big = {"model": "tiny-v3", "messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}
    r = httpx2.post(url, json=big, headers=auth)
    assert r.status_code == 413
    assert f"the limit is {BODY_LIMIT} bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit applies while the body is read
        yield b'{"model": "tiny-v3", "messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 512 + 1):
            yield b"y" * 512
        yield b'"}]}'

    r = httpx2.post(url, content=chunks(), headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert f"over the limit of {BODY_LIMIT} bytes" in r.json()["error"]["message"]
    # Just under the limit is served.
    small = {"model": "tiny-v3", "messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 1}
    assert httpx2.post(url, json=small, headers=auth, timeout=300).status_code == 200
    assert engine.stats().accepted == accepted + 1


# ------------------------------------------------------------------------------------------- bad requests

CHAT = "/v1/chat/completions"
BAD_REQUESTS = [
    # (route, body (bytes: sent as is), status, param, words the message must hold)
    ("malformed JSON", CHAT, b'{"model": "tiny-v3", "messages": [', 400, None, ["not valid JSON"]),
    ("not an object", CHAT, b"[1, 2]", 400, None, ["must be a JSON object", "list"]),
    ("no model", CHAT, {"messages": HELLO}, 400, "model", ["'model' is required"]),
    ("unknown model", CHAT, {"model": "gpt-4", "messages": HELLO}, 404, "model", ["gpt-4", "tiny-v3"]),
    (
        "wrong type",
        CHAT,
        {"model": "tiny-v3", "messages": HELLO, "temperature": "hot"},
        400,
        "temperature",
        ["must be a number", "hot"],
    ),
    (
        "out of range",
        CHAT,
        {"model": "tiny-v3", "messages": HELLO, "temperature": -0.5},
        400,
        "temperature",
        ["-0.5", "[0, 2]"],
    ),
    (
        "too many logprobs",
        CHAT,
        {"model": "tiny-v3", "messages": HELLO, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
        ["50", "[0, 20]"],
    ),
    ("n = 0", CHAT, {"model": "tiny-v3", "messages": HELLO, "n": 0}, 400, "n", ["n = 0", "[1, 256]"]),
    (
        "n > 1 on messages",
        "/v1/messages",
        {"model": "tiny-v3", "max_tokens": 4, "messages": HELLO, "n": 3},
        400,
        "n",
        ["n = 3", "one choice"],
    ),
    (
        "prompt too long",
        CHAT,
        {"model": "tiny-v3", "messages": [{"role": "user", "content": "word " * 1300}]},
        400,
        "messages",
        ["1137"],
    ),
    (
        "max_tokens over the context",
        "/v1/completions",
        {"model": "tiny-v3", "prompt": [5, 6, 7], "max_tokens": 5000},
        400,
        "max_tokens",
        ["5000", "1137"],
    ),
    (
        "token id outside the vocabulary",
        "/v1/completions",
        {"model": "tiny-v3", "prompt": [5, 99999]},
        400,
        "prompt",
        ["99999", "512"],
    ),
    (
        "response_format json_schema llguidance cannot enforce",
        CHAT,
        {"model": "tiny-v3", "messages": JSON_ASK, "response_format": UNSATISFIABLE},
        400,
        "response_format",
        ["JSON schema cannot be enforced", "required property 'v' is unsatisfiable"],
    ),
    (
        "response_format regex that does not parse",
        CHAT,
        {"model": "tiny-v3", "messages": HELLO, "response_format": {"type": "regex", "regex": "[a-z"}},
        400,
        "response_format",
        ["regex cannot be enforced", "unclosed character class"],
    ),
    (
        "response_format with tools",
        CHAT,
        {
            "model": "tiny-v3",
            "messages": JSON_ASK,
            "response_format": {"type": "json_object"},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        },
        400,
        "response_format",
        ["response_format and tools both constrain the reply", "tool_choice"],
    ),
    (
        "text.format json_schema llguidance cannot enforce",
        "/v1/responses",
        {
            "model": "tiny-v3",
            "input": "answer in json",
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "n",
                    "schema": UNSATISFIABLE["json_schema"]["schema"],
                }
            },
        },
        400,
        "text.format",
        ["JSON schema cannot be enforced", "required property 'v' is unsatisfiable"],
    ),
    (
        "json_object without asking for JSON",
        CHAT,
        {"model": "tiny-v3", "messages": HELLO, "response_format": {"type": "json_object"}},
        400,
        "response_format",
        ["must contain the word 'json'"],
    ),
    (
        "logit_bias out of range",
        CHAT,
        {"model": "tiny-v3", "messages": HELLO, "logit_bias": {"5": 150}},
        400,
        "logit_bias",
        ["[-100, 100]", "150"],
    ),
    (
        "logit_bias outside the vocabulary",
        "/v1/completions",
        {"model": "tiny-v3", "prompt": [5, 6], "logit_bias": {"9999": 1}},
        400,
        "logit_bias",
        ["9999", "[0, 512)"],
    ),
    ("no messages", "/v1/messages", {"model": "tiny-v3", "max_tokens": 4}, 400, "messages", ["messages"]),
    ("unknown route", "/v1/embeddings", {"model": "tiny-v3"}, 404, None, ["/v1/embeddings", "no such route"]),
]


@pytest.mark.parametrize(
    "route, body, status, param, words", [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_requests_are_refused_before_the_engine(server, engine, route, body, status, param, words):
    accepted = engine.stats().accepted
    kw = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx2.post(f"{server.url}{route}", timeout=60, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert engine.stats().accepted == accepted  # nothing reached the engine


def test_the_clients_raise_the_status_and_message(client, claude):
    with pytest.raises(openai.BadRequestError, match="'temperature' must be a number") as info:
        client.chat.completions.create(model="tiny-v3", messages=HELLO, extra_body={"temperature": "hot"})
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(anthropic.BadRequestError, match=r"n = 2: messages requests have one choice"):
        claude.messages.create(model="tiny-v3", max_tokens=4, messages=HELLO, extra_body={"n": 2})


# ------------------------------------------------------------------------------------------- admission bound


def test_over_the_admission_bound_is_429_with_retry_after(server, engine):
    """While the engine is held (exclusive), accepted requests wait; with the bound lowered to the running
    limit, one request more is refused at once with 429 and ``Retry-After``; the held ones then complete."""
    body = {"model": "tiny-v3", "prompt": [4, 5, 6], "max_tokens": 2, "ignore_eos": True}
    url = f"{server.url}/v1/completions"
    saved = engine.max_queued_requests

    async def run() -> tuple[list[int], httpx2.Response]:
        async with httpx2.AsyncClient(timeout=300) as http:
            with engine.exclusive():
                engine.max_queued_requests = 0
                try:
                    held = [
                        asyncio.ensure_future(http.post(url, json=body)) for _ in range(engine.max_running)
                    ]
                    while engine.stats().unfinished < engine.max_running:
                        await asyncio.sleep(0.01)
                    over = await http.post(url, json=body)
                finally:
                    engine.max_queued_requests = saved
            done = await asyncio.gather(*held)
        return [r.status_code for r in done], over

    refused = engine.stats().refused
    statuses, over = asyncio.run(run())
    assert over.status_code == 429
    assert int(over.headers["retry-after"]) >= 1
    error = over.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "server.max_queued_requests = 0" in error["message"]
    assert statuses == [200] * engine.max_running
    assert engine.stats().refused == refused + 1
    assert_engine_empty(engine)


# ------------------------------------------------------------------------------------------- disconnects


def _aborted(engine) -> int:
    return engine.stats().finished.get("abort", 0)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_streaming_client_that_disconnects_aborts_its_request(server, engine, route):
    body = {"model": "tiny-v3", "messages": HELLO, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    before = _aborted(engine)
    with httpx2.stream("POST", f"{server.url}{route}", json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        while seen < 4:  # a few events, then hang up mid-stream
            seen += bool(next(lines).startswith("data: "))
    _wait_until(lambda: _aborted(engine) == before + 1)
    assert_engine_empty(engine)
    stats = engine.stats()
    assert stats.cache_blocks_used == 0


def test_a_non_streaming_client_that_disconnects_aborts_its_request(server, engine):
    body = {"model": "tiny-v3", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
    before = _aborted(engine)
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(f"{server.url}/v1/completions", json=body, timeout=httpx2.Timeout(1.5, connect=30))
    _wait_until(lambda: _aborted(engine) == before + 1)
    assert_engine_empty(engine)


# ------------------------------------------------------------------------------------------- a failing step


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_failed_step_is_a_500_and_the_server_serves_on(server, engine, monkeypatch, stream):
    """A step that raises ends the request with a server error (a 500 body, or an error event in the stream),
    the engine recovers, and the next request is served."""
    executor = engine.llm.executor
    original = executor.run
    calls = {"n": 0}

    def failing(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return original(plan)

    monkeypatch.setattr(executor, "run", failing)
    body = {"model": "tiny-v3", "messages": HELLO, "max_tokens": 8, "stream": stream}
    r = httpx2.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    if stream:
        assert r.status_code == 200  # the stream had started; the failure comes as its last event
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"  # OpenAI's stream end, after the error event
        assert "injected step failure" in events[-2] and '"type": "server_error"' in events[-2]
    else:
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and "injected step failure" in error["message"]
    assert_engine_empty(engine)
    monkeypatch.setattr(executor, "run", original)
    ok = httpx2.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=300)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


async def _add(engine, prompt, params):
    engine.add_request(prompt, params, "replay-refused")


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"model": "tiny-v3", "prompt": [5, 6, 7], "echo": True, "logprobs": 1}),
        ("/v1/completions", {"model": "tiny-v3", "prompt": [[5, 6], [7, 8]], "echo": True, "logprobs": 0}),
    ],
    ids=["one prompt", "two prompts"],
)
def test_prompt_logprobs_under_bounded_replay_are_a_400(server, engine, monkeypatch, route, body):
    """With ``scheduler.yoco_truncation`` on (``LLM.replay``, which ``LLM.check_replay`` reads; set here on the
    served tiny-v3 engine, whose own model has no consumer layers to truncate), prompt logprobs (``echo`` with
    ``logprobs``) are refused before the engine with a message naming both settings; the same request is
    served once truncation is off again. ``AsyncLLM.add_request`` refuses them the same way."""
    from deepinfer_jax import SamplingParams

    with engine.exclusive() as llm:
        monkeypatch.setattr(llm, "replay", "compact")
    accepted = engine.stats().accepted
    r = httpx2.post(f"{server.url}{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "prompt_logprobs" in message and "scheduler.yoco_truncation = 'compact'" in message, message
    assert engine.stats().accepted == accepted
    with pytest.raises(ValueError, match=r"prompt_logprobs = 1 is impossible with scheduler.yoco_truncation"):
        asyncio.run(_add(engine, {"prompt_token_ids": [5, 6, 7]}, SamplingParams(prompt_logprobs=1)))
    assert engine.stats().accepted == accepted
    monkeypatch.undo()
    r = httpx2.post(f"{server.url}{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text
