"""One process of the 2-process x 4-CPU-device engine run of ``test_engine_mesh.py`` (started by that test).

Usage: ``python mesh_worker.py PROCESS_ID PORT DP EP EXTRA PROMPTS_JSON OUT_JSON``. Builds ``LLM("tiny-v3")`` on a
``(dp, ep)`` mesh over the 8 devices of both processes (the ``parallel.*`` settings make the ``LLM`` join the
distributed system), with ``EXTRA`` redundant expert slots and EPLB re-placing the experts every other step,
generates greedily for the prompts and writes as JSON this process's outputs, re-placement count, final
placements and which routed experts of layer 1 it read from the checkpoint.
"""

from __future__ import annotations

import json
import os
import sys

# Before jax is imported: four CPU devices per process, no accelerator.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"


def main(process_id: int, port: int, dp: int, ep: int, extra: int, prompts_path: str, out_path: str) -> None:
    import numpy as np

    from deepinfer_jax.checkpoint import reader as reader_mod
    from deepinfer_jax.checkpoint.deferred import is_expert_tensor
    from deepinfer_jax.engine.llm import LLM

    read = reader_mod.SafetensorsReader.read
    experts_read: dict[str, set[int]] = {}

    def recording(self, name):  # which expert of which layer-1 tensor this process reads
        if is_expert_tensor(name) and ".layers.1." in f".{name}":
            rest = name.split(".experts.", 1)[1]
            index, kind = rest.split(".", 1)
            experts_read.setdefault(kind, set()).add(int(index))
        return read(self, name)

    reader_mod.SafetensorsReader.read = recording
    from deepinfer_jax.engine.params import SamplingParams

    with open(prompts_path) as f:
        prompts = json.load(f)
    llm = LLM(
        "tiny-v3",
        dtype="float32",
        data_parallel_size=dp,
        expert_parallel_size=ep,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        kv_cache_memory="8MiB",
        **{
            "cache.block_size": 16,
            "parallel.coordinator_address": f"localhost:{port}",
            "parallel.num_processes": 2,
            "parallel.process_id": process_id,
            "parallel.initialization_timeout_s": 120.0,
            "parallel.eplb_interval_steps": 2,
            "parallel.eplb_window_steps": 2,
            "parallel.eplb_num_redundant_experts": extra,
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    with open(out_path, "w") as f:
        placements = {p: pl.slot_to_expert.tolist() for p, pl in llm.expert_balancer.placements().items()}
        laid = llm.executor.params["layers"][1]["mlp"]["experts"].placement.slot_to_expert
        json.dump(
            {
                "tokens": [o.outputs[0].token_ids for o in outputs],
                "steps": llm.last_stats.steps,
                "rearrangements": llm.last_stats.eplb_rearrangements,
                "placements": placements,
                "laid_out": np.asarray(laid.addressable_data(0)).tolist(),
                "experts_read": {k: sorted(v) for k, v in experts_read.items()},
            },
            f,
        )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:6]), sys.argv[6], sys.argv[7])
