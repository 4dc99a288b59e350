"""Multi-turn chat with and without prefix caching: TTFT and the prefill tokens computed.

    .venv/bin/python scripts/bench_prefix_cache.py --model tiny-v3 [--conversations 16 --turns 6]

A thin wrapper of :func:`deepinfer_jax.bench.scenarios.run_multi_turn`, the benchmark behind
``deepinfer-jax bench --workload multi_turn`` (its docstring describes the workload and the variants ``off``,
``on``, ``small`` and ``host``). Prints the table of medians over ``--repeats`` alternated runs; the replies must be
identical in every variant (greedy): the exit status is 1 when they are not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepinfer_jax.bench.scenarios import format_multi_turn, run_multi_turn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-v3")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system_tokens", type=int, default=64)
    ap.add_argument("--user_tokens", type=int, default=32)
    ap.add_argument("--reply_tokens", type=int, default=32)
    ap.add_argument("--block_size", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--small_blocks", type=int, default=180)
    ap.add_argument("--host_memory", type=int, default=1 << 30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="off,on,small,host")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    report = run_multi_turn(
        args.model,
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        reply_tokens=args.reply_tokens,
        block_size=args.block_size,
        group=args.group,
        small_blocks=args.small_blocks,
        host_memory=args.host_memory,
        repeats=args.repeats,
        variants=args.variants.split(","),
        log=lambda msg: print(msg, file=sys.stderr),
    )
    print(format_multi_turn(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **report}, f, indent=1)
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
