"""`deepinfer-jax generate`: run prompts through the engine (:class:`deepinfer_jax.LLM`) and print the
completions.

Prompts come from `--prompt` (repeatable) or `--prompt_ids` (comma-separated token ids, repeatable, for models
without a tokenizer). `--json_schema FILE`, `--regex R`, `--choice a,b,c`, `--grammar FILE` (Lark-style EBNF) or
`--json_object` constrain every completion (structured outputs; at most one of them). A progress bar runs while the
requests are generated, and a one-line summary (requests, tokens, tokens/s, compile time) follows. The tiny built-in
models have random weights, so their text is noise; the
command says so.
"""

from __future__ import annotations

import sys

from absl import flags

from deepinfer_jax.cli import common


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "model", None, "a built-in model name (tiny-v3, ...) or a model folder", flag_values=fv, required=True
    )
    flags.DEFINE_multi_string("prompt", [], "a text prompt (repeatable)", flag_values=fv)
    flags.DEFINE_multi_string(
        "prompt_ids", [], "a prompt as comma-separated token ids (repeatable)", flag_values=fv
    )
    common.define_engine_flags(fv, max_tokens=16)
    flags.DEFINE_string("json_schema", None, "constrain the output to this JSON schema file", flag_values=fv)
    flags.DEFINE_string("regex", None, "constrain the output to this regular expression", flag_values=fv)
    flags.DEFINE_list(
        "choice", None, "constrain the output to one of these comma-separated strings", flag_values=fv
    )
    flags.DEFINE_string(
        "grammar", None, "constrain the output to this Lark-style EBNF grammar file", flag_values=fv
    )
    flags.DEFINE_boolean("json_object", False, "constrain the output to any JSON value", flag_values=fv)


def structured_outputs_from_flags(fv: flags.FlagValues):  # -> StructuredOutputsParams | None
    """The ``StructuredOutputsParams`` the structured-output flags ask for (``None`` for none of them)."""
    from deepinfer_jax.engine.structured import StructuredOutputsParams

    given = [
        name
        for name, v in (
            ("json_schema", fv.json_schema),
            ("regex", fv.regex),
            ("choice", fv.choice),
            ("grammar", fv.grammar),
            ("json_object", fv.json_object or None),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"give at most one of --json_schema, --regex, --choice, --grammar, --json_object; got {given}"
        )
    if not given:
        return None

    def read(flag: str, path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as err:
            raise ValueError(f"--{flag} {path!r}: {err.strerror}") from None

    if fv.json_schema is not None:
        return StructuredOutputsParams(json=read("json_schema", fv.json_schema))
    if fv.grammar is not None:
        return StructuredOutputsParams(grammar=read("grammar", fv.grammar))
    if fv.regex is not None:
        return StructuredOutputsParams(regex=fv.regex)
    if fv.choice is not None:
        return StructuredOutputsParams(choice=list(fv.choice))
    return StructuredOutputsParams(json_object=True)


def _parse_ids(items: list[str]) -> list[list[int]]:
    out = []
    for i, item in enumerate(items):
        try:
            out.append([int(x) for x in item.split(",") if x.strip()])
        except ValueError:
            raise ValueError(f"--prompt_ids[{i}]: {item!r} is not a comma-separated list of ints") from None
    return out


def _check_prompt_ids(fv: flags.FlagValues, prompt_ids: list[list[int]], params: object) -> None:
    """Token-id prompts against the model's config.json (no weights read): ids inside the vocabulary, lengths
    within --max_model_len (or the model's max_position_embeddings; the engine checks the exact limit)."""
    if not prompt_ids:
        return
    from deepinfer_jax import config as config_lib
    from deepinfer_jax.engine.params import validate_request

    model = config_lib.load_config(common.resolve_model(fv.model)[0]).model
    if model is None:
        return
    limit = fv.max_model_len or model.max_position_embeddings or 2**31 - 1
    for i, ids in enumerate(prompt_ids):
        try:
            validate_request(ids, params, vocab_size=model.vocab_size, max_model_len=limit)
        except (ValueError, TypeError) as err:
            raise type(err)(f"--prompt_ids[{i}]: {err}") from None


def _format_logprobs(token_ids: list[int], logprobs: list[dict]) -> str:
    """Each generated token's logprob, e.g. ``5:-0.12 9:-1.70``."""
    return " ".join(f"{t}:{entry[t].logprob:.4f}" for t, entry in zip(token_ids, logprobs, strict=False))


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"generate: unexpected arguments {argv[1:]}; prompts go in --prompt", file=sys.stderr)
        return 2
    if bool(fv.prompt) == bool(fv.prompt_ids):
        print("generate: give --prompt or --prompt_ids (one of them)", file=sys.stderr)
        return 2
    from deepinfer_jax.models import builtin

    try:
        # Every flag is checked before the model loads: the sampling flags here, the prompts, then the engine
        # settings inside LLM (which checks them before reading any weight).
        params = common.sampling_params_from_flags(fv)
        structured = structured_outputs_from_flags(fv)
        if structured is not None:
            params = params.replace(structured_outputs=structured)
        prompt_ids = _parse_ids(list(fv.prompt_ids))
        common.resolve_model(fv.model)
        _check_prompt_ids(fv, prompt_ids, params)
        llm = common.llm_from_flags(fv)
        if builtin.is_builtin(fv.model) and builtin.get_builtin(fv.model).random_weights:
            print(f"{fv.model} is a built-in test model with random weights: its completions are noise.")
        if fv.verbose:
            print(llm.memory_plan.describe())
        if fv.prompt:
            outputs = llm.generate(list(fv.prompt), params, use_tqdm=fv.progress)
        else:
            outputs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=fv.progress)
    except (ValueError, TypeError, NotImplementedError) as err:
        print(f"generate: error: {common.flag_message(err)}", file=sys.stderr)
        return 2
    for i, out in enumerate(outputs):
        shown = out.prompt if out.prompt is not None else out.prompt_token_ids
        print(f"[{i}] prompt: {shown!r}")
        for c in out.outputs:
            tag = f"[{i}]" if len(out.outputs) == 1 else f"[{i}.{c.index}]"
            print(f"{tag} output ({c.finish_reason}): {c.text!r} ids={list(c.token_ids)}")
            if c.logprobs is not None:
                print(f"{tag} logprobs: {_format_logprobs(c.token_ids, c.logprobs)}")
            if c.error:
                print(f"{tag} error: {c.error}")
    assert llm.last_stats is not None
    if not fv.progress:  # with the progress bar, generate() has already printed the summary line
        print(llm.last_stats.summary(len(outputs)))
    return 0
