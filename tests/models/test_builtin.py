"""The built-in tiny models: registry, HF-layout materialisation, determinism, and cache safety."""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import deepinfer_jax
from deepinfer_jax.models import builtin
from deepinfer_jax.text.synthetic import build_synthetic_tokenizer

TINY = ("tiny-v3", "tiny-v4", "tiny-v41")
REPO = Path(__file__).resolve().parents[2]
FILES = {"COMPLETE", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}

# sha256 of the materialised files: byte-identical on every machine (NumPy-only weights, fixed seeds). A change
# here means the bytes of a built-in model changed: bump the family's generator version and update the values.
EXPECTED_SHA256 = {
    "tiny-v3": {
        "config.json": "ad1f4173afeccf3086e9e2048339606c3deebb3ba0f7e91c454e6c989561de7f",
        "model.safetensors": "f24352cfc5965d3fcc39a00ca0e38deb0e6c4d2536b909ad7274cdcede3a0689",
    },
    "tiny-v4": {
        "config.json": "7c75b9bc0190525ae19f367dff59a8a91e84b520374a86a678978dd6adf60a07",
        "model.safetensors": "4741ff3b4e886d65472d24edba0ed4bc724910a909c3cba10f0baaa0de671f5a",
    },
    "tiny-v41": {
        "config.json": "9977758eeebb4f2ae8371c85349be999024ae13e3d2099cd50fa29ec68e94e6c",
        "model.safetensors": "e3dad591baa749e5b9e962a5f2ace97c01b810236367c58829abd0b98ce04d63",
    },
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _yaml_model(name: str) -> dict:
    """The `model:` section of the model's yaml, read here independently of the code under test."""
    doc = yaml.safe_load((REPO / "configs" / builtin.get_builtin(name).config).read_text())
    return doc["model"]


def _vocab(config: dict) -> int:
    return config.get("text_config", config)["vocab_size"]


def _read_safetensors_header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8 : 8 + n])


@pytest.fixture(scope="session")
def materialized() -> dict[str, Path]:
    """One materialisation per tiny model in the shared cache ($DEEPINFER_JAX_CACHE, set by tests/conftest.py)."""
    return {name: builtin.materialize(name) for name in TINY}


@pytest.fixture
def registry_snapshot():
    """Restore the registries after a test that registers models or generators."""
    models = dict(builtin.BUILTIN_MODELS)
    generators = dict(builtin._WEIGHT_GENERATORS)
    yield
    builtin.BUILTIN_MODELS.clear()
    builtin.BUILTIN_MODELS.update(models)
    builtin._WEIGHT_GENERATORS.clear()
    builtin._WEIGHT_GENERATORS.update(generators)


# ---------------------------------------------------------------------------------------------------------------
# Registry


def test_registry_holds_the_three_tiny_models():
    # The two trained models (tests/models/test_trained_builtin.py) are registered beside them.
    assert builtin.list_builtin() == ["shakespeare-v3", "shakespeare-v41", "tiny-v3", "tiny-v4", "tiny-v41"]
    families = {name: builtin.get_builtin(name).family for name in TINY}
    assert families == {"tiny-v3": "deepseek_v3", "tiny-v4": "deepseek_v4", "tiny-v41": "deepseek_v41"}
    for name in TINY:
        model = builtin.get_builtin(name)
        assert builtin.is_builtin(name)
        assert "random weights" in model.description and "\n" not in model.description
        assert model.yaml_path == REPO / "configs" / model.config and model.yaml_path.is_file()
        assert callable(model.weight_generator) and callable(model.tokenizer_builder)
    assert len({builtin.get_builtin(n).seed for n in TINY}) == 3
    assert not builtin.is_builtin("tiny-v5") and not builtin.is_builtin(None)  # type: ignore[arg-type]


def test_unknown_model_is_refused_with_the_known_names():
    with pytest.raises(
        ValueError,
        match=r"'tiny-v5' is not a built-in model \(known: shakespeare-v3, shakespeare-v41, tiny-v3, tiny-v4, tiny-v41\)",
    ):
        builtin.get_builtin("tiny-v5")
    with pytest.raises(ValueError, match="tiny-v5"):
        builtin.materialize("tiny-v5")


def test_register_builtin_and_reregister_a_weight_generator(registry_snapshot, tmp_path):
    def toy_generator(config, rngs):
        return {"w": rngs("w").standard_normal((2, config["width"]), dtype=np.float32)}

    builtin.register_weight_generator("toy", toy_generator, version="toy-1")
    (tmp_path / "toy.yaml").write_text("model:\n  vocab_size: 300\n  width: 3\n")
    model = builtin.register_builtin(
        "toy", family="toy", config="toy.yaml", description="toy, random weights", seed=7
    )
    assert model.weight_generator is toy_generator and model.generator_version == "toy-1"
    assert "toy" in builtin.list_builtin()

    with pytest.raises(ValueError, match="already registered"):
        builtin.register_builtin("toy", family="toy", config="toy.yaml", description="x", seed=7)
    builtin.register_builtin(
        "toy", family="toy", config="toy.yaml", description="x, random weights", seed=8, replace=True
    )
    assert builtin.get_builtin("toy").seed == 8

    def toy_generator_2(config, rngs):
        return {"w": np.zeros((1,), np.float32)}

    builtin.register_weight_generator("toy", toy_generator_2, version="toy-2")
    assert builtin.get_builtin("toy").weight_generator is toy_generator_2
    assert builtin.get_builtin("toy").generator_version == "toy-2"
    assert builtin.get_builtin("tiny-v3").family == "deepseek_v3"  # other families untouched
    builtin.register_weight_generator("deepseek_v41", toy_generator_2, version="toy-3")
    assert builtin.get_builtin("shakespeare-v41").weight_generator is None  # trained models have none


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"family": "nope"}, ValueError, "family: 'nope' has no registered weight generator"),
        ({"config": "/abs/tiny.yaml"}, ValueError, "relative to the configs/ folder"),
        ({"config": "../tiny.yaml"}, ValueError, "relative to the configs/ folder"),
        ({"seed": -1}, ValueError, "seed: expected a non-negative int, got -1"),
        ({"seed": 1.5}, TypeError, r"seed: expected an int, got 1\.5 \(float\)"),
        ({"name": "../escape"}, ValueError, "it names a cache folder"),
        ({"tokenizer_builder": "tok"}, TypeError, "tokenizer_builder: expected a callable"),
        ({"description": ""}, TypeError, "description: expected a non-empty str"),
    ],
)
def test_register_builtin_refuses_bad_fields(registry_snapshot, kwargs, error, message):
    fields = {
        "name": "tiny-bad",
        "family": "deepseek_v3",
        "config": "tiny_v3.yaml",
        "description": "d, random weights",
        "seed": 1,
    }
    fields.update(kwargs)
    with pytest.raises(error, match=message):
        builtin.register_builtin(**fields)
    assert "tiny-bad" not in builtin.BUILTIN_MODELS


def test_configs_folder_is_found_beside_the_package_or_refused(monkeypatch, tmp_path):
    assert builtin.configs_dir() == REPO / "configs"
    monkeypatch.setattr(deepinfer_jax, "__file__", str(tmp_path / "pkg" / "__init__.py"))
    with pytest.raises(FileNotFoundError, match=r"configs folder .* does not exist"):
        _ = builtin.get_builtin("tiny-v3").yaml_path


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_JAX_CACHE", str(tmp_path / "env"))
    assert builtin.cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    assert builtin.cache_root() == tmp_path / "env"
    monkeypatch.delenv("DEEPINFER_JAX_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert builtin.cache_root() == tmp_path / "home" / ".cache" / "deepinfer_jax"
    with pytest.raises(TypeError, match="cache_dir: expected a path, got int"):
        builtin.cache_root(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# Materialised layout


@pytest.mark.parametrize("name", TINY)
def test_materialized_folder_layout(materialized, name):
    folder = materialized[name]
    assert folder.parent == builtin.cache_root() / "builtin"
    prefix, key = folder.name.rsplit("-", 1)
    assert prefix == name and len(key) == 12 and int(key, 16) >= 0
    assert {p.name for p in folder.iterdir()} == FILES

    config = _yaml_model(name)
    if name == "tiny-v41":
        # The yaml leaves Engram's compressed vocabulary size null; the written config.json carries the size
        # derived from the model's synthetic tokenizer (model.md §9.1; its derivation is tested in
        # tests/models/deepseek_v41/test_v41_engram.py): 412 of the 512 ids remain distinct.
        assert config["text_config"]["engram_compressed_vocab_size"] is None
        config["text_config"]["engram_compressed_vocab_size"] = 412
    assert (folder / "config.json").read_text() == json.dumps(config, indent=2, sort_keys=True) + "\n"
    assert (folder / "tokenizer.json").read_text(encoding="utf-8") == build_synthetic_tokenizer(
        _vocab(config)
    )
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (
        tok_config["bos_token"] == "<｜begin▁of▁sentence｜>"
        and tok_config["eos_token"] == "<｜end▁of▁sentence｜>"
    )

    manifest = json.loads((folder / "COMPLETE").read_text())
    assert set(manifest["files"]) == FILES - {"COMPLETE"}
    for file, entry in manifest["files"].items():
        assert entry == {"bytes": (folder / file).stat().st_size, "sha256": _sha256(folder / file)}


@pytest.mark.parametrize("name", TINY)
def test_materialized_bytes_match_the_committed_hashes(materialized, name):
    for file, digest in EXPECTED_SHA256[name].items():
        assert _sha256(materialized[name] / file) == digest, f"{name}/{file}"


@pytest.mark.parametrize("name", TINY)
def test_model_safetensors_holds_the_generated_tensors_in_name_order(materialized, name):
    path = materialized[name] / "model.safetensors"
    header_len, header = _read_safetensors_header(path)
    assert header_len % 8 == 0
    assert header.pop("__metadata__") == {"format": "pt"}
    names = list(header)
    assert names == sorted(names)
    offsets = [tuple(header[n]["data_offsets"]) for n in names]
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(offsets))
    assert offsets[-1][1] == path.stat().st_size - 8 - header_len

    model = builtin.get_builtin(name)
    expected = model.weight_generator(_yaml_model(name), builtin.TensorRngFactory(model.seed))
    parsed = dict(safetensors.deserialize(path.read_bytes()))  # the safetensors library's own parser
    assert sorted(parsed) == sorted(expected)
    for tensor_name, array in expected.items():
        entry = parsed[tensor_name]
        assert entry["shape"] == list(array.shape), tensor_name
        assert bytes(entry["data"]) == array.tobytes(), tensor_name


def test_tiny_v41_storage_dtypes(materialized):
    _, header = _read_safetensors_header(materialized["tiny-v41"] / "model.safetensors")
    assert header["layers.1.attn.wq_b.weight"]["dtype"] == "F8_E4M3"
    assert header["layers.1.attn.wq_b.scale"]["dtype"] == "F8_E8M0"
    assert header["layers.1.ffn.experts.0.w1.weight"]["dtype"] == "U8"
    assert header["layers.1.ffn.experts.0.w1.scale"]["dtype"] == "F8_E8M0"
    assert header["layers.1.hc_attn_fn"]["dtype"] == "F32"
    assert header["embed.weight"]["dtype"] == "BF16"
    assert header["layers.0.engram.embed.weight"]["shape"] == [4062, 128]


def test_materialize_reuses_a_complete_folder(materialized):
    folder = materialized["tiny-v3"]
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert builtin.materialize("tiny-v3") == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


@pytest.mark.parametrize("name", TINY)
def test_two_cache_dirs_get_identical_bytes(materialized, tmp_path, name):
    a = builtin.materialize(name, cache_dir=tmp_path / "a")
    b = builtin.materialize(name, cache_dir=tmp_path / "b")
    assert a.name == b.name == materialized[name].name
    for file in FILES:
        assert (
            (a / file).read_bytes() == (b / file).read_bytes() == (materialized[name] / file).read_bytes()
        ), file


def test_corrupted_or_incomplete_cache_is_rebuilt(materialized, tmp_path):
    reference = materialized["tiny-v3"]
    folder = builtin.materialize("tiny-v3", cache_dir=tmp_path)

    weights = folder / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    weights.write_bytes(bytes(raw))
    assert builtin.materialize("tiny-v3", cache_dir=tmp_path) == folder
    assert weights.read_bytes() == (reference / "model.safetensors").read_bytes()

    (folder / "COMPLETE").unlink()  # a folder without its manifest is unfinished
    (folder / "tokenizer.json").write_text("truncated")
    stale = folder.parent / f".{folder.name}.tmp-crashed"  # left behind by a writer that died
    stale.mkdir()
    assert builtin.materialize("tiny-v3", cache_dir=tmp_path) == folder
    for file in FILES:
        assert (folder / file).read_bytes() == (reference / file).read_bytes(), file
    assert not stale.exists()
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted([folder.name, f"{folder.name}.lock"])


def test_processes_racing_on_an_empty_cache_agree(materialized, tmp_path):
    cache = tmp_path / "race"
    script = textwrap.dedent(
        f"""
        import sys
        from deepinfer_jax.models import builtin
        print(builtin.materialize("tiny-v3", cache_dir={str(cache)!r}))
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in results}
    assert paths == {str(cache / "builtin" / materialized["tiny-v3"].name)}
    folder = Path(paths.pop())
    for file in FILES:
        assert (folder / file).read_bytes() == (materialized["tiny-v3"] / file).read_bytes(), file
    # No partial or temporary folder is left behind: only the model folder and its lock file.
    assert sorted(p.name for p in (cache / "builtin").iterdir()) == sorted(
        [folder.name, f"{folder.name}.lock"]
    )


def test_missing_tokenizer_builder_fails_clearly(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deepinfer_jax.text.synthetic", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"synthetic tokenizer builder .*build_synthetic_tokenizer"):
        builtin.materialize("tiny-v41", cache_dir=tmp_path)
    assert not (tmp_path / "builtin").exists()


def test_bad_yaml_is_refused_with_the_file_named(registry_snapshot, monkeypatch, tmp_path):
    monkeypatch.setattr(builtin, "configs_dir", lambda: tmp_path)
    builtin.register_builtin("tiny-bad", family="deepseek_v3", config="bad.yaml", description="d", seed=1)
    with pytest.raises(FileNotFoundError, match=r"bad\.yaml does not exist"):
        builtin.materialize("tiny-bad", cache_dir=tmp_path / "cache")
    (tmp_path / "bad.yaml").write_text("engine: {}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: expected a mapping with a `model:` mapping"):
        builtin.materialize("tiny-bad", cache_dir=tmp_path / "cache")
    (tmp_path / "bad.yaml").write_text("model: {vocab_size: 0}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: model\.vocab_size: expected a positive int, got 0"):
        builtin.materialize("tiny-bad", cache_dir=tmp_path / "cache")
    (tmp_path / "bad.yaml").write_text("model: {vocab_size: 300, hidden_size: [}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: not valid yaml"):
        builtin.materialize("tiny-bad", cache_dir=tmp_path / "cache")


def test_a_failing_generator_leaves_no_folder(registry_snapshot, monkeypatch, tmp_path):
    def broken(config, rngs):
        raise ValueError("hidden_size: required key is missing")

    builtin.register_weight_generator("deepseek_v3", broken, version="broken")
    with pytest.raises(ValueError, match="hidden_size"):
        builtin.materialize("tiny-v3", cache_dir=tmp_path)
    assert [p.name for p in (tmp_path / "builtin").iterdir() if not p.name.endswith(".lock")] == []


def test_cache_key_follows_the_generator_version(registry_snapshot, materialized, tmp_path):
    fn = builtin.get_builtin("tiny-v3").weight_generator
    builtin.register_weight_generator("deepseek_v3", fn, version="another-version")
    folder = builtin.materialize("tiny-v3", cache_dir=tmp_path)
    assert folder.name != materialized["tiny-v3"].name
    assert (folder / "model.safetensors").read_bytes() == (
        materialized["tiny-v3"] / "model.safetensors"
    ).read_bytes()


# ---------------------------------------------------------------------------------------------------------------
# safetensors writer

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "U8": np.uint8,
    "I8": np.int8,
    "I64": np.int64,
}


@settings(max_examples=30, deadline=None)
@given(
    spec=st.dictionaries(
        st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=12),
        st.tuples(st.sampled_from(sorted(_DTYPES)), st.lists(st.integers(0, 4), max_size=3)),
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_write_safetensors_round_trips_through_the_reference_parser(tmp_path_factory, spec, seed):
    rng = np.random.default_rng(seed)
    tensors = {
        name: rng.integers(
            0, 256, size=int(np.prod(shape)) * np.dtype(_DTYPES[code]).itemsize, dtype=np.uint8
        )
        .view(_DTYPES[code])
        .reshape(shape)
        for name, (code, shape) in spec.items()
    }
    path = tmp_path_factory.mktemp("st") / "t.safetensors"
    builtin.write_safetensors(path, tensors, {"format": "pt"})
    header_len, header = _read_safetensors_header(path)
    assert header_len % 8 == 0 and header.pop("__metadata__") == {"format": "pt"}
    assert list(header) == sorted(tensors)
    parsed = dict(safetensors.deserialize(path.read_bytes()))
    for name, (code, shape) in spec.items():
        assert parsed[name]["dtype"] == code
        assert parsed[name]["shape"] == shape
        assert bytes(parsed[name]["data"]) == tensors[name].tobytes()


def test_write_safetensors_refuses_unknown_dtypes_and_names(tmp_path):
    with pytest.raises(TypeError, match=r"tensor 'c': dtype complex64 has no safetensors encoding"):
        builtin.write_safetensors(tmp_path / "x", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="__metadata__"):
        builtin.write_safetensors(tmp_path / "x", {"__metadata__": np.zeros(2, np.float32)})
    with pytest.raises(TypeError, match="metadata"):
        builtin.write_safetensors(tmp_path / "x", {}, {"format": 1})  # type: ignore[dict-item]


def test_big_endian_arrays_are_written_little_endian(tmp_path):
    value = np.arange(4, dtype=">f4")
    builtin.write_safetensors(tmp_path / "x", {"v": value})
    parsed = dict(safetensors.deserialize((tmp_path / "x").read_bytes()))
    assert bytes(parsed["v"]["data"]) == np.arange(4, dtype="<f4").tobytes()


def test_environment_is_only_read_for_the_cache_root():
    source = Path(builtin.__file__).read_text()
    assert source.count("os.environ") == 1 and "DEEPINFER_JAX_CACHE" in source
    assert "getenv" not in source
