"""Scanned layers (``ops.scan_layers``, ``deepinfer_jax/models/common/layer_runs.py``): runs of same-structure
decoder layers stacked and run with ``lax.scan``.

The reference is the unrolled model: the same functions in the same order over the same values. XLA fuses the
scan's body and the unrolled layers differently, so float32 results differ by reassociation only: tiny-v3's
logits by up to 2.4e-6 here (shakespeare-v3's were bitwise equal), so logits are compared with ``atol = 1e-5`` (a
wrong layer, weight or cache slot moves them by O(0.1)), the engine's logprobs with ``test_engine_families``'s
``1e-4``, and tokens exactly (random weights are far from near-ties at these lengths). In bfloat16 the two differ
more: XLA's excess-precision simplification drops different bf16 roundings inside a while loop's body than
across unrolled layers (with ``--xla_allow_excess_precision=false`` shakespeare-v3's scanned and unrolled bf16
logits are bitwise equal; docs/engine.md), so bf16 is not compared here.

tiny-v3 has two MoE layers after its dense one: ``ops.scan_layers = 2`` stacks them (the default, 3, leaves
tiny-v3 unrolled: a stack of two compiles slower than two layers on XLA:CPU, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_engine_families as families  # tests/engine/test_engine_families.py: its workload and engine

import deepinfer_jax
from deepinfer_jax.config.errors import ConfigValueError, ConfigWarning
from deepinfer_jax.engine import llm as llm_module
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.models.common import taps
from deepinfer_jax.models.common.layer_runs import (
    LayerStack,
    has_stacks,
    iter_layers,
    run_layers,
    stack_layers,
    unstack_layers,
)
from deepinfer_jax.models.deepseek_v3 import model as v3_model

ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _drop_imported_engines():
    """The conftest drops this module's cached engines after its last test; those of the imported module too."""
    yield
    families._batch.cache_clear()
    families._llm.cache_clear()


def _layer(width: int, seed: int, extra: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    tree = {"w": jnp.asarray(rng.standard_normal((width, width)), jnp.float32)}
    if extra:
        tree["b"] = jnp.asarray(rng.standard_normal(width), jnp.float32)
    return tree


def test_stack_layers_finds_runs_of_one_structure():
    """Runs are consecutive layers with equal tree structure, shapes and dtypes; shorter runs than ``min_run`` stay
    single; unstacking gives the original layers back; a run of one and negative lengths are refused."""
    layers = [_layer(4, 0, extra=True)] + [_layer(4, i) for i in range(1, 4)] + [_layer(8, 9), _layer(8, 10)]
    segs = stack_layers(layers, min_run=3)
    assert [type(s).__name__ for s in segs] == ["dict", "LayerStack", "dict", "dict"]
    stack = segs[1]
    assert (stack.start, stack.count) == (1, 3) and stack.params["w"].shape == (3, 4, 4)
    assert len(unstack_layers(segs)) == 6 and has_stacks(segs)
    two = stack_layers(layers, min_run=2)
    assert [(s.start, s.count) for s in two if isinstance(s, LayerStack)] == [(1, 3), (4, 2)]
    assert not has_stacks(stack_layers(layers, min_run=0))
    for a, b in zip(unstack_layers(two), layers, strict=True):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    assert [i for i, _ in iter_layers(two)] == list(range(6))
    # restacking a stacked list with another run length starts from the layers
    assert [(s.start, s.count) for s in stack_layers(two, min_run=3) if isinstance(s, LayerStack)] == [(1, 3)]
    for bad in (1, -1, True):
        with pytest.raises(ValueError, match="min_run"):
            stack_layers(layers, min_run=bad)


def test_run_layers_scans_stacks_and_unrolls_them_under_taps():
    """``run_layers`` gives the unrolled result; inside a stack the index is traced, outside a Python int; under
    a training tap the stack runs unrolled, so every layer's record reaches the collector."""
    layers = [_layer(4, 0, extra=True)] + [_layer(4, i) for i in range(1, 4)]
    segs = stack_layers(layers, min_run=3)
    seen = []

    def body(x, p, i):
        seen.append(type(i).__name__)
        taps.record("layer", index=i)
        return jnp.tanh(x @ p["w"] + p.get("b", 0.0)) + i

    x0 = jnp.ones((2, 4), jnp.float32)
    want = x0
    for i, p in enumerate(layers):
        want = jnp.tanh(want @ p["w"] + p.get("b", 0.0)) + i
    got = jax.jit(lambda s: run_layers(s, body, x0))(segs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert seen[0] == "int" and all(t != "int" for t in seen[1:]) and len(seen) == 2  # one trace of the body
    with taps.collect() as sink:
        run_layers(segs, body, x0)
    assert [int(v["index"]) for _, v in sink] == [0, 1, 2, 3]


@functools.cache
def _v3(min_run: int):
    model = deepinfer_jax.load_model("tiny-v3", "float32")
    if min_run:
        model.params = v3_model.scan_layout(model.params, model.config, min_run=min_run)
    return model


def test_scanned_v3_forwards_equal_the_unrolled_ones():
    """tiny-v3's two MoE layers as one stack: the full forward's logits and the cached forward's logits and
    latents equal the unrolled model's (float32, module docstring)."""
    plain, scanned = _v3(0), _v3(2)
    assert [type(s).__name__ for s in scanned.params["layers"]] == ["dict", "LayerStack"]
    cfg = plain.config
    ids = np.random.default_rng(0).integers(3, 500, (2, 12)).astype(np.int32)
    full = jax.jit(v3_model.forward_logits, static_argnums=1)
    np.testing.assert_allclose(
        np.asarray(full(scanned.params, cfg, ids)),
        np.asarray(full(plain.params, cfg, ids)),
        rtol=0,
        atol=ATOL,
    )
    cached = jax.jit(v3_model.forward, static_argnums=1)
    pos = np.broadcast_to(np.arange(12, dtype=np.int32), ids.shape)
    outs = [cached(m.params, cfg, ids, pos, v3_model.init_cache(cfg, 2, 16)) for m in (plain, scanned)]
    np.testing.assert_allclose(np.asarray(outs[1][0]), np.asarray(outs[0][0]), rtol=0, atol=ATOL)
    np.testing.assert_allclose(
        np.asarray(outs[1][1]["latent"]), np.asarray(outs[0][1]["latent"]), rtol=0, atol=ATOL
    )


@functools.cache
def _scanned_llm(mesh: tuple[int, int]) -> LLM:
    dp, ep = mesh
    return LLM(
        "tiny-v3",
        dtype="float32",
        data_parallel_size=dp,
        expert_parallel_size=ep,
        max_num_seqs=4 * dp * ep,
        max_num_batched_tokens=16 * dp * ep,
        kv_cache_memory="64MiB",
        **{"cache.block_size": 16, "cache.num_blocks": families.BLOCKS, "ops.scan_layers": 2},
    )


@pytest.mark.parametrize("mesh", [(1, 1), (2, 1)], ids=["one-device", "dp2"])
def test_scanned_engine_gives_the_unrolled_engines_outputs(mesh):
    """The sixteen mixed requests of test_engine_families (greedy and seeded rows, top-2 logprobs, a cache that
    forces preemption) through the scanned tiny-v3 engine, on one device and on a dp = 2 mesh (replicated
    stacks): tokens and finish reasons equal the unrolled one-device engine's, logprobs within 1e-4."""
    prompts, params, want = families._batch("tiny-v3", (1, 1))
    llm = _scanned_llm(mesh)
    stacks = [s for s in llm.model.params["layers"] if isinstance(s, LayerStack)]
    assert [(s.start, s.count) for s in stacks] == [(1, 2)]
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    if mesh == (1, 1):
        assert sum(o.metrics.num_preemptions for o in got) > 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason, f"request {i}"
        for k, (la, lb) in enumerate(zip(x.logprobs, y.logprobs, strict=True)):
            assert la.keys() == lb.keys(), (i, k)
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < families.LOGPROB_TOL, (i, k, t)


def test_the_default_scans_runs_of_three_on_a_cpu_only():
    """``ops.scan_layers = None``: shakespeare-v3's five MoE layers are one stack on a CPU, and stay unrolled on
    an accelerator (where a scanned layer's experts would be copied out of the stack every step)."""
    model = deepinfer_jax.load_model("shakespeare-v3", "float32")
    cpu = llm_module._scan_layout(model, None, "cpu")
    assert [(s.start, s.count) for s in cpu.params["layers"] if isinstance(s, LayerStack)] == [(1, 5)]
    assert llm_module._scan_layout(model, None, "gpu") is model
    two = llm_module._scan_layout(_v3(0), None, "cpu")  # tiny-v3: a run of two stays unrolled by default
    assert not has_stacks(two.params["layers"])


def test_expert_slots_and_families_without_a_scan_layout_stay_unrolled():
    """An expert-parallel mesh keeps per-layer expert slots (EPLB moves each layer's), so nothing is stacked;
    a family without a scan layout warns when ops.scan_layers is set, and keeps its layers; a run of one is
    refused before anything loads."""
    with pytest.warns(ConfigWarning, match=r"ops\.scan_layers = 2 .*per-layer expert slots"):
        llm = LLM(
            "tiny-v3",
            dtype="float32",
            data_parallel_size=1,
            expert_parallel_size=2,
            max_num_seqs=4,
            kv_cache_memory="64MiB",
            **{"ops.scan_layers": 2},
        )
    assert not has_stacks(llm.model.params["layers"])
    llm.close()
    v4 = deepinfer_jax.load_model("tiny-v4", "float32")
    with pytest.warns(ConfigWarning, match=r"ops\.scan_layers = 2 has no effect here"):
        assert llm_module._scan_layout(v4, 2, "cpu") is v4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert llm_module._scan_layout(v4, None, "cpu") is v4  # the default: no warning
    with pytest.raises(ConfigValueError, match=r"ops\.scan_layers = 1"):
        LLM("tiny-v3", **{"ops.scan_layers": 1})
