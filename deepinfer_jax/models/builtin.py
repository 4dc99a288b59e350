"""Built-in models: a registry, deterministic random weights, shipped trained weights, and an HF-layout writer.

Researchers without checkpoints or GPUs still need complete models to run the engine end to end, so the project
ships three tiny ones - `tiny-v3`, `tiny-v4` and `tiny-v41` - with **random weights**, and two small *trained*
ones, `shakespeare-v41` and `shakespeare-v3`, whose checkpoints are files of the package
(`deepinfer_jax/models/trained/<name>/`, made by `scripts/train_tiny.py`): `materialize` returns that folder as
it is, and loading one never trains or writes anything. Each random-weight model is described by a
yaml file in the repository's `configs/` folder (its `model:` section is the HF `config.json`), a synthetic
tokenizer and a deterministic weight generator for its family. `materialize(name)` writes the model on first
use, in the layout of a Hugging Face checkpoint folder:

    <cache>/builtin/<name>-<key>/
        config.json            the yaml's `model:` section (sorted keys, 2-space indent)
        model.safetensors      every tensor of the family's checkpoint contract, names in sorted order
        tokenizer.json         the synthetic tokenizer (exactly `vocab_size` ids)
        tokenizer_config.json  minimal: tokenizer class and special tokens, so `AutoTokenizer` can load it
        COMPLETE               manifest (sha256 and size of every file), written last

`<cache>` is the `cache_dir` argument, else the environment variable `DEEPINFER_JAX_CACHE`, else
`~/.cache/deepinfer_jax`; `DEEPINFER_JAX_CACHE` is the only environment variable this module reads. `<key>` is a
short hash of everything the folder's bytes depend on (the yaml bytes, the generator version, the seed, the
tokenizer text and the folder layout version), so an edited config never reuses a stale folder.

Writers are safe against each other: the folder is built in a temporary directory beside the target, fsynced and
renamed into place with `os.replace` while holding a file lock, so parallel pytest-xdist workers and separate
processes racing on an empty cache all end up reading the same complete folder. A folder whose manifest does not
match its files (a corrupted or truncated cache) is rebuilt.

Weights come from NumPy only: `np.random.default_rng` seeded per tensor from `(model seed, tensor name)`
(`TensorRngFactory`), so the bytes are identical on every machine and independent of the JAX version, and adding
a tensor never changes the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import filelock
import ml_dtypes
import numpy as np
import yaml

import deepinfer_jax
from deepinfer_jax.models import synthetic_base
from deepinfer_jax.models.deepseek_v3 import synthetic as v3_synthetic
from deepinfer_jax.models.deepseek_v4 import synthetic as v4_synthetic

__all__ = [
    "BUILTIN_MODELS",
    "CACHE_ENV_VAR",
    "BuiltinModel",
    "RngFactory",
    "TensorRngFactory",
    "TokenizerBuilder",
    "WeightGenerator",
    "cache_root",
    "configs_dir",
    "get_builtin",
    "hf_config",
    "is_builtin",
    "list_builtin",
    "materialize",
    "register_builtin",
    "register_trained",
    "register_weight_generator",
    "trained_folder",
    "write_safetensors",
]

CACHE_ENV_VAR = "DEEPINFER_JAX_CACHE"

RngFactory = synthetic_base.RngFactory
"""`tensor name -> numpy Generator`: an independent, reproducible random stream per tensor."""

WeightGenerator = Callable[[Mapping[str, Any], RngFactory], dict[str, np.ndarray]]
"""`(raw HF config dict, rng factory) -> {tensor name: array in its storage dtype}`."""

TokenizerBuilder = Callable[[int], str]
"""`vocab_size -> tokenizer.json text`."""

# Bump when the set of files or their formatting changes (the weights have their own generator versions).
_LAYOUT_VERSION = "builtin-layout-3"
_MANIFEST = "COMPLETE"
_KEY_CHARS = 12
_LOCK_TIMEOUT_S = 900.0
_SAFETENSORS_METADATA = {"format": "pt"}


# ---------------------------------------------------------------------------------------------------------------
# Deterministic random streams


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {seed!r} ({type(seed).__name__})")
    if seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed}")
    return seed


class TensorRngFactory:
    """Per-tensor NumPy generators derived from a model seed and the tensor name.

    The stream of a tensor is `default_rng(SeedSequence([seed, *sha256(name) as eight uint32 words]))`: it
    depends on nothing but the seed and the name, so tensors can be generated in any order, and adding, removing
    or renaming one tensor leaves every other tensor's bytes unchanged.
    """

    def __init__(self, seed: int) -> None:
        self.seed = _check_seed(seed)

    def __call__(self, name: str) -> np.random.Generator:
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor name: expected a non-empty str, got {name!r}")
        words = np.frombuffer(hashlib.sha256(name.encode("utf-8")).digest(), dtype="<u4")
        return np.random.default_rng(np.random.SeedSequence([self.seed, *(int(w) for w in words)]))


# ---------------------------------------------------------------------------------------------------------------
# Registry


def configs_dir() -> Path:
    """The repository's `configs/` folder (beside the `deepinfer_jax` package directory)."""
    path = Path(deepinfer_jax.__file__).resolve().parent.parent / "configs"
    if not path.is_dir():
        raise FileNotFoundError(
            f"built-in models: the configs folder {path} does not exist; the built-in models need a source "
            "checkout (or an install that ships configs/ beside the deepinfer_jax package)"
        )
    return path


def trained_folder(name: str) -> Path:
    """The package folder of trained built-in model ``name``: ``deepinfer_jax/models/trained/<name>/``."""
    return Path(deepinfer_jax.__file__).resolve().parent / "models" / "trained" / name


_TRAINED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _synthetic_tokenizer(vocab_size: int) -> str:
    """The project's synthetic tokenizer (`deepinfer_jax.text.synthetic`).

    Imported on use rather than at module import, so that the registry stays importable on its own and a
    missing builder is reported, when a model is materialised, as exactly that.
    """
    try:
        from deepinfer_jax.text.synthetic import build_synthetic_tokenizer
    except ImportError as e:
        raise ImportError(
            "built-in models need the synthetic tokenizer builder "
            f"deepinfer_jax.text.synthetic.build_synthetic_tokenizer, which cannot be imported: {e}"
        ) from e
    return build_synthetic_tokenizer(vocab_size)


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """One built-in model: where its config lives and how its tokenizer and weights are produced.

    A trained model (``trained`` set) has its whole checkpoint folder in the package instead: ``config`` is then
    that folder's ``config.json`` and there is no weight generator.
    """

    name: str
    family: str  # "deepseek_v3" | "deepseek_v4" | "deepseek_v41"
    config: str  # yaml file name, relative to the repository's configs/ folder ("config.json" if trained)
    description: str  # one line; says whether the weights are random or trained
    seed: int
    weight_generator: WeightGenerator | None
    generator_version: str
    tokenizer_builder: TokenizerBuilder = _synthetic_tokenizer
    trained: str | None = None  # folder name under deepinfer_jax/models/trained/

    @property
    def yaml_path(self) -> Path:
        """Absolute path of the model's config: its yaml, or a trained model's ``config.json``."""
        if self.trained is not None:
            return trained_folder(self.trained) / "config.json"
        return configs_dir() / self.config

    @property
    def random_weights(self) -> bool:
        """Whether the weights are random (the tiny models) rather than trained."""
        return self.trained is None


_WEIGHT_GENERATORS: dict[str, tuple[WeightGenerator, str]] = {
    "deepseek_v3": (v3_synthetic.generate_v3_weights, v3_synthetic.V3_GENERATOR_VERSION),
    "deepseek_v4": (v4_synthetic.generate_v4_weights, v4_synthetic.V4_GENERATOR_VERSION),
    "deepseek_v41": (v4_synthetic.generate_v41_weights, v4_synthetic.V41_GENERATOR_VERSION),
}

BUILTIN_MODELS: dict[str, BuiltinModel] = {}


def _check_str(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{field}: expected a non-empty str, got {value!r}")
    return value


def register_weight_generator(family: str, fn: WeightGenerator, *, version: str | None = None) -> None:
    """Make `fn` the weight generator of `family`, for the registry and for later `register_builtin` calls.

    `version` enters the cache key of every model of the family: give a new one whenever `fn`'s output changes,
    or cached folders from the previous generator are reused. It defaults to the function's qualified name.
    """
    _check_str("family", family)
    if not callable(fn):
        raise TypeError(f"weight generator for {family!r}: expected a callable, got {type(fn).__name__}")
    version = version if version is not None else f"{fn.__module__}.{fn.__qualname__}"
    _check_str("version", version)
    _WEIGHT_GENERATORS[family] = (fn, version)
    for name, model in list(BUILTIN_MODELS.items()):
        if model.family == family and model.trained is None:
            BUILTIN_MODELS[name] = dataclasses.replace(model, weight_generator=fn, generator_version=version)


def register_builtin(
    name: str,
    *,
    family: str,
    config: str,
    description: str,
    seed: int,
    tokenizer_builder: TokenizerBuilder | None = None,
    replace: bool = False,
) -> BuiltinModel:
    """Register (or, with `replace=True`, re-register) a built-in model; returns its record.

    The weight generator is the one registered for `family` (`register_weight_generator`).
    """
    _check_str("name", name)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ValueError(f"name: {name!r} must be letters, digits, '.', '_' or '-' (it names a cache folder)")
    _check_str("config", config)
    _check_str("description", description)
    if family not in _WEIGHT_GENERATORS:
        known = ", ".join(sorted(_WEIGHT_GENERATORS))
        raise ValueError(f"family: {family!r} has no registered weight generator (known: {known})")
    _check_seed(seed)
    if tokenizer_builder is not None and not callable(tokenizer_builder):
        raise TypeError(f"tokenizer_builder: expected a callable, got {type(tokenizer_builder).__name__}")
    if name in BUILTIN_MODELS and not replace:
        raise ValueError(
            f"name: built-in model {name!r} is already registered (pass replace=True to replace it)"
        )
    if Path(config).is_absolute() or ".." in Path(config).parts:
        raise ValueError(f"config: {config!r} must be a file name relative to the configs/ folder")
    fn, version = _WEIGHT_GENERATORS[family]
    model = BuiltinModel(
        name=name,
        family=family,
        config=config,
        description=description,
        seed=seed,
        weight_generator=fn,
        generator_version=version,
        tokenizer_builder=tokenizer_builder if tokenizer_builder is not None else _synthetic_tokenizer,
    )
    BUILTIN_MODELS[name] = model
    return model


register_builtin(
    "tiny-v3",
    family="deepseek_v3",
    config="tiny_v3.yaml",
    description="tiny DeepSeek-V3 (MLA, dense + DeepSeekMoE layers, MTP), random weights, for tests and demos",
    seed=3,
)
register_builtin(
    "tiny-v4",
    family="deepseek_v4",
    config="tiny_v4.yaml",
    description="tiny DeepSeek-V4 (mHC, CSA/HCA compressors, indexer, hash MoE), random weights, for tests and demos",
    seed=4,
)
register_builtin(
    "tiny-v41",
    family="deepseek_v41",
    config="tiny_v41.yaml",
    description=(
        "tiny DeepSeek-V4.1 (ratio 1/2 layers, KV/index sharing, Engram, DSpark drafter, FP8/MXFP4), "
        "random weights, for tests and demos"
    ),
    seed=41,
)


def register_trained(
    name: str, *, family: str, description: str, seed: int, replace: bool = False
) -> BuiltinModel:
    """Register a trained built-in model whose checkpoint is the package folder :func:`trained_folder` ``(name)``."""
    _check_str("name", name)
    _check_str("description", description)
    _check_seed(seed)
    if name in BUILTIN_MODELS and not replace:
        raise ValueError(
            f"name: built-in model {name!r} is already registered (pass replace=True to replace it)"
        )
    model = BuiltinModel(
        name=name,
        family=family,
        config="config.json",
        description=description,
        seed=seed,
        weight_generator=None,
        generator_version="trained",
        trained=name,
    )
    BUILTIN_MODELS[name] = model
    return model


register_trained(
    "shakespeare-v41",
    family="deepseek_v41",
    description=(
        "small DeepSeek-V4.1 trained on Shakespeare (every V4.1 layer kind, Engram, DSpark drafter with "
        "confidence head, FP8/MXFP4 weights)"
    ),
    seed=0,
)
register_trained(
    "shakespeare-v3",
    family="deepseek_v3",
    description="small DeepSeek-V3 trained on Shakespeare (MLA, group-limited MoE, one MTP layer, FP8 weights)",
    seed=0,
)


def is_builtin(name: str) -> bool:
    """Whether `name` is a registered built-in model."""
    return isinstance(name, str) and name in BUILTIN_MODELS


def list_builtin() -> list[str]:
    """Names of the registered built-in models, sorted."""
    return sorted(BUILTIN_MODELS)


def get_builtin(name: str) -> BuiltinModel:
    """The record of built-in model `name`; a `ValueError` lists the known names otherwise."""
    if not is_builtin(name):
        raise ValueError(f"model: {name!r} is not a built-in model (known: {', '.join(list_builtin())})")
    return BUILTIN_MODELS[name]


def _parse_model_section(raw: bytes, path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid yaml: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise ValueError(f"{path}: expected a mapping with a `model:` mapping (the HF config.json keys)")
    return doc["model"]


def hf_config(name: str) -> dict[str, Any]:
    """The HF `config.json` dict of built-in model `name` (the `model:` section of its yaml)."""
    model = get_builtin(name)
    path = model.yaml_path
    return _parse_model_section(path.read_bytes(), path)


def _vocab_size(config: Mapping[str, Any], path: Path) -> int:
    section = config.get("text_config", config)
    where = "model.text_config.vocab_size" if "text_config" in config else "model.vocab_size"
    vocab = section.get("vocab_size") if isinstance(section, Mapping) else None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{path}: {where}: expected a positive int, got {vocab!r}")
    return vocab


# ---------------------------------------------------------------------------------------------------------------
# safetensors


_SAFETENSORS_DTYPES: dict[np.dtype, str] = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint64): "U64",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` as a safetensors file, tensors in sorted-name order, and fsync it.

    The layout is the format's own (8-byte little-endian header length, JSON header padded with spaces to a
    multiple of 8 bytes, then the raw little-endian tensor bytes back to back). Ordering by name, rather than the
    reference serializer's dtype-then-name order, makes the file easy to diff and the bytes a pure function of the
    tensors.
    """
    header: dict[str, Any] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata: keys and values must be str, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    arrays: list[np.ndarray] = []
    offset = 0
    for name in sorted(tensors):
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"safetensors tensor name: {name!r} is not allowed")
        array = np.asarray(tensors[name])
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would also turn a 0-d array into 1-d)
            array = array.copy(order="C")
        dtype_name = _SAFETENSORS_DTYPES.get(array.dtype.newbyteorder("="))
        if dtype_name is None:
            raise TypeError(f"safetensors tensor {name!r}: dtype {array.dtype} has no safetensors encoding")
        if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
            array = array.byteswap().view(array.dtype.newbyteorder("<"))
        header[name] = {
            "dtype": dtype_name,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for array in arrays:
            f.write(array.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------------------------
# Materialisation


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: `cache_dir`, else `$DEEPINFER_JAX_CACHE`, else `~/.cache/deepinfer_jax`."""
    if cache_dir is not None:
        if not isinstance(cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir: expected a path, got {type(cache_dir).__name__}")
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "deepinfer_jax"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes the entries (and a rename) durable; not every platform supports it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_complete(folder: Path) -> bool:
    """Whether `folder` holds a manifest and every file it lists, with the listed size and sha256."""
    try:
        manifest = json.loads((folder / _MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        for name, entry in files.items():
            path = folder / name
            if path.stat().st_size != entry["bytes"] or _sha256_file(path) != entry["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return bool(files)


def _special_token(tokenizer: Mapping[str, Any], token_id: Any) -> str | None:
    for token in tokenizer.get("added_tokens", ()):
        if isinstance(token, Mapping) and token.get("id") == token_id:
            return token.get("content")
    return None


def _tokenizer_config(config: Mapping[str, Any], tokenizer_text: str) -> dict[str, Any]:
    """A minimal `tokenizer_config.json`: class and special tokens, so transformers' AutoTokenizer can load it."""
    tokenizer = json.loads(tokenizer_text)
    section = config.get("text_config", config)
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    for role in ("bos", "eos", "pad"):
        content = _special_token(tokenizer, config.get(f"{role}_token_id"))
        if content is not None:
            out[f"{role}_token"] = content
    max_len = section.get("max_position_embeddings") if isinstance(section, Mapping) else None
    if isinstance(max_len, int) and not isinstance(max_len, bool):
        out["model_max_length"] = max_len
    return out


def _cache_key(model: BuiltinModel, yaml_bytes: bytes, tokenizer_text: str) -> str:
    digest = hashlib.sha256()
    for part in (
        _LAYOUT_VERSION.encode(),
        model.generator_version.encode(),
        str(model.seed).encode(),
        yaml_bytes,
        tokenizer_text.encode("utf-8"),
    ):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:_KEY_CHARS]


def _write_folder(
    folder: Path, model: BuiltinModel, config: dict[str, Any], tokenizer_text: str, yaml_path: Path
) -> None:
    try:
        config_text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"{yaml_path}: the `model:` section cannot be written as config.json: {e}") from e
    _write_text(folder / "config.json", config_text)
    assert model.weight_generator is not None  # materialize returns trained folders before this
    tensors = model.weight_generator(config, TensorRngFactory(model.seed))
    write_safetensors(folder / "model.safetensors", tensors, _SAFETENSORS_METADATA)
    _write_text(folder / "tokenizer.json", tokenizer_text)
    tok_config = _tokenizer_config(config, tokenizer_text)
    _write_text(
        folder / "tokenizer_config.json",
        json.dumps(tok_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
    )
    files = sorted(p.name for p in folder.iterdir())
    manifest = {
        "name": model.name,
        "family": model.family,
        "generator_version": model.generator_version,
        "seed": model.seed,
        "files": {
            name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256_file(folder / name)}
            for name in files
        },
    }
    _write_text(folder / _MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _fsync_dir(folder)


def _remove_tree(path: Path) -> None:
    """Move `path` out of the way atomically, then delete it (a reader never sees a half-deleted folder)."""
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.trash-", dir=path.parent))
    os.replace(path, trash / path.name)
    shutil.rmtree(trash, ignore_errors=True)


def _stale_temporaries(root: Path, folder_name: str) -> Iterable[Path]:
    return (p for p in root.glob(f".{folder_name}.*") if p.is_dir())


def _derive_from_tokenizer(family: str, config: dict[str, Any], tokenizer_text: str) -> dict[str, Any]:
    """Fill the config values that are defined by the model's own tokenizer (model.md §9.1, §15.2).

    A V4.1 config with Engram layers may leave `engram_compressed_vocab_size` null in its yaml: the written
    `config.json` then carries `Vc`, the size of the tokenizer's compressed vocabulary, which every Engram hash
    multiplier depends on. An explicit value is kept (and checked against the tokenizer when the model loads).
    """
    text = config.get("text_config")
    if family != "deepseek_v41" or not isinstance(text, Mapping):
        return config
    if not text.get("engram_layer_ids") or text.get("engram_compressed_vocab_size") is not None:
        return config
    import tokenizers

    from deepinfer_jax.models.deepseek_v4.engram import CompressionMap

    size = CompressionMap.from_tokenizer(tokenizers.Tokenizer.from_str(tokenizer_text)).size
    return {**config, "text_config": {**text, "engram_compressed_vocab_size": int(size)}}


def materialize(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write built-in model `name` in HF layout on first use and return its folder.

    A trained model's folder is the package's own (:func:`trained_folder`), returned as it is: nothing is
    written, and nothing trains. Later calls (from any process) reuse the folder when its manifest checks out; a corrupted or incomplete
    folder is rebuilt. The folder name carries a hash of the config, generator and tokenizer, so a changed
    config gets a new folder.

    Raises:
      ValueError: `name` is not a built-in model, or its yaml is malformed.
      FileNotFoundError: the configs/ folder or the model's yaml is missing.
      ImportError: the synthetic tokenizer builder is not available.
    """
    model = get_builtin(name)
    if model.trained is not None:
        folder = trained_folder(model.trained)
        missing = [f for f in _TRAINED_FILES if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"built-in model {name!r}: the shipped folder {folder} lacks {missing}; it is made by "
                "scripts/train_tiny.py --ship (an installed package carries it as package data)"
            )
        return folder
    yaml_path = model.yaml_path
    if not yaml_path.is_file():
        raise FileNotFoundError(f"built-in model {name!r}: config file {yaml_path} does not exist")
    yaml_bytes = yaml_path.read_bytes()
    config = _parse_model_section(yaml_bytes, yaml_path)
    tokenizer_text = model.tokenizer_builder(_vocab_size(config, yaml_path))
    if not isinstance(tokenizer_text, str):
        raise TypeError(
            f"built-in model {name!r}: the tokenizer builder returned {type(tokenizer_text).__name__}, "
            "expected the tokenizer.json text (str)"
        )

    config = _derive_from_tokenizer(model.family, config, tokenizer_text)

    root = cache_root(cache_dir) / "builtin"
    folder_name = f"{name}-{_cache_key(model, yaml_bytes, tokenizer_text)}"
    target = root / folder_name
    if _is_complete(target):
        return target

    root.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(root / f"{folder_name}.lock"), timeout=_LOCK_TIMEOUT_S)
    try:
        with lock:
            if _is_complete(target):  # another process finished it while we waited
                return target
            for leftover in _stale_temporaries(root, folder_name):  # from a writer that died mid-way
                shutil.rmtree(leftover, ignore_errors=True)
            if target.exists():
                _remove_tree(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{folder_name}.tmp-", dir=root))
            try:
                _write_folder(tmp, model, config, tokenizer_text, yaml_path)
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _fsync_dir(root)
    except filelock.Timeout as e:
        raise TimeoutError(
            f"built-in model {name!r}: waited {_LOCK_TIMEOUT_S:.0f} s for the lock {lock.lock_file} held by "
            "another writer"
        ) from e
    return target
