"""Compile (never run) the whole DeepSeek-V3 decode forward at real shapes, unrolled and with scanned layers.

    JAX_PLATFORMS=cpu python scripts/compile_real_v3.py [--batch 64] [--context 32768] [--scan_layers 0 --scan_layers 3]

The shapes are those of ``configs/deepseek_v3.yaml`` (61 layers: 3 dense, 58 MoE with 256 FP8 experts; bf16
production mode; a bf16 latent cache), without the MTP layer. Parameters and cache are abstract
(``jax.eval_shape``), so nothing of the ~670 GB is allocated: for each ``--scan_layers`` value (0: every layer
unrolled; n: runs of at least n same-structure layers as one ``lax.scan``, ``ops.scan_layers``) the script
traces, lowers and compiles one decode step of ``--batch`` sequences, one token each, at ``--context`` tokens of
context, and prints one JSON line with the seconds of each stage and XLA's reported temporary memory.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 64, "decode rows")
flags.DEFINE_integer("context", 32 * 1024, "context tokens per row")
flags.DEFINE_multi_integer("scan_layers", [0, 3], "ops.scan_layers values to compile, in order")

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    from _real_compile import compile_stages, decode_meta_structs  # scripts/_real_compile.py

    from deepinfer_jax.cache.ragged import make_meta
    from deepinfer_jax.config import load_model_config
    from deepinfer_jax.config.model import ModelConfig
    from deepinfer_jax.models.deepseek_v3.model import scan_layout
    from deepinfer_jax.models.deepseek_v3.paged import V3PagedModel
    from deepinfer_jax.models.deepseek_v3.weights import assemble_params, expected_tensors

    full = load_model_config(ROOT / "configs" / "deepseek_v3.yaml")
    cfg = ModelConfig.from_hf({**full.hf, "num_nextn_predict_layers": 0})
    structs = {
        name: jax.ShapeDtypeStruct(
            shape, jnp.dtype("float8_e4m3fn" if "float8_e4m3fn" in dtypes else dtypes[0])
        )
        for name, (shape, dtypes) in expected_tensors(cfg).items()
    }
    params = jax.eval_shape(lambda t: assemble_params(cfg, t, "bfloat16"), structs)
    model = V3PagedModel(cfg, BLOCK, "bfloat16")
    batch, context = FLAGS.batch, FLAGS.context
    cache = jax.eval_shape(lambda: model.init_cache(batch * context // BLOCK + 1, batch + 1))
    meta_args = decode_meta_structs(batch, context, BLOCK)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def step(params, cache, tokens, *meta_args):
        return model.forward(params, cache, tokens, make_meta(*meta_args), tile=None)

    for min_run in FLAGS.scan_layers:
        laid_out = jax.eval_shape(lambda p, n=min_run: scan_layout(p, cfg, min_run=n), params)
        stages = compile_stages(step, laid_out, cache, tokens, *meta_args)
        print(
            json.dumps(
                {
                    "scan_layers": min_run,
                    "layers": cfg.num_hidden_layers,
                    "experts": cfg.n_routed_experts,
                    "batch": batch,
                    "context": context,
                    "backend": jax.default_backend(),
                    **stages,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
