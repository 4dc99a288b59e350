"""tcgen05 tensor-core GEMMs for SM100 (Blackwell): FP8 block-scaled and grouped MXFP4 weights, TMEM accumulators.

**Compiled for sm_100a, not run on hardware**: no SM100 machine has executed these kernels; they are built to
cubins and re-assembled with ``ptxas`` in CI, and their CPU paths are the references. Their numerics follow from
construction (below), their speed is unmeasured.

Design (one CTA per output tile, no warp specialisation or multi-stage pipeline yet):

* **Swap AB.** The weight is the MMA's ``A`` operand (``M = 128`` output features per CTA) and the tokens are ``B``
  (``N = BN`` = 16 or 64 tokens), so a decode step of a few tokens still fills the 128-row tensor-core tile. The
  accumulator ``D [128, BN]`` float32 lives in tensor memory (TMEM), ``BN`` columns (two such for the fused SwiGLU).
* **Weights decoded into shared memory.** Each K step of 64, the CTA's 128 threads load the weight tile in its
  checkpoint format (E4M3 bytes + UE8M0 block scales, or packed E2M1 nibbles + UE8M0 group scales), decode it with
  the integer rules of :mod:`custom_calls.cutedsl._device`, and store it as bf16 in the K-major, 128-byte-swizzled
  SMEM layout the UMMA descriptors expect. The decode is exact: ``E4M3 · 2^k`` and ``E2M1 · 2^k`` are bf16 values.
  The activations (bf16 -- the MXFP8 activation cast keeps them bf16-exact) are staged next to them.
* **MMA.** After a proxy fence and a CTA barrier, warp 0 issues four ``tcgen05.mma.kind::f16`` (K = 16 each) per
  K step and commits them to an mbarrier that every thread waits on before the next step overwrites the tiles.
* **Epilogue.** ``tcgen05.ld.32x32b`` moves each TMEM lane (one output feature) to one thread's registers,
  ``BN`` columns; the thread converts (and, fused, applies the clamped SwiGLU to the gate/up pair) and stores the
  feature for each live token row.

Grouped experts: rows are sorted by expert; a static work list of ``(expert, first row, live rows)`` slots, one
per (row tile, expert) pair that intersect (at most ``ceil(T / BN) + E - 1``, computed by XLA), is the grid's second
axis, so every CTA multiplies one expert's weight tile with rows of that expert only and rows never mix experts.

What it does not cover (the wrappers route these to the SIMT kernels of :mod:`.gemm` / :mod:`.grouped_gemm`):
float32 activations (parity mode) and DeepSeek-V3's float32 ``scale_inv`` blocks, whose decoded weights are not
bf16 values.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.experimental.primitives import nvvm_wrapper
from cutlass.memory import SmemAllocator

from custom_calls.cutedsl import _device

__all__ = [
    "BLOCK_K",
    "BLOCK_M",
    "THREADS",
    "fp8_block_gemm_tc",
    "mxfp4_grouped_gemm_tc",
    "mxfp4_grouped_swiglu_gemm_tc",
]

#: Output features per CTA (the MMA's M).
BLOCK_M = 128
#: Reduction step: one 128-byte swizzle row of bf16.
BLOCK_K = 64
#: Threads per CTA: four warps, one TMEM lane (output feature) per thread in the epilogue.
THREADS = 128
_MMA_K = 16  # K of one tcgen05.mma kind::f16 instruction
_GROUP = 32  # elements per MXFP4 scale byte


def _tiled_mma(bn: int) -> cute.TiledMma:
    return sm100.make_trivial_tiled_mma(
        cutlass.BFloat16,
        cutlass.BFloat16,
        OperandMajorMode.K,
        OperandMajorMode.K,
        cutlass.Float32,
        tcgen05.CtaGroup.ONE,
        (BLOCK_M, bn),
    )


def _tmem_cols(bn: int, accumulators: int) -> int:
    cols = 32
    while cols < bn * accumulators:
        cols *= 2
    return cols


# ------------------------------------------------------------------------------------------------ device helpers


@cute.jit
def _stage_rows(sB: cute.Tensor, x: cute.Tensor, row0, lo, hi, k0, bn: cutlass.Constexpr[int]):
    """``sB[t, k] = x[row0 + t, k0 + k]`` for live rows ``lo <= row0 + t < hi`` (zero elsewhere), bf16."""
    tidx, _, _ = cute.arch.thread_idx()
    k_total = x.shape[1]
    for j in cutlass.range(bn * BLOCK_K // THREADS, unroll=8):
        idx = j * THREADS + tidx
        t = idx // BLOCK_K
        k = idx % BLOCK_K
        v = cutlass.Float32(0.0)
        r = row0 + t
        if r >= lo and r < hi and k0 + k < k_total:
            v = x[r, k0 + k].to(cutlass.Float32)
        sB[(t, k % _MMA_K), 0, k // _MMA_K, 0] = v.to(cutlass.BFloat16)


@cute.jit
def _stage_fp8(
    sA: cute.Tensor,
    w: cute.Tensor,
    s: cute.Tensor,
    n0,
    k0,
    block_rows: cutlass.Constexpr[int],
    block_cols: cutlass.Constexpr[int],
):
    """The decoded FP8 weight tile: ``sA[m, k] = e4m3(w[n0 + m, k0 + k]) · 2^(s[...] - 127)`` as bf16 (exact)."""
    tidx, _, _ = cute.arch.thread_idx()
    num_n, k_total = w.shape
    for j in cutlass.range(BLOCK_M * BLOCK_K // THREADS, unroll=8):
        idx = j * THREADS + tidx
        m = idx // BLOCK_K
        k = idx % BLOCK_K
        v = cutlass.Float32(0.0)
        n = n0 + m
        kk = k0 + k
        if n < num_n and kk < k_total:
            v = _device.e4m3_to_f32(cutlass.Int32(w[n, kk]))
            v = _device.apply_ue8m0(v, cutlass.Int32(s[n // block_rows, kk // block_cols]))
        sA[(m, k % _MMA_K), 0, k // _MMA_K, 0] = v.to(cutlass.BFloat16)


@cute.jit
def _stage_mxfp4(sA: cute.Tensor, packed: cute.Tensor, s: cute.Tensor, e, n0, k0):
    """The decoded MXFP4 tile of expert ``e``: nibble ``k`` of row ``n0 + m`` times its group's UE8M0 scale."""
    tidx, _, _ = cute.arch.thread_idx()
    num_n = packed.shape[1]
    k_total = packed.shape[2] * 2
    for j in cutlass.range(BLOCK_M * BLOCK_K // THREADS, unroll=8):
        idx = j * THREADS + tidx
        m = idx // BLOCK_K
        k = idx % BLOCK_K
        v = cutlass.Float32(0.0)
        n = n0 + m
        kk = k0 + k
        if n < num_n and kk < k_total:
            byte = cutlass.Int32(packed[e, n, kk // 2])
            code = (byte >> ((kk % 2) * 4)) & 0xF
            v = _device.apply_ue8m0(_device.e2m1_to_f32(code), cutlass.Int32(s[e, n, kk // _GROUP]))
        sA[(m, k % _MMA_K), 0, k // _MMA_K, 0] = v.to(cutlass.BFloat16)


@cute.jit
def _issue(tiled_mma: cute.TiledMma, acc: cute.Tensor, frag_a: cute.Tensor, frag_b: cute.Tensor, carry_in):
    """One K step of MMAs (warp-uniform; the compiler elects the issuing thread). ``carry_in``: add to the
    accumulator (false on the first K step, which overwrites it)."""
    for kb in cutlass.range_constexpr(BLOCK_K // _MMA_K):
        tiled_mma.set(tcgen05.Field.ACCUMULATE, carry_in if kb == 0 else True)
        cute.gemm(tiled_mma, acc, frag_a[None, None, kb, 0], frag_b[None, None, kb, 0], acc)


@cute.jit
def _load_acc(acc: cute.Tensor, bn: cutlass.Constexpr[int]):
    """This thread's TMEM lane of ``acc [128, bn]`` in registers, with the (row, token) coordinate of each value."""
    tidx, _, _ = cute.arch.thread_idx()
    atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(bn)), cutlass.Float32)
    view = acc[None, 0, 0]
    tiled = tcgen05.make_tmem_copy(atom, view)
    thr = tiled.get_slice(tidx)
    coords = thr.partition_D(cute.make_identity_tensor(view.shape))
    regs = cute.make_rmem_tensor(coords.shape, cutlass.Float32)
    cute.copy(tiled, thr.partition_S(view), regs)
    cute.arch.fence_view_async_tmem_load()
    return regs, coords


# ------------------------------------------------------------------------------------------------ kernels


@cute.jit
def _setup(
    smem: SmemAllocator,
    a_layout: cute.ComposedLayout,
    b_layout: cute.ComposedLayout,
    n_a: cutlass.Constexpr[int],
    cols: cutlass.Constexpr[int],
):
    """Shared tiles (``n_a`` weight tiles, one token tile), the MMA mbarrier, the TMEM allocation."""
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tiles_a = [
        smem.allocate_tensor(cutlass.BFloat16, a_layout.outer, 128, a_layout.inner) for _ in range(n_a)
    ]
    s_b = smem.allocate_tensor(cutlass.BFloat16, b_layout.outer, 128, b_layout.inner)
    mbar = smem.allocate_array(cutlass.Int64, 1, byte_alignment=8)
    holder = smem.allocate_array(cutlass.Int32, 1, byte_alignment=4)
    if warp == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar, 1)
        cute.arch.alloc_tmem(cols, holder)
    cute.arch.mbarrier_init_fence()
    nvvm_wrapper.tcgen05_fence("before_thread_sync")
    cute.arch.sync_threads()
    nvvm_wrapper.tcgen05_fence("after_thread_sync")
    tmem = cute.arch.retrieve_tmem_ptr(cutlass.Float32, 16, holder)
    return tiles_a, s_b, mbar, tmem, warp


@cute.jit
def _finish(tmem, cols: cutlass.Constexpr[int], warp):
    nvvm_wrapper.tcgen05_fence("before_thread_sync")
    cute.arch.sync_threads()
    if warp == 0:
        cute.arch.relinquish_tmem_alloc_permit()
        cute.arch.dealloc_tmem(tmem, cols)


@cute.jit
def _mma_and_wait(tiled_mma, accs, frags_a, frag_b, carry_in, mbar, phase, warp):
    cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy SMEM stores before the async-proxy MMA
    cute.arch.sync_threads()
    if warp == 0:
        for acc, frag_a in zip(accs, frags_a, strict=True):
            _issue(tiled_mma, acc, frag_a, frag_b, carry_in)
        with cute.arch.elect_one():
            tcgen05.commit(mbar)
    cute.arch.mbarrier_wait(mbar, phase)
    nvvm_wrapper.tcgen05_fence("after_thread_sync")
    return phase ^ 1


@cute.kernel
def _fp8_tc_kernel(
    tiled_mma: cute.TiledMma,
    x: cute.Tensor,
    w: cute.Tensor,
    s: cute.Tensor,
    out: cute.Tensor,
    a_layout: cute.ComposedLayout,
    b_layout: cute.ComposedLayout,
    bn: cutlass.Constexpr[int],
    block_rows: cutlass.Constexpr[int],
    block_cols: cutlass.Constexpr[int],
):
    bidx, bidy, _ = cute.arch.block_idx()
    n0, t0 = bidx * BLOCK_M, bidy * bn
    cols = _tmem_cols(bn, 1)
    smem = SmemAllocator()
    tiles_a, s_b, mbar, tmem, warp = _setup(smem, a_layout, b_layout, 1, cols)
    frag_a = tiled_mma.make_fragment_A(tiles_a[0])
    frag_b = tiled_mma.make_fragment_B(s_b)
    acc = cute.make_tensor(tmem, tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BLOCK_M, bn))).layout)
    num_t, k_total = x.shape
    phase = cutlass.Int32(0)
    for kt in cutlass.range((k_total + BLOCK_K - 1) // BLOCK_K):
        _stage_fp8(tiles_a[0], w, s, n0, kt * BLOCK_K, block_rows, block_cols)
        _stage_rows(s_b, x, t0, 0, num_t, kt * BLOCK_K, bn)
        phase = _mma_and_wait(tiled_mma, [acc], [frag_a], frag_b, kt > 0, mbar, phase, warp)
    regs, coords = _load_acc(acc, bn)
    for i in cutlass.range_constexpr(cute.size(regs)):
        ((m, t),) = coords[i]
        if n0 + m < w.shape[0] and t0 + t < num_t:
            out[t0 + t, n0 + m] = regs[i].to(out.element_type)
    _finish(tmem, cols, warp)


@cute.kernel
def _mxfp4_tc_kernel(
    tiled_mma: cute.TiledMma,
    x: cute.Tensor,
    packed: cute.Tensor,
    s: cute.Tensor,
    slots: cute.Tensor,
    out: cute.Tensor,
    a_layout: cute.ComposedLayout,
    b_layout: cute.ComposedLayout,
    bn: cutlass.Constexpr[int],
):
    bidx, bidy, _ = cute.arch.block_idx()
    n0 = bidx * BLOCK_M
    e, row0, lo, hi = slots[bidy, 0], slots[bidy, 1], slots[bidy, 2], slots[bidy, 3]
    cols = _tmem_cols(bn, 1)
    smem = SmemAllocator()
    tiles_a, s_b, mbar, tmem, warp = _setup(smem, a_layout, b_layout, 1, cols)
    frag_a = tiled_mma.make_fragment_A(tiles_a[0])
    frag_b = tiled_mma.make_fragment_B(s_b)
    acc = cute.make_tensor(tmem, tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BLOCK_M, bn))).layout)
    k_total = x.shape[1]
    trips = cutlass.Int32(0)  # unused slots of the static work list run no K step and store nothing
    if lo < hi:
        trips = (k_total + BLOCK_K - 1) // BLOCK_K
    phase = cutlass.Int32(0)
    for kt in cutlass.range(trips):
        _stage_mxfp4(tiles_a[0], packed, s, e, n0, kt * BLOCK_K)
        _stage_rows(s_b, x, row0, lo, hi, kt * BLOCK_K, bn)
        phase = _mma_and_wait(tiled_mma, [acc], [frag_a], frag_b, kt > 0, mbar, phase, warp)
    regs, coords = _load_acc(acc, bn)
    for i in cutlass.range_constexpr(cute.size(regs)):
        ((m, t),) = coords[i]
        r = row0 + t
        if n0 + m < packed.shape[1] and r >= lo and r < hi:
            out[r, n0 + m] = regs[i].to(out.element_type)
    _finish(tmem, cols, warp)


@cute.kernel
def _mxfp4_swiglu_tc_kernel(
    tiled_mma: cute.TiledMma,
    x: cute.Tensor,
    gate_packed: cute.Tensor,
    gate_s: cute.Tensor,
    up_packed: cute.Tensor,
    up_s: cute.Tensor,
    slots: cute.Tensor,
    out: cute.Tensor,
    a_layout: cute.ComposedLayout,
    b_layout: cute.ComposedLayout,
    bn: cutlass.Constexpr[int],
    limit: cutlass.Constexpr[float | None],
):
    bidx, bidy, _ = cute.arch.block_idx()
    n0 = bidx * BLOCK_M
    e, row0, lo, hi = slots[bidy, 0], slots[bidy, 1], slots[bidy, 2], slots[bidy, 3]
    cols = _tmem_cols(bn, 2)
    smem = SmemAllocator()
    tiles_a, s_b, mbar, tmem, warp = _setup(smem, a_layout, b_layout, 2, cols)
    frag_g = tiled_mma.make_fragment_A(tiles_a[0])
    frag_u = tiled_mma.make_fragment_A(tiles_a[1])
    frag_b = tiled_mma.make_fragment_B(s_b)
    acc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BLOCK_M, bn))).layout
    acc_g = cute.make_tensor(tmem, acc_layout)
    acc_u = cute.make_tensor(tmem + tcgen05.find_tmem_tensor_col_offset(acc_g), acc_layout)
    k_total = x.shape[1]
    trips = cutlass.Int32(0)
    if lo < hi:
        trips = (k_total + BLOCK_K - 1) // BLOCK_K
    phase = cutlass.Int32(0)
    for kt in cutlass.range(trips):
        _stage_mxfp4(tiles_a[0], gate_packed, gate_s, e, n0, kt * BLOCK_K)
        _stage_mxfp4(tiles_a[1], up_packed, up_s, e, n0, kt * BLOCK_K)
        _stage_rows(s_b, x, row0, lo, hi, kt * BLOCK_K, bn)
        phase = _mma_and_wait(tiled_mma, [acc_g, acc_u], [frag_g, frag_u], frag_b, kt > 0, mbar, phase, warp)
    g_regs, coords = _load_acc(acc_g, bn)
    u_regs, _ = _load_acc(acc_u, bn)
    for i in cutlass.range_constexpr(cute.size(g_regs)):
        ((m, t),) = coords[i]
        r = row0 + t
        if n0 + m < gate_packed.shape[1] and r >= lo and r < hi:
            out[r, n0 + m] = _device.clamped_swiglu(g_regs[i], u_regs[i], limit).to(out.element_type)
    _finish(tmem, cols, warp)


# ------------------------------------------------------------------------------------------------ launchers


def _layouts(tiled_mma: cute.TiledMma, bn: int):
    tile = (BLOCK_M, bn, BLOCK_K)
    return (
        sm100.make_smem_layout_a(tiled_mma, tile, cutlass.BFloat16, 1),
        sm100.make_smem_layout_b(tiled_mma, tile, cutlass.BFloat16, 1),
    )


@cute.jit
def fp8_block_gemm_tc(
    stream: cuda.CUstream,
    x: cute.Tensor,
    w: cute.Tensor,
    s: cute.Tensor,
    out: cute.Tensor,
    bn: cutlass.Constexpr[int] = 64,
    block_rows: cutlass.Constexpr[int] = 32,
    block_cols: cutlass.Constexpr[int] = 32,
):
    """``out [T, N] = x [T, K] (bf16) · deq(w [N, K] E4M3 bytes, s UE8M0 bytes per block)ᵀ`` on tcgen05."""
    tiled_mma = _tiled_mma(bn)
    a_layout, b_layout = _layouts(tiled_mma, bn)
    grid = [(w.shape[0] + BLOCK_M - 1) // BLOCK_M, (x.shape[0] + bn - 1) // bn, 1]
    _fp8_tc_kernel(tiled_mma, x, w, s, out, a_layout, b_layout, bn, block_rows, block_cols).launch(
        grid=grid, block=[THREADS, 1, 1], stream=stream
    )


@cute.jit
def mxfp4_grouped_gemm_tc(
    stream: cuda.CUstream,
    x: cute.Tensor,
    packed: cute.Tensor,
    s: cute.Tensor,
    slots: cute.Tensor,
    out: cute.Tensor,
    bn: cutlass.Constexpr[int] = 64,
):
    """Grouped ``out [T, N]`` over experts ``packed [E, N, K/2]`` / ``s [E, N, K/32]`` for the work list
    ``slots [S, 4]`` (expert, first row, live rows from, to) on tcgen05."""
    tiled_mma = _tiled_mma(bn)
    a_layout, b_layout = _layouts(tiled_mma, bn)
    grid = [(packed.shape[1] + BLOCK_M - 1) // BLOCK_M, slots.shape[0], 1]
    _mxfp4_tc_kernel(tiled_mma, x, packed, s, slots, out, a_layout, b_layout, bn).launch(
        grid=grid, block=[THREADS, 1, 1], stream=stream
    )


@cute.jit
def mxfp4_grouped_swiglu_gemm_tc(
    stream: cuda.CUstream,
    x: cute.Tensor,
    gate_packed: cute.Tensor,
    gate_s: cute.Tensor,
    up_packed: cute.Tensor,
    up_s: cute.Tensor,
    slots: cute.Tensor,
    out: cute.Tensor,
    bn: cutlass.Constexpr[int] = 64,
    limit: cutlass.Constexpr[float | None] = None,
):
    """The fused first expert GEMM pair with the clamped SwiGLU epilogue on tcgen05 (two TMEM accumulators)."""
    tiled_mma = _tiled_mma(bn)
    a_layout, b_layout = _layouts(tiled_mma, bn)
    grid = [(gate_packed.shape[1] + BLOCK_M - 1) // BLOCK_M, slots.shape[0], 1]
    _mxfp4_swiglu_tc_kernel(
        tiled_mma, x, gate_packed, gate_s, up_packed, up_s, slots, out, a_layout, b_layout, bn, limit
    ).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)
