"""`deepinfer-jax chat`: one conversation through :meth:`deepinfer_jax.LLM.chat`, printed as reasoning, answer and
tool calls.

The conversation is given as `--message 'ROLE: TEXT'` flags, in order (`user`, `assistant`, `system`, ...), with
`--system` as a shorthand for a leading system message; `--tools` takes a JSON file of Chat Completions function
tools. Thinking mode (`--thinking`, `--reasoning_effort`) opens a reasoning block for the reply, which is printed
apart from the answer. `--json` prints the parsed turn as one JSON object (and the notices on stderr), for
scripts. The tiny built-in models have random weights, so their replies are noise; the command says so.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from absl import flags

from deepinfer_jax.cli import common
from deepinfer_jax.text.chat import CHAT_VERSIONS, REASONING_EFFORTS


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "model", None, "a built-in model name (tiny-v3, ...) or a model folder", flag_values=fv, required=True
    )
    flags.DEFINE_multi_string(
        "message", [], "a message as 'ROLE: TEXT', e.g. 'user: hi' (repeatable, in order)", flag_values=fv
    )
    flags.DEFINE_string("system", None, "a system prompt, placed before the messages", flag_values=fv)
    flags.DEFINE_string(
        "tools", None, "a JSON file holding a list of Chat Completions function tools", flag_values=fv
    )
    flags.DEFINE_boolean("thinking", False, "thinking mode: reason first, then answer", flag_values=fv)
    flags.DEFINE_enum(
        "reasoning_effort",
        None,
        list(REASONING_EFFORTS),
        "reasoning effort in thinking mode (default: the template's)",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "chat_version",
        None,
        sorted(CHAT_VERSIONS),
        "chat template (default: v41 for DeepSeek-V4.1 models, v4 otherwise)",
        flag_values=fv,
    )
    flags.DEFINE_boolean("json", False, "print the parsed turn as one JSON object", flag_values=fv)
    common.define_engine_flags(fv, max_tokens=256)


def parse_message(index: int, text: str) -> dict[str, str]:
    """``'user: hi'`` -> ``{"role": "user", "content": "hi"}`` (one space after the colon is dropped).

    The role is checked by the chat encoder, which names the known roles.
    """
    role, colon, content = text.partition(":")
    if not colon or not role.strip():
        raise ValueError(f"--message[{index}]={text!r} is not 'ROLE: TEXT' (for example 'user: hello')")
    return {"role": role.strip(), "content": content[1:] if content.startswith(" ") else content}


def load_tools(path: str) -> list[Any]:
    """The tool list of a JSON file; its entries are checked by the chat encoder."""
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--tools={path!r} cannot be read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--tools={path!r} is not a JSON file: {exc}") from None
    if not isinstance(tools, list):
        raise ValueError(f"--tools={path!r} holds a {type(tools).__name__}; expected a JSON list of tools")
    return tools


def _print_turn(output: Any) -> None:
    if output.reasoning_content is not None:
        print(f"reasoning: {output.reasoning_content!r}")
    print(f"answer: {output.content!r}")
    for call in output.tool_calls:
        print(f"tool call {call.id}: {call.name}({call.arguments})")
    usage = output.usage
    print(
        f"finish_reason: {output.finish_reason}; tokens: {usage['prompt_tokens']} prompt, "
        f"{usage['completion_tokens']} completion ({usage['reasoning_tokens']} reasoning)"
    )


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"chat: unexpected arguments {argv[1:]}; messages go in --message", file=sys.stderr)
        return 2
    if not fv.message:
        print(
            "chat: give at least one --message 'ROLE: TEXT' (for example --message 'user: hi')",
            file=sys.stderr,
        )
        return 2
    from deepinfer_jax.models import builtin

    notice = sys.stderr if fv.json else sys.stdout
    try:
        messages = [parse_message(i, m) for i, m in enumerate(fv.message)]
        if fv.system is not None:
            messages.insert(0, {"role": "system", "content": fv.system})
        tools = load_tools(fv.tools) if fv.tools is not None else None
        # Every flag is checked before the model loads (LLM checks its settings before reading any weight).
        params = common.sampling_params_from_flags(fv)
        if params.n != 1:
            raise ValueError(
                f"--n={params.n}: chat prints one reply per conversation; use `deepinfer-jax generate --n` for "
                "several samples of one prompt"
            )
        common.resolve_model(fv.model)
        llm = common.llm_from_flags(fv)
        if fv.verbose:
            print(llm.memory_plan.describe(), file=notice)
        if builtin.is_builtin(fv.model) and builtin.get_builtin(fv.model).random_weights:
            print(
                f"{fv.model} is a built-in test model with random weights: its replies are noise.",
                file=notice,
            )
        (output,) = llm.chat(
            messages,
            params,
            tools=tools,
            thinking=fv.thinking,
            reasoning_effort=fv.reasoning_effort,
            use_tqdm=fv.progress,
            chat_version=fv.chat_version,
        )
    except (ValueError, TypeError, NotImplementedError) as err:
        print(f"chat: error: {common.flag_message(err)}", file=sys.stderr)
        return 2
    if fv.json:
        record = dataclasses.asdict(output)
        record["usage"] = dict(output.usage)
        print(json.dumps(record, ensure_ascii=False))
    else:
        _print_turn(output)
    return 0
