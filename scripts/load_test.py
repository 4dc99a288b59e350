"""The full server load test of docs/serving.md, as one command (tests/server/test_server_load.py is its small form).

    python scripts/load_test.py                          # tiny-v3, 64 clients, 512 requests, 1/8 disconnecting
    python scripts/load_test.py --requests 128 --output load.json

Starts the server on a loopback port over a batch-invariant engine, sends the workload of
:class:`deepinfer_jax.bench.load.LoadSpec` (64 concurrent streaming clients, 512 requests, prompts of 4-96 tokens,
2-48 new tokens, seeded sampling at temperature 1, some clients hanging up mid-stream), then checks that every
request that was not disconnected got exactly the offline engine's tokens for its seed, that every request
finished once in the engine, and that every cache block and state slot is free again. Prints requests/s, output
tokens/s, TTFT and TPOT p50/p99 (client clocks, so the HTTP round trip is included). Exits 1 when a check fails.
The run is bounded by ``--deadline_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))

from deepinfer_jax.bench.load import LoadSpec, load_requests, offline_params, run_load_test
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.server import Server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-v3")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--disconnect_fraction", type=float, default=0.125)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_num_seqs", type=int, default=64)
    parser.add_argument("--max_num_batched_tokens", type=int, default=512)
    parser.add_argument("--kv_cache_memory", default="64MiB")
    parser.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="size of the online warm-up pass, as a fraction of --requests",
    )
    parser.add_argument("--deadline_s", type=float, default=1800.0)
    parser.add_argument("--output", default=None, help="write the summary and the check as JSON here")
    args = parser.parse_args()

    spec = LoadSpec(
        clients=args.clients,
        requests=args.requests,
        disconnect_fraction=args.disconnect_fraction,
        seed=args.seed,
        deadline_s=args.deadline_s,
    )
    t0 = time.monotonic()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        batch_invariant=True,
    )
    spec = LoadSpec(**{**spec.__dict__, "vocab": min(spec.vocab, llm.model.config.vocab_size)})
    with Server(llm, model_name=args.model, port=0, max_queued_requests=args.requests) as server:
        engine = server.engine
        # The offline reference runs first: it also compiles the step shapes the online run will use, so the
        # timings below are of a warm engine (online batches can still hit a shape the offline run did not).
        requests = load_requests(spec)
        with engine.exclusive() as held:
            outs = held.generate(
                prompt_token_ids=[list(r.prompt_token_ids) for r in requests],
                sampling_params=[offline_params(r) for r in requests],
                use_tqdm=False,
            )
        want = [o.outputs[0].token_ids for o in outs]
        # A warm-up pass online (another seed): online batches take shapes the offline
        # run does not; the compilations left during the measured run are reported.
        warm = LoadSpec(
            **{**spec.__dict__, "seed": spec.seed + 1, "requests": max(spec.requests // 4, spec.clients)}
        )
        run_load_test(server.url, args.model, warm, lambda p, _s: [[]] * len(p))
        executor = held.runner.executor
        compiles = executor.compile_count
        buckets = set(executor.compiled_buckets)
        print(
            f"server at {server.url}, offline reference done after {time.monotonic() - t0:.1f} s; running {spec}",
            flush=True,
        )
        before = engine.stats()
        check, summary, _ = run_load_test(server.url, args.model, spec, lambda _p, _s: want)
        after = engine.stats()
        compiles = executor.compile_count - compiles
        new_buckets = sorted(set(executor.compiled_buckets) - buckets)
        finished = {
            k: v - before.finished.get(k, 0)
            for k, v in after.finished.items()
            if v > before.finished.get(k, 0)
        }
        problems = list(check.problems)
        if after.accepted - before.accepted != spec.requests:
            problems.append(
                f"the engine accepted {after.accepted - before.accepted} requests, expected {spec.requests}"
            )
        if sum(finished.values()) != spec.requests:
            problems.append(f"the engine finished {finished}, expected {spec.requests} in all")
        with engine.exclusive() as held:
            for i, dev in enumerate(held.scheduler.devices):
                if dev.blocks.num_free != dev.blocks.capacity or dev.slots.num_free != dev.slots.capacity:
                    problems.append(
                        f"device {i}: {dev.blocks.capacity - dev.blocks.num_free} blocks and "
                        f"{dev.slots.capacity - dev.slots.num_free} slots still in use"
                    )
    report = {
        "spec": spec.__dict__,
        "engine": {
            "model": args.model,
            "dtype": args.dtype,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "summary": summary,
        "compilations_during_the_run": compiles,
        "new_buckets_during_the_run": new_buckets,
        "finished": finished,
        "complete": check.complete,
        "disconnected": check.disconnected,
        "problems": problems,
    }
    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    ttft, tpot = summary["ttft_seconds"], summary["tpot_seconds"]
    print(
        f"{summary['completed']} completed, {summary['disconnected']} disconnected in {summary['duration_seconds']:.1f} s: "
        f"{summary['requests_per_second']:.2f} requests/s, {summary['output_tokens_per_second']:.1f} output tokens/s; "
        f"TTFT p50 {ttft['p50'] * 1e3:.0f} ms p99 {ttft['p99'] * 1e3:.0f} ms; "
        f"TPOT p50 {tpot['p50'] * 1e3:.1f} ms p99 {tpot['p99'] * 1e3:.1f} ms"
    )
    print(
        f"compilations during the measured run: {compiles} (new (tokens, sequences) buckets: {new_buckets})"
    )
    print("checks:", "all hold" if not problems else f"{len(problems)} FAILED")
    for line in problems[:20]:
        print("  ", line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
