"""`deepinfer-jax convert`: HF safetensors folder <-> orbax checkpoint, tensor for tensor, byte for byte.

Both directions move **checkpoint-form** tensors: names, shapes, dtypes and bytes are kept exactly (FP8 codes,
UE8M0 scales, packed FP4 and all), so HF -> orbax -> HF gives back every tensor bit-identical. ``config.json``
and the tokenizer files (``reader.AUX_FILES``) travel along. The destination is built in a temporary folder
beside it and renamed into place, so an interrupted conversion never leaves a half-written checkpoint; an
existing non-empty destination is refused unless ``--overwrite``.

Memory: towards HF, tensors are written as they are read (one at a time from safetensors; orbax restores them
in bounded batches); towards orbax, safetensors tensors are handed to orbax as memory maps, which its writer reads with a bounded
number of bytes in flight.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from deepinfer_jax.checkpoint import orbax_io
from deepinfer_jax.checkpoint.loader import read_config
from deepinfer_jax.checkpoint.reader import (
    AUX_FILES,
    CheckpointError,
    CheckpointReader,
    SafetensorsReader,
    check_destination,
    open_checkpoint,
    save_hf_checkpoint,
)

# The size Hugging Face's own `save_pretrained` shards at by default.
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "src",
        None,
        "source checkpoint: a folder (HF safetensors or orbax) or a built-in model name (tiny-v3, tiny-v4, "
        "tiny-v41: its random-weight HF folder)",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "dst", None, "destination folder (created; must not exist or be empty)", flag_values=fv
    )
    flags.DEFINE_enum("to", None, ["orbax", "hf"], "destination format", flag_values=fv)
    flags.DEFINE_integer(
        "max_shard_bytes",
        DEFAULT_MAX_SHARD_BYTES,
        "--to hf: above this many tensor bytes, write model-0000i-of-0000n.safetensors shards and an index",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_boolean("overwrite", False, "replace a non-empty --dst", flag_values=fv)
    for name in ("src", "dst", "to"):
        flags.mark_flag_as_required(name, flag_values=fv)


def convert_checkpoint(
    src: str | Path, dst: str | Path, to: str, *, max_shard_bytes: int | None = None, overwrite: bool = False
) -> Path:
    """Convert the checkpoint at ``src`` (a folder or a built-in model name) into format ``to`` (``"orbax"`` or
    ``"hf"``) at ``dst``."""
    if to not in ("orbax", "hf"):
        raise ValueError(f"to: {to!r} must be 'orbax' or 'hf'")
    from deepinfer_jax.models import builtin

    if isinstance(src, str) and builtin.is_builtin(src):
        src = builtin.materialize(src)
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"dst: {dst} is the source folder; convert into a new folder")
    check_destination(dst, overwrite=overwrite)  # before reading anything
    with open_checkpoint(src) as reader:
        config = read_config(reader) if reader.config_path is not None else None
        root = reader.path
        files = [root / f for f in AUX_FILES if (root / f).is_file()]
        if to == "hf":
            infos = [reader.info(n) for n in reader.names()]
            return save_hf_checkpoint(
                dst,
                infos,
                reader.read_many,
                config,
                max_shard_bytes=max_shard_bytes,
                files=files,
                overwrite=overwrite,
            )
        return orbax_io.save_checkpoint(
            dst,
            _host_tensors(reader),
            config,
            storage_dtypes={n: reader.info(n).storage_dtype for n in reader.names()},
            files=files,
            overwrite=overwrite,
        )


def _host_tensors(reader: CheckpointReader) -> dict:
    if isinstance(reader, SafetensorsReader):
        return {n: reader.memmap(n) for n in reader.names()}
    return dict(reader.read_many(reader.names()))


def main(argv: list[str], fv: flags.FlagValues) -> int:
    if len(argv) > 1:
        print(f"deepinfer-jax convert: unexpected arguments {argv[1:]!r}", file=sys.stderr)
        return 2
    try:
        out = convert_checkpoint(
            fv.src, fv.dst, fv.to, max_shard_bytes=fv.max_shard_bytes, overwrite=fv.overwrite
        )
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        # The library's errors name its arguments (overwrite=True); on the command line they are flags.
        message = str(e).replace("pass overwrite=True", "pass --overwrite")
        print(f"deepinfer-jax convert: error: {message}", file=sys.stderr)
        return 1
    with open_checkpoint(out) as result:
        total = sum(result.info(n).nbytes for n in result.names())
        print(f"converted {len(result)} tensors ({total} bytes) from {fv.src} to {out} ({fv.to})")
    return 0
