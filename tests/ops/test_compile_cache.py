"""The persistent compilation cache and the trace cache (deepinfer_jax/ops/compile_cache.py).

The trace cache skips tracing on a later start, so what it must never do is serve a program traced for a
different function, shape or static setting: each test below would fail if the key missed one of them or if the
deserialised program computed something else than the traced one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from deepinfer_jax.ops import compile_cache


@pytest.fixture
def own_cache(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        assert compile_cache.configure(True, tmp_path / "jit") == str(tmp_path / "jit")
        yield tmp_path / "jit"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
        compilation_cache.reset_cache()


def _fn(scale):
    def f(tree, y):
        return {"sum": tree["a"] @ tree["b"] * scale + y, "max": jnp.max(y)}

    return f


def _args(n):
    s = jax.ShapeDtypeStruct
    return ({"a": s((n, 4), jnp.float32), "b": s((4, n), jnp.float32)}, s((n, n), jnp.float32))


def test_traced_program_is_stored_read_back_and_equal_to_jit(own_cache):
    rng = np.random.default_rng(0)
    n = 3
    tree = {"a": rng.standard_normal((n, 4), np.float32), "b": rng.standard_normal((4, n), np.float32)}
    y = rng.standard_normal((n, n), np.float32)
    want = jax.jit(_fn(2.0))(tree, y)
    before = compile_cache.trace_counters()
    first = compile_cache.compile_traced(_fn(2.0), _args(n), static_key="scale=2")
    assert compile_cache.trace_counters().misses == before.misses + 1
    assert len(list((own_cache / "traces").glob("*.trace"))) == 1
    second = compile_cache.compile_traced(_fn(2.0), _args(n), static_key="scale=2")
    assert compile_cache.trace_counters().hits == before.hits + 1
    for got in (first(tree, y), second(tree, y)):
        np.testing.assert_allclose(got["sum"], want["sum"], rtol=1e-6)
        assert float(got["max"]) == float(want["max"])
    # Another static key or another shape is another program, traced anew.
    other = compile_cache.compile_traced(_fn(3.0), _args(n), static_key="scale=3")
    np.testing.assert_allclose(other(tree, y)["sum"], jax.jit(_fn(3.0))(tree, y)["sum"], rtol=1e-6)
    compile_cache.compile_traced(_fn(2.0), _args(n + 1), static_key="scale=2")
    assert compile_cache.trace_counters().misses == before.misses + 3


def test_torn_entry_is_traced_anew(own_cache):
    compile_cache.compile_traced(_fn(2.0), _args(2), static_key="torn")
    (entry,) = (own_cache / "traces").glob("*.trace")
    entry.write_bytes(b"not a trace")
    before = compile_cache.trace_counters()
    fn = compile_cache.compile_traced(_fn(2.0), _args(2), static_key="torn")
    assert compile_cache.trace_counters().misses == before.misses + 1
    x = {"a": np.ones((2, 4), np.float32), "b": np.ones((4, 2), np.float32)}
    np.testing.assert_allclose(fn(x, np.zeros((2, 2), np.float32))["sum"], np.full((2, 2), 8.0))


def test_donated_arguments_are_donated(own_cache):
    fn = compile_cache.compile_traced(
        lambda a, b: (a + b, b),
        (jax.ShapeDtypeStruct((8,), jnp.float32),) * 2,
        static_key="d",
        donate_argnums=(0,),
    )
    a = jnp.ones(8)
    out, _ = fn(a, jnp.ones(8))
    assert a.is_deleted() and float(out.sum()) == 16.0


def test_a_folder_set_through_jax_gets_no_trace_cache(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
        assert compile_cache.configure(True, None) == str(tmp_path / "user")  # the user's JAX setting stands
        compile_cache.compile_traced(_fn(2.0), _args(2), static_key="user")
        assert not (tmp_path / "user" / "traces").exists()
        with pytest.raises(ValueError, match=r"ops\.kernel_cache_dir"):
            compile_cache.configure(False, tmp_path / "x")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


def test_a_program_jax_export_refuses_compiles_without_the_trace_cache(own_cache):
    # A host callback has no serialisation guarantee: jax.export refuses it, so the program is compiled by plain
    # jit (same result) and nothing is written to the trace folder.
    def f(x):
        return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    x = np.arange(4, dtype=np.float32)
    fn = compile_cache.compile_traced(f, (jax.ShapeDtypeStruct((4,), jnp.float32),), static_key="cb")
    np.testing.assert_array_equal(fn(x), x * 2 + 1)
    assert not list((own_cache / "traces").glob("*.trace"))
