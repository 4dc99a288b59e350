"""Compress-and-store and the mHC Sinkhorn kernels (interpret mode) against their references.

``v4_compress_store``: the reference is first checked to compute exactly what the paged V4.1 model does today
(the model's pooling op, ``astype``, ``rms_norm``, ``apply_rope``, the numerics encoder, a scatter), then the kernel
against it. The kernel's pre-RoPE entries match the reference's within float32/bf16 rounding (its ``exp``,
``rsqrt`` and division are the platform's); its records then decode to the reference's values except where a
last-bit difference moved a value across a quantisation midpoint, which is bounded here by one step on a few
elements. Rows with a negative slot and padding rows write nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.models.deepseek_v4.compressor import compressor_pool
from deepinfer_jax.models.deepseek_v4.mhc import sinkhorn
from deepinfer_jax.numerics import kv_records as kr
from deepinfer_jax.ops import apply_rope, rms_norm, rope_cos_sin
from deepinfer_jax.ops import kv_store as ref
from pallas_kernels.compress_store import v4_compress_store as kernel
from pallas_kernels.mhc import mhc_sinkhorn

N, S, D, R, NB, E = 5, 2, 64, 16, 4, 4


def _inputs(rng, key_format):
    fmt = ref.key_record_format(key_format, D)
    width = D if fmt is None else fmt.record_bytes
    dtype = jnp.float32 if fmt is None else jnp.uint8
    pages = jnp.asarray(rng.integers(0, 200, (NB, E, width)), dtype)  # old contents must survive
    kv = jnp.asarray(rng.standard_normal((N, S, D)), jnp.float32)
    gate = jnp.asarray(rng.standard_normal((N, S, D)), jnp.float32).at[0, 1].set(-jnp.inf)  # a weight-0 slot
    weight = jnp.asarray(rng.random(D) + 0.5, jnp.float32)
    cos, sin = rope_cos_sin(
        jnp.arange(N, dtype=jnp.int32) * 6, jnp.asarray(np.exp(-np.arange(R // 2)), jnp.float32)
    )
    slots = jnp.array([3, -1, 0, 15, 9], jnp.int32)
    return pages, kv, gate, weight, cos, sin, slots


def test_reference_is_the_models_compress_chain():
    rng = np.random.default_rng(40)
    pages, kv, gate, weight, cos, sin, slots = _inputs(rng, "fp4")
    got_pages, got_p = ref.v4_compress_store(
        pages, kv, gate, weight, cos, sin, slots, eps=1e-6, rope_dim=R, key_format="fp4"
    )
    p = rms_norm(compressor_pool(kv, gate).astype(jnp.bfloat16), weight, eps=1e-6, out_dtype=jnp.bfloat16)
    rec = kr.encode_records(
        apply_rope(p, cos, sin, rope_dim=R).astype(jnp.float32), kr.fp4_e4m3_record_format(D)
    )
    want = np.asarray(pages).reshape(NB * E, -1).copy()
    for n, s in enumerate(np.asarray(slots)):
        if s >= 0:
            want[s] = np.asarray(rec[n])
    np.testing.assert_array_equal(np.asarray(got_p), np.asarray(p))
    np.testing.assert_array_equal(np.asarray(got_pages).reshape(NB * E, -1), want)


@pytest.mark.parametrize(
    ("key_format", "entry_dtype"), [("fp4", jnp.bfloat16), ("mxfp8", jnp.bfloat16), (None, jnp.float32)]
)
def test_kernel_matches_the_reference(key_format, entry_dtype):
    rng = np.random.default_rng(41)
    args = _inputs(rng, key_format)
    kw = dict(eps=1e-6, rope_dim=R, key_format=key_format, entry_dtype=entry_dtype)
    want_pages, want_p = ref.v4_compress_store(*args, **kw)
    got_pages, got_p = kernel(*args, interpret=True, **kw)
    assert got_p.dtype == want_p.dtype == entry_dtype
    np.testing.assert_allclose(
        np.asarray(got_p, np.float32), np.asarray(want_p, np.float32), rtol=2**-7, atol=1e-6
    )
    got, want = np.asarray(got_pages).reshape(NB * E, -1), np.asarray(want_pages).reshape(NB * E, -1)
    untouched = np.setdiff1d(np.arange(NB * E), np.asarray(args[-1]))
    np.testing.assert_array_equal(got[untouched], np.asarray(args[0]).reshape(NB * E, -1)[untouched])
    written = np.asarray(args[-1])[np.asarray(args[-1]) >= 0]
    fmt = ref.key_record_format(key_format, D)
    if fmt is None:
        np.testing.assert_allclose(got[written], want[written], rtol=1e-6, atol=1e-6)
        return
    dg = np.asarray(kr.decode_records(jnp.asarray(got[written]), fmt))
    dw = np.asarray(kr.decode_records(jnp.asarray(want[written]), fmt))
    step = np.abs(dw).max(axis=1, keepdims=True) / 2  # at most one quantisation step, on few elements
    assert (np.abs(dg - dw) <= step).all() and (dg != dw).mean() < 0.02


def test_nothing_to_store():
    rng = np.random.default_rng(42)
    pages, kv, gate, weight, cos, sin, slots = _inputs(rng, "mxfp8")
    out, p = kernel(
        pages,
        kv[:0],
        gate[:0],
        weight,
        cos[:0],
        sin[:0],
        slots[:0],
        eps=1e-6,
        rope_dim=R,
        key_format="mxfp8",
        interpret=True,
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pages))
    assert p.shape == (0, D)


def test_sinkhorn_kernel_matches_the_model():
    rng = np.random.default_rng(43)
    for m, lead in ((4, (3, 7)), (3, (5,))):  # m = 3: padded to 4, the padding must not enter any sum
        logits = jnp.asarray(rng.standard_normal((*lead, m, m)) * 3, jnp.float32)
        want = np.asarray(sinkhorn(logits, iters=20, eps=1e-6))
        got = np.asarray(mhc_sinkhorn(logits, iters=20, eps=1e-6, block_n=16, interpret=True))
        # 20 rounds of divisions in another order: float32 rounding only on entries in [0, 1]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="iters"):
        mhc_sinkhorn(logits, iters=0, eps=1e-6)


def test_exports_for_cuda(triton_calls):
    s = jax.ShapeDtypeStruct

    def store(pages, kv, gate, w, cos, sin, slots):
        return kernel(pages, kv, gate, w, cos, sin, slots, eps=1e-6, rope_dim=64, key_format="fp4")

    f32 = jnp.float32
    specs = (s((4097, 64, 288), jnp.uint8), s((40, 2, 512), f32), s((40, 2, 512), f32), s((512,), f32))
    specs += (s((40, 32), f32), s((40, 32), f32), s((40,), jnp.int32))
    assert triton_calls(store, *specs) == 1
    assert triton_calls(lambda x: mhc_sinkhorn(x, iters=20, eps=1e-6), s((64, 4, 4), f32)) == 1
