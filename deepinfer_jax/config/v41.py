"""DeepSeek-V4.1 model config (``model_type: deepseek_v41``), spec/model.md §2.

V4.1 nests its model keys under ``text_config``; the top level holds ``architectures``, ``dtype``,
``quantization_config``, the special token ids and ``vision_config``. Every constraint of §2.1-§2.7 that the
reference enforces is checked here, so that a bad config fails at load with the key and the file, not deep
inside model construction. The cross-layer sharing maps (§7.8) are built by the model code from the raw
source-id lists kept here; only the rules that need no maps are checked (sorted lists, YOCO boundary being a
KV source, Engram on the prefill side).

Spelling variants accepted (spec §2.2, §17 item 15): ``rope_scaling`` with ``type`` or ``rope_type``, the
nested ``{main, compress}`` RoPE form (under ``rope_parameters`` or ``rope_scaling``), and ``null``, ``-1``
or an absent key for "no candidate source".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from deepinfer_jax.config.base import check_range
from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.config.hf import HFReader
from deepinfer_jax.config.v4 import DeepseekV4BaseConfig

__all__ = ["V41_QUANTIZATION", "DeepseekV41Config"]

V41_QUANTIZATION: dict[str, Any] = {
    "quant_method": "fp8",
    "expert_dtype": "fp4",
    "activation_scheme": "dynamic",
    "weight_block_size": (32, 32),
    "scale_fmt": "ue8m0",
}
"""The only quantisation a V4.1 checkpoint has (FP8 32x32 UE8M0 blocks, MXFP4 experts)."""

_TOP_LEVEL_FIELDS = {
    "architectures": "architectures",
    "checkpoint_dtype": "dtype",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
    "quantization": "quantization_config",
    "vision_config": "vision_config",
    "hf": "hf",
    "source": "source",
}
_DRAFT_KEYS = (
    "dspark_block_size",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_noise_token_id",
    "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
)
_ENGRAM_SIZE_KEYS = (
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
)
# Candidate-block kernels: kept blocks per query a multiple of 8 and at most 4096; blocks of at most 16 keys.
_CANDIDATE_TOPK_LIMIT = 4096
_CANDIDATE_BLOCK_LIMIT = 16


@dataclass(frozen=True, kw_only=True)
class DeepseekV41Config(DeepseekV4BaseConfig):
    """DeepSeek-V4.1 (the engine's primary target, e.g. V4.1-Flash).

    Attributes:
        compress_ratios: per backbone layer ratio in {0, 1, 2} (the first ``num_hidden_layers`` entries of the
            HF list).
        draft_compress_ratios: the HF list's trailing ``num_nextn_predict_layers`` entries (draft layers; they
            only count for the length check and for ``n_prefill_layer``).
        kv_source_layer_ids, index_source_layer_ids: sorted source-id lists of §7.8, as written.
        index_k_source_layer_ids: as written; ``None`` when absent (it then defaults to the KV sources, see
            :attr:`resolved_index_k_source_layer_ids`).
        candidate_source_layer_id: ``None`` when the file says ``null``, ``-1`` or nothing.
        engram_compressed_vocab_size: ``None`` = derive the compressed vocabulary size from the tokenizer
            when the model is built (and check it there).
        vision_config: kept for completeness; the vision tower is outside the text engine.
    """

    MODEL_TYPE: ClassVar[str] = "deepseek_v41"
    ARCHITECTURE: ClassVar[str] = "DeepseekV41ForCausalLM"
    _PREFIX: ClassVar[str] = "text_config"

    vision_config: Mapping[str, Any] | None = None
    draft_compress_ratios: tuple[int, ...] = ()
    use_fp4_sparse_kv: bool = True
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_k_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    hc_shifted: bool = True
    dspark_block_size: int | None = None
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_target_attn_input: bool = True
    dspark_markov_rank: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    engram_layer_ids: tuple[int, ...] = ()
    engram_max_ngram_size: int | None = None
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_compressed_vocab_size: int | None = None
    engram_num_embeddings: tuple[int, ...] | None = None
    engram_pad_token_id: int | None = None

    def _name(self, field_name: str) -> str:
        if field_name in _TOP_LEVEL_FIELDS:
            return _TOP_LEVEL_FIELDS[field_name]
        return f"text_config.{field_name}"

    # ------------------------------------------------------------------------------------------ parsing

    @classmethod
    def _parse(cls, reader: HFReader) -> dict[str, Any]:
        # Keys the reference reads unconditionally at the top level must be present.
        reader.get("architectures", tuple[str, ...])
        if not reader.has("dtype") and not reader.has("torch_dtype"):
            reader.get("dtype", str)
        # Optional: without it the checkpoint stores every linear unquantised (a float-weight model, below).
        reader.sub("quantization_config", required=False)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            reader.get(key, int | tuple[int, ...] | None)
        vision = reader.sub("vision_config", required=False)
        if vision is not None:
            for key in ("hidden_size", "downsample_ratio"):
                value = vision.get(key, int | None)
                check_range(vision.path(key), value, ge=1)
        text = reader.sub("text_config")
        assert text is not None  # sub(required=True) never returns None

        fields = cls._parse_common(reader, text)
        n_layers, n_draft = fields["num_hidden_layers"], fields["num_nextn_predict_layers"]
        ratios = text.get("compress_ratios", tuple[int, ...])
        if len(ratios) != n_layers + n_draft:
            raise text.error(
                "compress_ratios",
                f"has {len(ratios)} entries; must have num_hidden_layers + num_nextn_predict_layers = "
                f"{n_layers} + {n_draft} = {n_layers + n_draft}",
            )
        for i, ratio in enumerate(ratios):
            if ratio not in (0, 1, 2):
                raise text.error(f"compress_ratios[{i}]", f"= {ratio}: V4.1 ratios are 0, 1 or 2")
        backbone = ratios[:n_layers]
        compressed = any(backbone)

        fields.update(cls._parse_attention(text, compressed=compressed))
        candidate = text.get("candidate_source_layer_id", int | None, None)
        fields.update(
            vision_config=reader.get("vision_config", Mapping[str, Any] | None, None),
            compress_ratios=backbone,
            draft_compress_ratios=ratios[n_layers:],
            use_fp4_sparse_kv=text.get("use_fp4_sparse_kv", bool, True),
            kv_source_layer_ids=text.get("kv_source_layer_ids", tuple[int, ...]),
            index_source_layer_ids=text.get("index_source_layer_ids", tuple[int, ...]),
            index_k_source_layer_ids=text.get("index_k_source_layer_ids", tuple[int, ...] | None, None),
            candidate_source_layer_id=None if candidate == -1 else candidate,
            candidate_topk_blocks=text.get("candidate_topk_blocks", int | None, None),
            candidate_block_size=text.get("candidate_block_size", int | None, None),
            hc_shifted=text.get("hc_shifted", bool, True),
            dspark_target_attn_input=text.get("dspark_target_attn_input", bool, True),
            engram_layer_ids=text.get("engram_layer_ids", tuple[int, ...] | None, None) or (),
            engram_compressed_vocab_size=text.get("engram_compressed_vocab_size", int | None, None),
            engram_num_embeddings=text.get("engram_num_embeddings", tuple[int, ...] | None, None),
        )
        # Draft keys: required (value may be null = unknown) when there are draft layers.
        for key in _DRAFT_KEYS:
            tp = tuple[int, ...] | None if key == "dspark_target_layer_ids" else int | None
            fields[key] = text.get(key, tp) if n_draft else text.get(key, tp, None)
        # Engram size keys: required (value may be null = unknown) when Engram is on.
        for key in _ENGRAM_SIZE_KEYS:
            fields[key] = (
                text.get(key, int | None) if fields["engram_layer_ids"] else text.get(key, int | None, None)
            )
        return fields

    # ------------------------------------------------------------------------------------- validation

    def _validate(self) -> None:
        super()._validate()
        n = self._name
        L = self.num_hidden_layers
        if self.architectures != (self.ARCHITECTURE,):
            raise ConfigValueError(
                f"architectures = {list(self.architectures)!r}: must be exactly [{self.ARCHITECTURE!r}]",
                field="architectures",
            )
        if self.quantization is None:
            # A float-weight V4.1 (no quantization_config): every linear, the Engram tables and the experts are
            # stored unquantised in ``dtype``; float32 storage is allowed here (a float32 master checkpoint).
            if self.checkpoint_dtype not in ("bfloat16", "float32"):
                key = self.checkpoint_dtype_key
                raise ConfigValueError(
                    f"{key} = {self.checkpoint_dtype!r} (config.json's dtype of the checkpoint's unquantised "
                    "tensors, not the engine's dtype setting): a float-weight V4.1 checkpoint (no "
                    "quantization_config) stores its tensors as 'bfloat16' or 'float32'",
                    field=key,
                )
        else:
            if self.checkpoint_dtype != "bfloat16":
                key = self.checkpoint_dtype_key
                raise ConfigValueError(
                    f"{key} = {self.checkpoint_dtype!r} (config.json's dtype of the checkpoint's unquantised "
                    "tensors, not the engine's dtype setting): a quantised V4.1 checkpoint's unquantised tensors "
                    "are 'bfloat16'",
                    field=key,
                )
            for key, expected in V41_QUANTIZATION.items():
                actual = getattr(self.quantization, key)
                if actual != expected:
                    raise ConfigValueError(
                        f"quantization_config.{key} = {actual!r}: must be {expected!r} for V4.1",
                        field=f"quantization_config.{key}",
                    )
        if len(self.draft_compress_ratios) != self.num_nextn_predict_layers:
            raise ConfigValueError(
                f"{n('compress_ratios')}: {L + len(self.draft_compress_ratios)} entries; must have "
                f"num_hidden_layers + num_nextn_predict_layers = {L + self.num_nextn_predict_layers}",
                field=n("compress_ratios"),
            )
        for i, ratio in enumerate(self.compress_ratios + self.draft_compress_ratios):
            if ratio not in (0, 1, 2):
                raise ConfigValueError(
                    f"{n('compress_ratios')}[{i}] = {ratio}: V4.1 ratios are 0, 1 or 2",
                    field=n("compress_ratios"),
                )
        # Routing (§2.5).
        if not self.norm_topk_prob:
            raise ConfigValueError(
                f"{n('norm_topk_prob')} = False: must be true for V4.1", field=n("norm_topk_prob")
            )
        if self.compress_rope.is_yarn and self.compress_rope.attention_factor not in (None, 1.0):
            key = f"{self.compress_rope.scaling_key}.attention_factor"
            raise ConfigValueError(
                f"{key} = {self.compress_rope.attention_factor!r}: V4.1 applies no YaRN magnitude scaling (must be 1.0)",
                field=key,
            )
        self._validate_sharing()
        self._validate_candidates()
        self._validate_draft()
        self._validate_engram()

    def _validate_sharing(self) -> None:
        n = self._name
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "index_k_source_layer_ids"):
            self._layer_ids(name, getattr(self, name))
        npl = self.n_prefill_layer
        if npl < self.num_hidden_layers and npl not in self.kv_source_layer_ids:
            raise ConfigValueError(
                f"{n('kv_source_layer_ids')} = {list(self.kv_source_layer_ids)!r}: must contain n_prefill_layer = "
                f"{npl} (the first ratio-1 layer; KV sharing never crosses the YOCO boundary)",
                field=n("kv_source_layer_ids"),
            )

    def _validate_candidates(self) -> None:
        n = self._name
        source = self.candidate_source_layer_id
        if source is None:
            return
        check_range(n("candidate_source_layer_id"), source, ge=0, lt=self.num_hidden_layers)
        if self.compress_ratios[source] == 0:
            raise ConfigValueError(
                f"{n('candidate_source_layer_id')} = {source}: layer {source} is sliding-window only; a candidate "
                "source must be a compressed layer",
                field=n("candidate_source_layer_id"),
            )
        for name in ("candidate_topk_blocks", "candidate_block_size"):
            if getattr(self, name) is None:
                raise ConfigValueError(
                    f"{n(name)} is required when candidate_source_layer_id = {source}, but it is missing or null",
                    field=n(name),
                )
        blocks, size = self.candidate_topk_blocks, self.candidate_block_size
        assert blocks is not None and size is not None
        check_range(n("candidate_topk_blocks"), blocks, ge=8, le=_CANDIDATE_TOPK_LIMIT)
        if blocks % 8:
            raise ConfigValueError(
                f"{n('candidate_topk_blocks')} = {blocks}: must be a multiple of 8",
                field=n("candidate_topk_blocks"),
            )
        check_range(n("candidate_block_size"), size, ge=1, le=_CANDIDATE_BLOCK_LIMIT)
        if self.index_topk is not None and blocks * size < self.index_topk:
            raise ConfigValueError(
                f"{n('candidate_topk_blocks')} * {n('candidate_block_size')} = {blocks * size}: must be >= "
                f"index_topk = {self.index_topk} (the candidates must hold the top-k)",
                field=n("candidate_topk_blocks"),
            )

    def _validate_draft(self) -> None:
        n = self._name
        if not self.dspark_target_attn_input:
            raise ConfigValueError(
                f"{n('dspark_target_attn_input')} = False: draft features are taken at the attention input (true)",
                field=n("dspark_target_attn_input"),
            )
        check_range(n("dspark_block_size"), self.dspark_block_size, ge=1)
        check_range(n("dspark_markov_rank"), self.dspark_markov_rank, ge=1)
        check_range(n("dspark_noise_token_id"), self.dspark_noise_token_id, ge=0, lt=self.vocab_size)
        check_range(n("dspark_n_routed_experts"), self.dspark_n_routed_experts, ge=1)
        check_range(
            n("dspark_num_experts_per_tok"),
            self.dspark_num_experts_per_tok,
            ge=1,
            le=self.dspark_n_routed_experts if self.dspark_n_routed_experts is not None else None,
        )
        targets = self.dspark_target_layer_ids
        if targets is not None:
            for i, layer in enumerate(targets):
                check_range(f"{n('dspark_target_layer_ids')}[{i}]", layer, ge=0, lt=self.num_hidden_layers)
            if len(set(targets)) != len(targets):
                raise ConfigValueError(
                    f"{n('dspark_target_layer_ids')} = {list(targets)!r}: duplicate layer",
                    field=n("dspark_target_layer_ids"),
                )

    def _validate_engram(self) -> None:
        n = self._name
        layers = self.engram_layer_ids
        if not layers:
            return
        self._layer_ids("engram_layer_ids", layers)
        if self.hc_mult < 2:
            raise ConfigValueError(
                f"{n('hc_mult')} = {self.hc_mult}: Engram needs more than one hyper-connection stream",
                field=n("hc_mult"),
            )
        if layers[-1] >= self.n_prefill_layer:
            raise ConfigValueError(
                f"{n('engram_layer_ids')} = {list(layers)!r}: Engram layers must lie before n_prefill_layer = "
                f"{self.n_prefill_layer} (the YOCO prefill side)",
                field=n("engram_layer_ids"),
            )
        check_range(n("engram_max_ngram_size"), self.engram_max_ngram_size, ge=2)
        for name in ("engram_vocab_size", "engram_n_heads", "engram_head_dim"):
            check_range(n(name), getattr(self, name), ge=1)
        check_range(n("engram_pad_token_id"), self.engram_pad_token_id, ge=0, lt=self.vocab_size)
        vc = self.engram_compressed_vocab_size
        if vc is not None and vc < 1:
            raise ConfigValueError(
                f"{n('engram_compressed_vocab_size')} = {vc}: Engram needs tokenizer compression; give the "
                "compressed vocabulary size, or null to derive it from the tokenizer",
                field=n("engram_compressed_vocab_size"),
            )
        check_range(n("engram_compressed_vocab_size"), vc, le=self.vocab_size)
        rows = self.engram_num_embeddings
        if rows is not None:
            if len(rows) != len(layers):
                raise ConfigValueError(
                    f"{n('engram_num_embeddings')} = {list(rows)!r}: needs one entry per Engram layer "
                    f"({len(layers)})",
                    field=n("engram_num_embeddings"),
                )
            for i, count in enumerate(rows):
                check_range(f"{n('engram_num_embeddings')}[{i}]", count, ge=1)

    # ---------------------------------------------------------------------------------- derived (§2.8)

    @property
    def n_prefill_layer(self) -> int:
        """Index of the first ratio-1 entry of the whole HF ``compress_ratios`` list (§2.8).

        Layers ``[n_prefill_layer, L)`` form the YOCO consumer half. With no ratio-1 entry, or the first one in
        the draft tail, there is no YOCO and the value is ``L``.
        """
        full = self.compress_ratios + self.draft_compress_ratios
        first = next((i for i, r in enumerate(full) if r == 1), len(full))
        return min(first, self.num_hidden_layers)

    @property
    def has_yoco(self) -> bool:
        return self.n_prefill_layer < self.num_hidden_layers

    @property
    def yoco_layer_ids(self) -> tuple[int, ...]:
        """The YOCO consumer half, ``[n_prefill_layer, L)``."""
        return tuple(range(self.n_prefill_layer, self.num_hidden_layers))

    @property
    def resolved_index_k_source_layer_ids(self) -> tuple[int, ...]:
        """``index_k_source_layer_ids``, defaulting to ``kv_source_layer_ids`` (not the index sources)."""
        if self.index_k_source_layer_ids is None:
            return self.kv_source_layer_ids
        return self.index_k_source_layer_ids

    @property
    def engram_enabled(self) -> bool:
        return bool(self.engram_layer_ids)

    @property
    def num_engram_orders(self) -> int:
        """N-gram orders with a table, ``2..engram_max_ngram_size`` (0 when Engram is off or unknown)."""
        if not self.engram_enabled or self.engram_max_ngram_size is None:
            return 0
        return self.engram_max_ngram_size - 1

    def _nullable_values(self) -> Iterator[tuple[str, Any]]:
        yield from super()._nullable_values()
        if self.num_nextn_predict_layers:
            for key in _DRAFT_KEYS:
                yield self._name(key), getattr(self, key)
        if self.engram_layer_ids:
            for key in _ENGRAM_SIZE_KEYS:
                yield self._name(key), getattr(self, key)

    def derived(self) -> dict[str, Any]:
        return {
            **super().derived(),
            "n_prefill_layer": self.n_prefill_layer,
            "yoco_layer_ids": list(self.yoco_layer_ids),
            "resolved_index_k_source_layer_ids": list(self.resolved_index_k_source_layer_ids),
            "num_engram_orders": self.num_engram_orders,
        }
