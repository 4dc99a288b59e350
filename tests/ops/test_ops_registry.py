"""The op registry: registration, selection by platform and backend, fallback logging, strict mode, describe()."""

from __future__ import annotations

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax import ops
from deepinfer_jax.ops import registry as registry_lib
from deepinfer_jax.ops.registry import BackendUnavailableError, OpRegistry


def _double_ref(x):
    return x * 2


def _double_pallas(x):
    return x * 2 + 100  # distinguishable result: tells which implementation ran


def _double_cute(x):
    return x * 2 + 200


@pytest.fixture
def reg() -> OpRegistry:
    """A private registry with one op, a GPU Pallas kernel and an SM100 kernel whose probe is switchable."""
    r = OpRegistry()
    r.register_op("double", _double_ref, doc="multiply by two")
    r.register_op("other", _double_ref, doc="a second op, for per-op overrides")
    r.register_impl("double", "pallas_gpu", _double_pallas, platforms=("gpu",))
    state = {"cute_ok": True}
    r.register_impl(
        "double",
        "cutedsl_sm100",
        _double_cute,
        platforms=("gpu",),
        available=lambda: state["cute_ok"],
        reason="needs nvidia-cutlass-dsl",
    )
    r.register_impl("other", "pallas_gpu", _double_pallas, platforms=("gpu",))
    r._test_state = state  # type: ignore[attr-defined]
    return r


def _absl_records(caplog, needle: str) -> list[logging.LogRecord]:
    return [rec for rec in caplog.records if rec.name == "absl" and needle in rec.getMessage()]


# ------------------------------------------------------------------ registration


def test_register_and_list(reg):
    assert reg.list_ops() == ["double", "other"]
    assert reg.backends_for("double") == ["reference", "pallas_gpu", "cutedsl_sm100"]
    assert reg.doc("double") == "multiply by two"


def test_register_op_returns_fn_and_rejects_duplicates(reg):
    assert reg.register_op("triple", _double_ref, doc="x") is _double_ref
    with pytest.raises(ValueError, match="'double' is already registered"):
        reg.register_op("double", _double_ref, doc="again")


def test_register_impl_rejects_duplicates(reg):
    with pytest.raises(ValueError, match="already has a 'pallas_gpu' implementation"):
        reg.register_impl("double", "pallas_gpu", _double_pallas)


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        (
            {"backend": "triton"},
            ValueError,
            "unknown backend 'triton'; known backends: reference, pallas_gpu",
        ),
        ({"backend": "reference"}, ValueError, "given to register_op"),
        (
            {"backend": "ascend", "platforms": ("npu",)},
            ValueError,
            "unknown platform 'npu'; known platforms: cpu",
        ),
        ({"backend": "ascend", "platforms": ()}, ValueError, "at least one platform"),
        ({"backend": "ascend", "platforms": "gpu"}, TypeError, "sequence of platform names"),
        ({"backend": "ascend", "fn": 3}, TypeError, "fn must be callable or a 'module:attribute' string"),
        ({"backend": "ascend", "available": True}, TypeError, "available must be a callable"),
        ({"backend": "ascend", "priority": 1.5}, TypeError, "priority must be an int"),
    ],
)
def test_register_impl_validation(reg, kwargs, exc, pattern):
    args = {"op_name": "double", "fn": _double_pallas, **kwargs}
    with pytest.raises(exc, match=pattern):
        reg.register_impl(args.pop("op_name"), args.pop("backend"), args.pop("fn"), **args)


def test_bad_op_names_are_refused():
    r = OpRegistry()
    with pytest.raises(ValueError, match="non-empty identifier"):
        r.register_op("rms norm", _double_ref, doc="x")
    with pytest.raises(TypeError, match="op name must be a str"):
        r.register_op(3, _double_ref, doc="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="doc must be a non-empty str"):
        r.register_op("ok", _double_ref, doc=" ")
    with pytest.raises(TypeError, match="must be callable"):
        r.register_op("ok", "not callable", doc="x")  # type: ignore[arg-type]


def test_unknown_op_and_backend_errors(reg):
    with pytest.raises(ValueError, match=r"unknown op 'nope'; registered ops: double, other"):
        reg.select("nope")
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        reg.register_impl("nope", "pallas_gpu", _double_pallas)
    with pytest.raises(ValueError, match="backend: unknown backend 'cuda'; known backends: auto, reference"):
        reg.select("double", backend="cuda")
    with pytest.raises(TypeError, match="backend must be a str"):
        reg.select("double", backend=3)  # type: ignore[arg-type]
    # None is the default: "what the active selection says", plain auto without one
    assert reg.select("double", backend=None).requested == "auto"


# ------------------------------------------------------------------ selection


def test_auto_on_faked_gpu_picks_most_specialised_available(reg):
    sel = reg.select("double", platform="gpu")
    assert (sel.backend, sel.platform, sel.requested) == ("cutedsl_sm100", "gpu", "auto")
    assert int(sel(jnp.int32(1))) == 202
    reg._test_state["cute_ok"] = False
    sel = reg.select("double", platform="gpu")
    assert sel.backend == "pallas_gpu"
    assert int(sel(jnp.int32(1))) == 102


def test_auto_on_cpu_is_reference(reg):
    sel = reg.select("double", platform="cpu")
    assert sel.backend == "reference"
    assert sel.reason == "auto: no implementation registered for cpu"
    assert not sel.fell_back


def test_auto_uses_current_platform_by_default(reg):
    assert jax.default_backend() == "cpu"  # the test suite forces the CPU
    assert reg.select("double").platform == "cpu"


def test_platform_aliases(reg):
    assert reg.select("double", platform="CUDA").platform == "gpu"
    assert reg.select("double", platform="cuda").backend == "cutedsl_sm100"


def test_priority_beats_default_order(reg):
    reg.register_impl("other", "cutedsl_sm100", _double_cute, platforms=("gpu",))
    assert reg.select("other", platform="gpu").backend == "cutedsl_sm100"
    r = OpRegistry()
    r.register_op("double", _double_ref, doc="x")
    r.register_impl("double", "cutedsl_sm100", _double_cute, platforms=("gpu",))
    r.register_impl("double", "pallas_gpu", _double_pallas, platforms=("gpu",), priority=1)
    assert r.select("double", platform="gpu").backend == "pallas_gpu"


def test_auto_with_every_candidate_unavailable_reports_why(reg, caplog):
    caplog.set_level(logging.INFO, logger="absl")
    r = OpRegistry()
    r.register_op("double", _double_ref, doc="x")
    r.register_impl("double", "pallas_gpu", _double_pallas, available=lambda: False, reason="no triton")
    sel = r.select("double", platform="gpu")
    assert sel.backend == "reference"
    assert sel.reason == "auto: no registered implementation can run (pallas_gpu: no triton)"
    assert len(_absl_records(caplog, "auto skips 'pallas_gpu' on gpu (no triton)")) == 1


def test_explicit_backend_runs_when_possible(reg):
    sel = reg.select("double", backend="pallas_gpu", platform="gpu")
    assert (sel.backend, sel.reason, sel.fell_back) == ("pallas_gpu", "pallas_gpu requested", False)
    assert reg.select("double", backend="reference", platform="gpu").backend == "reference"


@pytest.mark.parametrize(
    ("backend", "platform", "why"),
    [
        ("ascend", "gpu", "no ascend implementation is registered for this op"),
        ("pallas_gpu", "cpu", "the pallas_gpu implementation is registered for gpu, not cpu"),
        ("cutedsl_sm100", "gpu", "needs nvidia-cutlass-dsl"),
    ],
)
def test_fallback_to_reference_logs_why(reg, caplog, backend, platform, why):
    reg._test_state["cute_ok"] = False
    caplog.set_level(logging.WARNING, logger="absl")
    sel = reg.select("double", backend=backend, platform=platform)
    assert sel.backend == "reference" and sel.fell_back
    assert sel.fn is _double_ref
    assert sel.reason == f"fallback from {backend}: {why}"
    records = _absl_records(caplog, f"op 'double': backend '{backend}' cannot run on {platform} ({why})")
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].getMessage().endswith("using the reference")


@pytest.mark.parametrize(
    ("backend", "platform"), [("ascend", "gpu"), ("pallas_gpu", "cpu"), ("cutedsl_sm100", "gpu")]
)
def test_strict_mode_raises_instead(reg, backend, platform):
    reg._test_state["cute_ok"] = False
    with pytest.raises(
        BackendUnavailableError, match=f"op 'double': backend '{backend}' cannot run on {platform}"
    ):
        reg.select("double", backend=backend, platform=platform, strict=True)
    # strict never affects auto or a backend that can run
    assert reg.select("double", platform="cpu", strict=True).backend == "reference"
    assert reg.select("double", backend="pallas_gpu", platform="gpu", strict=True).backend == "pallas_gpu"


def test_per_op_override(reg):
    overrides = {"double": "reference"}
    assert (
        reg.select("double", backend="pallas_gpu", overrides=overrides, platform="gpu").backend == "reference"
    )
    assert (
        reg.select("other", backend="pallas_gpu", overrides=overrides, platform="gpu").backend == "pallas_gpu"
    )
    sel = reg.select("other", backend="reference", overrides={"other": "auto"}, platform="gpu")
    assert (sel.backend, sel.requested) == ("pallas_gpu", "auto")


def test_override_validation(reg):
    with pytest.raises(ValueError, match="overrides: unknown op 'dubble'; registered ops: double, other"):
        reg.select("double", overrides={"dubble": "reference"})
    with pytest.raises(ValueError, match=r"overrides\['double'\]: unknown backend 'fast'"):
        reg.select("double", overrides={"double": "fast"})
    with pytest.raises(TypeError, match="overrides must be a mapping"):
        reg.select("double", overrides=[("double", "reference")])  # type: ignore[arg-type]


def test_fallback_is_logged_once_even_under_jit_retracing(reg, caplog):
    caplog.set_level(logging.WARNING, logger="absl")
    traces = []

    @jax.jit
    def f(x):
        traces.append(x.shape)
        return reg.call("double", x, backend="ascend", platform="gpu")

    for n in (1, 2, 3):
        np.testing.assert_array_equal(f(jnp.ones(n)), np.full(n, 2.0))
    for _ in range(3):
        reg.select("double", backend="ascend", platform="gpu")
    assert len(traces) == 3  # three shapes, three traces, three selections...
    assert len(_absl_records(caplog, "backend 'ascend' cannot run on gpu")) == 1  # ...one log line
    # a different reason (another platform) is a new line
    reg.select("double", backend="ascend", platform="cpu")
    assert len(_absl_records(caplog, "backend 'ascend' cannot run on cpu")) == 1


def test_probe_that_raises_counts_as_unavailable(reg):
    def probe() -> bool:
        raise OSError("libcuda.so not found")

    reg.register_impl("other", "cutedsl_sm100", _double_cute, available=probe, reason="needs a CUDA driver")
    sel = reg.select("other", backend="cutedsl_sm100", platform="gpu")
    assert sel.backend == "reference"
    assert "needs a CUDA driver (availability check raised OSError: libcuda.so not found)" in sel.reason


def test_lazy_string_targets_resolve_on_selection(reg):
    reg.register_impl("other", "ascend", "operator:neg", platforms=("cpu",))
    sel = reg.select("other", backend="ascend", platform="cpu")
    assert sel.backend == "ascend" and int(sel(jnp.int32(3))) == -3
    reg.register_impl("double", "ascend", "deepinfer_jax_no_such_module:kernel", platforms=("cpu",))
    sel = reg.select("double", backend="ascend", platform="cpu")
    assert sel.backend == "reference"
    assert "cannot import 'deepinfer_jax_no_such_module:kernel' (ModuleNotFoundError" in sel.reason


def test_get_and_call(reg):
    assert reg.get("double", platform="gpu") is _double_cute
    assert int(reg.call("double", jnp.int32(5), backend="reference")) == 10
    assert int(jax.jit(lambda x: reg.call("double", x))(jnp.int32(5))) == 10


def test_select_from_duck_typed_config(reg):
    cfg = types.SimpleNamespace(backend="pallas_gpu", overrides={"other": "reference"})
    assert reg.select_from(cfg, "double", platform="gpu").backend == "pallas_gpu"
    assert reg.select_from(cfg, "other", platform="gpu").backend == "reference"
    strict_cfg = types.SimpleNamespace(backend="ascend", overrides=None, strict=True)
    with pytest.raises(BackendUnavailableError):
        reg.select_from(strict_cfg, "double", platform="gpu")
    with pytest.raises(TypeError, match="SimpleNamespace lacks 'overrides'"):
        reg.select_from(types.SimpleNamespace(backend="auto"), "double")


def test_describe_table(reg):
    reg._test_state["cute_ok"] = False
    rows = {row["op"]: row for row in reg.describe_rows(platform="gpu")}
    assert rows["double"] == {
        "op": "double",
        "reference": "all",
        "pallas_gpu": "gpu",
        "cutedsl_sm100": "gpu (unavailable)",
        "ascend": "-",
        "auto": "pallas_gpu",
        "doc": "multiply by two",
    }
    text = reg.describe(platform="gpu")
    lines = text.splitlines()
    assert lines[0].split() == ["op", "reference", "pallas_gpu", "cutedsl_sm100", "ascend", "auto", "(gpu)"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["double", "all", "gpu", "gpu", "(unavailable)", "-", "pallas_gpu"]
    assert lines[3].split() == ["other", "all", "gpu", "-", "-", "pallas_gpu"]
    assert reg.describe(platform="cpu").splitlines()[2].split()[-1] == "reference"


def test_describe_does_not_use_up_the_log_budget(reg, caplog):
    reg._test_state["cute_ok"] = False
    caplog.set_level(logging.INFO, logger="absl")
    reg.describe(platform="gpu")
    assert not _absl_records(caplog, "auto skips")
    reg.select("double", platform="gpu")
    assert len(_absl_records(caplog, "auto skips 'cutedsl_sm100' on gpu")) == 1


# ------------------------------------------------------------------ the project's default registry


def test_default_registry_holds_the_project_ops():
    assert {"rms_norm", "rope"} <= set(ops.list_ops())
    assert registry_lib.default_registry is ops.default_registry
    assert ops.select("rms_norm", platform="cpu").fn is ops.rms_norm
    assert ops.select("rope").fn is ops.apply_rope
    text = ops.describe(platform="cpu")
    assert "rms_norm" in text and "rope" in text


def test_default_registry_call_matches_direct_call():
    x = jnp.arange(8, dtype=jnp.float32).reshape(2, 4) - 3.0
    np.testing.assert_array_equal(ops.call("rms_norm", x, eps=1e-6), ops.rms_norm(x, eps=1e-6))
    np.testing.assert_array_equal(
        ops.get("rms_norm", backend="reference")(x, eps=1e-6), ops.rms_norm(x, eps=1e-6)
    )
