"""Config sources and their priority: yaml (strict), gin (isolated), environment, keyword overrides."""

from __future__ import annotations

import json
import textwrap

import gin
import pytest
import yaml

from deepinfer_jax.config import (
    ConfigTypeError,
    ConfigValueError,
    config_to_dict,
    load_config,
    load_model_config,
    load_yaml,
    parse_gin,
    parse_overrides,
)


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------------------------------- yaml files


def test_unknown_section_names_key_file_and_allowed(tmp_path):
    path = write(tmp_path / "bad.yaml", "caches:\n  block_size: 64\n")
    with pytest.raises(ValueError) as info:
        load_yaml(path)
    message = str(info.value)
    assert "'caches'" in message and str(path) in message
    assert "allowed: model, engine, cache, parallel, scheduler, speculative, sampling, ops" in message


def test_unknown_field_names_key_file_section_and_allowed(tmp_path):
    path = write(tmp_path / "bad.yaml", "scheduler:\n  max_num_seq: 8\n")
    with pytest.raises(ValueError) as info:
        load_yaml(path)
    message = str(info.value)
    assert "'max_num_seq'" in message and "'scheduler'" in message and str(path) in message
    assert "max_num_seqs" in message and "chunked_prefill" in message  # the allowed names


def test_unknown_engine_field(tmp_path):
    path = write(tmp_path / "bad.yaml", "engine:\n  gpu_memory_utilization: 0.5\n")
    with pytest.raises(
        ValueError, match=r"unknown field 'gpu_memory_utilization' in section 'engine'.*max_model_len"
    ):
        load_yaml(path)


def test_section_must_be_a_mapping(tmp_path):
    path = write(tmp_path / "bad.yaml", "cache: 64\n")
    with pytest.raises(TypeError, match=r"section 'cache' of .*bad.yaml: expected a mapping of fields"):
        load_yaml(path)


def test_duplicate_yaml_keys_are_refused(tmp_path):
    path = write(tmp_path / "dup.yaml", "cache:\n  block_size: 64\n  block_size: 32\n")
    with pytest.raises(ValueError, match=r"dup.yaml:3: duplicate key 'block_size' \(first at line 2\)"):
        load_yaml(path)


def test_yaml_1_2_floats(tmp_path):
    path = write(tmp_path / "floats.yaml", "sampling:\n  top_p: 5e-1\n  temperature: 1E0\n")
    data = load_yaml(path)
    assert data["sampling"] == {"top_p": 0.5, "temperature": 1.0}
    assert yaml.safe_load("x: 5e-1")["x"] == "5e-1"  # what plain PyYAML would have done


def test_yaml_model_section_is_not_checked_as_a_section(tmp_path, hf):
    # HF dicts legitimately carry keys nobody reads; only the model parser judges them.
    d = hf("tiny_v3")
    d["initializer_range"] = 0.02
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"model": d}))
    assert load_yaml(path)["model"]["initializer_range"] == 0.02
    assert load_model_config(path).hidden_size == 256


# --------------------------------------------------------------------------------------- model sources


def test_load_model_config_from_dir_json_and_yaml(configs_dir, hf, model_dir):
    d = hf("tiny_v41")
    directory = model_dir(d)
    from_dir = load_model_config(directory)
    from_json = load_model_config(directory / "config.json")
    from_yaml = load_model_config(configs_dir / "tiny_v41.yaml")
    assert from_dir == from_json == from_yaml
    assert from_dir.source == str(directory / "config.json")
    cfg = load_config(directory, env={})
    assert cfg.model_path == str(directory)
    assert cfg.resolved_tokenizer == str(directory)


def test_model_sources_that_do_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        load_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_model_config(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"expected a checkpoint directory, a config.json or a .yaml/.yml file"
    ):
        load_model_config(tmp_path / "weights.bin")


def test_invalid_json_names_file_and_line(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "model_type": "deepseek_v3",\n  oops\n}')
    with pytest.raises(ValueError, match=r"config.json:3: invalid JSON"):
        load_model_config(tmp_path)


def test_no_model_anywhere_gives_a_settings_only_tree(tmp_path):
    path = write(tmp_path / "engine_only.yaml", "cache:\n  block_size: 64\n")
    cfg = load_config(yaml_path=path, env={})
    assert cfg.model is None and cfg.cache.block_size == 64
    assert cfg.num_draft_tokens == 5  # the reference runtime's default when no model says otherwise
    assert cfg.runtime_max_model_len == 4096 + 16
    assert cfg.resolved_kv_cache_dtype == "auto"  # production formats depend on the family
    assert json.loads(json.dumps(config_to_dict(cfg)))["model"] is None
    with pytest.raises(ValueError, match=r"model: building parameters needs a model config"):
        cfg.require_model("building parameters")
    with pytest.raises(
        ValueError, match=r"model.hidden_size: model keys were given but there is no model config"
    ):
        load_config(yaml_path=path, env={}, overrides={"model.hidden_size": 8})


def test_yaml_model_section_merges_over_config_json(hf, model_dir, tmp_path):
    directory = model_dir(hf("tiny_v41"))
    overlay = write(
        tmp_path / "overlay.yaml",
        """\
        model:
          rms_norm_eps: 1.0e-5          # flat: routed into text_config
          text_config:
            rope_scaling:
              factor: 8.0               # deep-merged: the other YaRN keys stay
          pad_token_id: 3               # a V4.1 top-level key stays at the top
        """,
    )
    cfg = load_config(directory, yaml_path=overlay, env={})
    assert cfg.model.rms_norm_eps == 1e-5
    assert cfg.model.compress_rope.factor == 8.0 and cfg.model.compress_rope.beta_fast == 32
    assert cfg.model.pad_token_id == 3
    assert "rms_norm_eps" not in cfg.model.hf  # nothing stray left at the top level
    assert str(overlay) in cfg.model.source and "config.json" in cfg.model.source


# ----------------------------------------------------------------------------------------------- priority


def _peel(levels: list[str], build, read):
    """Apply every level, then drop them from the top one by one; ``read`` gives the winning value."""
    seen = []
    for top in range(len(levels), 0, -1):
        seen.append(read(build(set(levels[:top]))))
    return seen


def test_one_field_set_at_every_level_peeled_one_by_one(hf, model_dir, tmp_path):
    """Effective draft length: default < HF config.json < yaml < gin < environment < keyword override."""
    levels = ["hf", "yaml", "gin", "env", "override"]
    with_block = hf("tiny_v41")  # dspark_block_size = 4
    without_block = hf("tiny_v41")
    without_block["text_config"]["dspark_block_size"] = None  # unknown -> the dataclass default (5) decides
    dir_with, dir_without = model_dir(with_block), model_dir(without_block)
    yaml_file = write(tmp_path / "s.yaml", "speculative:\n  num_draft_tokens: 3\n")

    def build(active):
        return load_config(
            dir_with if "hf" in active else dir_without,
            yaml_path=yaml_file if "yaml" in active else None,
            gin_bindings=["speculative.num_draft_tokens = 2"] if "gin" in active else [],
            env={"DEEPINFER_USE_NEXTN_DECODE": "1"} if "env" in active else {},
            overrides={"speculative.num_draft_tokens": 0} if "override" in active else None,
        )

    peeled = _peel(levels, build, lambda cfg: cfg.num_draft_tokens)
    assert peeled == [0, 1, 2, 3, 4]
    assert build(set()).num_draft_tokens == 5  # nothing set: the default


def test_section_field_at_every_level(hf, model_dir, tmp_path):
    levels = ["yaml", "gin", "env", "override"]
    directory = model_dir(hf("tiny_v3"))
    yaml_file = write(tmp_path / "s.yaml", "cache:\n  state_slots_ratio: 1.5\n")
    gin_file = write(tmp_path / "s.gin", "cache.state_slots_ratio = 2.0\n")

    def build(active):
        return load_config(
            directory,
            yaml_path=yaml_file if "yaml" in active else None,
            gin_files=[gin_file] if "gin" in active else [],
            env={"DEEPINFER_NUM_STATE_SLOTS_RATIO": "3.0"} if "env" in active else {},
            overrides={"cache.state_slots_ratio": 4.0} if "override" in active else None,
        )

    assert _peel(levels, build, lambda cfg: cfg.cache.state_slots_ratio) == [4.0, 3.0, 2.0, 1.5]
    assert build(set()).cache.state_slots_ratio is None  # the engine decides (docs/prefix_cache.md)


def test_model_key_at_every_level(hf, model_dir, tmp_path):
    levels = ["yaml", "gin", "override"]
    directory = model_dir(hf("tiny_v41"))  # rms_norm_eps 1e-6 in config.json
    yaml_file = write(tmp_path / "s.yaml", "model:\n  text_config:\n    rms_norm_eps: 1.0e-5\n")

    def build(active):
        return load_config(
            directory,
            yaml_path=yaml_file if "yaml" in active else None,
            gin_bindings=["model.rms_norm_eps = 1e-4"] if "gin" in active else [],
            overrides={"model.rms_norm_eps": 1e-3} if "override" in active else None,
            env={},
        )

    assert _peel(levels, build, lambda cfg: cfg.model.rms_norm_eps) == [1e-3, 1e-4, 1e-5]
    assert build(set()).model.rms_norm_eps == 1e-6
    # The parsed field and the HF dict agree, so config.json written from it carries the override.
    assert build({"override"}).model.hf["text_config"]["rms_norm_eps"] == 1e-3


def test_none_overrides_do_not_apply(configs_dir):
    cfg = load_config(
        configs_dir / "tiny_v41.yaml",
        gin_bindings=["cache.block_size = 64", "engine.dtype = 'float32'"],
        env={"DEEPINFER_USE_NEXTN_DECODE": "2"},
        overrides={
            "cache.block_size": None,
            "dtype": None,
            "speculative.num_draft_tokens": None,
            "model.hidden_size": None,
        },
    )
    assert cfg.cache.block_size == 64 and cfg.dtype == "float32" and cfg.num_draft_tokens == 2
    assert cfg.model.hidden_size == 256


def test_override_names_are_checked_even_when_none(configs_dir):
    with pytest.raises(ValueError, match=r"unknown field 'cache.blocksize'; fields of 'cache': block_size"):
        load_config(configs_dir / "tiny_v41.yaml", env={}, overrides={"cache.blocksize": None})
    with pytest.raises(ValueError, match=r"unknown setting 'dtypes'; root fields:"):
        load_config(configs_dir / "tiny_v41.yaml", env={}, overrides={"dtypes": "float32"})
    with pytest.raises(ValueError, match=r"'cache' names a section"):
        load_config(configs_dir / "tiny_v41.yaml", env={}, overrides={"cache": {"block_size": 64}})


def test_root_fields_with_and_without_engine_prefix(configs_dir):
    a = load_config(configs_dir / "tiny_v3.yaml", env={}, overrides={"dtype": "float32", "engine.seed": 7})
    assert (a.dtype, a.seed) == ("float32", 7)


def test_errors_name_the_source_that_set_the_value(configs_dir, tmp_path):
    gin_file = write(tmp_path / "bad.gin", "# comment\ncache.block_size = 96\n")
    with pytest.raises(ValueError, match=r"cache.block_size = 96: .* \[set by gin .*bad.gin:2\]"):
        load_config(configs_dir / "tiny_v41.yaml", gin_files=[gin_file], env={})
    with pytest.raises(ValueError, match=r"must be >= 1 \[set by environment variable DEEPINFER_CUDAGRAPH"):
        load_config(configs_dir / "tiny_v41.yaml", env={"DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL": "0"})
    with pytest.raises(ValueError, match=r"text_config.o_groups = 3: .* \[set by override model.o_groups\]"):
        load_config(configs_dir / "tiny_v41.yaml", env={}, overrides={"model.o_groups": 3})
    with pytest.raises(TypeError, match=r"max_model_len: expected int, got str .*\[set by yaml file"):
        load_config(
            configs_dir / "tiny_v41.yaml",
            yaml_path=write(tmp_path / "e.yaml", "engine:\n  max_model_len: '1k'\n"),
            env={},
        )


def test_model_yaml_sections_apply_below_yaml_path(tmp_path, configs_dir, hf):
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(
        yaml.safe_dump({"model": hf("tiny_v3"), "cache": {"block_size": 32}, "engine": {"seed": 1}})
    )
    settings_yaml = write(tmp_path / "settings.yaml", "cache:\n  block_size: 64\n")
    cfg = load_config(model_yaml, yaml_path=settings_yaml, env={})
    assert cfg.cache.block_size == 64 and cfg.seed == 1
    assert cfg.model_path is None


# ---------------------------------------------------------------------------------------------------- gin


def test_gin_state_is_contained(configs_dir, tmp_path):
    @gin.configurable("deepinfer_config_test_probe")
    def probe(x=0):
        return x

    gin.parse_config("deepinfer_config_test_probe.x = 7")
    before = gin.config_str()
    try:
        first = load_config(configs_dir / "tiny_v41.yaml", gin_bindings=["cache.block_size = 64"], env={})
        second = load_config(configs_dir / "tiny_v41.yaml", env={})
        assert first.cache.block_size == 64
        assert second.cache.block_size == 128  # nothing leaked from the first load
        assert gin.config_str() == before  # the process-wide gin config is untouched ...
        assert probe() == 7  # ... and the user's own bindings still apply
    finally:
        gin.clear_config()


def test_gin_files_macros_includes_and_bindings_order(tmp_path, configs_dir):
    write(tmp_path / "base.gin", "BLOCK = 32\ncache.block_size = %BLOCK\nscheduler.max_num_seqs = 8\n")
    main = write(
        tmp_path / "main.gin",
        """\
        include "base.gin"
        scheduler.max_num_seqs = 4           # later statements win
        ops.overrides = {"rope": "reference"}
        model.rope_scaling.factor = 2.0
        """,
    )
    cfg = load_config(
        configs_dir / "tiny_v41.yaml", gin_files=[main], gin_bindings=["engine.max_model_len = 512"], env={}
    )
    assert cfg.cache.block_size == 32 and cfg.scheduler.max_num_seqs == 4
    assert dict(cfg.ops.overrides) == {"rope": "reference"}
    assert cfg.model.compress_rope.factor == 2.0 and cfg.max_model_len == 512


@pytest.mark.parametrize(
    ("binding", "expected"),
    [
        ("cache.block_size = @foo", "configurable reference @foo is not supported"),
        ("cache.block_size = %UNDEFINED", "undefined macro %UNDEFINED"),
        ("train/cache.block_size = 64", "scoped binding train/cache.block_size"),
        ("import os", "import statements are not supported"),
        ("cache.block_size 64", "gin syntax error"),
        ("kache.block_size = 64", "unknown section 'kache'"),
        ("cache.blocks = 64", "unknown field 'cache.blocks'"),
    ],
)
def test_gin_errors(binding, expected, configs_dir):
    with pytest.raises(ValueError, match=None) as info:
        load_config(configs_dir / "tiny_v3.yaml", gin_bindings=[binding], env={})
    assert expected in str(info.value)


def test_gin_include_cycle_and_missing_file(tmp_path):
    write(tmp_path / "a.gin", 'include "b.gin"\n')
    write(tmp_path / "b.gin", 'include "a.gin"\n')
    with pytest.raises(ValueError, match=r"includes itself"):
        parse_gin([tmp_path / "a.gin"])
    with pytest.raises(FileNotFoundError, match=r"cannot read gin file"):
        parse_gin([tmp_path / "missing.gin"])


# ------------------------------------------------------------------------------------------ flag strings


def test_parse_overrides():
    assert parse_overrides(
        [
            "cache.block_size=64",
            "sampling.top_p=5e-1",
            "dtype=float32",
            "tokenizer=null",
            "sampling.banned_token_ids=[1, 2]",
        ]
    ) == {
        "cache.block_size": 64,
        "sampling.top_p": 0.5,
        "dtype": "float32",
        "tokenizer": None,
        "sampling.banned_token_ids": [1, 2],
    }
    with pytest.raises(ValueError, match=r"expected NAME=VALUE"):
        parse_overrides(["cache.block_size"])


def test_override_key_must_be_a_string(configs_dir):
    with pytest.raises(ConfigTypeError):
        load_config(configs_dir / "tiny_v3.yaml", env={}, overrides={1: 2})  # type: ignore[dict-item]


def test_loaded_config_is_json_round_trippable(configs_dir):
    cfg = load_config(configs_dir / "deepseek_v41_flash.yaml", env={})
    data = json.loads(json.dumps(config_to_dict(cfg)))
    assert data["model"]["missing_fields"][0] == "text_config.max_position_embeddings"
    assert isinstance(ConfigValueError("x"), ValueError)


def test_allowed_names_list_only_real_fields(tmp_path):
    path = write(tmp_path / "bad.yaml", "cache:\n  blocks: 64\n")
    with pytest.raises(ValueError) as info:
        load_yaml(path)
    assert "_PREFIX" not in str(info.value) and "block_size" in str(info.value)


def test_two_spellings_of_a_model_key_resolve_by_priority(configs_dir):
    cfg = load_config(
        configs_dir / "tiny_v41.yaml",
        gin_bindings=["model.rms_norm_eps = 1e-4"],
        overrides={"model.text_config.rms_norm_eps": 1e-3},
        env={},
    )
    assert cfg.model.rms_norm_eps == 1e-3
    cfg = load_config(
        configs_dir / "tiny_v41.yaml",
        gin_bindings=["model.text_config.rms_norm_eps = 1e-4"],
        overrides={"model.rms_norm_eps": 1e-3},
        env={},
    )
    assert cfg.model.rms_norm_eps == 1e-3
