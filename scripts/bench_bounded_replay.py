"""SWA bounded replay (``scheduler.yoco_truncation``): prefill throughput and consumer-layer FLOPs, off vs compact.

    .venv/bin/python scripts/bench_bounded_replay.py [--runs 5]

A thin wrapper of :func:`deepinfer_jax.bench.scenarios.run_long_prompts`, the benchmark behind
``deepinfer-jax bench --workload long_prompts`` (its docstring describes the workload and the FLOPs estimate):
long prompts (1K, 2K, 4K tokens) on tiny-v41 (random weights, float32, no drafts, one sequence, 1024-token
chunks, K = 140), ``generate`` with ``max_tokens = 1``; runs alternate between the two engines after one warm-up
each (the compile); the table reports medians.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepinfer_jax.bench.scenarios import format_long_prompts, run_long_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="measured runs per engine and length")
    args = ap.parse_args()
    report = run_long_prompts("tiny-v41", repeats=args.runs, log=lambda msg: print(msg, file=sys.stderr))
    print(format_long_prompts(report), flush=True)


if __name__ == "__main__":
    main()
