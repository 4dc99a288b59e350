"""The engine step with the kernels selected, for DeepSeek-V3, V4 and V4.1 on one device.

* **Interpreted.** ``LLM(..., ops.backend="pallas_gpu", ops.interpret=True)`` runs every Pallas kernel of its
  step with the Pallas interpreter on the CPU. Its greedy tokens equal greedy decoding by repeated full forwards
  of the model (as in tests/engine/test_engine_families.py: the argmax of one causal full forward over the
  generated sequence at every generated position), and its logprobs the full forward's log-softmax. A spy on
  ``pl.pallas_call`` records which kernels the step traced, so a call site that still ran a reference fails (the
  fused sampler ``sample_tokens`` included). tiny-v3 and tiny-v41 speculate (MTP and DSpark drafts at their
  natural lengths), so their drafting and verification run on the sampler kernel's ``draft_tokens`` and
  ``verify_tokens`` modes. With ops ``sample``, ``verify`` and ``draft_sample`` alone on their interpreted
  kernels, seeded sampled requests with drafts get exactly the reference engine's tokens and logprobs.
* **Exported.** The engine's step (:func:`deepinfer_jax.engine.step.step` over a plan from
  :func:`deepinfer_jax.engine.plan.build_plan`, lowered, never run) in production precision -- bfloat16 weights,
  the record caches (MXFP8 window, FP4 compressed and MXFP4 indexer keys for V4/V4.1, the FP8 latent for V3) --
  exports for CUDA under the ``pallas_gpu`` selection and for Ascend under the ``ascend`` selection. How many
  calls of each kernel or named call the module holds follows from the model's layer plan, and the CUDA
  attention-side kernels take the cache's bytes as operands (``ui8``): records are decoded inside the kernels.
* ``deepinfer-jax info`` (a fresh process) prints the selection the engine makes, and a requested backend that
  cannot run is, under ``ops.strict``, an error from ``LLM(...)`` naming the op.

Tolerances: float32 with unquantised caches, where the engine's reference path follows the full forward to about
1e-6 of the largest logit (tests/models/*/test_*_paged.py) and the float32 kernels differ from the references only
in summation order (tests/pallas_kernels/): greedy tokens on random weights must be identical, logprobs within
1e-4 (measured: about 3e-6).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from jax import export
from jax.experimental import pallas as pl

import deepinfer_jax
from deepinfer_jax import ops
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.engine.plan import DeviceBatch, build_plan
from deepinfer_jax.engine.step import step
from deepinfer_jax.models.deepseek_v4.attention import CSA, SLIDING
from deepinfer_jax.ops.registry import BackendUnavailableError
from pallas_kernels._common import EXPORT_DEVICE_KIND, EXPORT_NUM_CORES, TRITON_CUSTOM_CALL

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ["tiny-v3", "tiny-v4", "tiny-v41"]
LOGPROB_TOL = 1e-4
REF_LEN = 32
PROMPTS = (5, 19, 11)  # 19 > 16 tokens per step: a prefill chunked over two steps beside decodes
NEW_TOKENS = 4
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_cache_memory": "8MiB", "cache.block_size": 16}

every_family = pytest.mark.parametrize("name", FAMILIES)
#: Drafts of the interpreted engines: V3's MTP layer and V4.1's DSpark block at their natural lengths, so the
#: speculative step's drafting and verification run on the fused sampler's kernels too (tiny-v4 has no drafter).
DRAFTS = {"tiny-v3": 1, "tiny-v4": 0, "tiny-v41": 4}
SPEC_KERNELS = {"verify_tokens", "draft_tokens"}

#: The attention-side kernels each family's step must trace with ``ops.backend = pallas_gpu`` (kernel names;
#: ``kv_store_records`` of plain float keys is a scatter, not a kernel, so the float caches here trace none).
ATTENTION_KERNELS = {
    "tiny-v3": {"paged_mla_attention"},
    "tiny-v4": {"v4_sink_attention_segments", "v4_indexer_scores", "v4_compress_store", "mhc_sinkhorn"},
    "tiny-v41": {"v4_sink_attention_segments", "v4_indexer_scores", "v4_compress_store", "mhc_sinkhorn"},
}


# ------------------------------------------------------------------------------------------ interpreted


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(25)
    return [rng.integers(3, 500, n).tolist() for n in PROMPTS]


@functools.cache
def _interpreted(name: str):
    """The interpreted engine, its outputs for :data:`PROMPTS` and the kernels its step traced (name -> count)."""
    traced: collections.Counter[str] = collections.Counter()
    real = pl.pallas_call

    def spy(*args, **kwargs):
        traced[kwargs.get("name")] += 1
        return real(*args, **kwargs)

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl, "pallas_call", spy)
        llm = LLM(
            name,
            dtype="float32",
            num_draft_tokens=DRAFTS[name],
            **ENGINE,
            **{"ops.backend": "pallas_gpu", "ops.interpret": True},
        )
        outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=greedy, use_tqdm=False)
    return llm, outs, traced


@every_family
def test_interpreted_kernels_give_the_reference_greedy_tokens(name):
    llm, outs, traced = _interpreted(name)
    chosen = llm.op_selection.backends()
    for op in (
        "paged_mla_attention",
        "v4_sparse_attention",
        "v4_indexer_topk",
        "v4_compress_store",
        "sample",
        "verify",
        "draft_sample",
    ):
        assert chosen[op] == "pallas_gpu", op
    # a speculating engine samples every row in its verification (the fresh row), so it traces no sample_tokens
    want = ATTENTION_KERNELS[name] | (SPEC_KERNELS if DRAFTS[name] else {"sample_tokens"})
    assert want <= set(traced), traced
    if DRAFTS[name]:
        assert sum(llm.last_stats.verified_at) > 0  # drafts were verified
    model = deepinfer_jax.load_model(name, "float32")
    sequences = [p + o.outputs[0].token_ids for p, o in zip(_prompts(), outs, strict=True)]
    ids = np.zeros((len(sequences), REF_LEN), np.int32)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    logits = np.asarray(model.logits(ids), np.float64)  # causal: the padding changes no position
    for i, (prompt, out) in enumerate(zip(_prompts(), outs, strict=True)):
        got = out.outputs[0]
        ref = logits[i, len(prompt) - 1 : len(prompt) - 1 + NEW_TOKENS]
        assert got.token_ids == [int(t) for t in np.argmax(ref, axis=-1)], f"request {i}"
        logp = ref - ref.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for k, token in enumerate(got.token_ids):
            assert abs(got.logprobs[k][token].logprob - logp[k, token]) < LOGPROB_TOL, (i, k)


def test_interpreted_sampler_kernel_draws_the_reference_engines_tokens():
    """Ops ``sample``, ``verify`` and ``draft_sample`` alone on the interpreted fused kernel (``ops.overrides``),
    speculating with two MTP drafts: seeded sampled requests (top-k, top-p, min_p, penalties) and a greedy one get
    exactly the tokens, logprobs and per-position acceptance counts of the reference engine, whose logits are
    bitwise the same (every other op runs its reference in both)."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.5, repetition_penalty=1.3, presence_penalty=0.4, seed=11),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.3, frequency_penalty=0.5, seed=12),
        SamplingParams(temperature=0.0),
    ]
    params = [p.replace(max_tokens=2 * NEW_TOKENS, ignore_eos=True, logprobs=1) for p in params]
    sampler_ops = ("sample", "verify", "draft_sample")
    overrides = {"ops.overrides": dict.fromkeys(sampler_ops, "pallas_gpu"), "ops.interpret": True}
    kernel = LLM("tiny-v3", dtype="float32", num_draft_tokens=2, **ENGINE, **overrides)
    reference = LLM("tiny-v3", dtype="float32", num_draft_tokens=2, **ENGINE)
    for op in sampler_ops:
        assert kernel.op_selection.backends()[op] == "pallas_gpu", op
        assert reference.op_selection.backends()[op] == "reference", op
    outs = [
        llm.generate(prompt_token_ids=_prompts(), sampling_params=params, use_tqdm=False)
        for llm in (kernel, reference)
    ]
    for got, want in zip(*outs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs
    assert len({tuple(o.outputs[0].token_ids) for o in outs[0]}) == 3
    assert (
        sum(kernel.last_stats.verified_at) > 0
        and kernel.last_stats.verified_at == reference.last_stats.verified_at
    )
    assert kernel.last_stats.accepted_at == reference.last_stats.accepted_at


_ENGINE_SELECTION = """
import json, sys
from deepinfer_jax.engine.llm import LLM
llm = LLM("tiny-v41", dtype="float32", **{"ops.backend": "pallas_gpu", "ops.interpret": True})
json.dump(llm.op_selection.as_dict(), sys.stdout)
"""


def _run(*args: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=False, cwd=ROOT, env=env
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_info_prints_the_selection_the_engine_makes():
    """``deepinfer-jax info`` with an engine's ``ops`` settings reports the selection that engine resolves (every
    op it can call, the same backend and reason), each in a fresh process: a process that has imported other
    families has registered their ops too."""
    engine = _run("-c", _ENGINE_SELECTION)
    info = _run(
        "-m",
        "deepinfer_jax",
        "info",
        "--model",
        "tiny-v41",
        "--format",
        "json",
        "--set",
        "ops.backend=pallas_gpu",
        "--set",
        "ops.interpret=true",
    )["ops"]
    assert info == engine
    assert {"sample", "v4_sparse_attention", "moe_experts"} <= set(info["selected"])


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"ops.backend": "pallas_gpu"}, r"v4_sparse_attention \(pallas_gpu: .*registered for gpu, not cpu"),
        ({"ops.overrides": {"v4_indexer_topk": "cutedsl_sm100"}}, r"v4_indexer_topk \(cutedsl_sm100"),
    ],
    ids=["global-backend", "override"],
)
def test_strict_refuses_a_backend_that_cannot_run_naming_the_op(settings, match):
    with pytest.raises(BackendUnavailableError, match=match):
        LLM("tiny-v41", dtype="float32", **ENGINE, **settings, **{"ops.strict": True})


# ------------------------------------------------------------------------------------------ exported


@functools.cache
def _production(name: str) -> LLM:
    """The production precision: bf16 weights, the record caches (V3: the FP8 latent)."""
    return LLM(name, dtype="bfloat16", kv_cache_dtype="quantized", **ENGINE)


def _step_structs(llm: LLM):
    ex, sched = llm.executor, llm.scheduler
    plan = build_plan(
        [DeviceBatch(())],
        buckets=sched.buckets,
        max_blocks_per_seq=sched.max_blocks_per_seq,
        vocab_size=ex.vocab_size,
    )
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    return jax.tree.map(spec, (ex.params, ex.cache, ex.state, plan.inputs))


def _selection(backend: str, platform: str):
    cfg = types.SimpleNamespace(backend=backend, overrides={}, strict=True, interpret=False)
    return ops.resolve_selection(cfg, platform=platform)


@functools.cache
def _cuda_module(name: str) -> str:
    """The step exported for CUDA under ``pallas_gpu``: lowered on the (1, 1) mesh of an abstract H100 (Triton
    lowering needs a device kind; docs/backends.md)."""
    llm = _production(name)
    device = jax.sharding.AbstractDevice(
        device_kind=EXPORT_DEVICE_KIND, num_cores=EXPORT_NUM_CORES, platform="gpu"
    )
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.sharding.AbstractMesh((1, 1), ("dp", "ep"), axis_types=auto, abstract_device=device)
    fn = functools.partial(
        step, mesh=mesh, model=llm.executor.model, selection=_selection("pallas_gpu", "gpu")
    )
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        # jax deprecates its Triton backend in favour of Mosaic GPU (docs/backends.md says why we use it)
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated", DeprecationWarning)
        exported = export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*_step_structs(llm))
    assert exported.platforms == ("cuda",)
    return exported.mlir_module()


@functools.cache
def _ascend_module(name: str) -> str:
    from custom_calls.ascend.named import targets

    llm = _production(name)
    ex = llm.executor
    fn = functools.partial(step, mesh=ex.mesh, model=ex.model, selection=_selection("ascend", "ascend"))
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets(ops.list_ops())]
    exported = export.export(jax.jit(fn), platforms=["ascend"], disabled_checks=checks)(*_step_structs(llm))
    return exported.mlir_module()


def _triton_calls(text: str) -> collections.Counter[tuple[str, bool]]:
    """``(kernel name, takes uint8 operands)`` of every Triton custom call."""
    calls = collections.Counter()
    for line in text.splitlines():
        if f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}(" not in line:
            continue
        kernel = re.search(r'name = "([^"]+)", num_stages', line).group(1)
        operands = re.search(r"\} : \((.*)\) -> ", line).group(1)
        calls[kernel, "xui8>" in operands] += 1
    return calls


def _named_calls(text: str) -> collections.Counter[str]:
    return collections.Counter(re.findall(r"stablehlo\.custom_call @deepinfer\.ascend\.(\w+)\(", text))


def _expected(name: str) -> dict[str, int]:
    """Calls of each attention-side op per step, from the model's layer plan, and the sampler's one call."""
    model = _production(name).executor.model
    if name == "tiny-v3":
        return {"paged_mla_attention": len(_production(name).executor.params["layers"]), "sample": 1}
    if name == "tiny-v4":
        kinds = [s.kind for s in model.plan.attention]
        return {
            "sample": 1,
            # window-only and CSA layers; HCA layers attend to every visible entry by the page walk
            "v4_sparse_attention": sum(k in (SLIDING, CSA) for k in kinds),
            "v4_indexer_topk": kinds.count(CSA),
            "v4_compress_store": sum(k != SLIDING for k in kinds) + kinds.count(CSA),  # + indexer compressors
            "mhc_sinkhorn": 2 * len(kinds),
        }
    layers = model.layers
    return {
        "sample": 1,
        "v4_sparse_attention": sum(not lp.is_compressed or lp.uses_indexer for lp in layers),
        "v4_indexer_topk": sum(lp.is_index_source and not lp.is_candidate_source for lp in layers),
        # the candidate source scores whole rows (its Cand(p) needs the block maxima): the dense scores op
        "v4_indexer_scores": sum(lp.is_candidate_source for lp in layers),
        "v4_compress_store": sum(lp.is_kv_source and lp.ratio > 1 for lp in layers),
        "kv_store_records": sum(lp.is_kv_source and lp.ratio == 1 for lp in layers)
        + sum(lp.is_index_k_source for lp in layers),
        "mhc_sinkhorn": 2 * len(layers),
    }


#: op -> (Triton kernel name, whether it takes the cache's bytes) in the CUDA export of the record caches.
_KERNEL_OF = {
    "paged_mla_attention": ("paged_mla_attention", True),
    "v4_sparse_attention": ("v4_sink_attention_segments", True),
    "v4_indexer_topk": ("v4_indexer_scores", True),
    "v4_indexer_scores": ("v4_indexer_scores", False),  # float keys, decoded page by page
    "v4_compress_store": ("v4_compress_store", True),
    "kv_store_records": ("store_kv_records", True),
    "mhc_sinkhorn": ("mhc_sinkhorn", False),
    "sample": ("sample_tokens", False),
}


@every_family
def test_engine_step_exports_for_cuda_with_the_kernels(name):
    calls = _triton_calls(_cuda_module(name))
    want = collections.Counter()
    for op, count in _expected(name).items():
        want[_KERNEL_OF[op]] += count
    kernels = {kernel for kernel, _ in want}
    assert {k: v for k, v in calls.items() if k[0] in kernels} == dict(want), calls
    if name == "tiny-v41":
        # the MoE's sorted dispatch runs the MXFP4 grouped kernels (selected for the export's platform)
        moe = len(_production(name).executor.model.layers)
        assert calls["mxfp4_grouped_swiglu", True] == moe and calls["mxfp4_grouped_linear", True] == moe, (
            calls
        )


@every_family
def test_engine_step_exports_for_ascend_with_the_named_calls(name):
    calls = _named_calls(_ascend_module(name))
    for op, count in _expected(name).items():
        assert calls[op] == count, (op, calls)
    assert calls["v4_sink_attention"] == 0, calls  # the paged models read the records through the sparse op


@functools.cache
def _spec_modules() -> tuple[str, str, int]:
    """tiny-v41's speculative step (DSpark, its natural 4 drafts, fixed length) exported for CUDA under
    ``pallas_gpu`` and for Ascend under ``ascend``, in production precision; and the draft count."""
    from custom_calls.ascend.named import targets

    llm = LLM("tiny-v41", dtype="bfloat16", kv_cache_dtype="quantized", num_draft_tokens=4, **ENGINE)
    ex, sched = llm.executor, llm.scheduler
    k = ex.num_draft_tokens
    plan = build_plan(
        [DeviceBatch(())],
        buckets=sched.buckets,
        max_blocks_per_seq=sched.max_blocks_per_seq,
        vocab_size=ex.vocab_size,
        num_draft_tokens=k,
    )
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    structs = jax.tree.map(spec, (ex.params, ex.cache, ex.state, plan.inputs))
    statics = {
        "num_draft_tokens": k,
        "confidence_temperature": ex._static["confidence_temperature"],
        "model": ex.model,
    }
    device = jax.sharding.AbstractDevice(
        device_kind=EXPORT_DEVICE_KIND, num_cores=EXPORT_NUM_CORES, platform="gpu"
    )
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.sharding.AbstractMesh((1, 1), ("dp", "ep"), axis_types=auto, abstract_device=device)
    fn = functools.partial(step, mesh=mesh, selection=_selection("pallas_gpu", "gpu"), **statics)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated", DeprecationWarning)
        cuda = export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*structs)
    fn = functools.partial(step, mesh=ex.mesh, selection=_selection("ascend", "ascend"), **statics)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets(ops.list_ops())]
    ascend = export.export(jax.jit(fn), platforms=["ascend"], disabled_checks=checks)(*structs)
    return cuda.mlir_module(), ascend.mlir_module(), k


def test_speculative_step_exports_with_the_sampler_kernels():
    """The default V4.1 decode step drafts: its verification is one fused verify kernel (no ``sample_tokens``:
    the fresh rows are verification rows) and its drafting one draft kernel per draft position, for CUDA; one
    ``verify`` and ``k`` ``draft_sample`` named calls for Ascend."""
    cuda, ascend, k = _spec_modules()
    kernels = collections.Counter(kernel for (kernel, _), n in _triton_calls(cuda).items() for _ in range(n))
    assert kernels["verify_tokens"] == 1 and kernels["draft_tokens"] == k and kernels["sample_tokens"] == 0, (
        kernels
    )
    assert kernels["v4_sink_attention_segments"] > 0  # the attention side is on its kernels too
    named = _named_calls(ascend)
    assert named["verify"] == 1 and named["draft_sample"] == k and named["sample"] == 0, named
