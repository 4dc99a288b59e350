"""One engine for every server test of a worker: tiny-v3 in float32, batch invariant, behind two real servers on
loopback ports (one open, one with an API key and a small body limit) that share its ``AsyncLLM``.

The engine is batch invariant so that a request's tokens through the server, whatever it shares its steps with,
are exactly those of ``LLM.generate`` (or ``LLM.chat``) of the same request on the same engine; references run
inside ``AsyncLLM.exclusive()``.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from server_helpers import API_KEY, BODY_LIMIT  # tests/server/server_helpers.py

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.server import Server

MODEL = "tiny-v3"
# 72 blocks of 16 tokens (one reserved) and 17 state slots of tiny-v3 in float32 (as tests/engine/test_engine_chat.py):
# one request may hold 1136 tokens, enough for a prompt with a tool definition (about 700 tokens).
ENGINE = dict(
    dtype="float32",
    max_num_seqs=16,
    max_num_batched_tokens=64,
    kv_cache_memory=72 * 4 * 16 * 96 * 4 + 17 * 4 * 513,
    batch_invariant=True,
)


@pytest.fixture(scope="session")
def server():
    llm = LLM(MODEL, **ENGINE, **{"cache.block_size": 16})
    srv = Server(llm, model_name=MODEL, port=0, max_queued_requests=64).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def keyed_server(server):
    srv = Server(
        server.engine, model_name=MODEL, port=0, api_key=API_KEY, max_request_body_bytes=BODY_LIMIT
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def engine(server):
    return server.engine


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
