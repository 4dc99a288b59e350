"""Engine efficiency: the engine's decode tokens/s against the bare step at the same batch (docs/benchmarks.md).

    python scripts/engine_efficiency.py --model tiny-v3 [--model tiny-v4 ...] [--pairs 5]

The bare step is the "physical limit" of the engine around a model: the same compiled paged forward and sampler
the engine runs for a decode step of the batch (its executable, taken from the engine's own executor), called in a
tight Python loop with its inputs packed and placed on the device once, the cache and state threaded through.

The engine's decode rate is measured by difference, so prefill, admission and the first-token step cancel out:
``generate`` of the same prompts with ``--short`` and with ``--long`` new tokens (greedy, ``ignore_eos``), and

    engine decode tokens/s = num_prompts * (long - short) / (time(long) - time(short)).

Each pair measures the bare step, then the short and the long ``generate`` (every program is compiled before the
first pair), and the script prints the ratio per pair, the median of the pair ratios and best against best
(the 2-core machines are noisy). With ``--num_decode_steps K`` (> 1) each pair also measures a second engine of
the same model with the decode loop (``scheduler.num_decode_steps = K``, docs/engine.md "Decode loop") the same
way, and reports its rate against the same bare step and against the one-token engine of the pair. Workload: ``--num_prompts`` prompts of ``--prompt_len`` random token ids (seed 0),
float32, ``kv_cache_memory="64MiB"``, ``max_num_seqs`` = the batch, no speculative drafts.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("model", ["tiny-v3"], "built-in models or checkpoint directories (repeatable)")
flags.DEFINE_integer("num_prompts", 16, "decode batch (prompts generated together)")
flags.DEFINE_integer("prompt_len", 32, "tokens per prompt")
flags.DEFINE_integer("short", 8, "new tokens of the short generate")
flags.DEFINE_integer("long", 72, "new tokens of the long generate")
flags.DEFINE_integer("pairs", 5, "measurement pairs (bare step, then engine)")
flags.DEFINE_integer("calls", 64, "bare-step calls per measurement")
flags.DEFINE_integer("num_decode_steps", 1, "> 1: also measure an engine with this decode loop bound")
flags.DEFINE_integer("decode_stream_interval", 1, "the loop engine's scheduler.decode_stream_interval")


def _measure(name: str) -> dict[str, Any]:
    import jax

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.engine.step import pack_inputs

    # Plain decode steps (no drafts: tiny-v3's MTP layer would make every decode row two tokens long).
    options: dict[str, Any] = {
        "dtype": "float32",
        "kv_cache_memory": "64MiB",
        "num_draft_tokens": 0,
        "max_num_seqs": FLAGS.num_prompts,
    }
    llm = LLM(name, **options)
    k = FLAGS.num_decode_steps
    loop_settings = {
        "scheduler.num_decode_steps": k,
        "scheduler.decode_stream_interval": FLAGS.decode_stream_interval,
    }
    looped = LLM(name, **options, **loop_settings) if k > 1 else None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, FLAGS.prompt_len).tolist() for _ in range(FLAGS.num_prompts)]
    reference: dict[int, list[list[int]]] = {}

    def generate(new_tokens: int, engine: Any = llm) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = engine.generate(sampling_params=params, prompt_token_ids=prompts, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        tokens = [o.outputs[0].token_ids for o in outs]
        if reference.setdefault(new_tokens, tokens) != tokens:
            raise AssertionError(
                f"{name}: the decode-loop engine's tokens differ from the one-token engine's"
            )
        return seconds

    # Record the plans of one long generate (this also compiles every program both generates use).
    executor, recorded = llm.executor, []
    run = executor.run

    def record(plan: Any) -> Any:
        recorded.append(plan)
        return run(plan)

    executor.run = record
    try:
        generate(FLAGS.long)
    finally:
        executor.run = run
    generate(FLAGS.short)
    if looped is not None:
        generate(FLAGS.long, looped)
        generate(FLAGS.short, looped)

    def is_decode(p: Any) -> bool:  # every row of the batch samples, one token each
        rows = int(np.asarray(p.inputs.sample).sum())
        return rows == FLAGS.num_prompts and int(np.asarray(p.inputs.query_start)[..., -1].sum()) == rows

    decode = [p for p in recorded if is_decode(p)]
    if not decode:
        raise RuntimeError(f"{name}: no decode step of {FLAGS.num_prompts} rows was recorded")
    plan = decode[len(decode) // 2]
    packed, layout = pack_inputs(plan.inputs)
    args = jax.device_put(packed, executor._sharding)
    fn = executor._executable(plan, args, layout)
    rows = FLAGS.num_prompts

    def bare() -> float:
        cache, state = executor.cache, executor.state
        for _ in range(3):
            cache, state, out = fn(executor.params, cache, state, args)
        jax.block_until_ready(out)
        start = time.perf_counter()
        for _ in range(FLAGS.calls):
            cache, state, out = fn(executor.params, cache, state, args)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        executor.cache, executor.state = cache, state
        executor.reset_state()  # the bare calls wrote junk rows into the state; the engine's next run starts clean
        return rows * FLAGS.calls / seconds

    def decode_rate(engine: Any) -> float:
        short, long = generate(FLAGS.short, engine), generate(FLAGS.long, engine)
        return FLAGS.num_prompts * (FLAGS.long - FLAGS.short) / max(long - short, 1e-9)

    pairs, loop_rates = [], []
    for _ in range(FLAGS.pairs):
        bare_rate = bare()
        pairs.append((decode_rate(llm), bare_rate))
        if looped is not None:
            loop_rates.append(decode_rate(looped))
    llm.close()
    ratios = [e / b for e, b in pairs]
    extra: dict[str, Any] = {}
    if looped is not None:
        looped.close()
        extra = {
            "num_decode_steps": k,
            "decode_stream_interval": FLAGS.decode_stream_interval,
            "loop_tok_s": [round(r, 1) for r in loop_rates],
            "loop_vs_bare_median": round(
                float(np.median([r / b for r, (_, b) in zip(loop_rates, pairs)])), 3
            ),
            "loop_vs_engine_median": round(
                float(np.median([r / e for r, (e, _) in zip(loop_rates, pairs)])), 3
            ),
            "loop_vs_engine_best": round(max(loop_rates) / max(e for e, _ in pairs), 3),
            "loop_ms_per_step": round(1e3 * FLAGS.num_prompts / max(loop_rates), 2),
        }
    return {
        "model": name,
        "decode_bucket": list(plan.variant[:2]),
        "rows": rows,
        "engine_tok_s": [round(e, 1) for e, _ in pairs],
        "bare_tok_s": [round(b, 1) for _, b in pairs],
        "ratio_median": round(float(np.median(ratios)), 3),
        "ratio_best": round(max(e for e, _ in pairs) / max(b for _, b in pairs), 3),
        "bare_ms_per_step": round(1e3 * rows / max(b for _, b in pairs), 2),
        "engine_ms_per_step": round(1e3 * FLAGS.num_prompts / max(e for e, _ in pairs), 2),
        **extra,
    }


def main(argv: list[str]) -> None:
    del argv
    for name in FLAGS.model:
        print(json.dumps(_measure(name)), flush=True)


if __name__ == "__main__":
    app.run(main)
