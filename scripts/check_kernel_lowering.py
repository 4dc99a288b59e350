"""Lower every Pallas kernel for CUDA (no GPU needed) on the jax this interpreter has, and report per kernel.

    python scripts/check_kernel_lowering.py

Used to check that the kernels still lower on another jax release than the project's pin (the GPU machines'
image has jax 0.11.2): each kernel is exported for ``platforms=["cuda"]`` with the Triton lowering under an
abstract H100 (``pallas_kernels._common.export_for_cuda``), and one codec and one attention kernel also run in
interpret mode against the numerics reference. Lowering proves tracing and Triton IR generation, not PTX. Exits 1
if anything fails.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

S = jax.ShapeDtypeStruct
I32, BF16, F32, U8 = jnp.int32, jnp.bfloat16, jnp.float32, jnp.uint8


def _cases() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    from deepinfer_jax.sampling import SamplingTensors
    from pallas_kernels import (
        compress_store,
        fp8_block_linear,
        indexer,
        kv_records,
        mhc,
        mxfp4_grouped_linear,
        paged_mla,
        sampler,
        sparse_attention,
        swiglu,
    )

    empty = SamplingTensors.build([], [], [], 1000, num_rows=4, mask_width=4)
    fields = SamplingTensors(*(S(a.shape, a.dtype) for a in empty))._replace(
        allowed_ids=S((4, 32), I32), token_bitmask=S((4, 32), I32)
    )

    def mla(ql, qp, c, ts, p, bt, cx):
        return paged_mla.paged_mla_attention(ql, qp, c, 0, ts, p, bt, cx, scale=0.1)

    return {
        "paged_mla_attention (FP8 latent)": (
            mla,
            (
                S((4, 16, 128), BF16),
                S((4, 16, 64), BF16),
                S((1, 9, 16, 260), U8),
                S((4,), I32),
                S((4,), I32),
                S((2, 4), I32),
                S((2,), I32),
            ),
        ),
        "v4_sparse_attention": (
            lambda *a: sparse_attention.v4_sparse_attention(
                *a, scale=0.1, window_format="mxfp8", compressed_format="fp4"
            ),
            (
                S((4, 16, 512), BF16),
                S((4, 128, 528), U8),
                S((4, 128), jnp.bool_),
                S((16,), F32),
                S((9, 64, 288), U8),
                S((4, 512), I32),
            ),
        ),
        "v4_sink_attention": (
            lambda *a: sparse_attention.v4_sink_attention(*a, scale=0.1),
            (S((1, 4, 16, 128), BF16), S((1, 8, 128), BF16), S((1, 4, 8), jnp.bool_), S((16,), F32)),
        ),
        "v4_indexer_topk": (
            lambda *a: indexer.v4_indexer_topk(*a, k=64, key_format="mxfp4", score_dtype=BF16),
            (
                S((4, 32, 128), BF16),
                S((4, 32), F32),
                S((9, 64, 68), U8),
                S((2, 4), I32),
                S((4,), I32),
                S((4,), I32),
            ),
        ),
        "v4_indexer_scores": (
            indexer.v4_indexer_scores,
            (S((1, 4, 32, 128), BF16), S((1, 64, 128), BF16), S((1, 4, 32), F32)),
        ),
        "v4_compress_store": (
            lambda *a: compress_store.v4_compress_store(*a, eps=1e-6, rope_dim=64, key_format="fp4"),
            (
                S((9, 64, 288), U8),
                S((8, 2, 512), F32),
                S((8, 2, 512), F32),
                S((512,), F32),
                S((8, 32), F32),
                S((8, 32), F32),
                S((8,), I32),
            ),
        ),
        "kv_store_records": (
            lambda p, v, s: kv_records.store_records(p, v, s, "mxfp4"),
            (S((64, 68), U8), S((8, 128), F32), S((8,), I32)),
        ),
        "mhc_sinkhorn": (lambda x: mhc.mhc_sinkhorn(x, iters=20, eps=1e-6), (S((64, 4, 4), F32),)),
        "sample_tokens": (
            lambda x, st, c: sampler.sample_tokens(x, st, c, force_top_k=8),
            (S((4, 1000), F32), fields, S((4, 1000), I32)),
        ),
        "verify_tokens": (
            lambda x, st, c, d, lp, f: sampler.verify_tokens(x, st, c, d, lp, f, force_top_k=8),
            (S((4, 1000), F32), fields, S((4, 1000), I32), S((4,), I32), S((4, 1000), F32), S((4,), I32)),
        ),
        "draft_tokens": (
            lambda x, st: sampler.draft_tokens(x, st, force_top_k=8),
            (S((4, 1000), F32), fields),
        ),
        "fp8_block_linear": (
            lambda x, w, s: fp8_block_linear.fp8_block_linear(x, w, s, activation_cast="mxfp8"),
            (S((8, 256), BF16), S((128, 256), U8), S((4, 8), U8)),
        ),
        "mxfp4_grouped_swiglu": (
            lambda x, gp, gs, up, us, g: mxfp4_grouped_linear.mxfp4_grouped_swiglu(
                x, gp, gs, up, us, g, limit=7.0
            ),
            (
                S((8, 64), BF16),
                S((3, 32, 32), U8),
                S((3, 32, 2), U8),
                S((3, 32, 32), U8),
                S((3, 32, 2), U8),
                S((3,), I32),
            ),
        ),
        "mxfp4_grouped_linear": (
            lambda x, p, s, g: mxfp4_grouped_linear.mxfp4_grouped_linear(x, p, s, g),
            (S((8, 64), BF16), S((3, 32, 32), U8), S((3, 32, 2), U8), S((3,), I32)),
        ),
        "swiglu": (lambda u: swiglu.swiglu(u, limit=7.0), (S((8, 128), BF16),)),
    }


def main() -> int:
    from pallas_kernels._common import TRITON_CUSTOM_CALL, export_for_cuda

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}")
    failed = False
    for name, (fn, specs) in _cases().items():
        try:
            calls = export_for_cuda(fn, *specs).mlir_module().count(f"@{TRITON_CUSTOM_CALL}")
            status = f"lowers for cuda ({calls} Triton call{'s' if calls != 1 else ''})"
            failed |= calls < 1
        except Exception as e:  # report every kernel, then fail
            status = f"FAILS: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            failed = True
        print(f"  {name:34s} {status}")
    from deepinfer_jax.numerics import kv_records as kr
    from deepinfer_jax.numerics.formats import fp4_e4m3_record_format
    from pallas_kernels import kv_records, sparse_attention

    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    same = (
        np.asarray(kr.encode_records(jnp.asarray(x), fp4_e4m3_record_format(64)))
        == np.asarray(kv_records.encode_records(x, "fp4", interpret=True))
    ).all()
    print(f"  {'interpret: FP4 record encoding':34s} {'bit-exact' if same else 'MISMATCH'}")
    q = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4, 64)), F32)
    keys = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, 64)), F32)
    out = sparse_attention.v4_sparse_attention(
        q, keys, jnp.ones((2, 8), bool), jnp.zeros((4,), F32), scale=0.1, interpret=True
    )
    finite = bool(jnp.isfinite(out).all())
    print(f"  {'interpret: v4_sparse_attention':34s} {'runs' if finite else 'NON-FINITE'}")
    failed |= not (same and finite)
    print("all kernels lower" if not failed else "SOME KERNELS FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
