"""Check each Pallas kernel against its reference and time it against the XLA path, in one run.

    python scripts/bench_kernels.py            # on a GPU: V4.1-Flash expert shapes (E=384, H=5120, I=2304)
    python scripts/bench_kernels.py --smoke    # anywhere: tiny shapes, kernels in Pallas interpret mode

Cases: a decode step (64 tokens × top-6 = 384 expert rows) and a prefill (4096 tokens × top-6 = 24576 rows).
For each case and kernel it prints one line: the largest error against the reference, and the median time of the
kernel and of the XLA baseline measured in the same process, with their ratio (> 1: the kernel is faster).

Baselines: the grouped expert GEMMs are compared with ``lax.ragged_dot`` over expert weights dequantised to bf16
beforehand (XLA's best grouped path; the dequantisation is not timed, which favours XLA), the FP8 GEMM with the
reference op (tile-wise dequantisation inside the jitted step), SwiGLU with the reference op. Correctness is
checked against the reference ops where they are affordable (the smoke shapes, and the decode case); the prefill
case is checked against the ragged_dot result. Random weights are drawn as bytes on the device: every byte is a
valid E2M1 pair; E4M3 NaN codes are avoided; scale bytes stay near 2^-7 so sums stay in a sane range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.numerics.activation import mxfp8_cast
from deepinfer_jax.numerics.codecs import dequantize_mxfp4
from deepinfer_jax.ops.gemm import fp8_block_linear as fp8_reference
from deepinfer_jax.ops.grouped_gemm import mxfp4_grouped_linear as grouped_reference
from deepinfer_jax.ops.grouped_gemm import mxfp4_grouped_swiglu as grouped_swiglu_reference
from deepinfer_jax.ops.swiglu import swiglu as swiglu_reference
from pallas_kernels.fp8_block_linear import fp8_block_linear
from pallas_kernels.mxfp4_grouped_linear import mxfp4_grouped_linear, mxfp4_grouped_swiglu
from pallas_kernels.swiglu import swiglu

FULL = {
    "experts": 384,
    "hidden": 5120,
    "intermediate": 2304,
    "top_k": 6,
    "cases": {"decode": 64, "prefill": 4096},
}
SMOKE = {"experts": 4, "hidden": 64, "intermediate": 32, "top_k": 2, "cases": {"decode": 5, "prefill": 24}}


def _time(fn: Callable[..., Any], args: tuple[Any, ...], reps: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _mxfp4(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(key)
    packed = jax.random.bits(k1, (*shape[:-1], shape[-1] // 2), jnp.uint8)
    scale = jax.random.randint(k2, (*shape[:-1], shape[-1] // 32), 118, 122).astype(jnp.uint8)
    return packed, scale


def _group_sizes(key: jax.Array, rows: int, experts: int) -> jax.Array:
    ids = jax.random.randint(key, (rows,), 0, experts)
    return jnp.bincount(ids, length=experts).astype(jnp.int32)


@jax.jit
def _dequant_t(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """bf16 ``[E, K, N]`` expert weights for ``lax.ragged_dot`` (built once, outside the timed step)."""
    return jnp.swapaxes(dequantize_mxfp4(packed, scale, dtype=jnp.bfloat16), 1, 2)


def _xla_first(x: jax.Array, sizes: jax.Array, w1: jax.Array, w3: jax.Array) -> jax.Array:
    xq = mxfp8_cast(x)
    g = jax.lax.ragged_dot(xq, w1, sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xq, w3, sizes, preferred_element_type=jnp.float32)
    return swiglu_reference(jnp.concatenate([g, u], axis=-1), limit=7.0, out_dtype=jnp.bfloat16)


def _xla_second(a: jax.Array, sizes: jax.Array, w2: jax.Array) -> jax.Array:
    y = jax.lax.ragged_dot(mxfp8_cast(a), w2, sizes, preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)


def _report(name: str, case: str, err: float, t_kernel: float, t_xla: float) -> None:
    print(
        f"{case:8s} {name:22s} max_rel_err={err:.2e} kernel={t_kernel * 1e3:9.3f} ms "
        f"xla={t_xla * 1e3:9.3f} ms xla/kernel={t_xla / t_kernel:6.2f}",
        flush=True,
    )


def _rel_err(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run(shapes: dict[str, Any], *, interpret: bool, reps: int, tol: float) -> bool:
    e, h, i, k = shapes["experts"], shapes["hidden"], shapes["intermediate"], shapes["top_k"]
    key = jax.random.key(0)
    kg, ku, kd, kf, kx = jax.random.split(key, 5)
    gate, up, down = _mxfp4(kg, (e, i, h)), _mxfp4(ku, (e, i, h)), _mxfp4(kd, (e, h, i))
    fq = jax.random.bits(kf, (i, h), jnp.uint8) & jnp.uint8(0x7E)  # no NaN codes
    fs = jnp.full((-(-i // 32), -(-h // 32)), 120, jnp.uint8)
    ok = True
    for case, tokens in shapes["cases"].items():
        rows = tokens * k
        kx, k1, k2 = jax.random.split(kx, 3)
        x = jax.random.normal(k1, (rows, h), jnp.bfloat16)
        sizes = _group_sizes(k2, rows, e)
        check_ref = interpret or case == "decode"

        # first expert GEMM fused with SwiGLU; weights are arguments, never closed-over constants
        kern = jax.jit(
            lambda x, s, *w: mxfp4_grouped_swiglu(
                x, *w, s, limit=7.0, activation_cast="mxfp8", interpret=interpret
            )
        )
        w13 = (_dequant_t(*gate), _dequant_t(*up))
        xla = jax.jit(_xla_first)
        got = kern(x, sizes, *gate, *up)
        if check_ref:
            want = grouped_swiglu_reference(x, *gate, *up, sizes, limit=7.0, activation_cast="mxfp8")
        else:
            want = xla(x, sizes, *w13)
        err = _rel_err(got, want)
        ok &= err <= tol
        t_kernel = _time(kern, (x, sizes, *gate, *up), reps)
        _report("mxfp4_grouped_swiglu", case, err, t_kernel, _time(xla, (x, sizes, *w13), reps))
        del w13

        # second expert GEMM
        a = jax.random.normal(k1, (rows, i), jnp.bfloat16)
        kern = jax.jit(
            lambda a, s, *w: mxfp4_grouped_linear(a, *w, s, activation_cast="mxfp8", interpret=interpret)
        )
        w2 = _dequant_t(*down)
        xla = jax.jit(_xla_second)
        got = kern(a, sizes, *down)
        want = grouped_reference(a, *down, sizes, activation_cast="mxfp8") if check_ref else xla(a, sizes, w2)
        err = _rel_err(got, want)
        ok &= err <= tol
        t_kernel = _time(kern, (a, sizes, *down), reps)
        _report("mxfp4_grouped_linear", case, err, t_kernel, _time(xla, (a, sizes, w2), reps))
        del w2

        # SwiGLU alone
        u = jax.random.normal(k2, (rows, 2 * i), jnp.bfloat16) * 4
        kern = jax.jit(lambda u: swiglu(u, limit=7.0, interpret=interpret))
        xla = jax.jit(lambda u: swiglu_reference(u, limit=7.0))
        err = _rel_err(kern(u), xla(u))
        ok &= err <= tol
        _report("swiglu", case, err, _time(kern, (u,), reps), _time(xla, (u,), reps))

        # FP8 block-scaled GEMM at the shared expert's shape (tokens x hidden -> intermediate)
        xt = x[:tokens]
        kern = jax.jit(
            lambda x, q, s: fp8_block_linear(x, q, s, activation_cast="mxfp8", interpret=interpret)
        )
        xla = jax.jit(lambda x, q, s: fp8_reference(x, q, s, activation_cast="mxfp8"))
        err = _rel_err(kern(xt, fq, fs), xla(xt, fq, fs))
        ok &= err <= tol
        _report(
            "fp8_block_linear", case, err, _time(kern, (xt, fq, fs), reps), _time(xla, (xt, fq, fs), reps)
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; kernels interpreted off-GPU")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20, smoke 1)")
    parser.add_argument(
        "--cases", default="decode,prefill", help="comma-separated subset of: decode, prefill"
    )
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(FULL["cases"]))
    if unknown or not cases:
        parser.error(f"--cases: unknown case(s) {unknown or cases}; known: decode, prefill")
    on_gpu = jax.default_backend() == "gpu"
    if not args.smoke and not on_gpu:
        print("the full benchmark needs a GPU; use --smoke elsewhere", file=sys.stderr)
        return 2
    reps = args.reps or (1 if args.smoke else 20)
    print(f"backend={jax.default_backend()} devices={jax.devices()} smoke={args.smoke}", flush=True)
    # bf16 outputs: one bf16 rounding apart at most, relative to the largest value
    shapes = dict(SMOKE if args.smoke else FULL)
    shapes["cases"] = {c: n for c, n in shapes["cases"].items() if c in cases}
    ok = run(shapes, interpret=not on_gpu, reps=reps, tol=2**-6)
    print("all kernels match their references" if ok else "MISMATCH against a reference", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
