"""Training-side weights: float32 initialisation by checkpoint name, and export to the checkpoint formats.

Training works on the checkpoint's own tensors: a ``{HF tensor name: float32 array}`` dict of the *float-weight*
config (the model's config without ``quantization_config``, every linear unquantised). The loss assembles them with
the family's ``assemble_params`` inside the differentiated function, so ``jax.grad`` runs through the project's own
assembly and forward and the gradients come back keyed by tensor name; the trained state is a checkpoint already.

* :func:`init_tensors` -- the initial values of every required tensor of a V4.1 or V3 config, each drawn from its
  own NumPy stream (:class:`~deepinfer_jax.models.builtin.TensorRngFactory`), so they do not depend on JAX or on
  the order tensors are made in.
* :func:`export_tensors` -- the float32 tensors in the storage formats of a quantised config, quantised exactly as
  the real checkpoints store them: V4.1 FP8 E4M3 linears with 32x32 UE8M0 ``.scale`` blocks, MXFP4 routed experts
  (E2M1 pairs, one UE8M0 scale per 32 inputs), Engram tables FP8 with one UE8M0 scale per row and 32 columns, the
  rest BF16 (or float32 where §12.1.4 says so); V3 FP8 E4M3 projections with float32 ``weight_scale_inv`` on
  128x128 blocks, the rest BF16 with a float32 router bias. Quantisation uses :mod:`deepinfer_jax.numerics.host`,
  the codecs the synthetic checkpoints and the tests use. Every exported tensor is checked against the family's
  contract (``expected_tensors``) for name, shape and dtype.
* :func:`import_tensors` -- the inverse: a stored checkpoint's tensors as float32 values (every quantised weight
  dequantised), so a shipped model can be the frozen target of a later phase.
* :func:`tied_tensors` -- V3's MTP layer stores copies of the embedding and the LM head (``embed_tokens``,
  ``shared_head.head``); training shares them with the main model (as the V3 paper does), so they are not trained
  separately but filled in from the main tensors.

Initialisation (``spec/model.md`` §6.6 for mHC): linear weights ``N(0, 1/in)``, the projections that write into the
residual (attention output ``wo_b`` / ``o_proj``, expert and shared-expert ``w2`` / ``down_proj``, Engram's
``wkv``) further scaled by ``(2·layers)^-1/2``; embeddings and Engram rows ``N(0, 1)``; the LM head
``N(0, 0.09/H)``; norm and Engram gate weights 1; sinks, router biases, the Markov head and the confidence head 0
(the drafter's Markov term and confidence start neutral); mHC ``fn = 0``, ``scale = 0.01`` and the §6.6 ``base``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models.builtin import TensorRngFactory
from deepinfer_jax.numerics import host

__all__ = ["export_tensors", "import_tensors", "init_tensors", "tied_tensors", "trainable_names"]

_HC_PRE_INIT, _HC_RES_INIT, _HC_SCALE_INIT = 3.0, 3.0, 0.01
_HEAD_STD = 0.3
_MXFP4_GROUP = 32
_V41_FP8_BLOCK = (32, 32)
_ENGRAM_BLOCK = (1, 32)
_LAYER = re.compile(r"^(?:model\.)?(layers|mtp)\.(\d+)\.")


def _family(cfg: ModelConfig) -> str:
    name = getattr(cfg, "MODEL_TYPE", None)
    if name not in ("deepseek_v41", "deepseek_v3"):
        raise ValueError(f"cfg: training supports deepseek_v41 and deepseek_v3 configs, got {name!r}")
    return name


def _expected(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], bool]]:
    """``name -> (shape, dtypes, optional)`` of the family's contract (V3's has no optional entries)."""
    from deepinfer_jax.models.registry import get_family

    out = {}
    for name, spec in get_family(_family(cfg)).expected_tensors(cfg).items():
        shape, dtypes, *rest = spec
        out[name] = (tuple(shape), tuple(dtypes), bool(rest[0]) if rest else False)
    return out


def tied_tensors(cfg: ModelConfig) -> dict[str, str]:
    """``{copy: original}``: V3's MTP embedding and head are the main model's (none for V4.1, which stores none)."""
    if _family(cfg) != "deepseek_v3":
        return {}
    out = {}
    for layer in range(cfg.num_hidden_layers, cfg.num_layers_total):
        p = f"model.layers.{layer}."
        out[f"{p}embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"{p}shared_head.head.weight"] = "lm_head.weight"
    return out


def trainable_names(cfg: ModelConfig, *, drafter: bool) -> list[str]:
    """The tensors one training phase updates: the backbone (V4.1: everything but ``mtp.*``; V3: everything,
    MTP layer included, but the tied copies), or with ``drafter=True`` the V4.1 DSpark drafter's ``mtp.*``."""
    names = [
        n for n, (_, _, optional) in _expected(cfg).items() if not optional and n not in tied_tensors(cfg)
    ]
    if _family(cfg) == "deepseek_v41":
        return sorted(n for n in names if n.startswith("mtp.") == drafter)
    if drafter:
        raise ValueError(
            "trainable_names: drafter=True is the V4.1 DSpark phase; V3's MTP trains with the model"
        )
    return sorted(names)


def _hc_base(m: int, ell: int) -> np.ndarray:
    base = np.concatenate(
        [
            np.full(m, -_HC_PRE_INIT, np.float32),
            np.zeros(m, np.float32),
            np.where(np.eye(m, dtype=bool), _HC_RES_INIT, -_HC_RES_INIT).astype(np.float32).ravel(),
        ]
    )
    base[ell % m] = _HC_PRE_INIT
    return base


def _residual_writer(name: str) -> bool:
    return any(
        s in name
        for s in ("attn.wo_b.", ".w2.", "o_proj.", "down_proj.", "engram.wkv.", "shared_experts.w2.")
    )


def _init_one(cfg: ModelConfig, name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    family = _family(cfg)
    H = cfg.hidden_size
    match = _LAYER.match(name)
    depth = cfg.num_hidden_layers + getattr(cfg, "num_nextn_predict_layers", 0)
    normal = lambda std: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)  # noqa: E731
    ones, zeros = np.ones(shape, np.float32), np.zeros(shape, np.float32)
    if re.search(r"hc_(attn|ffn|head)_fn$", name):
        return zeros
    if re.search(r"hc_(attn|ffn)_base$", name):
        assert match is not None
        index = int(match.group(2))
        ell = index if match.group(1) == "layers" else cfg.num_hidden_layers + index + 1
        return _hc_base(cfg.hc_mult, ell)
    if re.search(r"hc_(attn|ffn|head)_scale$", name):
        return np.full(shape, _HC_SCALE_INIT, np.float32)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return ones
    if name.endswith(("engram.q_weight", "engram.k_weight")):
        return ones
    if name.endswith(("attn_sink", "gate.bias", "e_score_correction_bias")):
        return zeros
    if name.endswith(("markov_head.head.weight", "confidence_head.proj.weight")):
        return zeros
    if name in ("embed.weight", "model.embed_tokens.weight") or name.endswith(
        ("engram.embed.weight", "embed_tokens.weight")
    ):
        return normal(1.0)
    if name.endswith("markov_head.embed.weight"):
        return normal(1.0)
    if name in ("head.weight", "lm_head.weight") or name.endswith("shared_head.head.weight"):
        return normal(_HEAD_STD * H**-0.5)
    if len(shape) == 2 and name.endswith(".weight"):
        std = shape[1] ** -0.5
        if _residual_writer(name):
            std /= np.sqrt(2.0 * depth)
        return normal(std)
    raise ValueError(f"init_tensors: no initialisation rule for {family} tensor {name!r} of shape {shape}")


def init_tensors(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Float32 initial values of every required tensor of ``cfg`` (module docstring for the rules).

    ``cfg`` is the float-weight training config (no ``quantization_config``); V3's tied MTP copies are included,
    equal to the main embedding and head.
    """
    factory = TensorRngFactory(seed)
    out: dict[str, np.ndarray] = {}
    for name, (shape, _, optional) in _expected(cfg).items():
        if optional or name in tied_tensors(cfg):
            continue
        out[name] = _init_one(cfg, name, shape, factory(name))
    for copy, original in tied_tensors(cfg).items():
        out[copy] = out[original]
    return out


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def export_tensors(qcfg: ModelConfig, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``tensors`` (float32, names of the float-weight config) in the storage formats of the quantised ``qcfg``.

    Without a ``quantization_config`` in ``qcfg`` the result is the float32 master checkpoint (every tensor
    float32; ``qcfg`` must then say ``dtype: float32``).

    Raises:
        ValueError: a tensor missing from ``tensors`` or not in the contract of ``qcfg``, a shape that does not
            match, or an exported dtype the contract does not accept (each named).
    """
    family = _family(qcfg)
    expected = _expected(qcfg)
    q = qcfg.quantization
    floats = {name: np.asarray(value, np.float32) for name, value in tensors.items()}
    out: dict[str, np.ndarray] = {}
    for name, (shape, dtypes, optional) in expected.items():
        if optional or name.endswith((".scale", ".weight_scale_inv")):
            continue
        if name not in floats:
            raise ValueError(f"export_tensors: tensor {name!r} of the {family} contract is missing")
        w = floats[name]
        if q is None:
            out[name] = w
            continue
        stem = name.removesuffix(".weight")
        if family == "deepseek_v41" and f"{stem}.scale" in expected:
            if ".engram.embed." in f"{stem}.":
                out[name], out[f"{stem}.scale"] = host.quantize_fp8_blockwise(w, _ENGRAM_BLOCK, "ue8m0")
            elif shape[-1] * 2 == w.shape[-1]:  # packed E2M1 pairs: an MXFP4 routed expert
                out[name], out[f"{stem}.scale"] = host.quantize_mxfp4(w)
            else:
                out[name], out[f"{stem}.scale"] = host.quantize_fp8_blockwise(w, _V41_FP8_BLOCK, "ue8m0")
        elif family == "deepseek_v3" and f"{stem}.weight_scale_inv" in expected:
            block = tuple(q.weight_block_size)
            out[name], out[f"{stem}.weight_scale_inv"] = host.quantize_fp8_blockwise(w, block, "float32")
        elif dtypes == ("float32",) or name.endswith("e_score_correction_bias"):
            out[name] = w
        else:
            out[name] = _bf16(w)
    extra = sorted(
        set(floats) - set(out) - {n for n in floats if n.endswith((".scale", ".weight_scale_inv"))}
    )
    if extra:
        raise ValueError(
            f"export_tensors: {len(extra)} tensor(s) are not in the {family} contract: {extra[:8]}"
        )
    for name, array in out.items():
        shape, dtypes, _ = expected[name]
        if tuple(array.shape) != shape:
            raise ValueError(f"export_tensors: {name!r} has shape {array.shape}, the contract says {shape}")
        if np.dtype(array.dtype).name not in dtypes:
            raise ValueError(
                f"export_tensors: {name!r} exported as {array.dtype}, the contract takes {dtypes}"
            )
    return out


def import_tensors(qcfg: ModelConfig, stored: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The float32 values of ``stored`` (a checkpoint of ``qcfg`` in its storage formats), names of the
    float-weight config: FP8 and MXFP4 weights dequantised with their scales, BF16 widened. V3's tied MTP copies are
    filled in from the main tensors. ``export_tensors(qcfg, import_tensors(qcfg, s))`` stores the same values.

    Raises:
        ValueError: a required tensor or scale missing from ``stored``, or a tensor not in the contract (named).
    """
    family = _family(qcfg)
    expected = _expected(qcfg)
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise ValueError(
            f"import_tensors: {len(extra)} tensor(s) are not in the {family} contract: {extra[:8]}"
        )
    out: dict[str, np.ndarray] = {}
    for name, (_, _, optional) in expected.items():
        if optional or name.endswith((".scale", ".weight_scale_inv")) or name in tied_tensors(qcfg):
            continue
        if name not in stored:
            raise ValueError(f"import_tensors: tensor {name!r} of the {family} contract is missing")
        w = np.asarray(stored[name])
        stem = name.removesuffix(".weight")
        scale_name = next(
            (f"{stem}{s}" for s in (".scale", ".weight_scale_inv") if f"{stem}{s}" in expected), None
        )
        if scale_name is not None and scale_name not in stored:
            raise ValueError(f"import_tensors: the scale {scale_name!r} of {name!r} is missing")
        if scale_name is None:
            out[name] = w.astype(np.float32)
        elif family == "deepseek_v41" and ".engram.embed." in f"{stem}.":
            out[name] = host.dequantize_fp8_blockwise(w, np.asarray(stored[scale_name]), _ENGRAM_BLOCK)
        elif w.dtype == np.uint8:  # packed E2M1 pairs: an MXFP4 routed expert
            out[name] = host.dequantize_mxfp4(w, np.asarray(stored[scale_name]))
        else:
            block = _V41_FP8_BLOCK if family == "deepseek_v41" else tuple(qcfg.quantization.weight_block_size)
            out[name] = host.dequantize_fp8_blockwise(w, np.asarray(stored[scale_name]), block)
    for copy, original in tied_tensors(qcfg).items():
        out[copy] = out[original]
    return out
