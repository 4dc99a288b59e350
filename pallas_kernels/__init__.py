"""Pallas GPU kernels (Triton lowering), one module per kernel, each the ``pallas_gpu`` twin of a reference op.

| module | op |
|---|---|
| :mod:`pallas_kernels.fp8_block_linear` | ``fp8_block_linear`` |
| :mod:`pallas_kernels.mxfp4_grouped_linear` | ``mxfp4_grouped_linear``, ``mxfp4_grouped_swiglu`` |
| :mod:`pallas_kernels.swiglu` | ``swiglu`` |
| :mod:`pallas_kernels.paged_mla` | ``paged_mla_attention`` (float and FP8 latent caches) |
| :mod:`pallas_kernels.sparse_attention` | ``v4_sparse_attention``, ``v4_sink_attention`` |
| :mod:`pallas_kernels.indexer` | ``v4_indexer_topk``, ``v4_indexer_scores`` |
| :mod:`pallas_kernels.kv_records` | ``kv_store_records`` (and the record decoder as a kernel) |
| :mod:`pallas_kernels.compress_store` | ``v4_compress_store`` |
| :mod:`pallas_kernels.mhc` | ``mhc_sinkhorn`` |
| :mod:`pallas_kernels.sampler` | ``sample`` (the token: ``sample_tokens``; ``deepinfer_jax/sampling/fused.py`` reports around it) |

The op registry imports these modules lazily (``"pallas_kernels.<module>:<function>"``), only when the
``pallas_gpu`` backend is selected on a GPU; they import nothing but JAX and :mod:`deepinfer_jax.numerics` (the
sampler also the sampling stage functions it must compute exactly like the reference).
Every wrapper takes ``interpret=True`` to run its kernel with the Pallas interpreter (CPU tests), and
:func:`pallas_kernels._common.export_for_cuda` lowers any of them for CUDA without a GPU.
"""
