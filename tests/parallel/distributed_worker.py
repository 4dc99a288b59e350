"""One process of the 2-process x 4-CPU-device run of ``test_par_distributed.py`` (started by that test).

Usage: ``python distributed_worker.py PROCESS_ID PORT OUT_DIR IDS_NPY``. Joins the distributed system, lays
tiny-v3 out on a ``dp=2, ep=4`` mesh over the 8 global devices, runs the family's forward and writes this
process's copy of the (replicated) logits to ``OUT_DIR/logits_{PROCESS_ID}.npy``.
"""

from __future__ import annotations

import os
import sys

# Before jax is imported: four CPU devices per process, no accelerator.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"


def main(process_id: int, port: int, out_dir: str, ids_path: str) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from deepinfer_jax.checkpoint.model_loading import load_model
    from deepinfer_jax.config.tree import ParallelConfig
    from deepinfer_jax.parallel import distributed, mesh_from_config, place_on_mesh, shard_model_params

    cfg = ParallelConfig(
        data_parallel_size=2,
        expert_parallel_size=4,
        coordinator_address=f"localhost:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout_s=60,
    )
    assert distributed.initialize(cfg) is True
    assert distributed.initialize(cfg) is True  # idempotent
    assert (jax.process_count(), jax.process_index()) == (2, process_id)
    assert (jax.device_count(), jax.local_device_count()) == (8, 4)

    mesh = mesh_from_config(cfg)
    model = load_model("tiny-v3")
    params = shard_model_params(model.params, model.family.logical_axes(model.params), mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    ids = place_on_mesh(np.load(ids_path), replicated)
    forward = jax.jit(model.family.forward_logits, static_argnums=1, out_shardings=replicated)
    logits = forward(params, model.config, ids)
    np.save(os.path.join(out_dir, f"logits_{process_id}.npy"), np.asarray(logits.addressable_data(0)))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
