"""Shared helpers of the Pallas kernel tests: the CUDA export check."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture(scope="session")
def triton_calls():
    """``fn, *shape structs`` -> the number of Triton custom calls in ``fn`` exported for CUDA."""
    from pallas_kernels._common import TRITON_CUSTOM_CALL, export_for_cuda

    def count(fn, *specs):
        with warnings.catch_warnings():
            # jax deprecates its Triton backend in favour of Mosaic GPU (docs/backends.md says why we use it)
            warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated", DeprecationWarning)
            exported = export_for_cuda(fn, *specs)
        assert exported.platforms == ("cuda",)
        return exported.mlir_module().count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}")

    return count
