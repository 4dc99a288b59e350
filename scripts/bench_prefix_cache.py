"""Multi-turn chat with and without prefix caching: TTFT and the prefill tokens computed.

    .venv/bin/python scripts/bench_prefix_cache.py --model tiny-v3 [--conversations 16 --turns 6]

Each of ``--conversations`` conversations has ``--turns`` turns; a turn's prompt is the whole conversation so far
(a shared system prompt, then every user message and reply), its user message ``--user_tokens`` random ids, its
reply ``--reply_tokens`` greedy tokens (EOS ignored). Turn ``t`` is sent by ``--group`` conversations at a time
(one ``generate`` call each), so between two turns of a conversation the other groups run and fill the cache. Variants, each its own ``LLM`` on the same weights, run alternately ``--repeats`` times:

* ``off``: ``enable_prefix_caching=False``;
* ``on``: the prefix cache in device memory (a cache large enough for every conversation);
* ``host``: a device cache of ``--small_blocks`` blocks, too few to keep every conversation between its turns, so
  cached blocks are evicted to a host-memory tier of ``--host_memory`` bytes and come back from it;
* ``small``: the same small device cache without the host tier (what the host tier is measured against).

Reported per variant (medians over repeats): TTFT p50 / p99 of turn 1 and of turns >= 2 (from each request's
metrics: first token time - arrival), prefill tokens computed, tokens found cached, the run's wall time. The
replies must be identical in every variant (greedy; checked and printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepinfer_jax import LLM, SamplingParams


def conversations(vocab: int, n: int, turns: int, system: int, user: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, per turn, the user message's ids (turn 0's starts with the shared system prompt)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, system).tolist()
    out = []
    for _ in range(n):
        msgs = [rng.integers(3, vocab, user).tolist() for _ in range(turns)]
        msgs[0] = shared + msgs[0]
        out.append(msgs)
    return out


def run(llm: LLM, convs: list[list[list[int]]], reply: int, group: int) -> dict:
    params = SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True)
    history = [[] for _ in convs]
    ttft: dict[str, list[float]] = {"first": [], "later": []}
    prefill = cached = 0
    replies = []
    sched = llm.scheduler
    host_before = sched.stats.prefix_cache_host_hits
    compiles = llm.executor.compile_count
    start = time.perf_counter()
    for t in range(len(convs[0])):
        for g in range(0, len(convs), group):
            members = range(g, min(g + group, len(convs)))
            prompts = [history[i] + convs[i][t] for i in members]
            before = sched.stats.num_prefill_tokens
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            prefill += sched.stats.num_prefill_tokens - before
            for i, p, o in zip(members, prompts, outs, strict=True):
                m = o.metrics
                ttft["first" if t == 0 else "later"].append(m.first_token_time - m.arrival_time)
                cached += o.num_cached_tokens
                history[i] = p + list(o.outputs[0].token_ids)
                replies.append(tuple(o.outputs[0].token_ids))
    wall = time.perf_counter() - start

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(np.asarray(xs) * 1e3, q))

    return {
        "ttft_first_p50_ms": pct(ttft["first"], 50),
        "ttft_later_p50_ms": pct(ttft["later"], 50),
        "ttft_later_p99_ms": pct(ttft["later"], 99),
        "prefill_tokens": prefill,
        "cached_tokens": cached,
        "wall_s": wall,
        "replies": replies,
        "host_hits": sched.stats.prefix_cache_host_hits - host_before,
        "compiles": llm.executor.compile_count - compiles,
    }


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
    common = dict(
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=512,
        num_draft_tokens=0,
        **{"cache.block_size": args.block_size},
    )
    variants = {
        "off": dict(enable_prefix_caching=False),
        "on": dict(enable_prefix_caching=True),
        "small": dict(enable_prefix_caching=True, **{"cache.num_blocks": args.small_blocks}),
        "host": dict(
            enable_prefix_caching=True,
            **{"cache.num_blocks": args.small_blocks, "cache.host_memory": args.host_memory},
        ),
    }
    names = args.variants.split(",")
    engines = {n: LLM(args.model, **common, **variants[n]) for n in names}
    vocab = engines[names[0]].model.config.vocab_size
    convs = conversations(vocab, args.conversations, args.turns, args.system_tokens, args.user_tokens, 0)
    for llm in engines.values():  # compile every bucket once, outside the measurement
        run(llm, conversations(vocab, args.group, 2, args.system_tokens, args.user_tokens, 1), 4, args.group)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        for n in names if r % 2 == 0 else names[::-1]:
            engines[n].reset_prefix_cache()
            results[n].append(run(engines[n], convs, args.reply_tokens, args.group))
    same = len({tuple(res["replies"]) for rs in results.values() for res in rs}) == 1
    print(
        f"{args.model}: {args.conversations} conversations x {args.turns} turns, load {os.getloadavg()[0]:.1f}, "
        f"replies identical in every variant: {same}"
    )
    print(
        "| variant | TTFT turn 1 p50 (ms) | TTFT turns >= 2 p50 (ms) | p99 (ms) | prefill tokens | cached tokens | host-tier tokens | wall (s) | compiles |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for n in names:
        med = {k: statistics.median(res[k] for res in results[n]) for k in results[n][0] if k != "replies"}
        summary[n] = med
        print(
            f"| {n} | {med['ttft_first_p50_ms']:.1f} | {med['ttft_later_p50_ms']:.1f} | {med['ttft_later_p99_ms']:.1f} | "
            f"{med['prefill_tokens']:.0f} | {med['cached_tokens']:.0f} | {med['host_hits']:.0f} | {med['wall_s']:.2f} | "
            f"{med['compiles']:.0f} |"
        )
    if "off" in summary and "on" in summary:
        print(
            f"turns >= 2 TTFT p50, off / on: {summary['off']['ttft_later_p50_ms'] / summary['on']['ttft_later_p50_ms']:.2f}x"
        )
    if "small" in summary and "host" in summary:
        print(
            "turns >= 2 TTFT p50, small device cache without / with the host tier: "
            f"{summary['small']['ttft_later_p50_ms'] / summary['host']['ttft_later_p50_ms']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "identical": same, "variants": summary}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
