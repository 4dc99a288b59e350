"""SWA bounded replay on a trained model: greedy continuations with ``scheduler.yoco_truncation = compact``
against the exact model (``off``), prompt by prompt.

    .venv/bin/python scripts/replay_agreement.py [--model shakespeare-v41 --prompts 20 --reply 32]

The prompts are the model's own text: ``--prompts`` samples (temperature 0.8, seeded) of 200 to 900 tokens
after BOS, so they follow the training distribution without needing the corpus. Each prompt's greedy
continuation of ``--reply`` tokens is computed by two engines on the same weights (float32, drafts off, K = 140
by default); for every prompt that differs the script prints the first differing position and the exact
model's margin there (its top-1 minus top-2 logprob): compact changes what the consumer layers see of the
prompt's first ``L - K`` tokens, so a difference is expected only where the exact model is close to a tie.
The largest change of a common token's logprob shows how much truncation moved the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

from deepinfer_jax import LLM, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="shakespeare-v41")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--keep", type=int, default=140)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    common = dict(
        dtype=args.dtype, max_num_seqs=args.prompts, max_num_batched_tokens=1024, num_draft_tokens=0
    )
    off = LLM(args.model, **common, enable_prefix_caching=False)
    compact = LLM(
        args.model,
        **common,
        enable_prefix_caching=False,
        **{"scheduler.yoco_truncation": "compact", "scheduler.yoco_keep_tokens": args.keep},
    )
    bos = off.model.config.bos_token_id
    lengths = np.random.default_rng(0).integers(200, 901, args.prompts)
    samples = off.generate(
        [{"prompt_token_ids": [bos]}] * args.prompts,
        [
            SamplingParams(temperature=0.8, max_tokens=int(n), seed=i, ignore_eos=True)
            for i, n in enumerate(lengths)
        ],
        use_tqdm=False,
    )
    prompts = [[bos, *s.outputs[0].token_ids] for s in samples]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True, logprobs=2)
    outs = {
        name: llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        for name, llm in (("off", off), ("compact", compact))
    }
    rows, same_tokens = [], 0
    for i, (p, a, b) in enumerate(zip(prompts, outs["off"], outs["compact"], strict=True)):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        first = next((j for j, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), None)
        same_tokens += len(x) if first is None else first
        margin = None
        if first is not None:
            top = sorted((e.logprob for e in a.outputs[0].logprobs[first].values()), reverse=True)
            margin = float(top[0] - top[1])
        n = len(x) if first is None else first  # the common prefix: the same token, compare its logprob
        gap = max(
            (
                abs(a.outputs[0].logprobs[j][x[j]].logprob - b.outputs[0].logprobs[j][x[j]].logprob)
                for j in range(n)
            ),
            default=0.0,
        )
        rows.append(
            {
                "prompt": i,
                "length": len(p),
                "first_difference": first,
                "off_margin": margin,
                "max_logprob_gap": gap,
            }
        )
        where = (
            "identical" if first is None else f"differs at token {first} (off's top-2 margin {margin:.4f})"
        )
        print(f"prompt {i:2d} ({len(p)} tokens): {where}; largest logprob change {gap:.2e}")
    total = args.prompts * args.reply
    agree = sum(r["first_difference"] is None for r in rows)
    print(
        f"{args.model} {args.dtype}, K = {args.keep}: {agree}/{args.prompts} prompts identical, "
        f"{same_tokens}/{total} tokens before the first difference; largest logprob change of a common token "
        f"{max(r['max_logprob_gap'] for r in rows):.2e}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "prompts": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
