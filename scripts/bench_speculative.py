"""Speculative decoding benchmark: tokens/s without drafts, with fixed-length drafts and with variable length.

Usage: python scripts/bench_speculative.py [--model shakespeare-v3] [--concurrency 1,4,16,64] [--k 1,3]
       [--output_len 64] [--pairs 3] [--num_decode_steps 1] [--decode_stream_interval 0] [--json out.json]

For each concurrency ``c`` the same ``c`` prompts (text prompts of the model's tokenizer) are generated greedily
with every engine variant, in the same process and with the same weights: ``off`` (``num_draft_tokens=0``),
``fixed-k`` for each ``k`` and ``varlen-k`` (``speculative_variable_length=True``, the largest ``k``). Every
engine runs one unmeasured warm-up (compilation), then the variants alternate ``--pairs`` times; the table
reports the median tokens/s of the runs and its ratio to ``off``, with the mean accepted length and the drafts
verified per decode row. Greedy tokens of every variant are compared with ``off``. ``--num_decode_steps N``
builds every variant with the decode loop (``scheduler.num_decode_steps``; a speculative step is one iteration)
and ``--decode_stream_interval`` sets how often it streams (0: tokens when a call is done).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "First Citizen:\nBefore we proceed any further",
    "JULIET:\nO Romeo, Romeo",
    "KING RICHARD III:\nNow is the winter",
    "HAMLET:\nTo be, or not to be",
    "MENENIUS:\nWhy, masters, my good friends",
    "LADY MACBETH:\nOut, damned spot",
    "PROSPERO:\nOur revels now are ended",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shakespeare-v3")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--k", default="1,3")
    ap.add_argument("--output_len", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--num_decode_steps", type=int, default=1)
    ap.add_argument("--decode_stream_interval", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from deepinfer_jax import LLM, SamplingParams

    ks = [int(x) for x in args.k.split(",")]
    variants = (
        [("off", 0, False)] + [(f"fixed-{k}", k, False) for k in ks] + [(f"varlen-{max(ks)}", max(ks), True)]
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    loop = {}
    if args.num_decode_steps > 1:
        loop = {
            "scheduler.num_decode_steps": args.num_decode_steps,
            "scheduler.decode_stream_interval": args.decode_stream_interval,
        }
    results = []
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(c)]
        engines = {}
        for name, k, varlen in variants:
            start = time.perf_counter()
            llm = LLM(
                args.model,
                dtype=args.dtype,
                max_num_seqs=c,
                max_num_batched_tokens=64 + c * (1 + max(ks)),  # one budget for every variant
                num_draft_tokens=k,
                speculative_variable_length=varlen,
                **loop,
            )
            llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles the buckets
            engines[name] = llm
            print(
                f"c={c} {name}: built and warmed up in {time.perf_counter() - start:.1f} s", file=sys.stderr
            )
        rates: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        stats: dict[str, object] = {}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.pairs):
            for name, _, _ in variants:
                llm = engines[name]
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                assert llm.last_stats.compile_count == 0, f"{name} recompiled while measured"
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
                stats[name] = llm.last_stats
                tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        base = statistics.median(rates["off"])
        for name, k, _ in variants:
            st = stats[name]
            row = {
                "concurrency": c,
                "variant": name,
                "num_draft_tokens": k,
                "tokens_per_s": statistics.median(rates[name]),
                "runs": rates[name],
                "ratio_to_off": statistics.median(rates[name]) / base,
                "mean_accepted_length": st.mean_accepted_length,
                "verified_per_step": st.verified_per_step,
                "acceptance_rates": list(st.acceptance_rates),
                "steps": st.steps,
                "num_decode_steps": args.num_decode_steps,
                "loop_calls": st.loop_steps,
                "loop_iterations": st.loop_iterations,
                "greedy_equal_to_off": tokens[name] == tokens["off"],
            }
            results.append(row)
            acc = "-" if row["mean_accepted_length"] is None else f"{row['mean_accepted_length']:.2f}"
            ver = "-" if row["verified_per_step"] is None else f"{row['verified_per_step']:.2f}"
            print(
                f"c={c:3d} {name:9s} {row['tokens_per_s']:8.1f} tok/s  x{row['ratio_to_off']:.2f}  "
                f"accepted length {acc}  verified/row {ver}  steps {st.steps}  same tokens {row['greedy_equal_to_off']}"
            )
        for llm in engines.values():
            llm.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
