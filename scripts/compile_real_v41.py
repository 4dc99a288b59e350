"""Compile (never run) the whole DeepSeek-V4.1-Flash decode forward at real shapes on this machine's backend.

    JAX_PLATFORMS=cpu python scripts/compile_real_v41.py [--batch 64] [--context 131072]

The shapes are those of ``configs/deepseek_v41_flash.yaml`` (every backbone layer, 384 MXFP4 experts, bf16
production mode, FP4 / MXFP4 records in the pages); the values no source evidences are filled with the
placeholders of ``tests/models/deepseek_v41/test_v41_paged_memory.py`` (imported from there). The parameters and
the cache are abstract (``jax.eval_shape``), so nothing of the 150+ GB is allocated: the script traces, lowers and
compiles one decode step of ``--batch`` sequences, one token each, at ``--context`` tokens of context, and prints
the seconds of each stage and XLA's reported temporary memory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 64, "decode rows")
flags.DEFINE_integer("context", 128 * 1024, "context tokens per row")

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.cache.ragged import make_meta
    from deepinfer_jax.config import load_model_config
    from deepinfer_jax.config.model import ModelConfig
    from deepinfer_jax.models.deepseek_v4 import family_v41
    from deepinfer_jax.models.deepseek_v4.paged_v41 import V41PagedModel
    from deepinfer_jax.models.deepseek_v4.v41_params import assemble_params, expected_tensors

    sys.path.insert(0, str(ROOT / "tests" / "models" / "deepseek_v41"))
    from test_v41_paged_memory import BLOCK, PLACEHOLDERS

    start = time.perf_counter()
    full = load_model_config(ROOT / "configs" / "deepseek_v41_flash.yaml")
    hf = dict(full.hf)
    text = {**hf["text_config"], **PLACEHOLDERS}
    hf["text_config"] = text
    cfg = ModelConfig.from_hf(hf)
    model = V41PagedModel(
        static=family_v41.static_for(cfg, "bfloat16"),
        block_size=BLOCK,
        dtype="bfloat16",
        cache_dtype="quantized",
        head_dim=cfg.head_dim,
        index_head_dim=cfg.index_head_dim,
        use_fp4=True,
    )
    structs = {
        name: jax.ShapeDtypeStruct(shape, jnp.dtype(dtypes[0]))
        for name, (shape, dtypes, optional) in expected_tensors(cfg).items()
        if not optional
    }
    params = jax.eval_shape(lambda t: assemble_params(cfg, t, "bfloat16"), structs)
    batch, context = FLAGS.batch, FLAGS.context
    i32 = jnp.int32
    cache = jax.eval_shape(lambda: model.init_cache(batch * context // BLOCK + 1, batch + 1))
    meta_args = (
        jax.ShapeDtypeStruct((batch,), i32),  # token_seq
        jax.ShapeDtypeStruct((batch,), i32),  # positions
        jax.ShapeDtypeStruct((batch + 1,), i32),  # query_start
        jax.ShapeDtypeStruct((batch,), i32),  # context_lens
        jax.ShapeDtypeStruct((batch,), i32),  # seq_slots
        jax.ShapeDtypeStruct((batch, context // BLOCK), i32),  # block_tables
    )
    tokens = jax.ShapeDtypeStruct((batch,), i32)
    setup = time.perf_counter() - start

    def step(params, cache, tokens, *meta_args):
        return model.forward(params, cache, tokens, make_meta(*meta_args), tile=None)

    jitted = jax.jit(step, donate_argnums=(1,))
    t0 = time.perf_counter()
    traced = jitted.trace(params, cache, tokens, *meta_args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    memory = compiled.memory_analysis()
    print(
        json.dumps(
            {
                "layers": cfg.num_hidden_layers,
                "experts": cfg.n_routed_experts,
                "batch": batch,
                "context": context,
                "backend": jax.default_backend(),
                "setup_s": round(setup, 1),
                "trace_s": round(t1 - t0, 1),
                "lower_s": round(t2 - t1, 1),
                "compile_s": round(t3 - t2, 1),
                "temp_mib": round(memory.temp_size_in_bytes / (1 << 20), 1),
                "hlo_chars": len(lowered.as_text()),
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
