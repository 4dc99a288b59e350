"""Ascend lowering backend: the ``ascend`` platform name and per-op lowerings to named custom calls.

:mod:`custom_calls.ascend.platform` registers the platform (a lowering target; there is no Ascend runtime for
JAX), :mod:`custom_calls.ascend.lowerings` defines the ops. The op registry imports the lowerings lazily, as the
``ascend`` implementations of ``fp8_block_linear``, ``mxfp4_grouped_linear``, ``mxfp4_grouped_swiglu`` and
``swiglu``; see ``docs/backends.md``.
"""
