"""The README's main job, run by `scripts/demo`.

Materialises the built-in tiny DeepSeek-V4.1 model (random weights, HF layout), generates with it greedily by
repeated full forward passes, then runs the engine (continuous batching over paged caches) — on the V4.1 model
once the engine serves it, on the tiny V3 model until then, saying so. It never prints made-up model output.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from deepinfer_jax import cache
from deepinfer_jax import config as config_lib
from deepinfer_jax.models import builtin
from deepinfer_jax.text.detokenize import IncrementalDetokenizer
from deepinfer_jax.text.tokenizer import Tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="The capital of France is")
    parser.add_argument("--model", default="tiny-v41", choices=builtin.list_builtin())
    parser.add_argument("--max_tokens", type=int, default=12)
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

    from deepinfer_jax import LLM, SamplingParams, load_model

    # 1. The tiny V4.1 model itself: greedy decoding by repeated full forward passes (no KV cache yet for V4.1,
    #    so every token recomputes its prefix). The token buffer has a fixed length so there is one compile;
    #    the forward is causal, so the padding after the current position never changes its logits.
    model = load_model(path, "float32")
    prompt_ids = tok.encode(args.prompt, add_bos=True)
    buf = np.full((1, len(prompt_ids) + args.max_tokens), tok.pad_id, np.int32)
    buf[0, : len(prompt_ids)] = prompt_ids
    new_ids: list[int] = []
    for cur in range(len(prompt_ids), buf.shape[1]):
        logits = model.logits(buf)
        buf[0, cur] = int(np.argmax(logits[0, cur - 1]))
        new_ids.append(int(buf[0, cur]))
        if new_ids[-1] == tok.eos_id:
            break
    print(f"[demo] {args.model} greedy by full forward (random weights, so the text is noise): {new_ids}")
    print(f"[demo]   text {tok.decode(new_ids)!r}")

    # 2. The engine (paged caches, scheduler, jitted step, sampler). It serves DeepSeek-V3 so far; for other
    #    families it says so, and the demo shows it on the tiny V3 model instead of inventing anything.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    try:
        llm = LLM(model=args.model, dtype="float32", kv_cache_memory="64MiB")
    except NotImplementedError as e:
        print(f"[demo] engine with {args.model}: not available yet ({e}).")
        fallback = "tiny-v3"
        print(f"[demo] the engine on {fallback}: {builtin.get_builtin(fallback).description}")
        llm = LLM(model=fallback, dtype="float32", kv_cache_memory="64MiB")
    outputs = llm.generate([args.prompt], params)
    out = outputs[0].outputs[0]
    print(f"[demo] engine generated {len(out.token_ids)} tokens (greedy; random weights): {out.token_ids}")
    print(f"[demo]   text {out.text!r}  finish_reason={out.finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
