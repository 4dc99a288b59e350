"""The static layer plan of a DeepSeek-V4.1 model (spec/model.md §2.8, §3, §7.6, §7.8, §7.9, §9, §11).

V4.1 layers are heterogeneous: sliding-window-only, ratio-1 and ratio-2 layers; compressed KV, indexer keys and
top-k selections produced by *source* layers and read by later *consumer* layers; a YOCO consumer half whose
compressed KV all derives from one shared hidden; a candidate-block group; Engram layers; and the layers whose
attention inputs feed the DSpark drafter. The forward is a Python loop over layers traced once, so all of this
is resolved here, once per config, into a frozen, hashable :class:`V41Plan` that can be a static argument of
``jax.jit``.

Building the plan also enforces the rules of §7.8 and §3.4 that need the sharing maps (the config parser checks
everything that does not): a consumer must be a compressed layer with its source's ratio, index-top-k segments
must nest inside index-K segments and those inside KV segments, the candidate source must compute its own top-k
and its whole group must share its ratio. A config that breaks a rule fails with a
:class:`~deepinfer_jax.config.errors.ConfigValueError` naming the key, its value, the layer and the rule.

Sharing maps (§7.8): for a sorted source list ``S``, layer ``l >= min(S)`` maps to ``max{s in S : s <= l}``;
layers below ``min(S)`` map to themselves. A compressed layer that maps to itself is a source of that kind
(it computes the thing itself), whether or not it is listed; an SWA-only layer has nothing to share, so its
self-mapping gives it no role.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.config.v41 import DeepseekV41Config

__all__ = [
    "V41DraftLayerPlan",
    "V41LayerPlan",
    "V41Plan",
    "build_v41_plan",
    "describe_plan",
    "source_map",
]

LayerKind = Literal["swa", "c1", "c2"]
_KINDS: dict[int, LayerKind] = {0: "swa", 1: "c1", 2: "c2"}


def source_map(source_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The §7.8 map of a sorted source list: each layer's nearest source at or before it, else itself.

    >>> source_map((1, 3, 5), 7)
    (0, 1, 1, 3, 3, 5, 5)
    """
    out: list[int] = []
    current: int | None = None
    sources = set(source_ids)
    for layer in range(num_layers):
        if layer in sources:
            current = layer
        out.append(layer if current is None else current)
    return tuple(out)


@dataclass(frozen=True)
class V41LayerPlan:
    """Everything static about one backbone layer.

    Attributes:
        layer: backbone layer index.
        ratio: ``compress_ratios[layer]`` (0 = sliding window only, 1 = C1, 2 = C2).
        kv_source, index_k_source, index_source: the layer whose compressed KV / indexer keys / top-k selection
            this layer uses (``src_kv``, ``src_ik``, ``src_idx`` of §7.8; the layer itself for a source).
        uses_indexer: the layer selects compressed keys with the sparse indexer (``ratio > 0`` and
            ``index_topk > 0``); otherwise a compressed layer attends to every visible compressed key.
        yoco_consumer: the layer lies in the YOCO consumer half ``[n_prefill_layer, L)``.
        captures_shared_hidden: the layer is ``n_prefill_layer``; its attention-norm output is the shared
            hidden ``ĥ`` of §7.9.
        compressor_input: for a KV source, what its compressor reads: ``"own"`` (its own attention-norm
            output) or ``"shared"`` (the shared hidden, for KV sources after ``n_prefill_layer``); ``None``
            for layers without a compressor.
        candidate_source: the candidate source of the layer's group (``None`` outside a group, §7.6).
        engram_slot: the layer's position in ``engram_layer_ids`` (``None`` = no Engram).
        draft_target_slot: the layer's position in ``dspark_target_layer_ids`` (``None`` = not a target).
        rope_theta, rope_yarn: the RoPE base and whether YaRN applies (compress rope for C1/C2 layers, the
            main rope for SWA-only layers).
    """

    layer: int
    ratio: int
    kv_source: int
    index_k_source: int
    index_source: int
    uses_indexer: bool
    yoco_consumer: bool
    captures_shared_hidden: bool
    compressor_input: Literal["own", "shared"] | None
    candidate_source: int | None
    engram_slot: int | None
    draft_target_slot: int | None
    rope_theta: float | None
    rope_yarn: bool

    @property
    def kind(self) -> LayerKind:
        return _KINDS[self.ratio]

    @property
    def is_compressed(self) -> bool:
        return self.ratio > 0

    @property
    def is_kv_source(self) -> bool:
        """Owns a compressor and the compressed cache (``src_kv[l] == l`` on a compressed layer)."""
        return self.is_compressed and self.kv_source == self.layer

    @property
    def is_index_k_source(self) -> bool:
        """Owns ``indexer.wk`` / ``k_norm`` and the indexer-key cache."""
        return self.uses_indexer and self.index_k_source == self.layer

    @property
    def is_index_source(self) -> bool:
        """Computes its own top-k (owns ``indexer.wq_b`` / ``weights_proj``)."""
        return self.uses_indexer and self.index_source == self.layer

    @property
    def is_candidate_source(self) -> bool:
        return self.candidate_source == self.layer

    @property
    def is_candidate_consumer(self) -> bool:
        """An index source after the candidate source in its group: scores only the candidate blocks."""
        return (
            self.candidate_source is not None and self.layer > self.candidate_source and self.is_index_source
        )

    @property
    def has_engram(self) -> bool:
        return self.engram_slot is not None

    @property
    def roles(self) -> tuple[str, ...]:
        """The layer's roles, in a fixed order (the role table of spec §15.2 is written with these)."""
        out: list[str] = []
        if not self.is_compressed:
            out.append("swa_only")
        else:
            if self.captures_shared_hidden:
                out.append("yoco_first")
            out.append("kv_source" if self.is_kv_source else "kv_consumer")
            if self.compressor_input == "shared":
                out.append("kv_from_shared_hidden")
            if self.uses_indexer:
                out.append("index_source" if self.is_index_source else "index_consumer")
                out.append("index_k_source" if self.is_index_k_source else "index_k_consumer")
            if self.is_candidate_source:
                out.append("candidate_source")
            elif self.is_candidate_consumer:
                out.append("candidate_consumer")
        if self.has_engram:
            out.append("engram")
        if self.draft_target_slot is not None:
            out.append("draft_target")
        return tuple(out)


@dataclass(frozen=True)
class V41DraftLayerPlan:
    """One DSpark draft layer (``mtp.{index}``, runtime layer ``L + index``; window attention, main rope).

    Attributes:
        holds_main_proj: the first draft layer holds ``main_proj`` / ``main_norm`` (§11.1).
        holds_heads: the last draft layer holds ``norm``, ``markov_head.*`` and ``confidence_head.*``.
        holds_hc_head: the last draft layer also holds ``hc_head_*`` when the HC schedule is not shifted.
    """

    index: int
    runtime_layer: int
    holds_main_proj: bool
    holds_heads: bool
    holds_hc_head: bool


@dataclass(frozen=True)
class V41Plan:
    """The static layer plan of a V4.1 model (build it with :func:`build_v41_plan`).

    Attributes:
        layers: one :class:`V41LayerPlan` per backbone layer.
        draft_layers: one :class:`V41DraftLayerPlan` per draft layer.
        n_prefill_layer: first ratio-1 entry of the whole ratio list, or ``L`` (no YOCO) -- §2.8.
        index_topk, candidate_topk_blocks, candidate_block_size: the selection sizes (``None`` when unused).
        engram_layer_ids: Engram layers in config order (their order fixes table sizes and multipliers).
        draft_target_layer_ids: ``dspark_target_layer_ids`` in list order (``None`` = not known yet; empty
            without draft layers).
        hc_shifted: the shifted HC schedule (no ``hc_head_*``) or the non-shifted one.
        compressed_kv_format: ``"fp4"`` (E2M1 with E4M3 per-16 scales) or ``"mxfp8"`` (§12.3).
    """

    layers: tuple[V41LayerPlan, ...]
    draft_layers: tuple[V41DraftLayerPlan, ...]
    n_prefill_layer: int
    index_topk: int | None
    candidate_topk_blocks: int | None
    candidate_block_size: int | None
    engram_layer_ids: tuple[int, ...]
    draft_target_layer_ids: tuple[int, ...] | None
    hc_shifted: bool
    compressed_kv_format: Literal["fp4", "mxfp8"]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_draft_layers(self) -> int:
        return len(self.draft_layers)

    @property
    def ratios(self) -> tuple[int, ...]:
        return tuple(lp.ratio for lp in self.layers)

    @property
    def src_kv(self) -> tuple[int, ...]:
        return tuple(lp.kv_source for lp in self.layers)

    @property
    def src_ik(self) -> tuple[int, ...]:
        return tuple(lp.index_k_source for lp in self.layers)

    @property
    def src_idx(self) -> tuple[int, ...]:
        return tuple(lp.index_source for lp in self.layers)

    @property
    def has_yoco(self) -> bool:
        return self.n_prefill_layer < self.num_layers

    @property
    def yoco_layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.n_prefill_layer, self.num_layers))

    @property
    def shared_hidden_layer(self) -> int | None:
        """The layer whose attention-norm output is the YOCO shared hidden (``None`` without YOCO)."""
        return self.n_prefill_layer if self.has_yoco else None

    @property
    def candidate_source(self) -> int | None:
        return next((lp.layer for lp in self.layers if lp.is_candidate_source), None)

    @property
    def candidate_group(self) -> tuple[int, ...]:
        """Layers ``[cs, L)`` of the candidate group (empty without a candidate source)."""
        return tuple(lp.layer for lp in self.layers if lp.candidate_source is not None)

    @property
    def candidate_consumers(self) -> tuple[int, ...]:
        return tuple(lp.layer for lp in self.layers if lp.is_candidate_consumer)

    def layers_with(self, role: str) -> tuple[int, ...]:
        """Backbone layers carrying ``role`` (one of the strings of :attr:`V41LayerPlan.roles`)."""
        return tuple(lp.layer for lp in self.layers if role in lp.roles)

    def check_yoco_compaction(self) -> None:
        """Refuse YOCO compaction ("compact" prefill truncation, §7.9) where §3.4 forbids it.

        Compaction drops rows from the consumer half, so the draft target layers must lie all on one side of
        ``n_prefill_layer`` and Engram layers on the prefill side. (The second holds for every plan: the config
        parser enforces it always.)

        Raises:
            ConfigValueError: naming ``text_config.dspark_target_layer_ids``, its value and the boundary.
        """
        targets = self.draft_target_layer_ids or ()
        inside = {t >= self.n_prefill_layer for t in targets}
        if self.has_yoco and len(inside) > 1:
            raise ConfigValueError(
                f"text_config.dspark_target_layer_ids = {list(targets)!r}: YOCO compaction needs the draft "
                f"target layers all before or all from n_prefill_layer = {self.n_prefill_layer} (spec §3.4)",
                field="text_config.dspark_target_layer_ids",
            )


# --------------------------------------------------------------------------------------------- building


def _where(cfg: DeepseekV41Config) -> str:
    return f" (in {cfg.source})" if cfg.source else ""


def _fail(cfg: DeepseekV41Config, key: str, value: Any, rule: str) -> ConfigValueError:
    field = f"text_config.{key}"
    return ConfigValueError(f"{field} = {value!r}: {rule}{_where(cfg)}", field=field)


def _check_consumers(cfg: DeepseekV41Config, key: str, ids: tuple[int, ...], src: tuple[int, ...]) -> None:
    """§7.8 rule 1: a consumer is a compressed layer with its source's ratio."""
    ratios = cfg.compress_ratios
    for layer, source in enumerate(src):
        if source == layer:
            continue
        if ratios[layer] == 0:
            raise _fail(
                cfg,
                key,
                list(ids),
                f"makes layer {layer} a consumer of layer {source}, but layer {layer} is sliding-window only "
                f"(compress_ratios[{layer}] = 0); an SWA-only layer must lie below the first source or be "
                "listed as a source itself (spec §7.8 rule 1)",
            )
        if ratios[layer] != ratios[source]:
            raise _fail(
                cfg,
                key,
                list(ids),
                f"makes layer {layer} (ratio {ratios[layer]}) a consumer of layer {source} (ratio "
                f"{ratios[source]}); a consumer must have its source's compress ratio (spec §7.8 rule 1)",
            )


def _check_nesting(
    cfg: DeepseekV41Config,
    fine_key: str,
    fine_ids: tuple[int, ...],
    fine: tuple[int, ...],
    coarse_key: str,
    coarse: tuple[int, ...],
) -> None:
    """§7.8 rule 3: every segment of the finer map lies inside one segment of the coarser map."""
    for layer, source in enumerate(fine):
        if coarse[source] != coarse[layer]:
            raise _fail(
                cfg,
                fine_key,
                list(fine_ids),
                f"layer {layer} takes its {fine_key.removesuffix('_layer_ids').replace('_', ' ')} from layer "
                f"{source}, but {coarse_key} puts layer {layer} in the segment of {coarse[layer]} and layer "
                f"{source} in the segment of {coarse[source]}; top-k segments must nest in index-K segments "
                "and index-K segments in KV segments (spec §7.8 rule 3)",
            )


def _check_candidates(cfg: DeepseekV41Config, src_idx: tuple[int, ...]) -> None:
    """§7.6 / §7.8 rule 5: the candidate source computes its own top-k; its whole group shares its ratio."""
    source = cfg.candidate_source_layer_id
    if source is None:
        return
    key = "candidate_source_layer_id"
    if not cfg.index_topk:
        raise _fail(
            cfg,
            key,
            source,
            f"candidate blocks need the sparse indexer, but index_topk = {cfg.index_topk!r} (spec §7.6)",
        )
    if src_idx[source] != source:
        raise _fail(
            cfg,
            key,
            source,
            f"layer {source} reuses the top-k of layer {src_idx[source]}; the candidate source must be an index "
            "source (list it in index_source_layer_ids, spec §7.6)",
        )
    ratio = cfg.compress_ratios[source]
    for layer in range(source, cfg.num_hidden_layers):
        if cfg.compress_ratios[layer] != ratio:
            raise _fail(
                cfg,
                key,
                source,
                f"the candidate group is layers {source}..{cfg.num_hidden_layers - 1}, but layer {layer} has "
                f"compress ratio {cfg.compress_ratios[layer]} and the source {ratio}; every layer of the group "
                "must have the candidate source's ratio (spec §7.6)",
            )


@functools.lru_cache(maxsize=32)
def build_v41_plan(cfg: DeepseekV41Config) -> V41Plan:
    """Derive and validate the static layer plan of ``cfg`` (cached: configs are frozen and hashable).

    Raises:
        ConfigValueError: a sharing, candidate or placement rule of §7.6/§7.8 is broken; the message names
            the key, its value, the layer and the rule.
    """
    L = cfg.num_hidden_layers
    ratios = cfg.compress_ratios
    kv_ids = cfg.kv_source_layer_ids
    ik_key = "index_k_source_layer_ids" if cfg.index_k_source_layer_ids is not None else "kv_source_layer_ids"
    ik_ids = cfg.resolved_index_k_source_layer_ids
    idx_ids = cfg.index_source_layer_ids
    src_kv, src_ik, src_idx = source_map(kv_ids, L), source_map(ik_ids, L), source_map(idx_ids, L)

    _check_consumers(cfg, "kv_source_layer_ids", kv_ids, src_kv)
    _check_consumers(cfg, ik_key, ik_ids, src_ik)
    _check_consumers(cfg, "index_source_layer_ids", idx_ids, src_idx)
    _check_nesting(cfg, "index_source_layer_ids", idx_ids, src_idx, ik_key, src_ik)
    _check_nesting(cfg, ik_key, ik_ids, src_ik, "kv_source_layer_ids", src_kv)
    _check_candidates(cfg, src_idx)

    npl = cfg.n_prefill_layer
    cs = cfg.candidate_source_layer_id
    engram = {layer: i for i, layer in enumerate(cfg.engram_layer_ids)}
    # Target layers only mean something when there is a drafter to feed.
    targets = cfg.dspark_target_layer_ids if cfg.num_nextn_predict_layers else ()
    target_slot = {layer: i for i, layer in enumerate(targets or ())}
    indexer = bool(cfg.index_topk)
    layers = []
    for layer, ratio in enumerate(ratios):
        compressed = ratio > 0
        kv_source = compressed and src_kv[layer] == layer
        rope = cfg.layer_rope(layer)
        layers.append(
            V41LayerPlan(
                layer=layer,
                ratio=ratio,
                kv_source=src_kv[layer],
                index_k_source=src_ik[layer],
                index_source=src_idx[layer],
                uses_indexer=compressed and indexer,
                yoco_consumer=layer >= npl,
                captures_shared_hidden=layer == npl,
                compressor_input=("shared" if layer > npl else "own") if kv_source else None,
                candidate_source=cs if cs is not None and layer >= cs else None,
                engram_slot=engram.get(layer),
                draft_target_slot=target_slot.get(layer),
                rope_theta=rope.theta,
                rope_yarn=rope.is_yarn,
            )
        )
    M = cfg.num_nextn_predict_layers
    drafts = tuple(
        V41DraftLayerPlan(
            index=i,
            runtime_layer=L + i,
            holds_main_proj=i == 0,
            holds_heads=i == M - 1,
            holds_hc_head=i == M - 1 and not cfg.hc_shifted,
        )
        for i in range(M)
    )
    return V41Plan(
        layers=tuple(layers),
        draft_layers=drafts,
        n_prefill_layer=npl,
        index_topk=cfg.index_topk,
        candidate_topk_blocks=cfg.candidate_topk_blocks if cs is not None else None,
        candidate_block_size=cfg.candidate_block_size if cs is not None else None,
        engram_layer_ids=cfg.engram_layer_ids,
        draft_target_layer_ids=targets,
        hc_shifted=cfg.hc_shifted,
        compressed_kv_format="fp4" if cfg.use_fp4_sparse_kv else "mxfp8",
    )


def describe_plan(plan: V41Plan) -> dict[str, Any]:
    """The plan as plain JSON (for ``deepinfer-jax info`` and logs): maps, boundaries, groups, per-layer roles."""
    return {
        "num_layers": plan.num_layers,
        "num_draft_layers": plan.num_draft_layers,
        "n_prefill_layer": plan.n_prefill_layer,
        "yoco_layer_ids": list(plan.yoco_layer_ids),
        "shared_hidden_layer": plan.shared_hidden_layer,
        "src_kv": list(plan.src_kv),
        "src_ik": list(plan.src_ik),
        "src_idx": list(plan.src_idx),
        "index_topk": plan.index_topk,
        "candidate": None
        if plan.candidate_source is None
        else {
            "source": plan.candidate_source,
            "group": list(plan.candidate_group),
            "consumers": list(plan.candidate_consumers),
            "topk_blocks": plan.candidate_topk_blocks,
            "block_size": plan.candidate_block_size,
        },
        "engram_layer_ids": list(plan.engram_layer_ids),
        "draft_target_layer_ids": None
        if plan.draft_target_layer_ids is None
        else list(plan.draft_target_layer_ids),
        "hc_shifted": plan.hc_shifted,
        "compressed_kv_format": plan.compressed_kv_format,
        "layers": [
            {
                "layer": lp.layer,
                "ratio": lp.ratio,
                "kind": lp.kind,
                "rope_theta": lp.rope_theta,
                "rope_yarn": lp.rope_yarn,
                "roles": list(lp.roles),
                "src_kv": lp.kv_source,
                "src_ik": lp.index_k_source,
                "src_idx": lp.index_source,
            }
            for lp in plan.layers
        ],
        "draft_layers": [
            {
                "name": f"mtp.{d.index}",
                "runtime_layer": d.runtime_layer,
                "holds": [
                    name
                    for name, held in (
                        ("main_proj", d.holds_main_proj),
                        ("main_norm", d.holds_main_proj),
                        ("norm", d.holds_heads),
                        ("markov_head", d.holds_heads),
                        ("confidence_head", d.holds_heads),
                        ("hc_head", d.holds_hc_head),
                    )
                    if held
                ],
            }
            for d in plan.draft_layers
        ],
    }
