"""The engine-vs-transformers comparison of docs/benchmarks.md, as one command.

    python scripts/bench_generate.py                       # tiny-v3, baseline from .venv-oracle if present
    python scripts/bench_generate.py --model tiny-v4 --baseline_python /path/to/venv/bin/python

Runs ``deepinfer-jax bench`` with the recorded workload: 16 prompts of 32 tokens, 64 new tokens, greedy,
float32, one warm-up, engine and transformers runs alternated, torch with 2 threads. Any further arguments are
passed on (a later flag overrides an earlier one), e.g. ``--repeats 10 --output bench.json``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepinfer_jax.cli import main as cli

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WORKLOAD = [
    "--model=tiny-v3",
    "--dtype=float32",
    "--num_requests=16",
    "--prompt_len=32",
    "--output_len=64",
    "--temperature=0",
    "--kv_cache_memory=64MiB",
    "--warmup=1",
    "--repeats=8",
    "--baseline_threads=2",
]


def main(argv: list[str]) -> int:
    args = list(WORKLOAD)
    oracle = os.path.join(ROOT, ".venv-oracle", "bin", "python")
    if not any(a.startswith("--baseline_python") for a in argv) and os.path.isfile(oracle):
        args.append(f"--baseline_python={oracle}")
    return cli.main(["deepinfer-jax", "bench", *args, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
