"""`deepinfer-jax generate`: run prompts through the engine (:class:`deepinfer_jax.LLM`) and print the
completions.

Prompts come from `--prompt` (repeatable) or `--prompt_ids` (comma-separated token ids, repeatable, for models
without a tokenizer). A progress bar runs while the requests are generated, and a one-line summary (requests,
tokens, tokens/s, compile time) follows. The tiny built-in models have random weights, so their text is noise; the
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
    common.define_engine_flags(fv, max_tokens=16, max_tokens_help="tokens to generate per prompt")
    flags.DEFINE_boolean("ignore_eos", False, "keep generating after EOS", flag_values=fv)


def _parse_ids(items: list[str]) -> list[list[int]]:
    out = []
    for i, item in enumerate(items):
        try:
            out.append([int(x) for x in item.split(",") if x.strip()])
        except ValueError:
            raise ValueError(f"--prompt_ids[{i}]: {item!r} is not a comma-separated list of ints") from None
    return out


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"generate: unexpected arguments {argv[1:]}; prompts go in --prompt", file=sys.stderr)
        return 2
    if bool(fv.prompt) == bool(fv.prompt_ids):
        print("generate: give --prompt or --prompt_ids (one of them)", file=sys.stderr)
        return 2
    from deepinfer_jax.engine.params import SamplingParams
    from deepinfer_jax.models import builtin

    try:
        llm = common.llm_from_flags(fv)
        params = SamplingParams(
            temperature=fv.temperature,
            top_p=fv.top_p,
            top_k=fv.top_k,
            max_tokens=fv.max_tokens,
            ignore_eos=fv.ignore_eos,
        )
        if builtin.is_builtin(fv.model) and builtin.get_builtin(fv.model).random_weights:
            print(f"{fv.model} is a built-in test model with random weights: its completions are noise.")
        print(llm.memory_plan.describe())
        if fv.prompt:
            outputs = llm.generate(list(fv.prompt), params, use_tqdm=fv.progress)
        else:
            outputs = llm.generate(
                prompt_token_ids=_parse_ids(list(fv.prompt_ids)), sampling_params=params, use_tqdm=fv.progress
            )
    except (ValueError, TypeError, NotImplementedError) as err:
        print(f"generate: error: {err}", file=sys.stderr)
        return 2
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        shown = out.prompt if out.prompt is not None else out.prompt_token_ids
        print(f"[{i}] prompt: {shown!r}")
        print(f"[{i}] output ({c.finish_reason}): {c.text!r} ids={c.token_ids}")
        if c.error:
            print(f"[{i}] error: {c.error}")
    assert llm.last_stats is not None
    if not fv.progress:  # with the progress bar, generate() has already printed the summary line
        print(llm.last_stats.summary(len(outputs)))
    return 0
