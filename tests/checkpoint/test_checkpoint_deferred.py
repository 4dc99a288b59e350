"""Deferred routed experts (checkpoint/deferred.py): checked like every tensor, read only when their rows are asked
for, and equal bit for bit to the eagerly loaded stacks (through each family's own per-expert conversion)."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from deepinfer_jax.checkpoint import reader as reader_mod
from deepinfer_jax.checkpoint.deferred import DeferredTensor, ExpertStack, is_expert_tensor
from deepinfer_jax.checkpoint.loader import load_tensors
from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.checkpoint.reader import open_checkpoint
from deepinfer_jax.models import builtin


def test_expert_tensor_names():
    assert is_expert_tensor("model.layers.3.mlp.experts.17.gate_proj.weight")
    assert is_expert_tensor("layers.0.ffn.experts.0.w1.scale")
    assert is_expert_tensor("mtp.0.ffn.experts.3.w2.weight")
    assert not is_expert_tensor("model.layers.3.mlp.shared_experts.gate_proj.weight")
    assert not is_expert_tensor("layers.0.ffn.experts.w1")  # no expert index
    assert not is_expert_tensor("model.layers.3.mlp.gate.weight")


def _expert_paths(params):
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if ".experts." in jax.tree_util.keystr(path, simple=True, separator=".")
    }


@pytest.mark.parametrize(
    "name,dtype",
    [("tiny-v3", "float32"), ("tiny-v4", "bfloat16"), ("tiny-v41", "float32"), ("tiny-v41", "bfloat16")],
)
def test_deferred_stacks_equal_the_eager_ones_and_read_on_demand(name, dtype, monkeypatch):
    reads: list[str] = []
    real = reader_mod.SafetensorsReader.read

    def spy(self, tensor):
        reads.append(tensor)
        return real(self, tensor)

    monkeypatch.setattr(reader_mod.SafetensorsReader, "read", spy)
    eager = load_model(name, dtype)
    used_experts = {t for t in reads if is_expert_tensor(t)}  # the expert tensors the family reads
    reads.clear()
    deferred = load_model(name, dtype, defer_experts=True)
    # Assembly read every non-expert tensor once, and of the experts only expert 0 (for the stacks' shapes).
    expert_reads = [t for t in reads if is_expert_tensor(t)]
    assert expert_reads and all(".experts.0." in t for t in expert_reads)
    others = [t for t in reads if not is_expert_tensor(t)]
    assert others and len(others) == len(set(others))

    stacks, arrays = _expert_paths(deferred.params), _expert_paths(eager.params)
    assert stacks.keys() == arrays.keys() and stacks
    reads.clear()
    for path, stack in stacks.items():
        assert isinstance(stack, ExpertStack), path
        want = np.asarray(arrays[path])
        assert (stack.shape, stack.dtype, stack.ndim) == (want.shape, want.dtype, want.ndim), path
        np.testing.assert_array_equal(np.asarray(stack), want, err_msg=path)
    # Reading every leaf (an FP8 weight and its scale are built together) read each expert tensor exactly once.
    assert used_experts and collections.Counter(reads) == dict.fromkeys(used_experts, 1)
    # Everything else is the eager tree's, leaf for leaf.
    rest = [
        (p, leaf)
        for p, leaf in jax.tree_util.tree_leaves_with_path(deferred.params)
        if ".experts." not in jax.tree_util.keystr(p, simple=True, separator=".")
    ]
    want_rest = [
        leaf
        for p, leaf in jax.tree_util.tree_leaves_with_path(eager.params)
        if ".experts." not in jax.tree_util.keystr(p, simple=True, separator=".")
    ]
    for (path, leaf), want in zip(rest, want_rest, strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want), err_msg=str(path))

    # Rows read exactly the experts asked for.
    stack = next(iter(stacks.values()))
    reads.clear()
    rows = stack.rows([5, 2, 5])
    assert rows.shape == (3, *stack.shape[1:])
    np.testing.assert_array_equal(rows, np.asarray(arrays[next(iter(stacks))])[[5, 2, 5]])
    assert {t.split(".experts.")[1].split(".")[0] for t in reads if is_expert_tensor(t)} == {"5", "2"}
    with pytest.raises(IndexError, match=r"expert 8 is outside \[0, 8\)"):
        stack.row(8)


def test_deferral_is_refused_with_validation():
    with pytest.raises(ValueError, match="defer_experts: deferred experts cannot be validated"):
        load_model("tiny-v3", defer_experts=True, validate=True)
    with open_checkpoint(builtin.materialize("tiny-v3")) as reader:
        expected = {
            name: (info.shape, (info.dtype.name,))
            for name, info in ((n, reader.info(n)) for n in reader.names())
        }
        with pytest.raises(ValueError, match="validate_finite=True"):
            load_tensors(reader, expected, defer=is_expert_tensor, validate_finite=True)
        with pytest.raises(TypeError, match="defer: expected a callable"):
            load_tensors(reader, expected, defer=True)
        loaded = load_tensors(reader, expected, defer=is_expert_tensor)
        name = next(n for n in expected if is_expert_tensor(n))
        tensor = loaded[name]
        assert isinstance(tensor, DeferredTensor) and tensor.shape == reader.info(name).shape
        np.testing.assert_array_equal(np.asarray(tensor), reader.read(name))
        assert not any(isinstance(v, DeferredTensor) for n, v in loaded.items() if not is_expert_tensor(n))


def test_deferred_experts_from_an_orbax_checkpoint(tmp_path):
    from deepinfer_jax.checkpoint.loader import read_config
    from deepinfer_jax.checkpoint.orbax_io import save_checkpoint

    with open_checkpoint(builtin.materialize("tiny-v3")) as reader:
        saved = save_checkpoint(
            tmp_path / "orbax", {n: reader.read(n) for n in reader.names()}, read_config(reader)
        )
    eager, deferred = load_model(saved), load_model(saved, defer_experts=True)
    stacks = _expert_paths(deferred.params)
    assert stacks and all(isinstance(s, ExpertStack) for s in stacks.values())
    for (path, want), got in zip(
        jax.tree_util.tree_leaves_with_path(eager.params), jax.tree.leaves(deferred.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
