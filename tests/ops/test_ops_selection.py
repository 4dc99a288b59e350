"""ops.resolve_selection: ops.backend / ops.overrides / ops.strict / ops.interpret resolved in one place, the
context that makes model code follow it, and `deepinfer-jax info` printing the same selection."""

from __future__ import annotations

import functools
import importlib
import logging
import types

import jax
import jax.numpy as jnp
import pytest

from deepinfer_jax import ops
from deepinfer_jax.ops.registry import BackendUnavailableError, OpRegistry
from deepinfer_jax.ops.selection import bind_selection, resolve_selection, use_selection


def _ref(x):
    return x * 2


def _pallas(x, *, interpret=False):
    return x * 2 + (1000 if interpret else 100)  # tells which implementation ran, and how


def _cute(x):
    return x * 2 + 200


def _ascend(x):
    return x * 2 + 300


@pytest.fixture
def reg() -> OpRegistry:
    r = OpRegistry()
    r.register_op("attn", _ref, doc="has Pallas, CuteDSL and Ascend kernels")
    r.register_op("norm", _ref, doc="has only a Pallas kernel")
    r.register_op("plain", _ref, doc="has no kernel")
    r.register_impl("attn", "pallas_gpu", _pallas, platforms=("gpu",))
    r.register_impl(
        "attn", "cutedsl_sm100", _cute, platforms=("gpu",), available=lambda: False, reason="no SM100"
    )
    r.register_impl("attn", "ascend", _ascend, platforms=("ascend",))
    r.register_impl("norm", "pallas_gpu", _pallas, platforms=("gpu",))
    return r


def _cfg(**kw):
    base = {"backend": "auto", "overrides": {}, "strict": False}
    return types.SimpleNamespace(**{**base, **kw})


def test_auto_picks_the_best_runnable_kernel_per_platform(reg):
    gpu = resolve_selection(_cfg(), platform="cuda", registry=reg)
    assert gpu.platform == "gpu"
    # CuteDSL's probe fails, so Pallas; the op without a kernel runs its reference
    assert gpu.backends() == {"attn": "pallas_gpu", "norm": "pallas_gpu", "plain": "reference"}
    assert resolve_selection(_cfg(), platform="cpu", registry=reg).backends() == {
        "attn": "reference",
        "norm": "reference",
        "plain": "reference",
    }
    assert resolve_selection(_cfg(), platform="ascend", registry=reg).backends()["attn"] == "ascend"


def test_reference_backend_and_per_op_override(reg):
    sel = resolve_selection(
        _cfg(backend="reference", overrides={"norm": "pallas_gpu"}), platform="gpu", registry=reg
    )
    assert sel.backends() == {"attn": "reference", "norm": "pallas_gpu", "plain": "reference"}
    assert "override" in dict((c.op, c.reason) for c in sel.choices)["norm"]


def test_named_backend_applies_to_the_ops_that_have_it(reg):
    sel = resolve_selection(_cfg(backend="pallas_gpu"), platform="gpu", registry=reg)
    assert sel.backends() == {"attn": "pallas_gpu", "norm": "pallas_gpu", "plain": "reference"}
    plain = next(c for c in sel.choices if c.op == "plain")
    assert not plain.fell_back and "no pallas_gpu implementation" in plain.reason


def test_unrunnable_backend_falls_back_with_one_warning_per_op(reg, caplog):
    caplog.set_level(logging.WARNING)
    sel = resolve_selection(_cfg(backend="pallas_gpu"), platform="cpu", registry=reg)
    assert sel.backends() == {"attn": "reference", "norm": "reference", "plain": "reference"}
    assert {c.op for c in sel.choices if c.fell_back} == {"attn", "norm"}
    warned = [r.getMessage() for r in caplog.records if "cannot run on cpu" in r.getMessage()]
    assert len(warned) == 2 and all("registered for gpu, not cpu" in w for w in warned)


def test_strict_names_every_op_that_cannot_run(reg):
    with pytest.raises(BackendUnavailableError, match=r"2 op\(s\).*attn.*norm"):
        resolve_selection(_cfg(backend="pallas_gpu", strict=True), platform="cpu", registry=reg)
    with pytest.raises(BackendUnavailableError, match=r"attn.*cutedsl_sm100.*no SM100"):
        resolve_selection(_cfg(backend="cutedsl_sm100", strict=True), platform="gpu", registry=reg)
    # an op without a kernel of the global backend is not a failure; one named by an override is
    ok = resolve_selection(_cfg(backend="pallas_gpu", strict=True), platform="gpu", registry=reg)
    assert ok.backends()["plain"] == "reference"
    with pytest.raises(BackendUnavailableError, match="plain"):
        resolve_selection(
            _cfg(backend="pallas_gpu", strict=True, overrides={"plain": "pallas_gpu"}),
            platform="gpu",
            registry=reg,
        )


def test_strict_with_a_backend_no_op_implements_is_an_error():
    r = OpRegistry()
    r.register_op("plain", _ref, doc="no kernel")
    with pytest.raises(BackendUnavailableError, match="no registered op has a ascend implementation"):
        resolve_selection(_cfg(backend="ascend", strict=True), platform="ascend", registry=r)
    assert resolve_selection(_cfg(backend="ascend"), platform="ascend", registry=r).backends() == {
        "plain": "reference"
    }


def test_bad_settings_are_refused(reg):
    with pytest.raises(ValueError, match=r"ops.backend: unknown backend 'triton'"):
        resolve_selection(_cfg(backend="triton"), registry=reg)
    with pytest.raises(ValueError, match=r"ops.overrides: unknown op 'nope'"):
        resolve_selection(_cfg(overrides={"nope": "reference"}), registry=reg)
    with pytest.raises(ValueError, match=r"ops.overrides\['attn'\]: unknown backend 'x'"):
        resolve_selection(_cfg(overrides={"attn": "x"}), registry=reg)
    with pytest.raises(TypeError, match=r"ops.strict must be a bool"):
        resolve_selection(_cfg(strict="yes"), registry=reg)


def test_interpret_runs_pallas_kernels_on_the_cpu(reg):
    sel = resolve_selection(_cfg(backend="pallas_gpu", interpret=True), platform="cpu", registry=reg)
    assert sel.backends()["attn"] == "pallas_gpu"
    assert int(sel.select("attn")(jnp.int32(1))) == 1002  # called with interpret=True
    # a kernel without an interpret= argument cannot be interpreted: a fallback, an error under strict
    reg.register_op("composite", _ref, doc="composite")
    reg.register_impl("composite", "pallas_gpu", _cute, platforms=("gpu",))
    with pytest.raises(BackendUnavailableError, match=r"composite.*interpret"):
        resolve_selection(
            _cfg(backend="pallas_gpu", interpret=True, strict=True), platform="cpu", registry=reg
        )


def test_model_code_follows_the_active_selection_while_tracing(reg):
    sel = resolve_selection(_cfg(backend="pallas_gpu"), platform="gpu", registry=reg)

    def model(x):  # how model code asks: by name, no backend
        return reg.select("attn")(x) + reg.get("plain")(x)

    assert int(model(jnp.int32(1))) == 4  # no selection active: auto on the CPU, references
    with use_selection(sel):
        assert int(jax.jit(model)(jnp.int32(1))) == 104
        # an explicit backend still wins over the context
        assert int(reg.select("attn", backend="reference")(jnp.int32(1))) == 2
    assert int(jax.jit(bind_selection(model, sel))(jnp.int32(2))) == 108
    assert ops.active_selection() is None


def test_a_selection_of_another_registry_is_ignored(reg):
    sel = resolve_selection(_cfg(backend="reference"), platform="gpu", registry=reg)
    with use_selection(sel):
        assert ops.select("rms_norm").requested == "auto"  # the project registry is not `reg`


def test_ops_registered_later_follow_the_same_settings(reg):
    sel = resolve_selection(_cfg(backend="pallas_gpu", strict=True), platform="gpu", registry=reg)
    reg.register_op("late", _ref, doc="registered after resolution")
    reg.register_impl("late", "pallas_gpu", _pallas, platforms=("gpu",))
    reg.register_op("late_bad", _ref, doc="registered after resolution, kernel cannot run")
    reg.register_impl("late_bad", "pallas_gpu", _pallas, platforms=("gpu",), available=lambda: False)
    assert sel.select("late").backend == "pallas_gpu"
    with pytest.raises(BackendUnavailableError, match="late_bad"):
        sel.select("late_bad")
    # another platform asked explicitly (e.g. the expert-parallel path) resolves with the same settings
    with pytest.raises(BackendUnavailableError, match=r"attn.*registered for gpu, not ascend"):
        sel.choose("attn", "ascend")
    lax_sel = resolve_selection(_cfg(backend="pallas_gpu"), platform="gpu", registry=reg)
    assert lax_sel.choose("attn", "ascend").backend == "reference"


def test_selections_are_hashable_by_what_they_choose(reg):
    a = resolve_selection(_cfg(backend="pallas_gpu"), platform="gpu", registry=reg)
    b = resolve_selection(_cfg(backend="pallas_gpu"), platform="gpu", registry=reg)
    c = resolve_selection(_cfg(backend="reference"), platform="gpu", registry=reg)
    assert a == b and hash(a) == hash(b) and a != c
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def step(x, sel):
        traces.append(sel)
        with use_selection(sel):
            return reg.select("attn")(x)

    assert int(step(jnp.int32(1), a)) == 102
    assert int(step(jnp.int32(1), b)) == 102  # an equal selection reuses the trace
    assert int(step(jnp.int32(1), c)) == 2  # a different one traces again
    assert len(traces) == 2


def test_lines_and_log_once(reg, caplog):
    caplog.set_level(logging.INFO)
    sel = resolve_selection(
        _cfg(backend="pallas_gpu", overrides={"norm": "reference"}), platform="gpu", registry=reg
    )
    lines = sel.lines()
    assert lines[0].startswith("ops on gpu: backend=pallas_gpu, overrides={'norm': 'reference'}")
    assert "op attn: pallas_gpu -- pallas_gpu requested" in lines
    sel.log()
    sel.log()
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("op attn:")]
    assert logged == ["op attn: pallas_gpu -- pallas_gpu requested"]


def test_project_selection_on_cpu_and_for_export_platforms():
    cpu = resolve_selection(None, platform="cpu")
    assert set(cpu.backends().values()) == {"reference"}
    gpu = resolve_selection(
        types.SimpleNamespace(backend="pallas_gpu", overrides={}, strict=True), platform="gpu"
    )
    assert gpu.backends()["fp8_block_linear"] == "pallas_gpu"
    asc = resolve_selection(
        types.SimpleNamespace(backend="ascend", overrides={}, strict=True), platform="ascend"
    )
    assert asc.backends()["fp8_block_linear"] == "ascend"


def test_info_prints_the_resolved_selection():
    from absl import flags

    from deepinfer_jax.cli import info

    fv = flags.FlagValues()
    info.define_flags(fv)
    fv(["info", "--model", "tiny-v41", "--ops_platform", "gpu", "--set", "ops.backend=pallas_gpu"])
    report = info.collect(fv)["ops"]
    from deepinfer_jax.config.tree import OpsConfig

    want = resolve_selection(OpsConfig(backend="pallas_gpu"), platform="gpu").as_dict()
    assert report == want
    assert report["selected"]["fp8_block_linear"]["backend"] == "pallas_gpu"


def test_every_project_kernel_can_be_interpreted_under_strict():
    # the definition sites of paged_mla_attention, moe_experts and mhc_sinkhorn register them
    for module in (
        "deepinfer_jax.cache.paged",
        "deepinfer_jax.models.common.moe",
        "deepinfer_jax.models.deepseek_v4.mhc",
    ):
        importlib.import_module(module)

    cfg = types.SimpleNamespace(backend="pallas_gpu", overrides={}, strict=True, interpret=True)
    sel = resolve_selection(
        cfg, platform="cpu"
    )  # raises if any Pallas implementation could not be interpreted
    assert {"mhc_sinkhorn", "moe_experts", "paged_mla_attention", "v4_sparse_attention"} <= {
        op for op, be in sel.backends().items() if be == "pallas_gpu"
    }
