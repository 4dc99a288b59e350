"""Host-side costs of one decode step, each measured alone (docs/benchmarks.md, "The host loop (CPU)").

    python scripts/bench_host.py [--model tiny-v3] [--number 2000]

- ``build_plan`` of a 16-row decode step: the engine generates 16 prompts of 32 tokens (greedy, no drafts), the
  scheduler's batches of a late decode step are kept (each request copied as it was then), and ``build_plan``
  is timed on them ``--number`` times (mean per call).
- ``IncrementalDetokenizer.push`` of one id: the README's text, encoded with the shakespeare-v41 tokenizer, pushed
  one Python int at a time (best of 5 passes, per push).

- ``--breakdown``: instead, the engine's own host loop, one-token steps (``--num_decode_steps 1``) or decode
  loops, over 5 ``generate`` calls of that workload after 3 unmeasured ones: per decode iteration, the time in
  the runner, in waiting for the device (step outputs, a loop's payload, a streamed call still running), and
  in the scheduler's round, ``build_plan``, the sampling tensors, the dispatch and the processing of the tokens
  (timers wrapped around those calls; host = runner - wait).

Run it under two commits in alternation to compare them (``PYTHONPATH=<checkout>``).
"""

from __future__ import annotations

import copy
import dataclasses
import timeit
from pathlib import Path

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny-v3", "built-in model whose decode step is planned")
flags.DEFINE_integer("number", 2000, "build_plan calls timed")
flags.DEFINE_bool("breakdown", False, "time the host loop's parts instead")
flags.DEFINE_integer("num_decode_steps", 1, "--breakdown: scheduler.num_decode_steps")
flags.DEFINE_integer("decode_stream_interval", 0, "--breakdown: scheduler.decode_stream_interval")


def _snapshot(batch):
    if batch is None:
        return None
    rows = []
    for r in batch.rows:
        req = copy.copy(r.request)
        req.block_ids, req.output_token_ids = list(req.block_ids), list(req.output_token_ids)
        rows.append(dataclasses.replace(r, request=req))
    return dataclasses.replace(batch, rows=tuple(rows))


def _breakdown() -> None:
    import collections
    import time

    import jax

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.engine import decode_loop, runner, scheduler, step
    from deepinfer_jax.sampling import tensors

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(runner.EngineRunner, "run", "runner")
    timed(runner, "_tree_to_host", "wait")
    timed(scheduler.Scheduler, "schedule", "scheduler round")
    timed(scheduler, "build_plan", "build_plan")
    timed(tensors.SamplingTensors, "build", "sampling tensors")
    timed(step.StepExecutor, "run", "dispatch")
    timed(scheduler.Scheduler, "process_outputs", "process tokens")
    if hasattr(step.StepExecutor, "_settle"):
        timed(step.StepExecutor, "_settle", "wait")
    items = decode_loop.LoopStep.items

    def loop_items(self, *args, **kwargs):
        # Every wait for a loop's next iteration (its callback, or the finished call's rows) is wait.
        if not getattr(self, "streams", True):
            start = time.perf_counter()
            jax.block_until_ready(self.out.payload)
            spent["wait"] += time.perf_counter() - start
            yield from items(self, *args, **kwargs)
            return
        it = items(self, *args, **kwargs)
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                spent["wait"] += time.perf_counter() - start
            yield item

    decode_loop.LoopStep.items = loop_items
    settings = {
        "scheduler.num_decode_steps": FLAGS.num_decode_steps,
        "scheduler.decode_stream_interval": FLAGS.decode_stream_interval,
    }
    llm = LLM(
        FLAGS.model, dtype="float32", kv_cache_memory="64MiB", num_draft_tokens=0, max_num_seqs=16, **settings
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, 32).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        llm.generate(sampling_params=params, prompt_token_ids=prompts, use_tqdm=False)
    spent.clear()
    iterations = 0
    for _ in range(5):
        llm.generate(sampling_params=params, prompt_token_ids=prompts, use_tqdm=False)
        st = llm.last_stats
        iterations += st.steps - st.loop_steps + st.loop_iterations
    spent["host"] = spent["runner"] - spent["wait"]
    print(f"{FLAGS.model}, {iterations} decode iterations; ms per iteration:")
    for key in (
        "runner",
        "host",
        "wait",
        "scheduler round",
        "build_plan",
        "sampling tensors",
        "dispatch",
        "process tokens",
    ):
        print(f"  {key:17s} {spent[key] / iterations * 1e3:.3f}")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.breakdown:
        _breakdown()
        return
    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.engine import scheduler as scheduler_lib
    from deepinfer_jax.models import builtin
    from deepinfer_jax.text.detokenize import IncrementalDetokenizer
    from deepinfer_jax.text.tokenizer import Tokenizer

    llm = LLM(FLAGS.model, dtype="float32", kv_cache_memory="64MiB", num_draft_tokens=0, max_num_seqs=16)
    build_plan = scheduler_lib.build_plan
    captured = []

    def keep(batches, **kwargs):
        captured.append((tuple(_snapshot(b) for b in batches), kwargs))
        return build_plan(batches, **kwargs)

    scheduler_lib.build_plan = keep
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 200, 32).tolist() for _ in range(16)]
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        llm.generate(sampling_params=params, prompt_token_ids=prompts, use_tqdm=False)
    finally:
        scheduler_lib.build_plan = build_plan
    batches, kwargs = captured[-10]
    rows = sum(len(b.rows) for b in batches if b is not None)
    seconds = timeit.timeit(lambda: build_plan(batches, **kwargs), number=FLAGS.number) / FLAGS.number
    print(f"build_plan of a {rows}-row decode step ({FLAGS.model}): {seconds * 1e6:.1f} us")

    tok = Tokenizer.from_file(builtin.materialize("shakespeare-v41"))
    ids = [int(i) for i in tok.encode((Path(__file__).parents[1] / "README.md").read_text()[:20000])]

    def push_all() -> None:
        detok = IncrementalDetokenizer(tok)
        for i in ids:
            detok.push(i)

    push_all()
    best = min(timeit.repeat(push_all, number=1, repeat=5))
    print(f"IncrementalDetokenizer.push of one id ({len(ids)} ids): {best / len(ids) * 1e6:.2f} us")


if __name__ == "__main__":
    app.run(main)
