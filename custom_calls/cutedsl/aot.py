"""Ahead-of-time build of the CuteDSL kernels to PTX and cubins, without a GPU.

CuteDSL compiles for the architecture named by ``CUTE_DSL_ARCH`` and, with ``CUTE_DSL_KEEP=ptx,cubin``, writes the
PTX and the cubin of every compiled function into ``CUTE_DSL_DUMP_DIR``. Tensors are "fake" (a dtype and a
shape, no memory), and every extent is a dynamic ``int32`` symbol, so one cubin per kernel variant serves every
shape. This is how CI proves that the kernels compile for ``sm_100a`` on a machine without a GPU, and what the
Bazel ``genrule`` of ``custom_calls/cutedsl/BUILD.bazel`` runs::

    python -m custom_calls.cutedsl.aot --out_dir DIR [--arch sm_100a] [--only NAME ...]

The settings are environment variables that CuteDSL reads while compiling, so the build runs in a fresh process
(:func:`build` starts one) rather than changing the environment of a process that may be running JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["VARIANTS", "Artifact", "build", "compile_variants", "main"]

DEFAULT_ARCH = "sm_100a"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: the ``@cute.jit`` launcher, its tensor arguments and constants."""

    name: str
    module: str
    launcher: str
    # (dtype name in cutlass, rank) per tensor argument; every extent is a dynamic symbol.
    tensors: tuple[tuple[str, int], ...]
    constants: tuple[tuple[str, Any], ...] = ()


#: The kernel variants built ahead of time: the formats of the V4/V4.1 and V3 checkpoints.
VARIANTS: tuple[Variant, ...] = (
    Variant(
        "fp8_block_gemm_ue8m0",
        "custom_calls.cutedsl.gemm",
        "fp8_block_gemm",
        (("BFloat16", 2), ("Uint8", 2), ("Uint8", 2), ("BFloat16", 2)),
        (("block_rows", 32), ("block_cols", 32), ("ue8m0", True)),
    ),
    Variant(
        "fp8_block_gemm_scale_inv",
        "custom_calls.cutedsl.gemm",
        "fp8_block_gemm",
        (("BFloat16", 2), ("Uint8", 2), ("Float32", 2), ("BFloat16", 2)),
        (("block_rows", 128), ("block_cols", 128), ("ue8m0", False)),
    ),
    Variant(
        "mxfp4_grouped_gemm",
        "custom_calls.cutedsl.grouped_gemm",
        "mxfp4_grouped_gemm",
        (("BFloat16", 2), ("Uint8", 3), ("Uint8", 3), ("Int32", 1), ("BFloat16", 2)),
    ),
    Variant(
        "mxfp4_grouped_swiglu",
        "custom_calls.cutedsl.grouped_gemm",
        "mxfp4_grouped_swiglu_gemm",
        (
            ("BFloat16", 2),
            ("Uint8", 3),
            ("Uint8", 3),
            ("Uint8", 3),
            ("Uint8", 3),
            ("Int32", 1),
            ("BFloat16", 2),
        ),
        (("limit", 10.0),),
    ),
    # tcgen05 tensor-core kernels (tc_gemm.py): bf16 activations, UE8M0 scales; the token tile bn is the MMA's N
    Variant(
        "fp8_block_gemm_tc_bn16",
        "custom_calls.cutedsl.tc_gemm",
        "fp8_block_gemm_tc",
        (("BFloat16", 2), ("Uint8", 2), ("Uint8", 2), ("BFloat16", 2)),
        (("bn", 16), ("block_rows", 32), ("block_cols", 32)),
    ),
    Variant(
        "fp8_block_gemm_tc_bn64",
        "custom_calls.cutedsl.tc_gemm",
        "fp8_block_gemm_tc",
        (("BFloat16", 2), ("Uint8", 2), ("Uint8", 2), ("BFloat16", 2)),
        (("bn", 64), ("block_rows", 32), ("block_cols", 32)),
    ),
    Variant(
        "mxfp4_grouped_gemm_tc_bn64",
        "custom_calls.cutedsl.tc_gemm",
        "mxfp4_grouped_gemm_tc",
        (("BFloat16", 2), ("Uint8", 3), ("Uint8", 3), ("Int32", 2), ("BFloat16", 2)),
        (("bn", 64),),
    ),
    Variant(
        "mxfp4_grouped_swiglu_tc_bn64",
        "custom_calls.cutedsl.tc_gemm",
        "mxfp4_grouped_swiglu_gemm_tc",
        (
            ("BFloat16", 2),
            ("Uint8", 3),
            ("Uint8", 3),
            ("Uint8", 3),
            ("Uint8", 3),
            ("Int32", 2),
            ("BFloat16", 2),
        ),
        (("bn", 64), ("limit", 10.0)),
    ),
    Variant(
        "swiglu_clamped",
        "custom_calls.cutedsl.swiglu",
        "swiglu_kernel_launch",
        (("BFloat16", 2), ("BFloat16", 2)),
        (("limit", 10.0),),
    ),
    Variant(
        "swiglu",
        "custom_calls.cutedsl.swiglu",
        "swiglu_kernel_launch",
        (("BFloat16", 2), ("BFloat16", 2)),
        (("limit", None),),
    ),
)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """The files one variant compiled to."""

    name: str
    ptx: Path
    cubin: Path


def _variant_names() -> list[str]:
    return [v.name for v in VARIANTS]


def _select(only: Sequence[str] | None) -> list[Variant]:
    if not only:
        return list(VARIANTS)
    unknown = sorted(set(only) - set(_variant_names()))
    if unknown:
        raise ValueError(f"only: unknown kernel variant(s) {unknown}; known: {_variant_names()}")
    return [v for v in VARIANTS if v.name in only]


def compile_variants(out_dir: Path, only: Sequence[str] | None = None) -> list[Artifact]:
    """Compile the variants in this process; ``CUTE_DSL_ARCH``, ``CUTE_DSL_KEEP=ptx,cubin`` and
    ``CUTE_DSL_DUMP_DIR`` must already be set (:func:`main` sets them).

    CuteDSL names its files after the function and its argument types; the files each compilation adds to the
    dump folder are renamed to ``out_dir/<variant>.ptx`` and ``out_dir/<variant>.cubin``.
    """
    import importlib

    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.cute.typing import sym_int32

    dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    artifacts = []
    for v in _select(only):
        launcher: Callable[..., Any] = getattr(importlib.import_module(v.module), v.launcher)
        tensors = [
            make_fake_compact_tensor(getattr(cutlass, dtype), tuple(sym_int32() for _ in range(rank)))
            for dtype, rank in v.tensors
        ]
        before = set(dump.iterdir())
        cute.compile(launcher, cuda.CUstream(0), *tensors, **dict(v.constants))
        new = sorted(set(dump.iterdir()) - before)
        paths = {}
        for suffix in ("ptx", "cubin"):
            files = [f for f in new if f.name.endswith(f".{suffix}")]
            if len(files) != 1:
                raise RuntimeError(
                    f"kernel {v.name}: expected one new .{suffix} file in {dump}, found {[f.name for f in files]}"
                )
            paths[suffix] = files[0].replace(out_dir / f"{v.name}.{suffix}")
        artifacts.append(Artifact(v.name, paths["ptx"], paths["cubin"]))
    return artifacts


def build(
    out_dir: str | os.PathLike[str],
    *,
    arch: str = DEFAULT_ARCH,
    only: Sequence[str] | None = None,
    timeout: float = 600,
) -> list[Artifact]:
    """Compile the kernels for ``arch`` into ``out_dir`` in a fresh Python process; returns the artefacts."""
    if not isinstance(arch, str) or not arch.startswith("sm_"):
        raise ValueError(f"arch must be a CUDA architecture name such as 'sm_100a', got {arch!r}")
    selected = _select(only)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    repo_root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "custom_calls.cutedsl.aot", "--out_dir", str(out), "--arch", arch]
    for v in selected:
        cmd += ["--only", v.name]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"CuteDSL build for {arch} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return [Artifact(v.name, out / f"{v.name}.ptx", out / f"{v.name}.cubin") for v in selected]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", required=True, help="folder for <variant>.ptx and <variant>.cubin")
    parser.add_argument("--arch", default=DEFAULT_ARCH, help="CuteDSL target architecture (default sm_100a)")
    parser.add_argument("--only", action="append", help="build only this variant (repeatable)")
    args = parser.parse_args(argv)
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ["CUTE_DSL_ARCH"] = args.arch
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    dump = out / ".cute_dsl_dump"
    dump.mkdir(exist_ok=True)  # CuteDSL writes into the folder but does not create it
    os.environ["CUTE_DSL_DUMP_DIR"] = str(dump)
    for a in compile_variants(out, args.only):
        print(
            f"{a.name}: {a.ptx.name} ({a.ptx.stat().st_size} B), {a.cubin.name} ({a.cubin.stat().st_size} B)"
        )
    if not any(dump.iterdir()):
        dump.rmdir()  # leave only the declared outputs (a Bazel genrule checks them)
    return 0


if __name__ == "__main__":
    sys.exit(main())
