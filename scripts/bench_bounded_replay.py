"""SWA bounded replay (``scheduler.yoco_truncation``): prefill throughput and consumer-layer FLOPs, off vs compact.

Long prompts (1K, 2K, 4K tokens) on tiny-v41 (random weights, float32, no drafts, one sequence, 1024-token
chunks): each run is ``generate`` with ``max_tokens = 1`` (the prefill and its one sample). Runs alternate between
the two engines, after one warm-up each (the compile); the table reports medians.

Consumer-layer FLOPs are estimated as rows computed x per-row cost, the per-row cost being 2 x the parameters a
token touches in the consumer layers (routed experts scaled by ``k / E``) plus the window attention
(``4 * W * heads * head_dim`` per layer). Without truncation every row of every chunk's bucket runs the consumer
layers; compact runs ``min(T, S * K)`` rows per chunk (the static compact size).

    .venv/bin/python scripts/bench_bounded_replay.py [--runs 5]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from deepinfer_jax import LLM, SamplingParams

LENGTHS = (1024, 2048, 4095)  # 4095 + the sampled token = max_position_embeddings
CHUNK, KEEP = 1024, 140


def consumer_cost(llm: LLM) -> float:
    """Estimated FLOPs of one row through the YOCO consumer layers."""
    cfg = llm.model.config
    paged = llm.paged_model
    share = cfg.num_experts_per_tok / cfg.n_routed_experts
    total = 0.0
    for lp, layer in zip(paged.layers, llm.model.params["layers"], strict=True):
        if not lp.yoco_consumer:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(layer)[0]:
            name = jax.tree_util.keystr(path)
            size = float(np.prod(getattr(leaf, "shape", ()) or (1,)))
            total += 2 * size * (share if "experts" in name and "shared" not in name else 1.0)
        total += 4 * paged.window * cfg.num_attention_heads * cfg.head_dim
    return total


def main() -> None:
    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 5
    common = {"dtype": "float32", "max_num_seqs": 1, "max_num_batched_tokens": CHUNK, "num_draft_tokens": 0}
    engines = {
        "off": LLM("tiny-v41", **common, enable_prefix_caching=False),
        "compact": LLM(
            "tiny-v41",
            **common,
            **{"scheduler.yoco_truncation": "compact", "scheduler.yoco_keep_tokens": KEEP},
        ),
    }
    cost = consumer_cost(engines["off"])
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    print(f"load average: {os.getloadavg()}, cores: {os.cpu_count()}, per-row consumer cost {cost:.3e} FLOPs")
    print("| prompt | mode | prefill tok/s (median) | consumer rows | consumer GFLOPs (est.) | speedup |")
    print("|---|---|---|---|---|---|")
    for length in LENGTHS:
        prompt = [{"prompt_token_ids": rng.integers(3, 500, size=length).tolist()}]
        times: dict[str, list[float]] = {m: [] for m in engines}
        for llm in engines.values():
            llm.generate(prompt, params, use_tqdm=False)  # compile / warm up
        for _ in range(runs):
            for mode, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompt, params, use_tqdm=False)
                times[mode].append(time.perf_counter() - start)
        chunks = -(-length // CHUNK)
        rows = {"off": chunks * CHUNK, "compact": chunks * min(CHUNK, KEEP)}
        base = statistics.median(times["off"])
        for mode in engines:
            med = statistics.median(times[mode])
            print(
                f"| {length} | {mode} | {length / med:.0f} | {rows[mode]} | {rows[mode] * cost / 1e9:.2f} | "
                f"{base / med:.2f}x |",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
