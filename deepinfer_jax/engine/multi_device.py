"""The engine on a ``(dp, ep)`` mesh: a scheduler per device, a request router and one global step.

ARCHITECTURE §5: every device of the mesh is an attention rank that owns whole sequences and their caches, and
the routed experts are sharded over ``ep`` (replicated over ``dp``). The engine maps that onto the unchanged
single-device pieces:

* **One host scheduler per device.** Each of the ``dp * ep`` devices gets its own
  :class:`~deepinfer_jax.engine.scheduler.Scheduler` with its own block pool, state slots and step budgets
  (:class:`MeshScheduler`). Nothing about the scheduling policy changes: a device's scheduler sees only its own
  requests.
* **A deterministic router.** A new request goes to the device with the fewest unfinished sequences, then the
  fewest tokens held by them, then the lowest index (:func:`route`). The decision depends only on the order of
  requests and of finished outputs, never on time or hashing, so every process of a multi-process run makes
  the same one.
* **One global step.** Every device's plan is padded to one common bucket (the smallest bucket that holds the
  largest device's tokens and sequences); a device with nothing to run gets an all-padding placeholder plan,
  so every device enters every collective of the step. The per-device arrays are stacked along a leading
  device axis and the unchanged :func:`~deepinfer_jax.engine.step.step` runs once per device inside one
  ``jax.shard_map`` over the mesh (:func:`mesh_step`): each device sees its plan slice, its cache shard and its
  state shard; parameters are replicated except the routed-expert slots, whose ``ep`` shards each device holds.
  The MoE layers inside run the per-device expert-parallel body (dispatch and combine are ``all_to_all``
  collectives over ``ep``, :class:`ManualSlotExperts`).
* **Combined outputs.** :class:`MeshRunner` keeps one global step in flight, exactly as the single-device
  :class:`~deepinfer_jax.engine.runner.EngineRunner` does, and hands each device's slice of the sampled tokens to
  that device's scheduler.

Budgets. ``LLM(kv_cache_memory=, max_num_seqs=, max_num_batched_tokens=)`` describe the whole ``LLM``, also on a
mesh: each device gets the ``1 / (dp·ep)`` share of the cache memory (rounded down to whole bytes) and of the
two step budgets (rounded up, so no device gets a zero budget and the mesh as a whole admits at least what was
asked; :func:`device_share`). One request therefore has to fit the cache of one device. ``cache.num_blocks``,
when set, is a per-device count.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.cache.plan import MemoryPlan
from deepinfer_jax.checkpoint.model_loading import Model
from deepinfer_jax.engine.mesh_eplb import MeshExpertBalancer
from deepinfer_jax.engine.paged_model import PagedModel
from deepinfer_jax.engine.params import RequestOutput, SamplingParams
from deepinfer_jax.engine.plan import StepPlan, choose_bucket
from deepinfer_jax.engine.runner import EngineRunner, RunStats, step_arguments
from deepinfer_jax.engine.scheduler import Scheduler
from deepinfer_jax.engine.step import CompiledStep, StepInputs, StepOutput, init_state, step
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.common.moe import Routing
from deepinfer_jax.ops.moe_kernels import register_expert_layout
from deepinfer_jax.parallel import SlotExperts, local_moe_experts, shard_model_params, slot_expert_layers
from deepinfer_jax.parallel.expert_parallel import ExpertPlacement, resolve_transport
from deepinfer_jax.parallel.mesh import ALL_AXES, EP, mesh_sizes
from deepinfer_jax.parallel.model_parallel import place_on_mesh
from deepinfer_jax.sampling import SamplingTensors

__all__ = [
    "DEVICE_SPEC",
    "ManualSlotExperts",
    "MeshMemoryPlan",
    "MeshPlan",
    "MeshRunStats",
    "MeshRunner",
    "MeshScheduler",
    "MeshStepExecutor",
    "device_inputs",
    "device_share",
    "expert_count_layout",
    "mesh_memory_plan",
    "mesh_step",
    "param_specs",
    "route",
    "shard_model",
]

DEVICE_SPEC = PartitionSpec(ALL_AXES)
"""The leading device axis of every per-device array (plans, caches, state, outputs), spread over the mesh."""

_MIB = 1 << 20


def device_share(total: int, num_devices: int) -> int:
    """One device's share of a per-step budget of the whole ``LLM``: ``ceil(total / num_devices)``.

    Rounding up keeps every device's budget at least 1 and the mesh's combined budget at least ``total``.
    """
    return -(-total // num_devices)


# ---------------------------------------------------------------------------------- memory plan, parameters


@dataclasses.dataclass(frozen=True)
class MeshMemoryPlan(MemoryPlan):
    """The memory plan of one device of the mesh (``spec``, ``budget_bytes`` are per device), plus the layout.

    Attributes:
      dp, ep: the mesh.
      total_budget_bytes: ``kv_cache_memory`` of the whole ``LLM`` (each device plans ``total // (dp·ep)``).
      max_num_seqs, max_num_batched_tokens: each device's step budgets.
      expert_slots: ``(layer path, logical experts, physical slots)`` of every MoE layer; each device holds
        ``slots / ep`` of a layer's slots.
    """

    dp: int = 1
    ep: int = 1
    total_budget_bytes: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    expert_slots: tuple[tuple[str, int, int], ...] = ()

    @property
    def num_devices(self) -> int:
        return self.dp * self.ep

    def describe(self) -> str:
        """The per-device breakdown of :meth:`MemoryPlan.describe` under a summary of the mesh layout."""
        lines = [
            f"mesh: dp={self.dp} x ep={self.ep} = {self.num_devices} devices; each owns its sequences, a cache "
            f"of {self.spec.num_blocks} blocks and {self.spec.num_slots} state slots, and runs up to "
            f"{self.max_num_seqs} sequences / {self.max_num_batched_tokens} tokens per step "
            f"(kv_cache_memory {self.total_budget_bytes / _MIB:.1f} MiB in total)",
        ]
        if self.expert_slots:
            shapes = sorted({(e, p) for _, e, p in self.expert_slots})
            layout = ", ".join(f"{e} experts in {p} slots ({p // self.ep} per device)" for e, p in shapes)
            lines.append(
                f"routed experts: {len(self.expert_slots)} MoE layers sharded over ep={self.ep}: {layout}; "
                "everything else replicated"
            )
        return "\n".join([*lines, "per device: " + super().describe()])


def mesh_memory_plan(
    plan: MemoryPlan,
    *,
    mesh: Mesh,
    total_budget_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    params: Any,
) -> MeshMemoryPlan:
    """``plan`` (one device's) with the mesh layout of ``params`` (:class:`MeshMemoryPlan`)."""
    dp, ep = mesh_sizes(mesh)
    layers = tuple(
        (path, layer.num_experts, layer.num_slots) for path, layer in slot_expert_layers(params).items()
    )
    return MeshMemoryPlan(
        **{f.name: getattr(plan, f.name) for f in dataclasses.fields(MemoryPlan)},
        dp=dp,
        ep=ep,
        total_budget_bytes=total_budget_bytes,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        expert_slots=layers,
    )


def shard_model(model: Model, mesh: Mesh, *, extra: int = 0) -> Model:
    """``model`` with its parameters laid out on ``mesh``: routed experts in ``ep``-sharded slots (``extra``
    redundant ones per layer), everything else replicated (:func:`~deepinfer_jax.parallel.shard_model_params`).

    Raises ``NotImplementedError`` for a family without logical axes (its parameters cannot be laid out).
    """
    if model.family.logical_axes is None:
        raise NotImplementedError(
            f"data_parallel_size / expert_parallel_size: model family {model.family.name!r} has no logical "
            "parameter axes, so its parameters cannot be laid out on a mesh; use 1 and 1"
        )
    params = shard_model_params(model.params, model.family.logical_axes(model.params), mesh, extra=extra)
    return Model(model.config, params, model.family, model.dtype, model.path)


# ------------------------------------------------------------------------------------------------ routing


def route(loads: Sequence[tuple[int, int]]) -> int:
    """The device a new request goes to: fewest sequences, then fewest tokens, then the lowest index.

    ``loads[d]`` is ``(unfinished sequences, tokens they hold)`` of device ``d``.
    """
    if not loads:
        raise ValueError("route: loads is empty; expected one (sequences, tokens) pair per device")
    return min(range(len(loads)), key=lambda d: (loads[d][0], loads[d][1], d))


class MeshScheduler:
    """The schedulers of every device of a mesh behind one ``add_request``: the router (module docstring).

    Args:
      schedulers: one :class:`Scheduler` per device, in mesh order (device ``d`` at ``(d // ep, d % ep)``);
        they must share block size, block-table width and buckets, so their plans stack into one step.
    """

    def __init__(self, schedulers: Sequence[Scheduler]) -> None:
        if not schedulers:
            raise ValueError("MeshScheduler: schedulers is empty; expected one per device")
        for d, s in enumerate(schedulers):
            if not isinstance(s, Scheduler):
                raise TypeError(
                    f"MeshScheduler: schedulers[{d}] is a {type(s).__name__}, expected a Scheduler"
                )
        first = schedulers[0]
        for d, s in enumerate(schedulers):
            for name in ("block_size", "max_blocks_per_seq", "buckets", "vocab_size", "max_model_len"):
                if getattr(s, name) != getattr(first, name):
                    raise ValueError(
                        f"MeshScheduler: schedulers[{d}].{name} = {getattr(s, name)!r} differs from "
                        f"schedulers[0].{name} = {getattr(first, name)!r}"
                    )
        self.schedulers: tuple[Scheduler, ...] = tuple(schedulers)
        self._assigned: list[dict[str, None]] = [{} for _ in schedulers]  # insertion-ordered request ids
        self._owner: dict[str, int] = {}
        # The loads as of the last change that went through this object (a batch of add_request calls between
        # two steps updates it incrementally instead of walking every request once per add); None: recompute.
        self._loads: list[list[int]] | None = None

    @property
    def num_devices(self) -> int:
        return len(self.schedulers)

    @property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        return self.schedulers[0].buckets

    @property
    def max_blocks_per_seq(self) -> int:
        return self.schedulers[0].max_blocks_per_seq

    def loads(self) -> list[tuple[int, int]]:
        """``(unfinished sequences, tokens they hold)`` per device, the router's input.

        Tokens are the prompt and the outputs so far, in-flight samples included: what the sequences hold in
        the device's cache, or will hold once admitted.
        """
        if self._loads is None:
            self._loads = [self._device_load(d) for d in range(self.num_devices)]
        return [(seqs, tokens) for seqs, tokens in self._loads]

    def _device_load(self, device: int) -> list[int]:
        sched, assigned = self.schedulers[device], self._assigned[device]
        tokens = 0
        for rid in list(assigned):
            try:
                tokens += sched.get_request(rid).total_len
            except KeyError:  # finished: it no longer loads the device
                del assigned[rid]
                self._owner.pop(rid, None)
        return [len(assigned), tokens]

    def device_of(self, request_id: str) -> int:
        """The device an unfinished request was routed to (``KeyError`` once it has finished)."""
        return self._owner[request_id]

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Any,
        params: SamplingParams,
        *,
        seed: int,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> int:
        """Route a request to a device and queue it there (:meth:`Scheduler.add_request`); returns the device."""
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already queued or running")
        device = route(self.loads())
        sched = self.schedulers[device]
        sched.add_request(
            request_id, prompt_token_ids, params, seed=seed, prompt=prompt, arrival_time=arrival_time
        )
        try:
            tokens = sched.get_request(request_id).total_len
        except KeyError:  # it can never fit the cache and finished at once: it holds nothing
            return device
        self._assigned[device][request_id] = None
        self._owner[request_id] = device
        if self._loads is not None:
            self._loads[device][0] += 1
            self._loads[device][1] += tokens
        return device

    def schedule(self) -> MeshPlan | None:
        """Every device's part of the next global step, or ``None`` when no device can run anything now."""
        self._loads = None  # scheduling changes what the requests hold (in-flight samples)
        parts = tuple(s.schedule() for s in self.schedulers)
        if all(p is None for p in parts):
            return None
        return MeshPlan(parts)

    def process_outputs(
        self, device: int, plan: StepPlan, sampled_tokens: Any, **arrays: Any
    ) -> list[RequestOutput]:
        """:meth:`Scheduler.process_outputs` of ``device`` for its part of a step (requests may finish)."""
        self._loads = None
        return self.schedulers[device].process_outputs(plan, sampled_tokens, **arrays)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def take_ready_outputs(self) -> list[RequestOutput]:
        return [o for s in self.schedulers for o in s.take_ready_outputs()]


# ------------------------------------------------------------------------------------------------ plans


@dataclasses.dataclass(frozen=True, eq=False)
class MeshPlan:
    """One global step: each device's :class:`StepPlan`, ``None`` for a device with nothing to run now."""

    plans: tuple[StepPlan | None, ...]

    @property
    def num_placeholders(self) -> int:
        """Devices that run an all-padding placeholder in this step."""
        return sum(p is None for p in self.plans)

    def bucket(self, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """The step's global ``(T, S)``: the smallest of ``buckets`` holding every device's plan."""
        real = [p for p in self.plans if p is not None]
        if not real:
            raise ValueError("MeshPlan: every device's plan is None; a step needs at least one")
        return choose_bucket(max(p.padded_tokens for p in real), max(p.padded_seqs for p in real), buckets)


def device_inputs(plan: StepPlan | None, tokens: int, seqs: int, max_blocks_per_seq: int) -> StepInputs:
    """``plan``'s arrays padded to the global bucket ``(tokens, seqs)``; ``None`` gives the placeholder plan.

    Padding follows the plan's own conventions (engine/plan.py): extra tokens are id 0 at position 0 owned by
    the sentinel row ``seqs`` (the plan's own padding tokens are moved to it too), extra rows own no tokens, no
    slot and no blocks and sample nothing. The placeholder is all padding: the device computes ``tokens``
    throw-away rows, writes nothing to its cache or state, and takes part in every collective of the step.
    """
    if plan is None:
        return StepInputs(
            token_ids=np.zeros(tokens, np.int32),
            positions=np.zeros(tokens, np.int32),
            token_seq=np.full(tokens, seqs, np.int32),
            seq_slots=np.full(seqs, -1, np.int32),
            query_start=np.zeros(seqs + 1, np.int32),
            context_lens=np.zeros(seqs, np.int32),
            block_tables=np.full((seqs, max_blocks_per_seq), -1, np.int32),
            sample=np.zeros(seqs, np.bool_),
        )
    t, s = plan.bucket
    if t > tokens or s > seqs:
        raise ValueError(
            f"device_inputs: the plan's bucket {(t, s)} does not fit the step's {(tokens, seqs)}"
        )
    base = StepInputs.from_plan(plan, max_blocks_per_seq)
    extra_t, extra_s = tokens - t, seqs - s
    return StepInputs(
        token_ids=np.pad(base.token_ids, (0, extra_t)),
        positions=np.pad(base.positions, (0, extra_t)),
        token_seq=np.pad(
            np.where(base.token_seq >= s, seqs, base.token_seq), (0, extra_t), constant_values=seqs
        ),
        seq_slots=np.pad(base.seq_slots, (0, extra_s), constant_values=-1),
        query_start=np.pad(base.query_start, (0, extra_s), constant_values=plan.num_tokens),
        context_lens=np.pad(base.context_lens, (0, extra_s)),
        block_tables=np.pad(base.block_tables, ((0, extra_s), (0, 0)), constant_values=-1),
        sample=np.pad(base.sample, (0, extra_s)),
    )


def _pad_mask(sampling: SamplingTensors, width: int) -> SamplingTensors:
    """``sampling`` with ``masked_ids`` widened to ``width`` columns of ``-1`` (unused entries)."""
    extra = width - sampling.masked_ids.shape[1]
    if extra == 0:
        return sampling
    masked = np.pad(sampling.masked_ids, ((0, 0), (0, extra)), constant_values=-1)
    return dataclasses.replace(sampling, masked_ids=masked)


def _to_host(x: jax.Array) -> np.ndarray:
    """All of a global array on this host: every process reads every device's rows (SPMD: each process's
    schedulers then make the same decisions)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return multihost_utils.process_allgather(x, tiled=True)


def _stack(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


# ------------------------------------------------------------------------------------------------ MoE


@dataclasses.dataclass(frozen=True)
class ManualSlotExperts:
    """One MoE layer's routed experts as one device sees them inside the engine's ``shard_map`` (a pytree node).

    Inside the manual region a :class:`~deepinfer_jax.parallel.SlotExperts` would start a global-view
    expert-parallel ``shard_map`` of its own, which cannot nest there. :func:`mesh_step` swaps every one for this
    per-device view: the device's ``P / ep`` expert slots and the layer's placement, with op ``moe_experts``
    running the per-device body (dispatch over ``ep``, local experts, combine) directly.

    Attributes:
      experts: the device's slots of ``{"gate", "up", "down"}``, ``[P / ep, ...]``.
      placement: the layer's :class:`ExpertPlacement` (all ``P`` slots, replicated).
      ep: the expert-parallel group size (static).
      transport: a concrete transport of :mod:`deepinfer_jax.parallel.expert_parallel` (static).
      platform: the devices' platform, for the choice of the expert-compute backend (static).
      path: the layer's dotted path in the parameter tree (static; keys the step's expert counts).
    """

    experts: dict[str, Any]
    placement: ExpertPlacement
    ep: int
    transport: str
    platform: str
    path: str = ""


jax.tree_util.register_dataclass(
    ManualSlotExperts,
    data_fields=["experts", "placement"],
    meta_fields=["ep", "transport", "platform", "path"],
)


@dataclasses.dataclass
class _StepTrace:
    """What one device's trace of :func:`mesh_step` shares with its MoE layers (trace time only).

    ``valid`` marks this device's real tokens (padding tokens are routed to no expert: they cost no dispatch
    and no expert rows, and do not count as load); ``counts`` collects each layer's rows per local slot.
    """

    valid: jax.Array
    counts: dict[str, jax.Array]


_STEP_TRACE: contextvars.ContextVar[_StepTrace | None] = contextvars.ContextVar(
    "mesh_step_trace", default=None
)


def _manual_moe_experts(
    x: jax.Array,
    routing: Routing,
    experts: ManualSlotExperts,
    numerics: LinearNumerics,
    *,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    out_dtype: Any = None,
) -> jax.Array:
    """Op ``moe_experts`` for :class:`ManualSlotExperts`: this device's tokens, expert-parallel over ``ep``.

    Inside :func:`mesh_step` the step's padding tokens are dropped from the routing (expert id ``-1``) and the
    rows each local slot received are recorded for the step's expert counts.
    """
    trace = _STEP_TRACE.get()
    if trace is not None and trace.valid.shape[0] == x.shape[0]:
        routing = Routing(jnp.where(trace.valid[:, None], routing.ids, -1), routing.weights)
    result = local_moe_experts(
        x,
        routing,
        experts.experts,
        experts.placement,
        numerics,
        ep=experts.ep,
        swiglu_limit=swiglu_limit,
        weight_before_down=weight_before_down,
        out_dtype=out_dtype,
        transport=experts.transport,
        platform=experts.platform,
    )
    if trace is not None:
        seen = trace.counts.get(experts.path)
        trace.counts[experts.path] = result.slot_counts if seen is None else seen + result.slot_counts
    return result.out


register_expert_layout(ManualSlotExperts, _manual_moe_experts)


def _is_slot_experts(x: Any) -> bool:
    return isinstance(x, SlotExperts)


def expert_count_layout(params: Any, ep: int) -> tuple[tuple[str, int], ...]:
    """``(dotted path, slots per device)`` of every slot-layout MoE layer of ``params``, in tree order: the
    columns of :func:`mesh_step`'s expert counts."""
    return tuple((path, layer.num_slots // ep) for path, layer in slot_expert_layers(params).items())


def param_specs(params: Any) -> Any:
    """The ``shard_map`` in-specs of a laid-out parameter tree: expert slots over ``ep``, the rest replicated."""

    def one(x: Any) -> Any:
        if isinstance(x, SlotExperts):
            return dataclasses.replace(
                x,
                experts=jax.tree.map(lambda _: PartitionSpec(EP), x.experts),
                placement=jax.tree.map(lambda _: PartitionSpec(), x.placement),
            )
        return PartitionSpec()

    return jax.tree.map(one, params, is_leaf=_is_slot_experts)


def _manual_params(params: Any, mesh: Mesh) -> Any:
    """Inside the manual region: every :class:`SlotExperts` replaced by its :class:`ManualSlotExperts` view.

    A layer laid out for another mesh is refused: its slots would be split for a different EP group size.
    """
    _, ep = mesh_sizes(mesh)
    platform = mesh.devices.flat[0].platform

    def one(path: Any, x: Any) -> Any:
        if isinstance(x, SlotExperts):
            if x.mesh != mesh:
                raise ValueError(
                    f"params: a MoE layer is laid out for mesh {dict(x.mesh.shape)}, but the step runs on "
                    f"{dict(mesh.shape)}; lay the parameters out with shard_model_params on the step's mesh"
                )
            name = jax.tree_util.keystr(path, simple=True, separator=".")
            return ManualSlotExperts(
                x.experts, x.placement, ep, resolve_transport(x.transport, mesh), platform, name
            )
        return x

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_slot_experts)


# ------------------------------------------------------------------------------------------------ step


def mesh_step(
    params: Any,
    cache: Any,
    state: Any,
    inputs: StepInputs,
    sampling: SamplingTensors,
    prompt_lens: jax.Array,
    prompt_targets: jax.Array | None = None,
    *,
    mesh: Mesh,
    model: PagedModel,
    num_logprobs: int = 0,
    num_prompt_logprobs: int = -1,
    batch_invariant: bool = False,
    return_logits: bool = False,
    expert_counts: bool = False,
) -> tuple[Any, Any, Any]:
    """One global engine step: :func:`~deepinfer_jax.engine.step.step` on every device of ``mesh`` at once.

    Every array but ``params`` has a leading device axis of ``dp * ep`` entries, spread over the mesh
    (:data:`DEVICE_SPEC`): ``cache``, ``state`` and the step's per-device inputs; the outputs too. ``params`` is
    the tree of :func:`~deepinfer_jax.parallel.shard_model_params` (routed experts in ``ep``-sharded slots,
    everything else replicated). The keyword arguments are static, as for ``step``.

    Returns ``(cache, state, out)``; with ``expert_counts`` the third item is ``(out, counts)``: the rows each
    device's local slots received in every MoE layer, ``int32 [dp * ep, Σ P / ep]``, the layers side by side in
    the order of :func:`expert_count_layout` (a layer the step does not run counts zeros; device ``d`` holds
    slots ``(d % ep) * P / ep`` onwards; padding tokens are not routed, so not counted). One array, so reading
    a step's counts is one transfer however many layers the model has.
    """
    _, ep = mesh_sizes(mesh)  # a (dp, ep) mesh, or a ValueError naming its axes
    layout = expert_count_layout(params, ep) if expert_counts else ()

    def body(params: Any, cache: Any, state: Any, *args: Any) -> tuple[Any, Any, Any]:
        one = functools.partial(jax.tree.map, lambda a: a[0])
        args = tuple(one(a) for a in args)
        inputs = args[0]
        trace = _StepTrace(valid=inputs.token_seq < inputs.seq_slots.shape[0], counts={})
        token = _STEP_TRACE.set(trace)
        try:
            cache, state, out = step(
                _manual_params(params, mesh),
                one(cache),
                one(state),
                *args,
                model=model,
                num_logprobs=num_logprobs,
                num_prompt_logprobs=num_prompt_logprobs,
                batch_invariant=batch_invariant,
                return_logits=return_logits,
            )
        finally:
            _STEP_TRACE.reset(token)
        result: Any = out
        if expert_counts:
            unknown = sorted(set(trace.counts) - {path for path, _ in layout})
            if unknown:
                raise ValueError(f"mesh_step: MoE layers {unknown} are not slot-layout layers of params")
            parts = [trace.counts.get(path, jnp.zeros(width, jnp.int32)) for path, width in layout]
            result = (out, jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.int32))
        return jax.tree.map(lambda a: a[None], (cache, state, result))

    args: tuple[Any, ...] = (inputs, sampling, prompt_lens)
    if prompt_targets is not None:
        args = (*args, prompt_targets)
    # check_vma is off for the reason ep_moe_experts gives: op moe_experts skips experts without rows through
    # a lax.cond whose branches differ in which mesh axes their values vary over.
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(param_specs(params), DEVICE_SPEC, DEVICE_SPEC, *(DEVICE_SPEC,) * len(args)),
        out_specs=DEVICE_SPEC,
        check_vma=False,
    )
    return fn(params, cache, state, *args)


class MeshStepExecutor(CompiledStep):
    """Runs :func:`mesh_step` for one model on one mesh, compiling each global bucket once, on first use.

    Holds the stacked per-device caches and states (donated to every step). Like
    :class:`~deepinfer_jax.engine.step.StepExecutor` it compiles ahead of time per ``(T, S)`` bucket (and
    mask width and logprob variants) and counts compilations.

    Args:
      params: the laid-out parameters (:func:`~deepinfer_jax.parallel.shard_model_params` on ``mesh``).
      model: the family's :class:`PagedModel`.
      mesh: the ``(dp, ep)`` mesh.
      num_blocks, num_slots: each device's cache blocks and state slots.
      max_blocks_per_seq: block-table width.
      expert_counts: every step also returns its per-layer expert counts (:func:`mesh_step`), kept in
        :attr:`expert_counts` until the next step (EPLB and the ``moe_lb`` statistics read them).
    """

    def __init__(
        self,
        params: Any,
        model: PagedModel,
        mesh: Mesh,
        *,
        num_blocks: int,
        num_slots: int,
        max_blocks_per_seq: int,
        return_logits: bool = False,
        batch_invariant: bool = False,
        expert_counts: bool = False,
    ) -> None:
        super().__init__(
            mesh_step,
            params,
            model,
            num_blocks=num_blocks,
            num_slots=num_slots,
            max_blocks_per_seq=max_blocks_per_seq,
            return_logits=return_logits,
            batch_invariant=batch_invariant,
            static={"mesh": mesh, "expert_counts": bool(expert_counts)},
            lead=1,
        )
        self.expert_counts: jax.Array | None = None
        """The last dispatched step's expert counts, ``[dp * ep, Σ P / ep]`` (:func:`mesh_step`); ``None`` unless
        built with ``expert_counts=True``."""
        dp, ep = mesh_sizes(mesh)
        self.mesh = mesh
        self.num_devices = dp * ep
        self._sharding = NamedSharding(mesh, DEVICE_SPEC)
        self.cache = self._stacked(lambda: model.init_cache(num_blocks, num_slots))
        self.state = self._stacked(lambda: init_state(num_slots, self.vocab_size))
        self._num_slots = num_slots

    @property
    def returns_expert_counts(self) -> bool:
        """Whether every step also returns its per-layer expert counts (built with ``expert_counts=True``)."""
        return bool(self._static["expert_counts"])

    def _stacked(self, make: Callable[[], Any]) -> Any:
        """``make()``'s pytree once per device, stacked on a leading device axis and created in place, sharded."""
        d = self.num_devices
        return jax.jit(
            lambda: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (d, *a.shape)), make()),
            out_shardings=self._sharding,
        )()

    def run(
        self,
        inputs: StepInputs,
        sampling: SamplingTensors,
        prompt_lens: np.ndarray,
        *,
        num_logprobs: int = 0,
        prompt_targets: np.ndarray | None = None,
        num_prompt_logprobs: int = 0,
    ) -> StepOutput:
        """Dispatch one global step over stacked per-device numpy arrays (leading axis ``dp * ep``).

        Returns the stacked outputs (``[dp * ep, S, ...]``) without waiting for them. ``prompt_targets``
        (``[dp * ep, T]``) turns on prompt logprobs with ``num_prompt_logprobs`` alternatives.
        """
        d = self.num_devices
        if inputs.token_ids.ndim != 2 or inputs.token_ids.shape[0] != d:
            raise ValueError(
                f"inputs.token_ids: shape {inputs.token_ids.shape}, expected ({d}, T): one plan per device"
            )
        args: tuple[Any, ...] = (inputs, sampling, np.asarray(prompt_lens, np.int32))
        variant = -1
        if prompt_targets is not None:
            args = (*args, np.asarray(prompt_targets, np.int32))
            variant = int(num_prompt_logprobs)
        args = jax.tree.map(lambda a: place_on_mesh(a, self._sharding), args)
        out = self._dispatch(args, int(num_logprobs), variant)
        if self.returns_expert_counts:
            out, self.expert_counts = out
        return out

    def reset_state(self) -> None:
        """Zero every device's per-slot state; the caches need no reset (every read follows its write)."""
        self.state = self._stacked(lambda: init_state(self._num_slots, self.vocab_size))


# ------------------------------------------------------------------------------------------------ runner


@dataclasses.dataclass
class MeshRunStats(RunStats):
    """:class:`RunStats` of a mesh run, with the layout and the placeholder plans the steps needed."""

    dp: int = 1
    ep: int = 1
    placeholder_plans: int = 0
    """Per-device plans that were all padding (a device with nothing to run while others ran)."""
    eplb_rearrangements: int = 0
    """Expert re-placements done during the run (EPLB)."""
    moe_lb: float | None = None
    """``Σ max / Σ mean`` rows per EP rank over the run's steps and MoE layers (1.0 = even; ``None``: not
    measured, or no token routed)."""

    def summary(self, num_requests: int) -> str:
        extra = ""
        if self.moe_lb is not None:
            extra = f", moe_lb {self.moe_lb:.3f}, {self.eplb_rearrangements} expert re-placements"
        return (
            f"{super().summary(num_requests)} on {self.dp * self.ep} devices (dp={self.dp} x ep={self.ep}, "
            f"{self.placeholder_plans} placeholder plans{extra})"
        )


class _InFlight(NamedTuple):
    """A dispatched global step: its outputs, its expert counts and the placements it ran with."""

    out: StepOutput
    expert_counts: jax.Array | None
    snapshot: Any
    prefill: bool

    @property
    def tokens(self) -> jax.Array:
        """The step's sampled tokens (what a caller timing the step waits on, as on one device)."""
        return self.out.tokens


def _is_prefill(plan: MeshPlan) -> bool:
    """No device runs a decode row (a row of one token) in this step (mesh_eplb's prefill steps)."""
    for part in plan.plans:
        if part is not None and (np.diff(part.query_start[: part.num_seqs + 1]) == 1).any():
            return False
    return True


class MeshRunner(EngineRunner):
    """Drives a :class:`MeshScheduler` and a :class:`MeshStepExecutor` until every request has finished.

    :class:`~deepinfer_jax.engine.runner.EngineRunner`'s loop, unchanged, over global steps: the "plan" it
    schedules, dispatches and processes is a :class:`MeshPlan` (every device's part of the step), which this
    class runs as one :func:`mesh_step` and whose sampled tokens it hands back to each device's scheduler. One
    global step stays in flight while the next is planned, as on one device.
    """

    scheduler: MeshScheduler
    executor: MeshStepExecutor

    def __init__(
        self,
        scheduler: MeshScheduler,
        executor: MeshStepExecutor,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        balancer: MeshExpertBalancer | None = None,
    ) -> None:
        if scheduler.num_devices != executor.num_devices:
            raise ValueError(
                f"MeshRunner: {scheduler.num_devices} schedulers for a mesh of {executor.num_devices} devices"
            )
        if balancer is not None and not executor.returns_expert_counts:
            raise ValueError("MeshRunner: a balancer needs an executor built with expert_counts=True")
        super().__init__(scheduler, executor, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
        self.balancer = balancer
        self.placeholder_plans = 0
        """Per-device placeholder plans dispatched so far."""

    def _dispatch(self, plan: MeshPlan) -> _InFlight:  # type: ignore[override]
        out = self._run_step(plan)
        if self.balancer is None:
            return _InFlight(out, None, None, False)
        return _InFlight(out, self.executor.expert_counts, self.balancer.snapshot(), _is_prefill(plan))

    def _run_step(self, plan: MeshPlan) -> StepOutput:
        parts = plan.plans
        tokens, seqs = plan.bucket(self.scheduler.buckets)
        width = self.scheduler.max_blocks_per_seq
        inputs, samplings, prompt_lens, targets = [], [], [], []
        wanted, prompt_wanted, any_targets = 0, 0, False
        for sched, part in zip(self.scheduler.schedulers, parts):
            inputs.append(device_inputs(part, tokens, seqs, width))
            if part is None:
                samplings.append(SamplingTensors.build([], [], [], self.vocab_size, num_rows=seqs))
                prompt_lens.append(np.zeros(seqs, np.int32))
                targets.append(np.full(tokens, -1, np.int32))
                continue
            args = step_arguments(
                sched, part, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids, num_rows=seqs
            )
            samplings.append(args.sampling)
            prompt_lens.append(args.prompt_lens)
            wanted = max(wanted, args.num_logprobs)
            row_targets = np.full(tokens, -1, np.int32)
            if args.prompt_targets is not None:
                any_targets = True
                row_targets[: args.prompt_targets.shape[0]] = args.prompt_targets
                prompt_wanted = max(prompt_wanted, args.num_prompt_logprobs)
            targets.append(row_targets)
        mask = max(s.masked_ids.shape[1] for s in samplings)
        self.placeholder_plans += plan.num_placeholders
        return self.executor.run(
            _stack(inputs),
            _stack([_pad_mask(s, mask) for s in samplings]),
            np.stack(prompt_lens),
            num_logprobs=wanted,
            prompt_targets=np.stack(targets) if any_targets else None,
            num_prompt_logprobs=prompt_wanted,
        )

    def _process(self, plan: MeshPlan, step: _InFlight) -> list[RequestOutput]:  # type: ignore[override]
        finished = self._process_tokens(plan, step.out)
        if self.balancer is not None and step.expert_counts is not None:
            counts = _to_host(step.expert_counts)
            if self.balancer.observe(counts, prefill=step.prefill, snapshot=step.snapshot):
                # The next dispatch takes the re-placed slots; the step in flight keeps the arrays it was given.
                self.executor.params = self.balancer.rearrange(self.executor.params)
        return finished

    def _process_tokens(self, plan: MeshPlan, out: StepOutput) -> list[RequestOutput]:
        host = jax.tree.map(_to_host, out)
        finished: list[RequestOutput] = []
        for d, part in enumerate(plan.plans):
            if part is None:
                continue
            prompt = None if host.prompt is None else tuple(a[d] for a in host.prompt)
            finished.extend(
                self.scheduler.process_outputs(
                    d,
                    part,
                    host.tokens[d],
                    logprob=host.logprob[d],
                    rank=host.rank[d],
                    top_ids=host.top_ids[d],
                    top_logprobs=host.top_logprobs[d],
                    prompt_logprobs=prompt,
                )
            )
        return finished

    def run(
        self,
        on_finished: Callable[[RequestOutput], None] | None = None,
        *,
        poll: Callable[[], bool] | None = None,
    ) -> tuple[list[RequestOutput], MeshRunStats]:
        """:meth:`EngineRunner.run <deepinfer_jax.engine.runner.EngineRunner.run>` over the mesh; the stats
        also say the layout and how many per-device placeholder plans ran."""
        before = self.placeholder_plans
        balancer = self.balancer
        peak, mean = (balancer.total_peak, balancer.total_mean) if balancer is not None else (0.0, 0.0)
        replaced = balancer.rearrangements if balancer is not None else 0
        finished, stats = super().run(on_finished, poll=poll)
        dp, ep = mesh_sizes(self.executor.mesh)
        fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(RunStats)}
        moe_lb = None
        if balancer is not None and balancer.total_mean > mean:
            moe_lb = (balancer.total_peak - peak) / (balancer.total_mean - mean)
        return finished, MeshRunStats(
            **fields,
            dp=dp,
            ep=ep,
            placeholder_plans=self.placeholder_plans - before,
            eplb_rearrangements=(balancer.rearrangements - replaced) if balancer is not None else 0,
            moe_lb=moe_lb,
        )
