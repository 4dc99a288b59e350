"""DeepSeek-V4 (and the parts V4.1 shares): mHC, compressed sparse attention, hash / sqrtsoftplus MoE.

Modules: :mod:`.mhc` (hyper-connections), :mod:`.attention` (shared K=V head, sinks, grouped output
projection), :mod:`.compressor` (CSA/HCA compressors, lightning indexer), :mod:`.model` (the forward and its
incremental state), :mod:`.params` (checkpoint contract), :mod:`.family` (registry entry), :mod:`.synthetic`
(random checkpoints), and the engine's views of V4 and V4.1 over paged caches and state slots (:mod:`.paged`,
:mod:`.paged_v41`). Nothing is imported here, so ``synthetic`` stays usable without JAX model code.
"""
