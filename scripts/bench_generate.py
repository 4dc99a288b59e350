"""The engine-vs-transformers comparison of docs/benchmarks.md, as one command.

    python scripts/bench_generate.py                            # tiny-v3, baseline from .venv-oracle if present
    python scripts/bench_generate.py --model tiny-v4            # the same workload on tiny-v4
    python scripts/bench_generate.py --model tiny-v4 --dry_run  # print the bench command, run nothing

Runs ``deepinfer-jax bench`` with the recorded workload: 16 prompts of 32 tokens, 64 new tokens, greedy,
float32, one warm-up, engine and transformers runs alternated, torch with 2 threads. ``--model`` picks one of
:data:`MODELS` (default tiny-v3); both share the workload, so their rows in docs/benchmarks.md compare. Any
further arguments are passed on to ``bench`` (a later flag overrides an earlier one), e.g. ``--repeats 10
--output bench.json``. The full command is printed first, so it can be recorded next to its numbers.
"""

from __future__ import annotations

import os
import shlex
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))

from deepinfer_jax.cli import main as cli

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODELS = ("tiny-v3", "tiny-v4")
"""Built-in models whose comparison docs/benchmarks.md records (the same random weights on both sides)."""
WORKLOAD = [
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


def _split_model(argv: list[str]) -> tuple[str, bool, list[str]]:
    """``--model`` (``--model=X`` or ``--model X``) and ``--dry_run`` taken out of ``argv``; the rest is passed on."""
    model, dry_run, rest = "tiny-v3", False, []
    it = iter(argv)
    for arg in it:
        if arg == "--model":
            model = next(it, "")
        elif arg.startswith("--model="):
            model = arg.split("=", 1)[1]
        elif arg == "--dry_run":
            dry_run = True
        else:
            rest.append(arg)
    if model not in MODELS:
        raise ValueError(
            f"--model: {model!r} has no recorded comparison; expected one of {', '.join(MODELS)}"
        )
    return model, dry_run, rest


def bench_args(argv: list[str]) -> tuple[list[str], bool]:
    """The ``deepinfer-jax bench`` arguments of the comparison, and whether this is a dry run."""
    model, dry_run, rest = _split_model(argv)
    args = [f"--model={model}", *WORKLOAD]
    oracle = os.path.join(ROOT, ".venv-oracle", "bin", "python")
    if not any(a.startswith("--baseline_python") for a in rest) and os.path.isfile(oracle):
        args.append(f"--baseline_python={os.path.relpath(oracle)}")
    return [*args, *rest], dry_run


def main(argv: list[str]) -> int:
    try:
        args, dry_run = bench_args(argv)
    except ValueError as err:
        print(f"bench_generate: {err}", file=sys.stderr)
        return 2
    print("deepinfer-jax bench " + " ".join(shlex.quote(a) for a in args), file=sys.stderr)
    if dry_run:
        return 0
    return cli.main(["deepinfer-jax", "bench", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
