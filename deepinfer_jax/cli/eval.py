"""`deepinfer-jax eval`: how well a model predicts a text, through the engine (bits/char, perplexity, tokens/s).

    deepinfer-jax eval --model shakespeare-v41 --text held_out.txt

The text is tokenised, cut into chunks of at most `--chunk_tokens` tokens (default: the request limit,
`max_model_len` minus BOS and the one generated token), each chunk prefixed with BOS, and the engine's prompt
log-probabilities of every chunk token are summed (`deepinfer_jax.evaluation.evaluate_text`). Printed: bits per
character of the text, perplexity per token, tokens scored per second (prefill), and the precision mode.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import flags

from deepinfer_jax import config as config_lib


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "model",
        None,
        "a built-in model name (shakespeare-v41, ...) or a model folder",
        flag_values=fv,
        required=True,
    )
    flags.DEFINE_string("text", None, "the UTF-8 text file to score", flag_values=fv, required=True)
    flags.DEFINE_enum(
        "dtype",
        "bfloat16",
        ["float32", "bfloat16"],
        "precision mode: float32 (parity) or bfloat16 (production: its cache formats and rounding points)",
        flag_values=fv,
    )
    flags.DEFINE_string("kv_cache_dtype", "auto", "cache storage: auto, float32 or bfloat16", flag_values=fv)
    flags.DEFINE_string(
        "kv_cache_memory", None, "cache budget, e.g. 512MiB (default: 2GiB on CPU)", flag_values=fv
    )
    flags.DEFINE_integer(
        "max_model_len", None, "most tokens per request (default: the model's)", flag_values=fv
    )
    flags.DEFINE_integer(
        "chunk_tokens",
        None,
        "text tokens per chunk (default: max_model_len - 2)",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_integer("batch", 16, "chunks per generate call", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("max_num_seqs", 16, "most sequences per engine step", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer(
        "max_num_batched_tokens", 2048, "most tokens per engine step", lower_bound=1, flag_values=fv
    )
    flags.DEFINE_multi_string(
        "set", [], "an engine config override, e.g. --set cache.block_size=16 (repeatable)", flag_values=fv
    )
    flags.DEFINE_boolean("json", False, "print one JSON object instead of text", flag_values=fv)
    flags.DEFINE_boolean(
        "progress", False, "show the engine's progress bar per generate call", flag_values=fv
    )


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"eval: unexpected arguments {argv[1:]}; the text goes in --text", file=sys.stderr)
        return 2
    path = Path(fv.text)
    if not path.is_file():
        print(f"eval: error: --text: {fv.text!r} is not a file", file=sys.stderr)
        return 2
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        print(f"eval: error: --text: {fv.text!r} is not UTF-8 text: {err}", file=sys.stderr)
        return 2
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.evaluation import evaluate_text

    try:
        llm = LLM(
            fv.model,
            dtype=fv.dtype,
            kv_cache_dtype=fv.kv_cache_dtype,
            max_model_len=fv.max_model_len,
            max_num_seqs=fv.max_num_seqs,
            max_num_batched_tokens=fv.max_num_batched_tokens,
            kv_cache_memory=fv.kv_cache_memory,
            **config_lib.parse_overrides(fv.set),
        )
        score = evaluate_text(llm, text, chunk_tokens=fv.chunk_tokens, batch=fv.batch, use_tqdm=fv.progress)
    except (ValueError, TypeError, NotImplementedError) as err:
        print(f"eval: error: {err}", file=sys.stderr)
        return 2
    result = {"model": fv.model, "text": str(path), "dtype": fv.dtype, **score.as_dict()}
    if fv.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"model {fv.model} ({fv.dtype}); text {path}: {score.characters} characters, {score.tokens} tokens")
    print(f"chunks: {score.chunks} of at most {score.chunk_tokens} tokens, each after BOS")
    print(f"bits/char:  {score.bits_per_char:.4f}")
    print(f"perplexity: {score.perplexity:.3f} per token ({score.nats_per_token:.4f} nats/token)")
    print(f"tokens/s:   {score.tokens_per_s:.1f} ({score.seconds:.1f} s in the engine)")
    return 0
