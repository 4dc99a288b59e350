"""One process of an in-process A/B between two checkouts (docs/benchmarks.md, "One engine path on one device").

    PYTHONPATH=<checkout> python scripts/bench_checkout.py --model tiny-v4            # generate tokens/s
    PYTHONPATH=<checkout> python scripts/bench_checkout.py --model tiny-v4 --step     # one step alone, ms

Run it from each checkout in turn, alternating (A B A B ...), with one ``JAX_COMPILATION_CACHE_DIR`` shared by both
so neither pays for compiles, and compare the per-process medians pair by pair. It uses only ``LLM.generate`` and
``LLM.executor.run``, so it also runs against older checkouts.

Workload: 16 prompts of 32 random token ids (below 200, seed 0), 64 greedy tokens each, float32,
``kv_cache_memory="64MiB"``. The default mode does one warm-up ``generate``, then ``--repeats`` timed ones, and prints
the output tokens/s of each, their median and a hash of the tokens (equal tokens on both sides). ``--step`` records the
plans of one ``generate`` and then times ``executor.run`` (dispatch plus wait) on the middle one (a decode step) and
on the first one (the prefill step), ``--calls`` times each, printing the median and min in ms.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny-v4", "built-in model or checkpoint directory")
flags.DEFINE_integer("repeats", 5, "timed generate calls after the warm-up")
flags.DEFINE_bool("step", False, "time one decode and one prefill step alone instead of generate")
flags.DEFINE_integer("calls", 150, "timed executor.run calls per step (--step)")


def main(argv: list[str]) -> None:
    del argv
    import jax

    from deepinfer_jax import LLM, SamplingParams

    llm = LLM(FLAGS.model, dtype="float32", kv_cache_memory="64MiB")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, 32).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    def generate() -> Any:
        return llm.generate(sampling_params=params, prompt_token_ids=prompts, use_tqdm=False)

    if not FLAGS.step:
        outs = generate()
        rates = []
        for _ in range(FLAGS.repeats):
            start = time.perf_counter()
            outs = generate()
            seconds = time.perf_counter() - start
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
        tokens = json.dumps([list(o.outputs[0].token_ids) for o in outs])
        print(
            json.dumps(
                {
                    "tok_s": [round(r) for r in rates],
                    "median": round(float(np.median(rates))),
                    "tokens_sha256": hashlib.sha256(tokens.encode()).hexdigest()[:12],
                }
            )
        )
        return

    executor, recorded = llm.executor, []
    run = executor.run

    def record(*args: Any, **kwargs: Any) -> Any:
        recorded.append((args, kwargs))
        return run(*args, **kwargs)

    executor.run = record
    generate()
    executor.run = run
    result = {}
    for name, (args, kwargs) in (("decode", recorded[len(recorded) // 2]), ("prefill", recorded[0])):
        for _ in range(3):
            jax.block_until_ready(run(*args, **kwargs))
        times = []
        for _ in range(FLAGS.calls):
            start = time.perf_counter()
            jax.block_until_ready(run(*args, **kwargs))
            times.append(time.perf_counter() - start)
        result[name] = {
            "median_ms": round(float(np.median(times)) * 1e3, 2),
            "min_ms": round(min(times) * 1e3, 2),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
