"""Check each Pallas kernel against its reference and time it against the XLA path, in one run.

    python scripts/bench_kernels.py            # on a GPU: V4.1-Flash shapes (experts E=384, H=5120, I=2304;
                                               # attention 64 heads x 512, window 128, top-512, 128K context)
    python scripts/bench_kernels.py --smoke    # anywhere: tiny shapes, kernels in Pallas interpret mode
    python scripts/bench_kernels.py --group attention --peak_gbps 4800   # attention kernels only, H200 peak

Cases: a decode step (64 tokens × top-6 = 384 expert rows) and a prefill (4096 tokens × top-6 = 24576 rows).
For each case and kernel it prints one line: the largest error against the reference, and the median time of the
kernel and of the XLA baseline measured in the same process, with their ratio (> 1: the kernel is faster).

Attention group (``--group attention``): ``v4_sparse_attention`` (window MXFP8 records + selected FP4 records +
sinks), ``v4_indexer_topk`` (MXFP4 key pages, streaming top-k), ``v4_compress_store``, ``paged_mla_attention``
(V3 shape, bf16 and FP8 latent caches) and ``mhc_sinkhorn``, each against its reference op jitted by XLA, in a
decode case (64 sequences at 128K context, V3 at 32K) and a prefill-chunk case (4096 tokens of one sequence); and,
in the decode case, the fused sampler ``sample_tokens`` (64 rows over V3's 129280-id vocabulary) against op
``sample``'s reference tokens, and its speculative modes ``verify_tokens`` / ``draft_tokens`` against ops
``verify`` / ``draft_sample`` on the same rows. For
the decode attention and indexer kernels the line also gives the bytes the kernel must read and write and the
achieved bandwidth, as a fraction of ``--peak_gbps`` (default: the device's HBM peak from a small table, else 0
= not reported).

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

#: HBM peak bandwidth (GB/s) by device kind, for the attention lines' fraction of peak (vendor figures).
PEAK_GBPS = {"NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H200": 4800.0, "NVIDIA B200": 8000.0}

ATTN_FULL = {
    "heads": 64,
    "dim": 512,
    "window": 128,
    "topk": 512,
    "index_heads": 32,
    "index_dim": 128,
    "ratio": 2,
    "block": 128,
    "mla_heads": 128,
    "mla_rank": 512,
    "mla_rope": 64,
    "mla_block": 64,
    "vocab": 129280,
    "cases": {"decode": (64, 128 * 1024, 32 * 1024), "prefill": (4096, 8192, 8192)},
}
ATTN_SMOKE = {
    "heads": 4,
    "dim": 64,
    "window": 8,
    "topk": 6,
    "index_heads": 4,
    "index_dim": 64,
    "ratio": 2,
    "block": 8,
    "mla_heads": 4,
    "mla_rank": 64,
    "mla_rope": 16,
    "mla_block": 8,
    "vocab": 300,
    "cases": {"decode": (3, 48, 40), "prefill": (6, 24, 24)},
}

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


def _report(name: str, case: str, err: float, t_kernel: float, t_xla: float, extra: str = "") -> None:
    print(
        f"{case:8s} {name:22s} max_rel_err={err:.2e} kernel={t_kernel * 1e3:9.3f} ms "
        f"xla={t_xla * 1e3:9.3f} ms xla/kernel={t_xla / t_kernel:6.2f}{extra}",
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


def _bandwidth(nbytes: int, seconds: float, peak_gbps: float) -> str:
    gbps = nbytes / seconds / 1e9
    frac = f" = {gbps / peak_gbps:.1%} of {peak_gbps:.0f} GB/s" if peak_gbps else ""
    return f" bytes={nbytes / 2**20:.1f}MiB bw={gbps:.0f}GB/s{frac}"


def run_attention(
    shapes: dict[str, Any], *, interpret: bool, reps: int, tol: float, peak_gbps: float
) -> bool:
    """The attention-side kernels against their reference ops (module docstring)."""
    from deepinfer_jax.cache import paged
    from deepinfer_jax.models.deepseek_v4.mhc import sinkhorn
    from deepinfer_jax.ops import indexer as ix_ref
    from deepinfer_jax.ops import kv_store as ks_ref
    from deepinfer_jax.ops import sparse_attention as sa_ref
    from pallas_kernels import compress_store, indexer, mhc, paged_mla, sparse_attention

    h, d, w, topk = shapes["heads"], shapes["dim"], shapes["window"], shapes["topk"]
    hi, di, r, blk = shapes["index_heads"], shapes["index_dim"], shapes["ratio"], shapes["block"]
    per_page = blk // r
    ok = True
    key = jax.random.key(1)
    for case, (tokens, context, mla_context) in shapes["cases"].items():
        decode = case == "decode"
        seqs = tokens if decode else 1
        pages_per_seq = context // blk
        num_blocks = seqs * pages_per_seq + 1
        key, *ks = jax.random.split(key, 13)
        tables = (1 + jnp.arange(seqs * pages_per_seq, dtype=jnp.int32)).reshape(seqs, pages_per_seq)
        rows = jnp.arange(tokens, dtype=jnp.int32) if decode else jnp.zeros((tokens,), jnp.int32)
        pos = jnp.full((tokens,), context - 1, jnp.int32) if decode else context - tokens + jnp.arange(tokens)
        limit = ((pos + 1) // r).astype(jnp.int32)

        # sparse attention: window MXFP8 records, top-k FP4 records, sinks
        q = jax.random.normal(ks[0], (tokens, h, d), jnp.bfloat16)
        window = jax.random.bits(ks[1], (tokens, w, d + d // 32), jnp.uint8) & jnp.uint8(0x7E)
        window = window.at[..., d:].set(jnp.uint8(120))
        mask = jnp.ones((tokens, w), bool)
        pages = jax.random.bits(ks[2], (num_blocks, per_page, d // 2 + d // 16), jnp.uint8)
        pages = pages.at[..., d // 2 :].set(jnp.uint8(0x30))
        index = jax.random.randint(ks[3], (tokens, topk), 0, context // r)
        slots = sa_ref.entry_slots(index, tables, rows, entries_per_block=per_page)
        sinks = jax.random.normal(ks[4], (h,), jnp.float32)
        kw = dict(scale=d**-0.5, window_format="mxfp8", compressed_format="fp4")
        kern = jax.jit(lambda *a, kw=kw: sparse_attention.v4_sparse_attention(*a, interpret=interpret, **kw))
        ref = jax.jit(lambda *a, kw=kw: sa_ref.v4_sparse_attention(*a, **kw))
        args = (q, window, mask, sinks, pages, slots)
        err = _rel_err(kern(*args), ref(*args))
        ok &= err <= tol
        t_k, t_x = _time(kern, args, reps), _time(ref, args, reps)
        moved = 2 * q.size * 2 + window.size + tokens * topk * (d // 2 + d // 16 + 4) + h * 4
        print_bw = _bandwidth(moved, t_k, peak_gbps) if decode else ""
        _report("v4_sparse_attention", case, err, t_k, t_x, print_bw)

        # lightning indexer over MXFP4 pages with the streaming top-k
        qi = jax.random.normal(ks[5], (tokens, hi, di), jnp.bfloat16)
        wi = jax.random.uniform(ks[6], (tokens, hi), jnp.float32)
        ik = jax.random.bits(ks[7], (num_blocks, per_page, di // 2 + di // 32), jnp.uint8)
        ik = ik.at[..., di // 2 :].set(jnp.uint8(124))
        kwi = dict(k=topk, key_format="mxfp4", score_dtype=jnp.bfloat16)
        kern = jax.jit(lambda *a, kw=kwi: indexer.v4_indexer_topk(*a, interpret=interpret, **kw))
        ref = jax.jit(lambda *a, kw=kwi: ix_ref.v4_indexer_topk(*a, **kw))
        args = (qi, wi, ik, tables, rows, limit)
        got, want = np.asarray(kern(*args)), np.asarray(ref(*args))
        # near-ties in bf16 may swap at the boundary: report the fraction of picks the reference also made
        same = np.mean([len(np.intersect1d(g, t)) / max(len(t), 1) for g, t in zip(got, want, strict=True)])
        ok &= same >= 0.99
        t_k, t_x = _time(kern, args, reps), _time(ref, args, reps)
        moved = int(np.sum(np.asarray(limit))) * (di // 2 + di // 32) + qi.size * 2 + tokens * topk * 4
        print_bw = _bandwidth(moved, t_k, peak_gbps) if decode else ""
        _report("v4_indexer_topk", case, 1.0 - same, t_k, t_x, print_bw + " (err = 1 - pick overlap)")

        # compress-and-store of the entries this step completes
        entries = max(1, tokens // r)
        kv = jax.random.normal(ks[8], (entries, r, d), jnp.float32)
        gate = jax.random.normal(ks[9], (entries, r, d), jnp.float32)
        nw = jnp.ones((d,), jnp.float32)
        cos = jnp.ones((entries, 32 if d >= 64 else d // 2), jnp.float32)
        sin = jnp.zeros_like(cos)
        eslots = jnp.arange(entries, dtype=jnp.int32) * 3
        rope = 2 * cos.shape[1]
        kwc = dict(eps=1e-20, rope_dim=rope, key_format="fp4")
        kern = jax.jit(lambda *a, kw=kwc: compress_store.v4_compress_store(*a, interpret=interpret, **kw)[1])
        ref = jax.jit(lambda *a, kw=kwc: ks_ref.v4_compress_store(*a, **kw)[1])
        args = (pages, kv, gate, nw, cos, sin, eslots)
        err = _rel_err(kern(*args), ref(*args))
        ok &= err <= tol
        _report("v4_compress_store", case, err, _time(kern, args, reps), _time(ref, args, reps))

        # paged MLA (V3 shape) over bf16 and FP8 latent caches
        mh, mc, mr, mb = shapes["mla_heads"], shapes["mla_rank"], shapes["mla_rope"], shapes["mla_block"]
        mpages = mla_context // mb
        mtables = (1 + jnp.arange(seqs * mpages, dtype=jnp.int32)).reshape(seqs, mpages)
        mpos = (
            jnp.full((tokens,), mla_context - 1, jnp.int32)
            if decode
            else mla_context - tokens + jnp.arange(tokens)
        )
        ctx = jnp.full((seqs,), mla_context, jnp.int32)
        ql = jax.random.normal(ks[10], (tokens, mh, mc), jnp.bfloat16)
        qp = jax.random.normal(ks[10], (tokens, mh, mr), jnp.bfloat16)
        lat = jax.random.normal(ks[10], (1, seqs * mpages + 1, mb, mc + mr), jnp.bfloat16)
        for storage, cache in (("bf16", lat), ("fp8", paged.encode_latent_fp8(lat, mc))):
            kern = jax.jit(
                lambda ql, qp, c, *a: paged_mla.paged_mla_attention(
                    ql, qp, c, 0, *a, scale=0.07, interpret=interpret
                )
            )
            ref = jax.jit(lambda ql, qp, c, *a: paged.paged_mla_attention(ql, qp, c, 0, *a, scale=0.07))
            args = (ql, qp, cache, rows, mpos, mtables, ctx)
            err = _rel_err(kern(*args), ref(*args))
            ok &= err <= tol
            t_k, t_x = _time(kern, args, reps), _time(ref, args, reps)
            row_bytes = cache.shape[-1] * cache.dtype.itemsize
            moved = (
                int(np.sum(np.asarray(mpos) + 1)) * row_bytes if decode else seqs * mla_context * row_bytes
            )
            moved += (ql.size + qp.size) * 2 + tokens * mh * mc * 4
            print_bw = _bandwidth(moved, t_k, peak_gbps) if decode else ""
            _report(f"paged_mla[{storage}]", case, err, t_k, t_x, print_bw)

        # mHC Sinkhorn (hc_mult 4, 20 iterations), one sub-layer's mixes
        logits = jax.random.normal(ks[11], (tokens, 4, 4), jnp.float32) * 3
        kern = jax.jit(lambda x: mhc.mhc_sinkhorn(x, iters=20, eps=1e-6, interpret=interpret))
        ref = jax.jit(lambda x: sinkhorn(x, iters=20, eps=1e-6))
        err = _rel_err(kern(logits), ref(logits))
        ok &= err <= tol
        _report("mhc_sinkhorn", case, err, _time(kern, (logits,), reps), _time(ref, (logits,), reps))

        if decode:  # the fused sampler: one row per decoding sequence
            ok &= _bench_sampler(seqs, shapes["vocab"], key, interpret=interpret, reps=reps, tol=tol)
    return ok


def _bench_sampler(rows: int, vocab: int, key: jax.Array, *, interpret: bool, reps: int, tol: float) -> bool:
    """``sample_tokens`` against op ``sample``'s reference tokens: greedy, top-k, top-p and min_p rows with
    penalties. err = the fraction of rows whose token differs (the tests require 0 in interpret mode)."""
    from deepinfer_jax.engine.params import SamplingParams
    from deepinfer_jax.sampling import SamplingTensors, sample
    from pallas_kernels.sampler import sample_tokens

    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=50, repetition_penalty=1.1),
        SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5),
        SamplingParams(temperature=1.0, min_p=0.05, top_k=20, top_p=0.95, frequency_penalty=0.3),
    ]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    st = SamplingTensors.build(params, list(range(rows)), [1000 + i for i in range(rows)], vocab)
    k1, k2 = jax.random.split(key)
    logits = jax.random.normal(k1, (rows, vocab), jnp.float32) * 4
    counts = jax.random.randint(k2, (rows, vocab), 0, 2, jnp.int32) * (jnp.arange(vocab) % 50 == 0)
    kern = jax.jit(lambda x, c: sample_tokens(x, st, c, interpret=interpret)[0])
    ref = jax.jit(lambda x, c: sample(x, st, c, backend="reference").tokens)
    args = (logits, counts)
    err = float(jnp.mean((kern(*args) != ref(*args)).astype(jnp.float32)))
    _report(
        "sample_tokens",
        "decode",
        err,
        _time(kern, args, reps),
        _time(ref, args, reps),
        " (err = token mismatches)",
    )
    if err > tol:
        return False
    return _bench_speculative(logits, st, counts, interpret=interpret, reps=reps, tol=tol)


def _bench_speculative(
    logits: jax.Array, st: Any, counts: jax.Array, *, interpret: bool, reps: int, tol: float
) -> bool:
    """``verify_tokens`` / ``draft_tokens`` (the sampler kernel's speculative modes) against ops ``verify`` /
    ``draft_sample``'s references on the same rows: each row checks a draft drawn from its own logits plus
    noise; every fifth row is a fresh row. err = the fraction of rows whose token or acceptance differs."""
    from deepinfer_jax.sampling import speculative as sp
    from pallas_kernels.sampler import draft_tokens, verify_tokens

    rows = logits.shape[0]
    noisy = logits + jax.random.normal(jax.random.PRNGKey(7), logits.shape, jnp.float32)
    draft_lp = jax.nn.log_softmax(noisy)
    drafts = jax.random.categorical(jax.random.PRNGKey(8), noisy).astype(jnp.int32)
    fresh = jnp.arange(rows) % 5 == 4
    args = (logits, counts, drafts, draft_lp, fresh)

    def kern(x, c, d, lp, f):
        token, accept, _, _ = verify_tokens(x, st, c, d, lp, f, interpret=interpret)
        return token, accept

    def ref(x, c, d, lp, f):
        out = sp._verify_reference(
            x,
            st,
            c,
            d,
            lp,
            f,
            num_logprobs=0,
            logprobs_mode="raw_logprobs",
            force_top_k=0,
            batch_invariant=False,
        )
        return out.token, out.accept

    kern, ref = jax.jit(kern), jax.jit(ref)
    (kt, ka), (rt, ra) = kern(*args), ref(*args)
    err = float(jnp.mean(((kt != rt) | (ka != ra)).astype(jnp.float32)))
    _report(
        "verify_tokens", "decode", err, _time(kern, args, reps), _time(ref, args, reps), " (err = mismatches)"
    )
    dkern = jax.jit(lambda x: draft_tokens(x, st, interpret=interpret)[0])
    dref = jax.jit(lambda x: sp._draft_reference(x, st, force_top_k=0, batch_invariant=False)[0])
    derr = float(jnp.mean((dkern(logits) != dref(logits)).astype(jnp.float32)))
    _report(
        "draft_tokens",
        "decode",
        derr,
        _time(dkern, (logits,), reps),
        _time(dref, (logits,), reps),
        " (err = token mismatches)",
    )
    return err <= tol and derr <= tol


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; kernels interpreted off-GPU")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20, smoke 1)")
    parser.add_argument(
        "--cases", default="decode,prefill", help="comma-separated subset of: decode, prefill"
    )
    parser.add_argument(
        "--group", default="all", choices=["all", "weights", "attention"], help="which kernels to run"
    )
    parser.add_argument(
        "--peak_gbps",
        type=float,
        default=None,
        help="HBM peak for the bandwidth fraction (default: by device)",
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
    ok = True
    if args.group in ("all", "weights"):
        ok &= run(shapes, interpret=not on_gpu, reps=reps, tol=2**-6)
    if args.group in ("all", "attention"):
        attn = dict(ATTN_SMOKE if args.smoke else ATTN_FULL)
        attn["cases"] = {c: n for c, n in attn["cases"].items() if c in cases}
        peak = (
            args.peak_gbps if args.peak_gbps is not None else PEAK_GBPS.get(jax.devices()[0].device_kind, 0.0)
        )
        # bf16 attention outputs and probabilities: a few bf16 roundings apart, relative to the largest value
        ok &= run_attention(attn, interpret=not on_gpu, reps=reps, tol=2**-5, peak_gbps=peak)
    print("all kernels match their references" if ok else "MISMATCH against a reference", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
