"""Helpers of the server tests: offline references on the served engine, and the engine's emptiness."""

from __future__ import annotations

from typing import Any

from deepinfer_jax.engine.params import SamplingParams

API_KEY = "sk-test-0123456789abcdef"
"""The key of the keyed server (tests/server/conftest.py)."""
BODY_LIMIT = 4096
"""The keyed server's request body limit, in bytes."""

# Ids of the synthetic tokenizer's markers (docs/text.md): EOS, <think>, </think>, ｜DSML｜.
EOS, THINK, END_THINK, DSML = 1, 5, 6, 7

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}


def assert_engine_empty(engine: Any) -> None:
    """No request left in the engine, every block and state slot of every device free."""
    with engine.exclusive() as llm:
        sched = llm.scheduler
        assert not sched.has_unfinished_requests()
        for dev in sched.devices:
            assert dev.blocks.num_free == dev.blocks.capacity
            assert dev.slots.num_free == dev.slots.capacity
    assert engine.stats().unfinished == 0


def offline_chat(engine: Any, messages: list, params: SamplingParams, **kw: Any) -> Any:
    """``LLM.chat`` of one conversation on the served engine (the reference of the chat protocols)."""
    with engine.exclusive() as llm:
        return llm.chat(messages, params, use_tqdm=False, **kw)[0]


def offline_generate(engine: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    with engine.exclusive() as llm:
        return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def spell(tokenizer: Any, text: str) -> list[int]:
    """One character at a time, so no id is a marker even where the text spells one."""
    return [i for char in text for i in tokenizer.encode(char)]


def tool_call_ids(tokenizer: Any, city: str = "Paris", days: int = 2) -> list[int]:
    """A DSML tool-call block as the model writes it: the ｜DSML｜ marker is one id inside each tag."""
    pieces = [
        "\n\n<", DSML, "tool_calls>\n<", DSML, 'invoke name="get_weather">\n<', DSML,
        f'parameter name="city" string="true">{city}</', DSML, "parameter>\n<", DSML,
        f'parameter name="days" string="false">{days}</', DSML, "parameter>\n</", DSML,
        "invoke>\n</", DSML, "tool_calls>",
    ]  # fmt: skip
    ids: list[int] = []
    for piece in pieces:
        ids += [piece] if isinstance(piece, int) else spell(tokenizer, piece)
    return ids
