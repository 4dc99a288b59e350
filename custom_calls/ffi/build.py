"""Build the XLA FFI libraries of this folder with the system compilers (no Bazel needed).

* CPU: ``g++ -O2 -std=c++17 -shared -fPIC -isystem <jax ffi headers> dequant.cc -o build/libdeepinfer_dequant.so``
* CUDA (optional, needs ``nvcc``): the same handlers for ``sm_90a`` and ``sm_100a`` in
  ``build/libdeepinfer_dequant_cuda.so``.

The outputs go to ``custom_calls/ffi/build/`` (git-ignored) unless ``out_dir`` says otherwise. A library is
rebuilt only when it is missing or older than one of its sources, under a file lock and with an atomic rename,
so concurrent test workers never load a half-written file. Run it directly to build::

    python -m custom_calls.ffi.build [--cuda] [--out_dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock

__all__ = [
    "CPU_LIBRARY",
    "CUDA_ARCHS",
    "CUDA_LIBRARY",
    "DEFAULT_BUILD_DIR",
    "HERE",
    "build_cpu",
    "build_cuda",
    "cpu_command",
    "cuda_command",
    "ffi_include_dir",
    "main",
]

HERE = Path(__file__).resolve().parent
DEFAULT_BUILD_DIR = HERE / "build"
CPU_LIBRARY = "libdeepinfer_dequant.so"
CUDA_LIBRARY = "libdeepinfer_dequant_cuda.so"
#: Architectures of the CUDA build: Hopper and Blackwell, with their architecture-specific ("a") features.
CUDA_ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")

_CPU_SOURCES = ("dequant.cc", "dequant.h")
_CUDA_SOURCES = ("dequant_cuda.cu", "dequant.h")


def ffi_include_dir() -> str:
    """The folder of ``xla/ffi/api/ffi.h`` shipped with jaxlib."""
    import jax

    return jax.ffi.include_dir()


def cpu_command(output: Path, compiler: str = "g++") -> list[str]:
    """The compiler command that builds the CPU library at ``output``."""
    return [
        compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-isystem",
        ffi_include_dir(),
        str(HERE / "dequant.cc"),
        "-o",
        str(output),
    ]


def cuda_command(output: Path, archs: Sequence[str] = CUDA_ARCHS, compiler: str = "nvcc") -> list[str]:
    """The ``nvcc`` command that builds the CUDA library at ``output`` for ``archs`` (e.g. ``sm_100a``)."""
    cmd = [compiler, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-isystem", ffi_include_dir()]
    for arch in archs:
        if not isinstance(arch, str) or not arch.startswith("sm_"):
            raise ValueError(f"archs must hold CUDA architecture names such as 'sm_100a', got {arch!r}")
        cmd += ["-gencode", f"arch=compute_{arch[3:]},code={arch}"]
    return [*cmd, str(HERE / "dequant_cuda.cu"), "-o", str(output)]


def _up_to_date(output: Path, sources: Sequence[str]) -> bool:
    if not output.is_file() or output.stat().st_size == 0:
        return False
    built = output.stat().st_mtime
    return all((HERE / s).stat().st_mtime <= built for s in sources)


def _build(output: Path, sources: Sequence[str], command: list[str], compiler: str, force: bool) -> Path:
    if shutil.which(compiler) is None:
        raise FileNotFoundError(
            f"compiler {compiler!r} not found on PATH; it is needed to build {output.name}"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(output) + ".lock"):
        if not force and _up_to_date(output, sources):
            return output
        fd, tmp = tempfile.mkstemp(prefix=output.name + ".", suffix=".tmp", dir=output.parent)
        os.close(fd)
        try:
            cmd = [*command[:-1], tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"building {output.name} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}"
                )
            os.replace(tmp, output)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return output


def build_cpu(
    out_dir: str | os.PathLike[str] | None = None, *, force: bool = False, compiler: str = "g++"
) -> Path:
    """Build (if needed) the CPU FFI library; returns its path. Raises ``FileNotFoundError`` without ``g++``."""
    output = Path(out_dir or DEFAULT_BUILD_DIR).resolve() / CPU_LIBRARY
    return _build(output, _CPU_SOURCES, cpu_command(output, compiler), compiler, force)


def build_cuda(
    out_dir: str | os.PathLike[str] | None = None,
    *,
    archs: Sequence[str] = CUDA_ARCHS,
    force: bool = False,
    compiler: str = "nvcc",
) -> Path:
    """Build (if needed) the CUDA FFI library for ``archs``; returns its path. Raises without ``nvcc``."""
    output = Path(out_dir or DEFAULT_BUILD_DIR).resolve() / CUDA_LIBRARY
    return _build(output, _CUDA_SOURCES, cuda_command(output, archs, compiler), compiler, force)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the deepinfer XLA FFI libraries.")
    parser.add_argument("--out_dir", default=None, help=f"output folder (default {DEFAULT_BUILD_DIR})")
    parser.add_argument("--cuda", action="store_true", help="also build the CUDA library (needs nvcc)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    print(build_cpu(args.out_dir, force=args.force))
    if args.cuda:
        print(build_cuda(args.out_dir, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
