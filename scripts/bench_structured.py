"""Cost of structured outputs: tokens/s of free vs JSON-schema-constrained requests on the same workload.

    python scripts/bench_structured.py                     # tiny-v3, 1 and 16 sequences, 5 alternated pairs
    python scripts/bench_structured.py --model tiny-v4 --repeats 3

Every request generates exactly ``--output_len`` tokens (``ignore_eos``, greedy), so both sides emit the same
number of tokens; the constrained side follows a schema of a long bounded array of digits (its output stays
inside the grammar for the whole length, the rest after the grammar completes runs free). Free and constrained
runs alternate after one warm-up of each (which compiles every step variant); the report gives the median and
the best of each side, the ratio of medians and of bests, and the host time per masked step spent filling
grammar masks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))

SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 200,
    "maxItems": 200,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-v3")
    ap.add_argument("--seqs", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--prompt_len", type=int, default=16)
    ap.add_argument("--output_len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--num_draft_tokens",
        type=int,
        default=None,
        help="speculative drafts (default: the model's natural length)",
    )
    ap.add_argument(
        "--wait_for_tokens",
        action="store_true",
        help="constrained rows wait for their previous token instead of deferring their masks (the comparison)",
    )
    args = ap.parse_args()

    import numpy as np

    from deepinfer_jax import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(
        args.model,
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=256,
        kv_cache_memory=64 << 20,
        num_draft_tokens=args.num_draft_tokens,
    )
    llm.scheduler.defer_masks = not args.wait_for_tokens
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    base = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sides = {"free": base, "json": base.replace(structured_outputs=so)}
    rng = np.random.default_rng(0)
    print(
        f"model {args.model}, drafts {llm.num_draft_tokens}, deferred masks {not args.wait_for_tokens}, prompt {args.prompt_len}, output {args.output_len}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    for n in (int(x) for x in args.seqs.split(",")):
        prompts = [rng.integers(10, 500, args.prompt_len).tolist() for _ in range(n)]
        rates: dict[str, list[float]] = {k: [] for k in sides}
        mask = [0.0, 0, 0]
        for rep in range(args.repeats + 1):
            for name, p in sides.items():
                before = llm.scheduler.stats
                start = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)
                seconds = time.perf_counter() - start
                after = llm.scheduler.stats
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                assert tokens == n * args.output_len
                if rep:  # the first round is the warm-up
                    rates[name].append(tokens / seconds)
                    if name == "json":
                        mask[0] += after.mask_seconds - before.mask_seconds
                        mask[1] += after.num_masked_steps - before.num_masked_steps
                        mask[2] += after.num_deferred_masks - before.num_deferred_masks
        med = {k: statistics.median(v) for k, v in rates.items()}
        best = {k: max(v) for k, v in rates.items()}
        per_step = 1e6 * mask[0] / max(mask[1], 1)
        print(
            f"{n:>2} seqs: free {med['free']:.1f} tok/s (best {best['free']:.1f}), json {med['json']:.1f} tok/s "
            f"(best {best['json']:.1f}); json/free median {med['json'] / med['free']:.3f}, best "
            f"{best['json'] / best['free']:.3f}; masks {per_step:.0f} us per masked step over {mask[1]} steps, "
            f"{mask[2]} rows with deferred masks"
        )
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
