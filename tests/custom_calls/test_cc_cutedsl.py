"""CuteDSL SM100 kernels: sm_100a cubins built without a GPU, cuda export, CPU paths, registry wiring.

No GPU is needed (or used): the kernels are compiled ahead of time to PTX and cubins for ``sm_100a``, the JAX
wrappers are exported for ``platforms=["cuda"]``, and the wrappers' CPU paths are checked against references
written here with numpy and ml_dtypes. Running the kernels themselves needs an SM100 GPU.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (the 'nvidia' extra) is not installed")
pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl (the 'nvidia' extra) is not installed")

import custom_calls.cutedsl as cutedsl
from custom_calls.cutedsl import aot
from deepinfer_jax import ops
from deepinfer_jax.ops.registry import OpRegistry

CUSTOM_CALL = "CuteDSLRT_NvJaxCutlassCall_v2"
S = jax.ShapeDtypeStruct
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# ------------------------------------------------------------------------------------------------ numpy references


def _e8m0(b: np.ndarray) -> np.ndarray:
    return np.exp2(b.astype(np.float64) - 127).astype(np.float32)


def _fp8_weight(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    n, k = codes.shape
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = scale if scale.dtype == np.float32 else _e8m0(scale)
    s_full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:n, :k]
    return values * s_full


def _mxfp4_weight(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return E2M1[codes] * np.repeat(_e8m0(scale), 32, axis=-1)


def _grouped(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    y = np.zeros((x.shape[0], w.shape[1]), np.float64)
    start = 0
    for e, size in enumerate(sizes):
        y[start : start + size] = x[start : start + size].astype(np.float64) @ w[e].T.astype(np.float64)
        start += size
    return y


def _swiglu(g: np.ndarray, v: np.ndarray, limit: float | None) -> np.ndarray:
    g, v = g.astype(np.float64), v.astype(np.float64)
    if limit is not None:
        g, v = np.minimum(g, limit), np.clip(v, -limit, limit)
    return g / (1 + np.exp(-g)) * v


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(20261129)


def _fp8_inputs(rng, n=80, k=96, t=5, scale_inv=False):
    # Finite E4M3 codes only (0x7F/0xFF are NaN); scales near 1 keep the products in a comfortable range.
    codes = rng.integers(0, 0x7E, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
    grid = (-(-n // 32), -(-k // 32)) if not scale_inv else (-(-n // 128), -(-k // 128))
    if scale_inv:
        scale = rng.uniform(0.01, 0.1, grid).astype(np.float32)
    else:
        scale = rng.integers(120, 124, grid, dtype=np.uint8)
    x = rng.standard_normal((t, k)).astype(np.float32)
    return x, codes, scale


def _mxfp4_inputs(rng, e=4, n=24, k=64, t=11):
    packed = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
    scale = rng.integers(122, 130, (e, n, k // 32), dtype=np.uint8)
    x = rng.standard_normal((t, k)).astype(np.float32)
    return x, packed, scale


# Ragged groups: an empty expert, a group of one row, groups not multiples of any tile, and padding rows.
SIZES = np.array([3, 0, 1, 5], np.int32)  # sum 9 of 11 rows
GEMM_CASTS = ("none", "mxfp8", "fp8_token_128")


# ------------------------------------------------------------------------------------------------ AOT cubins


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, aot.Artifact]:
    out = tmp_path_factory.mktemp("cutedsl_sm100a")
    return {a.name: a for a in aot.build(out, arch="sm_100a")}


@pytest.mark.parametrize("name", [v.name for v in aot.VARIANTS])
def test_kernel_compiles_to_sm100a_cubin(artifacts, name):
    a = artifacts[name]
    cubin = a.cubin.read_bytes()
    assert len(cubin) > 0 and cubin[:4] == b"\x7fELF", f"{a.cubin} is not a non-empty ELF cubin"
    ptx = a.ptx.read_text()
    assert re.search(r"^\.target sm_100a\b", ptx, re.M), "PTX is not for sm_100a"
    assert ".entry kernel_" in ptx


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) is not on PATH")
def test_ptxas_reassembles_every_ptx(artifacts, tmp_path):
    for name, a in artifacts.items():
        out = tmp_path / f"{name}.cubin"
        proc = subprocess.run(
            ["ptxas", "-arch=sm_100a", str(a.ptx), "-o", str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, f"ptxas rejected {a.ptx.name}: {proc.stderr}"
        assert out.stat().st_size > 0


def test_bazel_genrule_lists_every_aot_variant(artifacts):
    build_file = Path(aot.__file__).with_name("BUILD.bazel").read_text()
    listed = re.search(r"_VARIANTS = \[(.*?)\]", build_file, re.S).group(1)
    assert re.findall(r'"(\w+)"', listed) == [v.name for v in aot.VARIANTS]
    out_dir = next(iter(artifacts.values())).cubin.parent
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        f"{v.name}.{ext}" for v in aot.VARIANTS for ext in ("ptx", "cubin")
    ), "the build must leave exactly the genrule's declared outputs"


def test_aot_rejects_unknown_variant_and_arch(tmp_path):
    with pytest.raises(ValueError, match="unknown kernel variant"):
        aot.build(tmp_path, only=["no_such_kernel"])
    with pytest.raises(ValueError, match="arch must be"):
        aot.build(tmp_path, arch="blackwell")


# ------------------------------------------------------------------------------------------------ cuda export


def _export_cases():
    from custom_calls.cutedsl.gemm import fp8_block_linear
    from custom_calls.cutedsl.grouped_gemm import mxfp4_grouped_linear, mxfp4_grouped_swiglu
    from custom_calls.cutedsl.swiglu import swiglu

    bf16, u8 = jnp.bfloat16, jnp.uint8
    return {
        "fp8_block_linear/ue8m0/mxfp8": (
            lambda x, w, s: fp8_block_linear(x, w, s, activation_cast="mxfp8"),
            (S((8, 64), bf16), S((48, 64), jnp.float8_e4m3fn), S((2, 2), jnp.float8_e8m0fnu)),
        ),
        "fp8_block_linear/scale_inv/fp8_token_128": (
            lambda x, w, s: fp8_block_linear(x, w, s, block=(128, 128), activation_cast="fp8_token_128"),
            (S((8, 256), bf16), S((200, 256), u8), S((2, 2), jnp.float32)),
        ),
        "mxfp4_grouped_linear": (
            lambda x, p, s, g: mxfp4_grouped_linear(x, p, s, g, activation_cast="mxfp8"),
            (S((8, 64), bf16), S((3, 16, 32), u8), S((3, 16, 2), u8), S((3,), jnp.int32)),
        ),
        "mxfp4_grouped_swiglu": (
            lambda x, gp, gs, up, us, g: mxfp4_grouped_swiglu(x, gp, gs, up, us, g, limit=7.0),
            (S((8, 64), bf16), *(S((3, 16, 32), u8), S((3, 16, 2), u8)) * 2, S((3,), jnp.int32)),
        ),
        "swiglu": (lambda u: swiglu(u, limit=7.0), (S((2, 4, 64), bf16),)),
    }


@pytest.mark.parametrize("case", list(_export_cases()))
def test_wrapper_exports_for_cuda_as_cutlass_call(case):
    import cutlass.jax

    fn, specs = _export_cases()[case]
    exp = jax.export.export(
        jax.jit(fn), platforms=["cuda"], disabled_checks=cutlass.jax.get_export_disabled_safety_checks()
    )(*specs)
    text = exp.mlir_module()
    assert re.findall(r"custom_call @([\w$.]+)", text) == [CUSTOM_CALL]
    assert exp.platforms == ("cuda",)
    assert len(exp.serialize()) > 0


@pytest.mark.parametrize(
    ("case", "x_dtype", "kernel"),
    [
        ("fp8_block_linear/ue8m0/mxfp8", jnp.bfloat16, "_fp8_tc_kernel"),
        ("fp8_block_linear/ue8m0/mxfp8", jnp.float32, "_fp8_block_gemm_kernel"),
        ("fp8_block_linear/scale_inv/fp8_token_128", jnp.bfloat16, "_fp8_block_gemm_kernel"),
        ("mxfp4_grouped_linear", jnp.bfloat16, "_mxfp4_tc_kernel"),
        ("mxfp4_grouped_swiglu", jnp.bfloat16, "_mxfp4_swiglu_tc_kernel"),
        ("mxfp4_grouped_swiglu", jnp.float32, "_mxfp4_grouped_swiglu_kernel"),
    ],
)
def test_bf16_products_export_the_tcgen05_kernels(case, x_dtype, kernel):
    """bf16 activations with power-of-two scales take the tcgen05 kernels (compiled for sm_100a, not run on
    hardware); float32 activations and V3 scale_inv blocks keep the SIMT kernels. The exported custom call embeds
    the compiled module, which names its kernel."""
    import cutlass.jax

    fn, specs = _export_cases()[case]
    specs = (S(specs[0].shape, x_dtype), *specs[1:])
    text = jax.export.export(
        jax.jit(fn), platforms=["cuda"], disabled_checks=cutlass.jax.get_export_disabled_safety_checks()
    )(*specs).mlir_module()
    counterpart = {
        "_fp8_tc_kernel": "_fp8_block_gemm_kernel",
        "_mxfp4_tc_kernel": "_mxfp4_grouped_gemm_kernel",
        "_mxfp4_swiglu_tc_kernel": "_mxfp4_grouped_swiglu_kernel",
    }
    counterpart.update({v: k for k, v in counterpart.items()})
    assert kernel in text and counterpart[kernel] not in text


def test_work_slots_partition_the_grouped_rows():
    from custom_calls.cutedsl._common import work_slots

    rng = np.random.default_rng(7)
    for sizes, rows, tile in (([5, 0, 70, 1, 60], 140, 64), ([0, 0, 3], 3, 16), ([16, 16], 40, 16)):
        slots = np.asarray(work_slots(jnp.asarray(sizes, jnp.int32), rows, tile))
        assert slots.shape == (-(-rows // tile) + len(sizes) - 1, 4)
        owner = np.full(rows, -1)
        for e, row0, lo, hi in slots:
            assert row0 % tile == 0 and (lo >= hi or (row0 <= lo < hi <= row0 + tile))
            for r in range(lo, hi):
                assert owner[r] == -1  # each live row belongs to one slot
                owner[r] = e
        want = np.concatenate([np.full(n, e) for e, n in enumerate(sizes)] + [np.full(rows - sum(sizes), -1)])
        np.testing.assert_array_equal(owner, want)  # ... and to the slot of its own expert
    del rng


# ------------------------------------------------------------------------------------------------ CPU paths


def test_fp8_block_linear_cpu_path_matches_numpy(rng):
    from custom_calls.cutedsl.gemm import fp8_block_linear

    for scale_inv in (False, True):
        x, codes, scale = _fp8_inputs(rng, scale_inv=scale_inv)
        block = (128, 128) if scale_inv else (32, 32)
        want = x.astype(np.float64) @ _fp8_weight(codes, scale, block).T.astype(np.float64)
        w_q = codes.view(ml_dtypes.float8_e4m3fn) if scale_inv else codes
        s = scale if scale_inv else scale.view(ml_dtypes.float8_e8m0fnu)
        got = jax.jit(lambda x, w, s, b=block: fp8_block_linear(x, w, s, block=b, out_dtype=jnp.float32))(
            x, w_q, s
        )
        # float32 accumulation of 96 products of magnitude <~ 10 against a float64 sum: a few ulp of the sum.
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_mxfp4_grouped_cpu_paths_match_numpy(rng):
    from custom_calls.cutedsl.grouped_gemm import mxfp4_grouped_linear, mxfp4_grouped_swiglu

    x, packed, scale = _mxfp4_inputs(rng)
    _, up_packed, up_scale = _mxfp4_inputs(rng)
    w, w_up = _mxfp4_weight(packed, scale), _mxfp4_weight(up_packed, up_scale)
    want = _grouped(x, w, SIZES)
    got = jax.jit(lambda *a: mxfp4_grouped_linear(*a, out_dtype=jnp.float32))(x, packed, scale, SIZES)
    # float32 sums of 64 products of magnitude <~ 50 against float64: relative ~1e-6; padding rows exactly 0.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)
    assert not np.asarray(got)[SIZES.sum() :].any()

    want_act = _swiglu(want, _grouped(x, w_up, SIZES), 7.0)
    got_act = jax.jit(lambda *a: mxfp4_grouped_swiglu(*a, limit=7.0, out_dtype=jnp.float32))(
        x, packed, scale, up_packed, up_scale, SIZES
    )
    np.testing.assert_allclose(np.asarray(got_act), want_act, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("limit", [None, 7.0])
def test_swiglu_cpu_path_matches_numpy(rng, limit):
    from custom_calls.cutedsl.swiglu import swiglu

    u = (rng.standard_normal((2, 3, 40)) * 6).astype(np.float32)  # beyond the clamp on both sides
    got = jax.jit(lambda u: swiglu(u, limit=limit))(u)
    want = _swiglu(u[..., :20], u[..., 20:], limit)
    assert got.shape == (2, 3, 20) and got.dtype == jnp.float32
    # float32 sigmoid/exp against float64: a few ulp.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_wrapper_cpu_paths_equal_the_op_references(rng):
    """Same signature, and on the CPU (where no kernel runs) the same numbers as the ops' reference implementations."""
    from custom_calls.cutedsl import gemm, grouped_gemm, swiglu

    x, codes, scale = _fp8_inputs(rng)
    xg, packed, pscale = _mxfp4_inputs(rng)
    u = jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16)

    def run_all(fns: dict) -> list:
        # One jitted program per side keeps this to two compilations.
        outs = [fns["fp8_block_linear"](x, codes, scale, activation_cast=c) for c in GEMM_CASTS]
        outs += [
            fns["mxfp4_grouped_linear"](xg, packed, pscale, SIZES, activation_cast=c, out_dtype=jnp.float32)
            for c in ("none", "mxfp8")
        ]
        outs.append(
            fns["mxfp4_grouped_swiglu"](
                xg, packed, pscale, packed, pscale, SIZES, limit=5.0, out_dtype=jnp.float32
            )
        )
        outs.append(fns["swiglu"](u, limit=3.0))
        return outs

    ours = {
        "fp8_block_linear": gemm.fp8_block_linear,
        "mxfp4_grouped_linear": grouped_gemm.mxfp4_grouped_linear,
        "mxfp4_grouped_swiglu": grouped_gemm.mxfp4_grouped_swiglu,
        "swiglu": swiglu.swiglu,
    }
    assert set(ours) == set(cutedsl.IMPLEMENTATIONS)
    refs = {name: ops.select(name, backend="reference").fn for name in ours}
    got = jax.jit(lambda: run_all(ours))()
    want = jax.jit(lambda: run_all(refs))()
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        # The CPU paths run the same numerics functions as the references: equal up to XLA's fusion choices.
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_refused_with_the_field_named(rng):
    from custom_calls.cutedsl.gemm import fp8_block_linear
    from custom_calls.cutedsl.grouped_gemm import mxfp4_grouped_linear
    from custom_calls.cutedsl.swiglu import swiglu

    x, codes, scale = _fp8_inputs(rng)
    with pytest.raises(ValueError, match=r"scale must have shape \(3, 3\)"):
        fp8_block_linear(x, codes, scale[:2])
    with pytest.raises(ValueError, match="activation_cast = 'fp4'"):
        fp8_block_linear(x, codes, scale, activation_cast="fp4")
    with pytest.raises(ValueError, match="block must be a pair"):
        fp8_block_linear(x, codes, scale, block=(32, 0))
    with pytest.raises(TypeError, match="w_q must be float8_e4m3fn"):
        fp8_block_linear(x, codes.astype(np.float32), scale)
    xg, packed, pscale = _mxfp4_inputs(rng)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(4,\)"):
        mxfp4_grouped_linear(xg, packed, pscale, SIZES[:3])
    with pytest.raises(ValueError, match="activation_cast = 'fp8_token_128'"):
        mxfp4_grouped_linear(xg, packed, pscale, SIZES, activation_cast="fp8_token_128")
    with pytest.raises(ValueError, match="limit must be finite and > 0"):
        swiglu(np.ones((2, 4), np.float32), limit=-1.0)
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(np.ones((2, 5), np.float32), limit=None)


# ------------------------------------------------------------------------------------------------ registry wiring


@pytest.fixture
def private_registry(monkeypatch) -> OpRegistry:
    """A registry with the real ops (their references) and nothing else; the target arch unset."""
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(cutedsl, "_configured_arch", None)
    reg = OpRegistry()
    for name in cutedsl.IMPLEMENTATIONS:
        reg.register_op(name, ops.select(name, backend="reference").fn, doc=ops.default_registry.doc(name))
    return reg


def test_register_adds_lazy_gpu_impls_once(private_registry):
    assert cutedsl.register(private_registry) == list(cutedsl.IMPLEMENTATIONS)
    assert cutedsl.register(private_registry) == []  # idempotent
    for name in cutedsl.IMPLEMENTATIONS:
        assert "cutedsl_sm100" in private_registry.backends_for(name)
        assert private_registry.describe_rows(platform="gpu")  # probes run without raising


def test_selection_falls_back_unless_sm100_gpu_is_configured(private_registry, monkeypatch, caplog):
    from custom_calls.cutedsl import grouped_gemm

    cutedsl.register(private_registry)
    name = "mxfp4_grouped_linear"
    caplog.set_level(logging.WARNING, logger="absl")
    sel = private_registry.select(name, backend="cutedsl_sm100", platform="gpu")
    assert sel.fell_back and "CuteDSL SM100 kernels need" in sel.reason  # no arch configured
    logged = [r.getMessage() for r in caplog.records if r.name == "absl"]
    assert any("'cutedsl_sm100' cannot run on gpu" in m and "using the reference" in m for m in logged)
    assert private_registry.select(name, platform="cpu").backend == "reference"

    cutedsl.configure("sm_90a")  # Hopper: not this backend's target
    monkeypatch.setattr(cutedsl, "_current_platform", lambda: "gpu")
    assert not cutedsl.available()
    assert private_registry.select(name, backend="cutedsl_sm100", platform="gpu").fell_back

    cutedsl.configure("sm_100a")
    sel = private_registry.select(name, backend="cutedsl_sm100", platform="gpu", strict=True)
    assert sel.backend == "cutedsl_sm100" and sel.fn is grouped_gemm.mxfp4_grouped_linear
    assert private_registry.select(name, platform="gpu").backend == "cutedsl_sm100"  # auto prefers it

    monkeypatch.setattr(cutedsl, "_current_platform", lambda: "cpu")
    assert not cutedsl.available()  # configured, but this process computes on the CPU


def test_target_arch_follows_env_unless_configured(monkeypatch):
    monkeypatch.setattr(cutedsl, "_configured_arch", None)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert cutedsl.target_arch() == "sm_100a"
    assert cutedsl.available(platform="gpu") and not cutedsl.available(platform="cpu")
    cutedsl.configure("sm_120a")
    assert cutedsl.target_arch() == "sm_120a" and not cutedsl.available(platform="gpu")
    with pytest.raises(ValueError, match="arch must be a CUDA architecture name"):
        cutedsl.configure("b200")
    with pytest.raises(TypeError, match="arch must be a str"):
        cutedsl.configure(100)
