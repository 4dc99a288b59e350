"""Token sampling: the logit pipeline, position-keyed random numbers, logprobs and penalty state.

* :class:`SamplingTensors` — a step's per-row parameters as padded arrays, built on the host (numpy).
* :func:`sample` — penalties → masks → [greedy argmax] → temperature → min_p → top-k/top-p → log_softmax →
  draw, with reported logprobs, ranks and top-n alternatives; jit-able, optionally batch-invariant.
* :func:`token_logprobs` — prompt logprobs (the model's own distribution at each position).
* :mod:`~deepinfer_jax.sampling.counts` — the device-resident per-slot token counts the penalties read.
* :mod:`~deepinfer_jax.sampling.rng` — random numbers keyed by (seed, position) only, and the fixed-point draw.

See ``docs/engine.md`` (section "Sampling").
"""

from typing import TYPE_CHECKING

from deepinfer_jax._lazy import lazy_exports

# Exported lazily: the host scheduler imports SamplingTensors, and must not pull in JAX with the device side.
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        (
            "COUNT_MASK",
            "PROMPT_FLAG",
            "init_token_counts",
            "reset_token_counts",
            "split_token_counts",
            "update_token_counts",
        ),
        "deepinfer_jax.sampling.counts",
    ),
    **dict.fromkeys(
        (
            "LOGPROBS_MODES",
            "MAX_LOGPROBS",
            "SampleOutput",
            "TokenLogprobs",
            "apply_masks",
            "apply_penalties",
            "filter_logits",
            "sample",
            "token_logprobs",
        ),
        "deepinfer_jax.sampling.pipeline",
    ),
    **dict.fromkeys(
        (
            "FIXED_POINT_BITS",
            "SAMPLE_STREAM",
            "categorical_from_weights",
            "fixed_point_weights",
            "mulhi_u32",
            "random_bits",
        ),
        "deepinfer_jax.sampling.rng",
    ),
    **dict.fromkeys(("ROW_FIELDS", "SamplingTensors", "split_seed"), "deepinfer_jax.sampling.tensors"),
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


__all__ = [
    "COUNT_MASK",
    "FIXED_POINT_BITS",
    "LOGPROBS_MODES",
    "MAX_LOGPROBS",
    "PROMPT_FLAG",
    "ROW_FIELDS",
    "SAMPLE_STREAM",
    "SampleOutput",
    "SamplingTensors",
    "TokenLogprobs",
    "apply_masks",
    "apply_penalties",
    "categorical_from_weights",
    "filter_logits",
    "fixed_point_weights",
    "init_token_counts",
    "mulhi_u32",
    "random_bits",
    "reset_token_counts",
    "sample",
    "split_seed",
    "split_token_counts",
    "token_logprobs",
    "update_token_counts",
]

if TYPE_CHECKING:
    from deepinfer_jax.sampling.counts import (
        COUNT_MASK,
        PROMPT_FLAG,
        init_token_counts,
        reset_token_counts,
        split_token_counts,
        update_token_counts,
    )
    from deepinfer_jax.sampling.pipeline import (
        LOGPROBS_MODES,
        MAX_LOGPROBS,
        SampleOutput,
        TokenLogprobs,
        apply_masks,
        apply_penalties,
        filter_logits,
        sample,
        token_logprobs,
    )
    from deepinfer_jax.sampling.rng import (
        FIXED_POINT_BITS,
        SAMPLE_STREAM,
        categorical_from_weights,
        fixed_point_weights,
        mulhi_u32,
        random_bits,
    )
    from deepinfer_jax.sampling.tensors import ROW_FIELDS, SamplingTensors, split_seed
