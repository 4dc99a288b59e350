"""Nothing poisons an ``LLM``: a failure inside a run aborts that call's requests, frees what they held, and the
next ``generate`` on the same object gives what a fresh ``LLM`` gives.

A hypothesis battery injects each kind of failure at a random step of a small run: an error raised by the device
step before it dispatches, a failed step that consumed the donated cache and state (their buffers are deleted, as
after a device error), a ``KeyboardInterrupt`` while the host reads a step's tokens, a bug in the scheduler, and
an exception from the user's progress bar. After each, every device's blocks and state slots are free, nothing is
queued, running or in flight, and the next run's tokens equal the reference: the same requests on a fresh
``LLM``. tiny-v3, float32, one small bucket.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.params import SamplingParams

SMALL = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_cache_memory": "4MiB"}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31], [40, 41, 42]]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True, seed=3),
    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2),
]
FAULTS = ["device_error", "consumed_state", "keyboard_interrupt", "scheduler_bug", "progress_callback"]


def _run(llm: LLM, **kwargs) -> list[list[int]]:
    kwargs.setdefault("use_tqdm", False)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, **kwargs)
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def _engines() -> tuple[LLM, list[list[int]]]:
    reference = _run(LLM("tiny-v3", **SMALL))
    return LLM("tiny-v3", **SMALL), reference


class Injected(Exception):
    """The failure a test injects."""


@contextlib.contextmanager
def _patched(obj: object, name: str, make):
    """Replace ``obj.name`` by ``make(original)`` for the block (instance attribute, restored after)."""
    had = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        if had:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def _on_call(at: int, effect):
    """A wrapper factory: the ``at``-th call runs ``effect`` (which raises), the others the original."""

    def make(original):
        calls = {"n": 0}

        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == at:
                effect()
            return original(*args, **kwargs)

        return wrapper

    return make


def _assert_empty(llm: LLM) -> None:
    for d in llm.scheduler.devices:
        assert d.blocks.num_free == d.blocks.capacity, "blocks still owned after the failure"
        assert d.slots.num_free == d.slots.capacity, "state slots still owned after the failure"
        d.blocks.check_consistency()
        d.slots.check_consistency()
    assert llm.scheduler.num_waiting == 0 and llm.scheduler.num_running == 0
    assert llm.scheduler.num_in_flight == 0
    assert not llm.scheduler.has_unfinished_requests()


def _inject(llm: LLM, fault: str, at: int):
    """The context that makes the ``at``-th occasion of ``fault`` fail, and the exception it raises."""
    if fault == "device_error":

        def effect():
            raise Injected("device error")

        return _patched(llm.executor, "run", _on_call(at, effect)), Injected
    if fault == "consumed_state":

        def effect():
            # What a failed step leaves: its donated inputs are gone.
            for leaf in jax.tree.leaves((llm.executor.cache, llm.executor.state)):
                leaf.delete()
            raise Injected("step failed after donating its buffers")

        return _patched(llm.executor, "run", _on_call(at, effect)), Injected
    if fault == "keyboard_interrupt":

        def effect():
            raise KeyboardInterrupt

        return _patched(llm.scheduler, "process_outputs", _on_call(at, effect)), KeyboardInterrupt
    if fault == "scheduler_bug":

        def effect():
            raise Injected("scheduler bug")

        return _patched(llm.scheduler, "schedule", _on_call(at, effect)), Injected
    raise AssertionError(fault)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(fault=st.sampled_from(FAULTS), at=st.integers(1, 7))
def test_a_failure_never_poisons_the_engine(fault, at):
    llm, reference = _engines()
    if fault == "progress_callback":
        updates = {"n": 0}

        class Bar:
            def __init__(self, **_):
                pass

            def update(self, _):
                updates["n"] += 1
                if updates["n"] == min(at, len(PROMPTS)):
                    raise Injected("progress callback")

            def close(self):
                pass

        with pytest.raises(Injected):
            _run(llm, use_tqdm=Bar)
    else:
        context, error = _inject(llm, fault, at)
        with context:
            try:
                tokens = _run(llm)
            except error:
                tokens = None
        if tokens is not None:  # the run had fewer occasions than ``at``: it must simply be right
            assert tokens == reference
    _assert_empty(llm)
    assert _run(llm) == reference
    _assert_empty(llm)


def test_a_consumed_cache_is_recreated():
    """The device-failure case on its own: the next run works on re-created arrays."""
    llm, reference = _engines()
    before = llm.executor.cache

    def effect():
        for leaf in jax.tree.leaves((llm.executor.cache, llm.executor.state)):
            leaf.delete()
        raise Injected("step failed")

    with _patched(llm.executor, "run", _on_call(2, effect)), pytest.raises(Injected):
        _run(llm)
    assert llm.executor.cache is not before
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(llm.executor.cache))
    assert _run(llm) == reference


def test_bad_values_are_refused_before_anything_is_queued():
    """Tier 1: what the step would reject is refused by SamplingParams / generate, and nothing is queued."""
    llm, reference = _engines()
    for bad in (
        {"temperature": 1e-40},
        {"temperature": 1e39},
        {"repetition_penalty": 1e-45},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match=r"request 1: sampling_params.logit_bias key 9999 is outside"):
        llm.generate(
            prompt_token_ids=PROMPTS[:2],
            sampling_params=[PARAMS[0], SamplingParams(logit_bias={9999: 1.0})],
            use_tqdm=False,
        )
    _assert_empty(llm)
    assert _run(llm) == reference


@pytest.mark.parametrize("interval", [1, 0], ids=["streamed", "at-the-end"])
def test_a_failure_inside_a_decode_loop_never_poisons_the_engine(interval):
    """``scheduler.num_decode_steps = 4``: the host fails while it processes an iteration of a decode loop, with
    the loop's later iterations (and the next call) still running on the device and delivering their callbacks.
    The run's requests end, everything is freed, the late callbacks of the abandoned calls are dropped, and the
    next run gives the one-token engine's tokens."""
    _, reference = _engines()
    llm = LLM(
        "tiny-v3", **SMALL, **{"scheduler.num_decode_steps": 4, "scheduler.decode_stream_interval": interval}
    )
    assert _run(llm) == reference and llm.last_stats.loop_steps > 0

    def make(original):
        def process(plan, tokens, **kwargs):
            if kwargs.get("iteration", 0) == 2:
                raise Injected("host failure inside a decode loop")
            return original(plan, tokens, **kwargs)

        return process

    with _patched(llm.scheduler, "process_outputs", make), pytest.raises(Injected):
        _run(llm)
    _assert_empty(llm)
    assert _run(llm) == reference
    _assert_empty(llm)
