"""The README's main job, run by `scripts/demo`.

Materialises the built-in tiny DeepSeek-V4.1 model (random weights, HF layout) and goes as far towards generation
as the project currently goes: where the V4.1 engine path is not built yet it says so and generates with the
model family the engine serves today. It never prints made-up model output.
"""

from __future__ import annotations

import argparse
import sys

from deepinfer_jax import cache
from deepinfer_jax import config as config_lib
from deepinfer_jax.models import builtin
from deepinfer_jax.text.detokenize import IncrementalDetokenizer
from deepinfer_jax.text.tokenizer import Tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="The capital of France is")
    parser.add_argument("--model", default="tiny-v41", choices=builtin.list_builtin())
    args = parser.parse_args()

    print(f"[demo] model {args.model}: {builtin.get_builtin(args.model).description}")
    path = builtin.materialize(args.model)
    print(f"[demo] checkpoint (HF layout) at {path}")
    model = config_lib.load_model_config(path)
    print(
        f"[demo] {model.family}: {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
        f"vocab {model.vocab_size}"
    )
    print(f"[demo] KV record bytes per token: {dict(cache.record_bytes(model))}")

    tok = Tokenizer.from_file(path)
    ids = tok.encode(args.prompt, add_bos=True)
    print(f"[demo] prompt {args.prompt!r} -> {len(ids)} token ids: {ids}")
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(i) for i in ids) + detok.finish()
    print(f"[demo] streamed back: {text!r}")

    from deepinfer_jax import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0)
    try:
        llm = LLM(model=args.model, dtype="float32", kv_cache_memory="64MiB")
    except NotImplementedError as e:
        print(f"[demo] generation with {args.model}: not available yet ({e}).")
        print(
            "[demo] Nothing is invented: what follows is the same engine on the model family it serves today."
        )
        fallback = "tiny-v3"
        print(f"[demo] model {fallback}: {builtin.get_builtin(fallback).description}")
        llm = LLM(model=fallback, dtype="float32", kv_cache_memory="64MiB")
    outputs = llm.generate([args.prompt], params)
    out = outputs[0].outputs[0]
    print(f"[demo] generated {len(out.token_ids)} tokens (greedy; random weights, so the text is noise):")
    print(f"[demo]   ids  {out.token_ids}")
    print(f"[demo]   text {out.text!r}  finish_reason={out.finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
