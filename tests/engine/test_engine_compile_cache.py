"""The engine through the trace cache (ops/compile_cache.py): what a user gets by default.

The suite configures JAX's persistent cache through ``JAX_COMPILATION_CACHE_DIR``, which the engine keeps as the
user's setting *without* the trace cache, so every other engine test runs plain ``jit``. A user who sets nothing
(or sets ``ops.kernel_cache_dir``) gets the trace cache: the step is exported, stored and, by the next engine with
the same settings, deserialised instead of traced. Here the same requests run three times: with plain ``jit`` (the
reference), through a freshly exported step (trace cache miss) and through the stored one (hit), on one device and
on a ``dp=2 x ep=4`` mesh in this process. A deserialised program that computed anything else, or a key that
missed a setting, would change tokens or logprobs.

Cost: tiny-v3, one 16-token bucket per device; about 20 s of compilation per mesh on 2 cores.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.ops import compile_cache


@pytest.fixture
def restore_jax_cache():
    before = jax.config.jax_compilation_cache_dir
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
        compilation_cache.reset_cache()


def _run(mesh, **settings):
    dp, ep = mesh
    llm = LLM(
        "tiny-v3",
        dtype="float32",
        data_parallel_size=dp,
        expert_parallel_size=ep,
        max_num_seqs=2 * dp * ep,
        max_num_batched_tokens=16 * dp * ep,
        kv_cache_memory="16MiB",
        **settings,
    )
    try:
        outs = llm.generate(
            prompt_token_ids=[[5, 6, 7, 8, 9], [11, 12, 13]],
            sampling_params=[
                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
                SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seq_seed=7, logprobs=2),
            ],
            use_tqdm=False,
        )
        return (
            [o.outputs[0].token_ids for o in outs],
            [
                [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                for o in outs
            ],
            llm.executor.compile_count,
        )
    finally:
        llm.close()


@pytest.mark.parametrize("mesh", [(1, 1), (2, 4)], ids=["one-device", "dp2-ep4"])
def test_the_stored_step_gives_the_plain_jit_tokens(mesh, tmp_path, restore_jax_cache):
    want_tokens, want_logprobs, _ = _run(mesh)  # the suite's JAX folder: plain jit, no trace cache
    before = compile_cache.trace_counters()
    settings = {"ops.kernel_cache_dir": str(tmp_path / "jit")}
    for attempt in ("exported", "read back"):
        tokens, logprobs, compiled = _run(mesh, **settings)
        assert tokens == want_tokens, attempt
        # The same program: the exported one runs the plain jit's arithmetic, so logprobs agree to float32 rounding.
        np.testing.assert_allclose(np.array(logprobs), np.array(want_logprobs), rtol=0, atol=1e-6)
    after = compile_cache.trace_counters()
    assert after.misses - before.misses == compiled > 0  # the first engine traced each step variant once ...
    assert after.hits - before.hits == compiled  # ... and the second read every one of them back
    assert len(list((tmp_path / "jit" / "traces").glob("*.trace"))) == compiled
