"""Compile (never run) the whole DeepSeek-V4.1-Flash decode forward at real shapes on this machine's backend.

    JAX_PLATFORMS=cpu python scripts/compile_real_v41.py [--batch 64] [--context 131072]

The shapes are those of ``configs/deepseek_v41_flash.yaml`` (every backbone layer, 384 MXFP4 experts, bf16
production mode, FP4 / MXFP4 records in the pages); the values no source evidences are filled with the
placeholders of ``tests/models/deepseek_v41/test_v41_paged_memory.py``, whose builder of the model, the
abstract parameters and the decode inputs this script imports. The parameters and
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

    sys.path.insert(0, str(ROOT / "tests" / "models" / "deepseek_v41"))
    from _real_compile import compile_stages  # scripts/_real_compile.py
    from test_v41_paged_memory import build_real, decode_inputs

    start = time.perf_counter()
    cfg, model, params = build_real()
    batch, context = FLAGS.batch, FLAGS.context
    cache, meta_args, _, _ = decode_inputs(cfg, model, batch, context)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    setup = time.perf_counter() - start

    def step(params, cache, tokens, *meta_args):
        return model.forward(params, cache, tokens, make_meta(*meta_args), tile=None)

    stages = compile_stages(step, params, cache, tokens, *meta_args)
    print(
        json.dumps(
            {
                "layers": cfg.num_hidden_layers,
                "experts": cfg.n_routed_experts,
                "batch": batch,
                "context": context,
                "backend": jax.default_backend(),
                "setup_s": round(setup, 1),
                **stages,
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
