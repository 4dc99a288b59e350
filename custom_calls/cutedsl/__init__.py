"""CuteDSL kernels for NVIDIA SM100 (Blackwell), called from JAX through ``cutlass.jax.cutlass_call``.

The weight-side hot ops have a CuteDSL version here, each in its own module and each with the signature of the
op it implements (``deepinfer_jax/ops``):

* :mod:`.gemm` -- ``"fp8_block_linear"``: FP8 E4M3 weights with block scales, dequantised inside the kernel;
* :mod:`.grouped_gemm` -- ``"mxfp4_grouped_linear"``: MXFP4 experts over rows sorted by expert, and
  ``"mxfp4_grouped_swiglu"``: the first expert GEMM pair fused with the SwiGLU;
* :mod:`.swiglu` -- ``"swiglu"``: the clamped SwiGLU of model.md §5.4;
* :mod:`.tc_gemm` -- the tcgen05 / TMEM tensor-core versions of the GEMMs above, which the wrappers use for bf16
  activations with power-of-two weight scales (**compiled for sm_100a, not run on hardware**).

This package module stays light on purpose: it imports neither JAX nor CuteDSL, so the op registry can ask
:func:`available` on every machine (a CPU CI runner, a Hopper box) at the cost of a dictionary lookup. The kernel
modules are only imported when the registry selects them (lazy ``"module:attr"`` targets, see
:data:`IMPLEMENTATIONS`), and each keeps a CPU path, so a jitted model that selected a CuteDSL op still compiles
for the host.

**Which GPU.** The kernels are compiled for the architecture CuteDSL itself targets, ``CUTE_DSL_ARCH`` (the
compile-time setting of the DSL, also honoured by the ahead-of-time build in :mod:`.aot`), or the architecture
given to :func:`configure`. Selection never looks at the devices: an SM count or compute capability read while
tracing would describe the tracing machine, which is not necessarily the one that runs an exported program.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "BACKEND",
    "IMPLEMENTATIONS",
    "SM100_ARCHS",
    "UNAVAILABLE_REASON",
    "available",
    "configure",
    "register",
    "target_arch",
    "toolchain_available",
]

#: The op-registry backend name these kernels register under.
BACKEND = "cutedsl_sm100"

#: CuteDSL architecture names of the SM100 family the kernels are built and selected for.
SM100_ARCHS: tuple[str, ...] = ("sm_100a", "sm_100f", "sm_103a", "sm_103f")

#: Op name -> lazy ``"module:attribute"`` target of its CuteDSL implementation.
IMPLEMENTATIONS: dict[str, str] = {
    "fp8_block_linear": "custom_calls.cutedsl.gemm:fp8_block_linear",
    "mxfp4_grouped_linear": "custom_calls.cutedsl.grouped_gemm:mxfp4_grouped_linear",
    "mxfp4_grouped_swiglu": "custom_calls.cutedsl.grouped_gemm:mxfp4_grouped_swiglu",
    "swiglu": "custom_calls.cutedsl.swiglu:swiglu",
}

#: The fallback reason the registry logs when :func:`available` is false.
UNAVAILABLE_REASON = (
    "CuteDSL SM100 kernels need the nvidia-cutlass-dsl package with its JAX extension, the 'gpu' platform, "
    f"and a configured target architecture in {SM100_ARCHS} (CUTE_DSL_ARCH or custom_calls.cutedsl.configure)"
)

_ARCH_ENV = "CUTE_DSL_ARCH"
_configured_arch: str | None = None


def configure(arch: str | None) -> None:
    """Set the GPU architecture the kernels are selected for (``None``: follow ``CUTE_DSL_ARCH`` again).

    An engine that knows its deployment target (from its config) calls this once; the value also becomes the
    default compile target of :mod:`.aot`.
    """
    global _configured_arch
    if arch is not None and not isinstance(arch, str):
        raise TypeError(f"arch must be a str such as 'sm_100a' or None, got {type(arch).__name__} {arch!r}")
    if arch is not None and not arch.startswith("sm_"):
        raise ValueError(f"arch must be a CUDA architecture name such as 'sm_100a', got {arch!r}")
    _configured_arch = arch


def target_arch() -> str | None:
    """The configured target architecture: :func:`configure`'s value, else ``CUTE_DSL_ARCH``, else ``None``."""
    return _configured_arch if _configured_arch is not None else (os.environ.get(_ARCH_ENV) or None)


def toolchain_available() -> bool:
    """True when ``cutlass`` (nvidia-cutlass-dsl) is installed; checked without importing it."""
    try:
        return importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False


def _current_platform() -> str:
    import jax  # deferred: keeps this module importable (and cheap) without initialising JAX

    return jax.default_backend()


def available(platform: str | None = None) -> bool:
    """True when the CuteDSL kernels can run: toolchain installed, GPU platform, SM100 target configured.

    ``platform`` defaults to ``jax.default_backend()``; it is the platform name, never a device property.
    """
    if target_arch() not in SM100_ARCHS or not toolchain_available():
        return False
    plat = _current_platform() if platform is None else platform
    return plat in ("gpu", "cuda")


class _Registry(Protocol):
    def register_impl(
        self,
        op_name: str,
        backend: str,
        fn: Callable[..., Any] | str,
        *,
        platforms: tuple[str, ...],
        available: Callable[[], bool] | None,
        reason: str | None,
    ) -> None: ...

    def list_ops(self) -> list[str]: ...

    def backends_for(self, name: str) -> list[str]: ...


def register(registry: _Registry) -> list[str]:
    """Register the CuteDSL implementations in ``registry`` for every op of :data:`IMPLEMENTATIONS` it defines.

    The registry is passed in (``deepinfer_jax.ops.default_registry`` in the engine) rather than imported, so
    this package depends on nothing above ``numerics``. Ops the registry does not define, and ops that already
    have a CuteDSL implementation (a second call), are skipped; the names registered are returned.
    """
    known = set(registry.list_ops())
    done = []
    for op_name, target in IMPLEMENTATIONS.items():
        if op_name not in known or BACKEND in registry.backends_for(op_name):
            continue
        registry.register_impl(
            op_name,
            BACKEND,
            target,
            platforms=("gpu",),
            available=available,
            reason=UNAVAILABLE_REASON,
        )
        done.append(op_name)
    return done
