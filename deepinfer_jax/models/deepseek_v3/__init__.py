"""DeepSeek-V3: MLA attention, DeepSeekMoE and multi-token prediction, as pure functions over a params pytree.

* :mod:`.weights` -- the checkpoint contract (:func:`expected_tensors`), load-time assembly
  (:func:`assemble_params`) and random parameters (:func:`init_params`);
* :mod:`.model` -- :func:`forward_logits` (no cache), :func:`init_cache` / :func:`forward` (absorbed MLA over a
  contiguous latent cache) and :func:`mtp_forward` (the MTP draft head);
* :mod:`.attention` -- MLA in naive and absorbed form (op ``"mla_attention"``);
* :mod:`.paged` -- the engine's view: the decoder layers over a flat ragged batch and the paged latent cache;
* :mod:`.family` -- the :class:`~deepinfer_jax.models.registry.ModelFamily` record;
* :mod:`.synthetic` -- deterministic random checkpoints (NumPy only; imported by the built-in models without JAX).

The model modules import JAX; this package ``__init__`` does not, so ``synthetic`` stays cheap to import.
"""
