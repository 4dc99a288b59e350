"""The README's main job, run by `scripts/demo`.

Loads the built-in `shakespeare-v41` (a small DeepSeek-V4.1 trained on Shakespeare, shipped in the package; any
built-in can be chosen with --model), continues a prompt greedily by repeated full forward passes, then runs the
engine (continuous batching over paged caches and state slots) on the same model: its greedy tokens must equal
the full forward's, and two seeded samples share the batch. Last, the same prompt as a conversation through
`LLM.chat`. It prints only what the model produced.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from deepinfer_jax import cache
from deepinfer_jax import config as config_lib
from deepinfer_jax.models import builtin
from deepinfer_jax.ops import compile_cache
from deepinfer_jax.text.detokenize import IncrementalDetokenizer
from deepinfer_jax.text.tokenizer import Tokenizer

DEFAULT_PROMPT = "KING.\nWhat news from Rome?\n\nMESSENGER.\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--model", default="shakespeare-v41", choices=builtin.list_builtin())
    parser.add_argument("--max_tokens", type=int, default=48)
    args = parser.parse_args()
    start = time.perf_counter()

    # Compiled programs go to the persistent compilation cache ($DEEPINFER_JIT_CACHE_DIR, else
    # $DEEPINFER_JAX_CACHE/jit): a second run of the demo compiles nothing.
    jit_dir = compile_cache.configure(directory=os.environ.get("DEEPINFER_JIT_CACHE_DIR") or None)
    print(f"[demo] compiled programs cached in {jit_dir}")
    record = builtin.get_builtin(args.model)
    print(f"[demo] model {args.model}: {record.description}")
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

    weights = "random weights, so the text is noise" if record.random_weights else "trained weights"
    # 1. The model itself: greedy decoding by repeated full forward passes (every token recomputes its prefix).
    #    The token buffer has a fixed length so there is one compile; the forward is causal, so the padding
    #    after the current position never changes its logits.
    model = load_model(path, "float32")
    buf = np.full((1, len(ids) + args.max_tokens), tok.pad_id, np.int32)
    buf[0, : len(ids)] = ids
    new_ids: list[int] = []
    for cur in range(len(ids), buf.shape[1]):
        logits = model.logits(buf)
        buf[0, cur] = int(np.argmax(logits[0, cur - 1]))
        new_ids.append(int(buf[0, cur]))
        if new_ids[-1] == tok.eos_id:
            break
    print(f"[demo] {args.model} greedy by full forward ({weights}): {new_ids}")
    print(f"[demo]   text {tok.decode(new_ids)!r}")

    # 2. The engine (paged caches, state slots, scheduler, jitted step, sampler) on the same model: its greedy
    #    tokens must equal the full forward's; two seeded samples share the batch. V4.1's DSpark drafter drafts
    #    (on by default): its rings and draft pool grow every state slot, so the demo keeps 16 of them. At most 16
    #    tokens per step: the three prompts are prefilled in chunks through the same compiled step shape (16
    #    tokens x 8 sequences) as the decode steps, so the first start compiles one engine step instead of two
    #    (a decode step of three rows with five drafts each would need 18; the scheduler verifies fewer drafts
    #    then, which the greedy tokens do not depend on).
    llm = LLM(
        model=args.model, dtype="float32", kv_cache_memory="64MiB", max_num_seqs=16, max_num_batched_tokens=16
    )
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
        SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.9, seq_seed=1),
        SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.9, seq_seed=2),
    ]
    prompts = [args.prompt] * 3
    outputs = llm.generate(prompts, params)
    for label, output in zip(("greedy", "sample 1", "sample 2"), outputs):
        out = output.outputs[0]
        print(f"[demo] engine ({label}) -> {len(out.token_ids)} tokens {out.token_ids}")
        print(f"[demo]   {args.prompt}{out.text}")
        print(f"[demo]   finish_reason={out.finish_reason}")
    print(f"[demo] {llm.last_stats.summary(len(prompts))}")
    greedy = outputs[0].outputs[0].token_ids
    same = greedy == new_ids[: len(greedy)]
    print(f"[demo] engine greedy tokens {'equal' if same else 'DIFFER FROM'} the full-forward greedy tokens")

    # 3. The same words as a conversation: LLM.chat encodes it in the DeepSeek-V4.1 chat format (the model's
    #    tokenizer has the chat markers). The model learnt plays, not conversations: its reply is play text.
    (reply,) = llm.chat(
        [{"role": "user", "content": args.prompt}],
        SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.9, seq_seed=3),
    )
    print(
        f"[demo] LLM.chat -> {reply.usage['completion_tokens']} tokens, finish_reason={reply.finish_reason}: "
        f"{reply.content!r}"
    )
    hits, traces = compile_cache.counters(), compile_cache.trace_counters()
    print(
        f"[demo] done in {time.perf_counter() - start:.1f} s; persistent compilation cache: {hits.hits} programs "
        f"read ({hits.saved_seconds:.1f} s of compiling saved), {hits.misses} compiled; traced programs: "
        f"{traces.hits} read, {traces.misses} traced"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
