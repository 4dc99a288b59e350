"""Scanned against unrolled layers (``ops.scan_layers``): compile time and decode rate of the engine.

    python scripts/bench_scan.py [--model shakespeare-v3] [--dtype bfloat16] [--scan 0 --scan 3] [--pairs 3]

Each run is a fresh process with an empty persistent compilation cache, so its first ``generate`` compiles every
program it needs; the runs of the ``--scan`` values alternate, ``--pairs`` times. A run reports the engine's
compile seconds (``RunStats.compile_seconds`` of the first ``generate``: 16 prompts, 8 greedy tokens) and its decode
milliseconds per step, by difference of a 72- and an 8-token ``generate`` of the same 16 prompts (prefill and
admission cancel out). It also checks that every value gives the first value's tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "shakespeare-v3", "built-in model or checkpoint folder")
flags.DEFINE_string("dtype", "bfloat16", "float32 or bfloat16")
flags.DEFINE_multi_integer("scan", [0, 3], "ops.scan_layers values, alternated")
flags.DEFINE_integer("pairs", 3, "rounds of alternated runs")
flags.DEFINE_boolean("child", False, "internal: one run")
flags.DEFINE_integer("child_scan", 0, "internal: the run's ops.scan_layers")

PROMPTS = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter", "O Romeo, Romeo"] * 4


def _child() -> None:
    import time

    from deepinfer_jax import LLM, SamplingParams

    llm = LLM(
        FLAGS.model,
        dtype=FLAGS.dtype,
        num_draft_tokens=0,
        enable_prefix_caching=False,
        max_num_seqs=16,
        **{"ops.scan_layers": FLAGS.child_scan},
    )
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    compile_s = llm.last_stats.compile_seconds
    walls, tokens = [], None
    for n in (8, 72):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        llm.generate(PROMPTS, params, use_tqdm=False)  # warm the buckets of this length
        start = time.perf_counter()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        tokens = [o.outputs[0].token_ids for o in outs]
    print(
        json.dumps(
            {
                "scan": FLAGS.child_scan,
                "compile_s": round(compile_s, 2),
                "decode_ms": round((walls[1] - walls[0]) / 64 * 1000, 3),
                "tokens": tokens,
            }
        )
    )


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.child:
        _child()
        return
    runs: dict[int, list[dict]] = {s: [] for s in FLAGS.scan}
    for _ in range(FLAGS.pairs):
        for scan in FLAGS.scan:
            with tempfile.TemporaryDirectory() as cache:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        f"--child_scan={scan}",
                        f"--model={FLAGS.model}",
                        f"--dtype={FLAGS.dtype}",
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "DEEPINFER_JIT_CACHE_DIR": cache, "JAX_COMPILATION_CACHE_DIR": ""},
                )
            runs[scan].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = FLAGS.scan[0]
    print(f"{FLAGS.model} {FLAGS.dtype}, {FLAGS.pairs} alternated runs per value")
    print(
        "| ops.scan_layers | compile s (runs) | median | decode ms/step (runs) | median | tokens = first value's |"
    )
    print("|---|---|---|---|---|---|")
    for scan, rs in runs.items():
        same = all(r["tokens"] == runs[first][i]["tokens"] for i, r in enumerate(rs))
        comp = [r["compile_s"] for r in rs]
        dec = [r["decode_ms"] for r in rs]
        print(
            f"| {scan} | {', '.join(map(str, comp))} | {statistics.median(comp):.2f} | "
            f"{', '.join(map(str, dec))} | {statistics.median(dec):.2f} | {same} |"
        )


if __name__ == "__main__":
    app.run(main)
