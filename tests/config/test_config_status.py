"""Every setting is honoured, warned about or refused (deepinfer_jax/config/status.py), and docs/config.md says so."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from deepinfer_jax.config import ConfigValueError, ConfigWarning, env, load_config_with_sources, status
from deepinfer_jax.config.tree import SECTIONS, EngineConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_every_field_has_a_status_and_every_variable_maps_to_one():
    fields = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    fields |= set(EngineConfig.ROOT_FIELDS)
    assert set(status.FIELDS) == fields  # a new field must be classified here
    for var in env.ENV_VARS.values():
        assert var.target is None or var.target in status.FIELDS, var.name
        assert var.target is not None or var.reason, var.name  # a variable without effect says why
    for name, setting in status.FIELDS.items():
        assert setting.status in ("honoured", "warns", "refused") and setting.note, name


def test_the_table_in_the_docs_is_the_generated_one():
    assert status.table_in(DOCS) == status.settings_table(), (
        "docs/config.md is out of date: run python -m deepinfer_jax.config.status --write docs/config.md"
    )
    table = status.settings_table()
    assert "| `scheduler.yoco_truncation` | `DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE` | honoured |" in table
    assert "| — | `DEEPINFER_ENFORCE_EAGER` | warns: no effect |" in table


def _load(environ=None, **overrides):
    return load_config_with_sources(None, env=environ or {}, overrides=overrides or None)


def test_defaults_give_no_warning():
    cfg, sources = _load()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        assert status.check_settings(cfg, sources) == []


def test_a_setting_without_effect_warns_naming_its_source_and_reason():
    cfg, sources = _load({"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "200"})
    with pytest.warns(ConfigWarning) as record:
        status.check_settings(cfg, sources)
    [message] = [str(w.message) for w in record]
    assert message.startswith("scheduler.yoco_keep_tokens = 200 (set by environment variable DEEPINFER_YOCO")
    assert "has no effect here: scheduler.yoco_truncation is off" in message
    cfg, sources = _load(**{"scheduler.decode_bucket_interval": 16})
    with pytest.warns(
        ConfigWarning, match=r"decode_bucket_interval = 16 \(set by override .*step buckets are fixed"
    ):
        status.check_settings(cfg, sources)


def test_speculative_settings_are_honoured():
    """The draft length and variable-length verification are honoured (the engine refuses drafts for families
    that cannot draft, tests/engine/test_engine_speculative.py)."""
    for values in ({"speculative.num_draft_tokens": v} for v in (0, None, 3)):
        cfg, sources = _load(**values)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigWarning)
            status.check_settings(cfg, sources)
    cfg, sources = _load(**{"speculative.variable_length": True, "speculative.latency_cache_ttl_s": 60})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        status.check_settings(cfg, sources)


def test_refused_values_raise_together_naming_each():
    cfg, sources = _load(
        {"DEEPINFER_FORCE_LOAD_BALANCE": "1"}, **{"parallel.context_parallel_size": 2, "revision": "main"}
    )
    with pytest.raises(ConfigValueError) as info:
        status.check_settings(cfg, sources)
    text = str(info.value)
    assert (
        "parallel.moe_force_uniform_routing = True (set by environment variable DEEPINFER_FORCE_LOAD_BALANCE)"
        in text
    )
    assert "parallel.context_parallel_size = 2" in text and "revision = 'main'" in text
    # A refusal of some values only: Engram tables on the device (True / None) are fine, host memory is not.
    cfg, sources = _load(**{"parallel.engram_on_device": True})
    status.check_settings(cfg, sources)
    cfg, sources = _load(**{"parallel.engram_on_device": False})
    with pytest.raises(ConfigValueError, match="engram_on_device = False"):
        status.check_settings(cfg, sources)
    cfg, sources = _load(**{"scheduler.chunked_prefill": False})
    with pytest.raises(ConfigValueError, match="chunked prefill is always on"):
        status.check_settings(cfg, sources)


def test_honoured_settings_warn_where_they_have_no_effect():
    cfg, sources = _load(**{"parallel.eplb_interval_steps": 8})
    with pytest.warns(ConfigWarning, match="eplb_interval_steps = 8 .*need an expert-parallel group"):
        status.check_settings(cfg, sources)
    cfg, sources = _load(**{"parallel.eplb_interval_steps": 8, "parallel.expert_parallel_size": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        status.check_settings(cfg, sources)


def test_env_report_says_what_each_variable_did():
    lines = status.env_report(
        {
            "DEEPINFER_BATCH_INVARIANT": "1",
            "DEEPINFER_ENFORCE_EAGER": "1",
            "DEEPINFER_TYPO": "x",
            "DEEPINFER_JAX_CACHE": "/c",
            "OTHER": "y",
        }
    )
    assert lines == [
        "DEEPINFER_BATCH_INVARIANT = '1': sets ops.batch_invariant (honoured)",
        "DEEPINFER_ENFORCE_EAGER = '1': no effect (XLA compiles and schedules every step; there is no CUDA-graph "
        "or eager mode to choose)",
        "DEEPINFER_JAX_CACHE = '/c': cache directory of materialised built-in models (read by "
        "deepinfer_jax.models.builtin)",
        "DEEPINFER_TYPO = 'x': not a deepinfer_jax setting; ignored",
    ]
