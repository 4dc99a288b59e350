"""`deepinfer-jax chat`: a conversation from flags, printed as reasoning / answer / tool calls, or as JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deepinfer_jax.cli import chat as chat_cli
from deepinfer_jax.cli import main as cli
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.text import ChatOutput, ToolCall

# The engine of tests/engine/test_engine_chat.py (72 blocks of 16 tokens), so compiled steps are shared.
MEMORY = 72 * 4 * 16 * 96 * 4 + 17 * 4 * 513
ENGINE = [
    "--dtype=float32",
    "--max_num_seqs=16",
    "--max_num_batched_tokens=64",
    f"--kv_cache_memory={MEMORY}",
    "--set=cache.block_size=16",
]
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
FLAGS = ["--system=be brief", "--message=user: hi", "--temperature=0", "--max_tokens=6", "--noprogress"]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["deepinfer-jax", "chat", "--model=tiny-v3", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The engine the command builds from ENGINE, for the expected replies."""
    return LLM(
        "tiny-v3",
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        kv_cache_memory=MEMORY,
        **{"cache.block_size": 16},
    )


def _expected(llm: LLM, thinking: bool, **kw) -> ChatOutput:
    params = SamplingParams(temperature=0.0, max_tokens=6)
    return llm.chat(CONVERSATION, params, thinking=thinking, use_tqdm=False, **kw)[0]


def test_registered_with_help(capsys):
    assert cli.subcommands()["chat"].module == "deepinfer_jax.cli.chat"
    assert cli.main(["deepinfer-jax", "chat", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--message" in out and "--thinking" in out and "--json" in out


def test_prints_reasoning_and_answer_apart(capsys, llm):
    rc, out, err = _run(capsys, *FLAGS, "--thinking", *ENGINE)
    assert rc == 0, err
    expected = _expected(llm, thinking=True)
    lines = out.splitlines()
    assert "random weights" in lines[0]
    assert f"reasoning: {expected.reasoning_content!r}" in lines
    assert f"answer: {expected.content!r}" in lines
    usage = expected.usage
    assert (
        f"finish_reason: {expected.finish_reason}; tokens: {usage['prompt_tokens']} prompt, "
        f"{usage['completion_tokens']} completion ({usage['reasoning_tokens']} reasoning)"
    ) in lines


def test_without_thinking_there_is_no_reasoning_line(capsys, llm):
    rc, out, err = _run(capsys, *FLAGS, *ENGINE)
    assert rc == 0, err
    assert not any(line.startswith("reasoning:") for line in out.splitlines())
    assert f"answer: {_expected(llm, thinking=False).content!r}" in out.splitlines()


def test_json_output(capsys, llm, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([TOOL]), encoding="utf-8")
    rc, out, err = _run(capsys, *FLAGS, "--json", f"--tools={tools}", *ENGINE)
    assert rc == 0, err
    assert "random weights" in err  # stdout holds only the JSON object
    record = json.loads(out)
    expected = dataclasses.asdict(_expected(llm, thinking=False, tools=[TOOL]))
    assert record == json.loads(json.dumps(expected))
    assert set(record) == {
        "reasoning_content",
        "content",
        "tool_calls",
        "finish_reason",
        "usage",
        "prompt_token_ids",
        "token_ids",
        "logprobs",
        "parsed",
    }
    assert record["reasoning_content"] is None
    # The tool definition is part of the prompt.
    assert record["usage"]["prompt_tokens"] > _expected(llm, thinking=False).usage["prompt_tokens"]


def test_tool_calls_are_printed(capsys):
    output = ChatOutput(
        reasoning_content="r",
        content="",
        tool_calls=(ToolCall(id="call_1", name="get_time", arguments='{"zone": "UTC"}'),),
        finish_reason="tool_calls",
        usage={"prompt_tokens": 3, "completion_tokens": 2, "reasoning_tokens": 1},
    )
    chat_cli._print_turn(output)
    assert capsys.readouterr().out.splitlines() == [
        "reasoning: 'r'",
        "answer: ''",
        'tool call call_1: get_time({"zone": "UTC"})',
        "finish_reason: tool_calls; tokens: 3 prompt, 2 completion (1 reasoning)",
    ]


def test_parse_message():
    assert chat_cli.parse_message(0, "user: hi") == {"role": "user", "content": "hi"}
    assert chat_cli.parse_message(0, "user:  two spaces: kept") == {
        "role": "user",
        "content": " two spaces: kept",
    }
    assert chat_cli.parse_message(0, " assistant :x") == {"role": "assistant", "content": "x"}
    with pytest.raises(ValueError, match=r"--message\[3\]='hi' is not 'ROLE: TEXT'"):
        chat_cli.parse_message(3, "hi")


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give at least one --message"),
        (["--message=hi"], "is not 'ROLE: TEXT'"),
        (["--message=wizard: hi", *ENGINE], "role='wizard' is not a known role"),
        (["--message=user: hi", "extra"], "unexpected arguments"),
        (["--message=user: hi", "--tools=no-such-folder/tools.json"], "cannot be read"),
        (["--message=user: hi", "--reasoning_effort=huge"], "reasoning_effort"),
    ],
)
def test_errors_exit_2(capsys, args, message):
    rc, _, err = _run(capsys, *args)
    assert rc == 2 and message in err, err


def test_tools_file_must_hold_a_list(tmp_path):
    bad = tmp_path / "tools.json"
    bad.write_text(json.dumps(TOOL), encoding="utf-8")
    with pytest.raises(ValueError, match=r"holds a dict; expected a JSON list of tools"):
        chat_cli.load_tools(str(bad))
    bad.write_text("[", encoding="utf-8")
    with pytest.raises(ValueError, match=r"is not a JSON file"):
        chat_cli.load_tools(str(bad))
