"""DeepSeek-V3 model config (``model_type: deepseek_v3``).

Both spellings of the RoPE settings are accepted (spec/oracles.md): real checkpoints carry a top-level
``rope_theta`` and ``rope_scaling = {type: "yarn", factor, original_max_position_embeddings, beta_fast,
beta_slow, mscale, mscale_all_dim}``; transformers 5.x writes ``rope_parameters = {rope_type: "yarn",
rope_theta, ...}`` instead. Keys that transformers' V3 config class does not have (``scoring_func``,
``topk_method``) default to the only values V3 uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from deepinfer_jax.config.base import check_range
from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.config.hf import HFReader
from deepinfer_jax.config.model import ModelConfig, RopeConfig, read_rope_entry

__all__ = ["DeepseekV3Config", "read_flat_rope"]


def read_flat_rope(reader: HFReader) -> RopeConfig:
    """The single RoPE of a flat (V3-style) config, from either spelling.

    With ``rope_parameters`` present it wins; a top-level ``rope_theta`` beside it must agree (transformers
    writes only one of them, so a disagreement means a hand edit went wrong).
    """
    params = reader.sub("rope_parameters", required=False)
    if params is not None:
        rope = read_rope_entry(params)
        if reader.has("rope_theta"):
            flat_theta = reader.get("rope_theta", float | None)
            if flat_theta != rope.theta:
                raise reader.error(
                    "rope_theta", f"= {flat_theta!r} contradicts rope_parameters.rope_theta = {rope.theta!r}"
                )
        return rope
    theta = reader.get("rope_theta", float | None)
    scaling = reader.sub("rope_scaling", required=False)
    if scaling is None:
        return RopeConfig(theta=theta, theta_key=reader.path("rope_theta"))
    return read_rope_entry(scaling, theta=theta, theta_key=reader.path("rope_theta"))


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(ModelConfig):
    """DeepSeek-V3: MLA attention, DeepSeekMoE with group-limited sigmoid routing, MTP draft layers.

    Attributes:
        q_lora_rank: query low-rank width; ``None`` means a plain ``q_proj`` (no query LoRA).
        n_group, topk_group: group-limited routing (``None`` = no group limit).
        first_k_dense_replace: the first this many layers use a dense SwiGLU FFN of ``intermediate_size``.
        rope_interleave: RoPE rotates interleaved pairs (always true for DeepSeek checkpoints).
    """

    MODEL_TYPE: ClassVar[str] = "deepseek_v3"
    ARCHITECTURE: ClassVar[str] = "DeepseekV3ForCausalLM"

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    first_k_dense_replace: int = 0
    n_group: int | None = None
    topk_group: int | None = None
    rope_interleave: bool = True

    @classmethod
    def _parse(cls, reader: HFReader) -> dict[str, Any]:
        fields = cls._parse_common(reader, reader)
        # One spelling for the MTP depth: real checkpoints write num_nextn_predict_layers, transformers'
        # V3 class also knows it as num_mtp_layers.
        if reader.has("num_mtp_layers"):
            mtp = reader.get("num_mtp_layers", int)
            if reader.has("num_nextn_predict_layers") and mtp != fields["num_nextn_predict_layers"]:
                raise reader.error(
                    "num_mtp_layers",
                    f"= {mtp} contradicts num_nextn_predict_layers = {fields['num_nextn_predict_layers']}",
                )
            fields["num_nextn_predict_layers"] = mtp
        moe_layer_freq = reader.get("moe_layer_freq", int, 1)
        if moe_layer_freq != 1:
            raise reader.error(
                "moe_layer_freq", f"= {moe_layer_freq}: only 1 (every layer after the dense ones)"
            )
        fields.update(
            rope=read_flat_rope(reader),
            scoring_func=reader.get("scoring_func", str, "sigmoid"),
            topk_method=reader.get("topk_method", str, "noaux_tc"),
            q_lora_rank=reader.get("q_lora_rank", int | None),
            kv_lora_rank=reader.get("kv_lora_rank", int),
            qk_nope_head_dim=reader.get("qk_nope_head_dim", int),
            qk_rope_head_dim=reader.get("qk_rope_head_dim", int),
            v_head_dim=reader.get("v_head_dim", int),
            intermediate_size=reader.get("intermediate_size", int),
            first_k_dense_replace=reader.get("first_k_dense_replace", int | None, 0) or 0,
            n_group=reader.get("n_group", int | None, None),
            topk_group=reader.get("topk_group", int | None, None),
            rope_interleave=reader.get("rope_interleave", bool, True),
        )
        return fields

    def _validate(self) -> None:
        super()._validate()
        n = self._name
        check_range(n("q_lora_rank"), self.q_lora_rank, ge=1)
        for name in (
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "intermediate_size",
        ):
            check_range(n(name), getattr(self, name), ge=1)
        if self.qk_rope_head_dim % 2:
            raise ConfigValueError(
                f"{n('qk_rope_head_dim')} = {self.qk_rope_head_dim}: must be even (RoPE rotates pairs)",
                field=n("qk_rope_head_dim"),
            )
        check_range(n("first_k_dense_replace"), self.first_k_dense_replace, ge=0, le=self.num_hidden_layers)
        if self.scoring_func != "sigmoid":
            raise ConfigValueError(
                f"{n('scoring_func')} = {self.scoring_func!r}: DeepSeek-V3 routing uses 'sigmoid'",
                field=n("scoring_func"),
            )
        if self.topk_method != "noaux_tc":
            raise ConfigValueError(
                f"{n('topk_method')} = {self.topk_method!r}: DeepSeek-V3 routing uses 'noaux_tc' "
                "(bias-corrected, group-limited top-k)",
                field=n("topk_method"),
            )
        if (self.n_group is None) != (self.topk_group is None):
            raise ConfigValueError(
                f"{n('n_group')} = {self.n_group!r}, {n('topk_group')} = {self.topk_group!r}: set both or neither",
                field=n("n_group"),
            )
        if self.n_group is not None and self.topk_group is not None:
            check_range(n("n_group"), self.n_group, ge=1)
            if self.n_routed_experts % self.n_group:
                raise ConfigValueError(
                    f"{n('n_group')} = {self.n_group}: must divide n_routed_experts = {self.n_routed_experts}",
                    field=n("n_group"),
                )
            check_range(n("topk_group"), self.topk_group, ge=1, le=self.n_group)
            eligible = self.topk_group * (self.n_routed_experts // self.n_group)
            if self.num_experts_per_tok > eligible:
                raise ConfigValueError(
                    f"{n('num_experts_per_tok')} = {self.num_experts_per_tok}: must be <= topk_group * experts per "
                    f"group = {eligible} (only that many experts survive the group limit)",
                    field=n("num_experts_per_tok"),
                )

    @property
    def qk_head_dim(self) -> int:
        """Query/key head width, ``qk_nope_head_dim + qk_rope_head_dim`` (192 for V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """Per backbone layer: ``"dense"`` for the first ``first_k_dense_replace`` layers, then ``"moe"``."""
        k = self.first_k_dense_replace
        return ("dense",) * k + ("moe",) * (self.num_hidden_layers - k)

    def derived(self) -> dict[str, Any]:
        return {
            **super().derived(),
            "qk_head_dim": self.qk_head_dim,
            "mlp_layer_types": list(self.mlp_layer_types),
        }
