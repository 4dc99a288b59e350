"""Logical axis names of the V4 / V4.1 parameter trees, and the families exposing theirs to ``parallel/``."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.models.deepseek_v4.axes import logical_axes
from deepinfer_jax.models.registry import get_family, list_families
from deepinfer_jax.parallel import make_mesh, param_shardings, slot_axes


@functools.cache
def _params(name: str):
    return load_model(name).params


def _flat(tree, axes):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert len(leaves) == len(names)
    for (path, leaf), leaf_axes in zip(leaves, names, strict=True):
        yield ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path), leaf, leaf_axes


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_every_leaf_is_named(name):
    params = _params(name)
    seen = set()
    for where, leaf, axes in _flat(params, logical_axes(params)):
        assert isinstance(axes, tuple) and all(isinstance(a, str) for a in axes), where
        assert len(axes) == leaf.ndim, (where, axes, leaf.shape)
        if ".experts." in where:
            seen.add("experts")
            want = ("expert", "embed", "moe_mlp") if ".down." in where else ("expert", "moe_mlp", "embed")
            assert axes == want, where
        elif where.endswith("ffn.gate.weight"):
            seen.add("router")
            assert axes == ("expert", "embed"), where
        elif where.endswith("ffn.bias"):
            assert axes == ("expert",), where
        elif where in ("embed", "head"):
            assert axes == ("vocab", "embed"), where
        elif where.endswith("attn_norm") or where == "norm":
            assert axes == ("embed",), where
        if where.startswith("mtp."):
            seen.add("mtp")
    assert {"experts", "router"} <= seen
    if name == "tiny-v41":
        assert "mtp" in seen  # the drafter layers are named too


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_only_slot_stacks_are_sharded(name):
    """After ``slot_axes``, the ep axis splits exactly the routed-expert stacks; the router stays replicated.

    (In logical layout: the expert counts, 8 and the drafter's 4, happen to divide ``ep = 4``.)
    """
    params = _params(name)
    mesh = make_mesh(2, 4)
    shardings = param_shardings(params, slot_axes(logical_axes(params)), mesh)
    for where, sharding, _ in _flat(shardings, logical_axes(params)):
        spec = tuple(sharding.spec)
        if ".experts." in where:
            assert spec[:1] == ("ep",) and all(s is None for s in spec[1:]), where
        else:
            assert all(s is None for s in spec), where


def test_every_family_exposes_its_axes():
    for family in list_families():
        fn = get_family(family).logical_axes
        assert callable(fn), family


def test_unknown_leaves_are_refused():
    with pytest.raises(ValueError, match=r"no axis names for parameter layers\.0\.attn\.mystery"):
        logical_axes({"layers": [{"attn": {"mystery": np.zeros((2, 3))}}]})
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight has 3 dimensions"):
        logical_axes({"layers": [{"attn": {"wq_a": {"weight": np.zeros((2, 3, 4))}}}]})
    # The same name means different things in different blocks.
    tree = {
        "layers": [
            {
                "attn": {"wkv": {"weight": np.zeros((2, 3))}, "compressor": {"wkv": np.zeros((2, 3))}},
                "engram": {"wkv": {"weight": np.zeros((2, 3))}},
                "hc_ffn": {"scale": np.zeros(3)},
            }
        ]
    }
    axes = logical_axes(tree)["layers"][0]
    assert axes["attn"]["wkv"]["weight"] == ("kv_head", "embed")
    assert axes["attn"]["compressor"]["wkv"] == ("compress_kv", "embed")
    assert axes["engram"]["wkv"]["weight"] == ("engram_kv", "engram_in")
    assert axes["hc_ffn"]["scale"] == ("hc_scale",)
