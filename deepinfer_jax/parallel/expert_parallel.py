"""Expert-parallel MoE: tokens travel to the devices holding their experts inside ``jax.shard_map``.

Layout (ARCHITECTURE §5, spec/engine.md §11): every device of the ``(dp, ep)`` mesh owns its own tokens
(attention is data parallel over all ``dp * ep`` devices). A MoE layer's logical experts are laid out in
``P`` *physical slots*, ``P`` the expert count plus redundant replicas rounded up to a multiple of ``ep``; EP rank
``r`` holds slots ``[r·L, (r+1)·L)`` with ``L = P / ep``, and each EP group (one per ``dp`` index) holds all
``P`` slots. Any expert count therefore works: the slots are padded with replicas of existing experts.

Per MoE layer and device:

1. each of its ``t·k`` (token, pick) rows picks one replica of its logical expert
   (``replica = (ep_rank + t · 23333) mod replicas``, spec/engine.md §11.1) and so a slot and a destination rank;
2. **dispatch**: rows go to their destination rank of the same EP group, with their local slot id and routing
   weight;
3. the received rows run through the existing expert compute (op ``moe_experts`` with one pick per row) on the
   device's ``L`` local slots;
4. **combine**: outputs return to their source, in float32, where each token sums its ``k`` rows in the same
   order as the unsharded op and rounds once.

Transports (``transport=``):

* ``"all_to_all"`` -- fixed capacity: a ``[ep, C, H]`` send buffer with ``C = t·k`` rows per destination, the
  worst case (every row of the device bound for one rank), so no token is ever dropped; XLA:CPU's only option
  (``ragged_all_to_all`` is not implemented there). The buffer is ``ep`` times larger than the rows sent.
* ``"ragged"`` -- ``lax.ragged_all_to_all``: rows sorted by destination, exact per-pair sizes exchanged first
  (an ``all_gather`` of ``ep`` counts); only real rows travel. The receive buffer keeps the worst-case size
  ``ep · t · k`` so that the compiled shape never depends on the routing.
* ``"ragged_emulated"`` -- the ragged path with the collective replaced by an ``all_gather``-based emulation of
  its exact semantics; it lets CPU tests check the offset arithmetic of ``"ragged"``.
* ``"auto"`` -- ``"ragged"`` on GPU/TPU meshes, ``"all_to_all"`` elsewhere.

Per-slot received-row counts are returned too (``expert_count`` of spec/engine.md §11.2): the input of EPLB
(:mod:`.eplb`). The placement is an argument made of arrays, so re-placing experts never recompiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.common.moe import Routing
from deepinfer_jax.ops.registry import select
from deepinfer_jax.parallel.mesh import ALL_AXES, EP, mesh_sizes

__all__ = [
    "REPLICA_HASH",
    "TRANSPORTS",
    "ExpertPlacement",
    "MoEOutput",
    "ep_moe_experts",
    "experts_to_slots",
    "initial_placement",
    "local_moe_experts",
    "num_slots",
    "physical_slots",
    "place_experts",
    "placement_from_slots",
    "resolve_transport",
]

REPLICA_HASH = 23333
"""Multiplier of the token index in the replica choice (spec/engine.md §11.1)."""

TRANSPORTS: tuple[str, ...] = ("auto", "all_to_all", "ragged", "ragged_emulated")
_RAGGED_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})


class ExpertPlacement(NamedTuple):
    """Where the replicas of each logical expert live: a pytree of int32 arrays (data, not shape).

    Attributes:
      slot_to_expert: ``[P]`` logical expert held by each physical slot.
      expert_slots: ``[E, R]`` the slots of each expert's replicas, ascending, ``-1`` past its count;
        ``R = P - E + 1``, the most replicas one expert can have, so the shape never depends on the placement.
      replica_count: ``[E]`` replicas of each expert (``>= 1``).
    """

    slot_to_expert: jax.Array
    expert_slots: jax.Array
    replica_count: jax.Array

    @property
    def num_slots(self) -> int:
        """Physical slots ``P`` (static: read from the shape, so usable at trace time)."""
        return int(self.slot_to_expert.shape[0])

    @property
    def num_experts(self) -> int:
        """Logical experts ``E`` (static, from the shape)."""
        return int(self.replica_count.shape[0])


class MoEOutput(NamedTuple):
    """The expert-parallel MoE result: ``out [T, H]`` and per-slot received rows ``slot_counts int32 [P]``.

    ``slot_counts`` sums over the ``dp`` groups; placeholder rows (expert id ``-1``) are not counted.
    """

    out: jax.Array
    slot_counts: jax.Array


def _positive_int(field: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{field} = {value} must be >= {low}")
    return int(value)


def num_slots(num_experts: int, ep: int, extra: int = 0) -> int:
    """Physical slots ``P``: ``num_experts + extra`` rounded up to a multiple of ``ep`` (spec/engine.md §11.1)."""
    num_experts = _positive_int("num_experts", num_experts)
    ep = _positive_int("expert_parallel_size", ep)
    extra = _positive_int("extra", extra, 0)
    return -(-(num_experts + extra) // ep) * ep


def placement_from_slots(slot_to_expert: Any, num_experts: int) -> ExpertPlacement:
    """The :class:`ExpertPlacement` of a slot -> logical-expert map (host side, NumPy in, device arrays out).

    Raises ``ValueError`` when a slot names an expert outside ``[0, num_experts)`` or an expert has no slot.
    """
    num_experts = _positive_int("num_experts", num_experts)
    s2e = np.asarray(slot_to_expert)
    if s2e.ndim != 1 or not np.issubdtype(s2e.dtype, np.integer):
        raise TypeError(f"slot_to_expert: expected a 1-D integer array, got {s2e.dtype} {s2e.shape}")
    slots = s2e.shape[0]
    bad = np.flatnonzero((s2e < 0) | (s2e >= num_experts))
    if bad.size:
        raise ValueError(
            f"slot_to_expert[{bad[0]}] = {s2e[bad[0]]} is outside [0, {num_experts}) (num_experts)"
        )
    counts = np.bincount(s2e, minlength=num_experts)
    if (counts == 0).any():
        missing = np.flatnonzero(counts == 0)
        raise ValueError(f"slot_to_expert: experts {missing.tolist()} have no slot among the {slots} slots")
    width = slots - num_experts + 1
    table = np.full((num_experts, width), -1, np.int32)
    order = np.argsort(s2e, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for e in range(num_experts):
        table[e, : counts[e]] = order[starts[e] : starts[e] + counts[e]]
    return ExpertPlacement(
        slot_to_expert=jnp.asarray(s2e, jnp.int32),
        expert_slots=jnp.asarray(table),
        replica_count=jnp.asarray(counts, jnp.int32),
    )


def initial_placement(num_experts: int, ep: int, extra: int = 0) -> ExpertPlacement:
    """Slot ``i`` holds expert ``i mod num_experts`` over ``num_slots(num_experts, ep, extra)`` slots (§11.3)."""
    slots = num_slots(num_experts, ep, extra)
    return placement_from_slots(np.arange(slots) % num_experts, num_experts)


def place_experts(experts: Mapping[str, Any], placement: ExpertPlacement) -> dict[str, Any]:
    """Expert stacks in slot layout: every leaf ``[E, ...]`` gathered to ``[P, ...]`` by ``slot_to_expert``.

    Works on any linear format (the FP8 scale grids and MXFP4 packs are stacked per expert too).
    """
    e = placement.num_experts

    def one(path: tuple[Any, ...], leaf: jax.Array) -> jax.Array:
        if leaf.ndim < 1 or leaf.shape[0] != e:
            name = ".".join(str(getattr(p, "key", p)) for p in path)
            raise ValueError(
                f"place_experts: {name} has shape {leaf.shape}; expected [{e}, ...] (num_experts)"
            )
        return jnp.take(leaf, placement.slot_to_expert, axis=0)

    return jax.tree_util.tree_map_with_path(one, dict(experts))


def experts_to_slots(params: Any, placement: ExpertPlacement) -> Any:
    """``params`` with every MoE layer's routed-expert stacks (an ``"experts"`` entry) in slot layout.

    Walks nested dicts and lists (the parameter trees of every model family keep a MoE layer's routed experts
    under the key ``"experts"``); all layers get the same ``placement``, the initial state of EPLB. Other
    leaves are shared, not copied.
    """
    if isinstance(params, Mapping):
        return {
            k: place_experts(v, placement) if k == "experts" else experts_to_slots(v, placement)
            for k, v in params.items()
        }
    if isinstance(params, (list, tuple)):
        return type(params)(experts_to_slots(v, placement) for v in params)
    return params


def physical_slots(ids: jax.Array, placement: ExpertPlacement, ep_rank: jax.Array | int) -> jax.Array:
    """The physical slot of each routed pick ``ids int [t, k]`` on EP rank ``ep_rank`` (``-1`` stays ``-1``).

    Replica ``(ep_rank + row · 23333) mod c`` of an expert with ``c`` replicas, ``row`` the token's index in the
    device's batch (spec/engine.md §11.1): the tokens of one device spread over all replicas, and devices with
    the same tokens start at different replicas. Computed modulo ``c`` term by term so int32 never overflows.
    """
    valid = ids >= 0
    safe = jnp.where(valid, ids, 0)
    count = placement.replica_count[safe]
    row = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
    replica = (jnp.asarray(ep_rank, jnp.int32) % count + (row % count) * (REPLICA_HASH % count)) % count
    slot = placement.expert_slots[safe, replica]
    return jnp.where(valid, slot, -1)


def resolve_transport(transport: str, mesh: Mesh) -> str:
    """The concrete transport of ``transport`` on ``mesh`` (``"auto"``: ragged where the platform has it)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: {transport!r} is not one of {TRANSPORTS}")
    if transport != "auto":
        return transport
    platform = mesh.devices.flat[0].platform
    return "ragged" if platform in _RAGGED_PLATFORMS else "all_to_all"


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _emulated_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
) -> jax.Array:
    """``lax.ragged_all_to_all``'s semantics from an ``all_gather``: every device sees every chunk, keeps its own.

    Device ``me`` writes, for each source ``s``, rows ``operand_s[input_offsets_s[me] :][: send_sizes_s[me]]``
    at ``output[output_offsets_s[me] :]``. ``recv_sizes`` is implied by the senders' sizes (it is accepted to
    keep the signature of the real collective). Memory is ``ep`` times the operand: for tests only.
    """
    del recv_sizes
    me = lax.axis_index(axis_name)
    every_op = lax.all_gather(operand, axis_name)  # [ep, rows, ...]
    in_off = lax.all_gather(input_offsets, axis_name)[:, me]  # [ep]: where source s's chunk for me starts
    size = lax.all_gather(send_sizes, axis_name)[:, me]
    out_off = lax.all_gather(output_offsets, axis_name)[:, me]
    pos = jnp.arange(output.shape[0], dtype=jnp.int32)[:, None]  # [N, 1]
    hit = (pos >= out_off[None, :]) & (pos < out_off[None, :] + size[None, :])  # [N, ep]
    src = jnp.argmax(hit, axis=1)
    row = in_off[src] + pos[:, 0] - out_off[src]
    got = every_op[src, jnp.clip(row, 0, operand.shape[0] - 1)]
    mask = hit.any(axis=1).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(mask, got, output)


def _expert_compute(
    rows: jax.Array,
    slots: jax.Array,
    weights: jax.Array,
    local_experts: Mapping[str, Any],
    numerics: LinearNumerics,
    swiglu_limit: float | None,
    weight_before_down: bool,
    platform: str,
) -> jax.Array:
    """``w · FFN_slot(row)`` per received row in float32 through op ``moe_experts`` (one pick per row)."""
    fn = select("moe_experts", platform=platform)
    return fn(
        rows,
        Routing(ids=slots[:, None], weights=weights[:, None]),
        local_experts,
        numerics,
        swiglu_limit=swiglu_limit,
        weight_before_down=weight_before_down,
        out_dtype=jnp.float32,
    )


Compute = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _fixed_capacity_exchange(
    rows: jax.Array,
    local_slot: jax.Array,
    row_w: jax.Array,
    dest: jax.Array,
    compute: Compute,
    *,
    ep: int,
) -> tuple[jax.Array, jax.Array]:
    """Dispatch / compute / combine through ``lax.all_to_all`` with ``[ep, rows, H]`` buffers.

    Returns each row's float32 output (garbage for rows with ``dest == ep``; the caller masks them) and the
    local slot ids of every received buffer row (``-1`` for empty ones).
    """
    n_rows, hidden = rows.shape
    onehot = (dest[:, None] == jnp.arange(ep)[None, :]).astype(jnp.int32)  # [rows, ep]; dest == ep: no column
    before = jnp.cumsum(onehot, axis=0) - onehot  # rows ahead of each row bound for the same rank
    target = jnp.minimum(dest, ep - 1)
    pos = jnp.take_along_axis(before, target[:, None], axis=1)[:, 0]
    cap = n_rows  # worst case: every row of this device goes to one rank; nothing can be dropped
    send_x = jnp.zeros((ep, cap, hidden), rows.dtype).at[dest, pos].set(rows, mode="drop")
    send_s = jnp.full((ep, cap), -1, jnp.int32).at[dest, pos].set(local_slot, mode="drop")
    send_w = jnp.zeros((ep, cap), jnp.float32).at[dest, pos].set(row_w, mode="drop")
    a2a = functools.partial(lax.all_to_all, axis_name=EP, split_axis=0, concat_axis=0, tiled=True)
    recv_x, recv_s, recv_w = a2a(send_x), a2a(send_s), a2a(send_w)
    y = compute(recv_x.reshape(ep * cap, hidden), recv_s.reshape(-1), recv_w.reshape(-1))
    back = a2a(y.reshape(ep, cap, hidden))
    return back[target, pos], recv_s.reshape(-1)


def _ragged_exchange(
    rows: jax.Array,
    local_slot: jax.Array,
    row_w: jax.Array,
    dest: jax.Array,
    compute: Compute,
    *,
    ep: int,
    rank: jax.Array,
    emulated: bool,
) -> tuple[jax.Array, jax.Array]:
    """Dispatch / compute / combine through ``lax.ragged_all_to_all`` (or its emulation): real rows only.

    Same results as :func:`_fixed_capacity_exchange`; received rows are packed at the front of the buffer.
    """
    n_rows, hidden = rows.shape
    rag = functools.partial(_emulated_ragged_all_to_all if emulated else lax.ragged_all_to_all, axis_name=EP)
    order = jnp.argsort(dest, stable=True)  # rows grouped by destination, placeholders last
    send_sizes = jnp.sum(dest[:, None] == jnp.arange(ep)[None, :], axis=0).astype(jnp.int32)  # [ep]
    in_off = _exclusive_cumsum(send_sizes)
    sizes = lax.all_gather(send_sizes, EP)  # [src, dst] rows sent between every pair of the group
    recv_sizes = sizes[:, rank]
    # My chunk lands in rank j's buffer after the chunks of the sources before me.
    out_off = jnp.sum(jnp.where(jnp.arange(ep)[:, None] < rank, sizes, 0), axis=0).astype(jnp.int32)
    buf = ep * n_rows  # worst case again: every row of the group lands here
    plan = (in_off, send_sizes, out_off, recv_sizes)
    recv_x = rag(rows[order], jnp.zeros((buf, hidden), rows.dtype), *plan)
    recv_s = rag(local_slot[order], jnp.full((buf,), -1, jnp.int32), *plan)
    recv_w = rag(row_w[order], jnp.zeros((buf,), jnp.float32), *plan)
    y = compute(recv_x, recv_s, recv_w)
    # Return trip: the roles swap; my rows go back to each source where that source's chunk for me began.
    back_off = jnp.sum(jnp.where(jnp.arange(ep)[None, :] < rank, sizes, 0), axis=1).astype(jnp.int32)
    back_plan = (_exclusive_cumsum(recv_sizes), recv_sizes, back_off, send_sizes)
    back = rag(y, jnp.zeros((n_rows, hidden), jnp.float32), *back_plan)
    return jnp.zeros((n_rows, hidden), jnp.float32).at[order].set(back), recv_s


def _local_moe(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    local_experts: Mapping[str, Any],
    placement: ExpertPlacement,
    *,
    ep: int,
    numerics: LinearNumerics,
    swiglu_limit: float | None,
    weight_before_down: bool,
    transport: str,
    platform: str,
) -> tuple[jax.Array, jax.Array]:
    """One device's part of the layer (inside ``shard_map``): dispatch, expert compute, combine."""
    tokens, top_k = ids.shape
    hidden = x.shape[1]
    n_rows = tokens * top_k
    local_slots = placement.num_slots // ep
    rank = lax.axis_index(EP)

    slot = physical_slots(ids, placement, rank).reshape(n_rows)
    valid = slot >= 0
    dest = jnp.where(valid, slot // local_slots, ep)  # ep = "nowhere": placeholder rows are not sent
    local_slot = jnp.where(valid, slot % local_slots, -1)
    rows = jnp.repeat(x, top_k, axis=0)
    row_w = weights.reshape(n_rows).astype(jnp.float32)
    compute = functools.partial(
        _expert_compute,
        local_experts=local_experts,
        numerics=numerics,
        swiglu_limit=swiglu_limit,
        weight_before_down=weight_before_down,
        platform=platform,
    )

    if transport == "all_to_all":
        out_rows, received = _fixed_capacity_exchange(rows, local_slot, row_w, dest, compute, ep=ep)
    else:
        emulated = transport == "ragged_emulated"
        out_rows, received = _ragged_exchange(
            rows, local_slot, row_w, dest, compute, ep=ep, rank=rank, emulated=emulated
        )
    out_rows = jnp.where(valid[:, None], out_rows, 0.0)
    counts = jnp.sum(received[:, None] == jnp.arange(local_slots)[None, :], axis=0).astype(jnp.int32)
    out = out_rows.reshape(tokens, top_k, hidden).sum(axis=1)
    return out, counts


def local_moe_experts(
    x: jax.Array,
    routing: Routing,
    local_experts: Mapping[str, Any],
    placement: ExpertPlacement,
    numerics: LinearNumerics,
    *,
    ep: int,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    out_dtype: Any = None,
    transport: str = "all_to_all",
    platform: str = "cpu",
) -> MoEOutput:
    """One device's part of :func:`ep_moe_experts`, for a caller already inside a ``shard_map`` over the mesh.

    A ``shard_map`` cannot nest inside another's manual region, so code that already runs per device (the
    engine's global step) calls the layer's per-device body directly: ``x [t, H]`` and ``routing`` are this
    device's tokens, ``local_experts`` its ``P / ep`` slots ``[P / ep, ...]``, ``placement`` the layer's whole
    (replicated) placement; dispatch and combine are collectives over the enclosing region's ``ep`` axis.
    ``transport`` must be concrete (``"auto"`` needs the mesh: :func:`resolve_transport`) and ``platform`` picks
    the expert-compute backend. ``slot_counts`` are the rows each of this device's ``P / ep`` slots received.
    """
    if transport not in TRANSPORTS or transport == "auto":
        raise ValueError(
            f"transport: {transport!r} is not a concrete transport; expected one of {TRANSPORTS[1:]} "
            "(resolve 'auto' with resolve_transport)"
        )
    if placement.num_slots % ep:
        raise ValueError(
            f"placement: {placement.num_slots} slots are not a multiple of expert_parallel_size = {ep}"
        )
    out, counts = _local_moe(
        x,
        routing.ids,
        routing.weights,
        local_experts,
        placement,
        ep=ep,
        numerics=numerics,
        swiglu_limit=swiglu_limit,
        weight_before_down=weight_before_down,
        transport=transport,
        platform=platform,
    )
    return MoEOutput(out=out.astype(out_dtype or x.dtype), slot_counts=counts)


def ep_moe_experts(
    x: jax.Array,
    routing: Routing,
    slot_experts: Mapping[str, Any],
    placement: ExpertPlacement,
    numerics: LinearNumerics,
    mesh: Mesh,
    *,
    swiglu_limit: float | None = None,
    weight_before_down: bool = False,
    out_dtype: Any = None,
    transport: str = "auto",
) -> MoEOutput:
    """Routed-expert output of ``x [T, H]`` computed expert-parallel on ``mesh``; equals op ``moe_experts``.

    Args:
      x: the layer's tokens ``[T, H]``, spread over all ``dp * ep`` devices along ``T`` (any ``T``: the batch is
        padded with placeholder rows to a multiple of the device count, which keeps a device with no tokens in
        the collectives).
      routing: logical expert ids ``int [T, k]`` (``-1`` = placeholder) and weights ``[T, k]`` from ``route``.
      slot_experts: ``{"gate", "up", "down"}`` linear weights in slot layout ``[P, ...]`` (:func:`place_experts`),
        sharded over ``ep`` or not (``shard_map`` moves them where they belong).
      placement: the :class:`ExpertPlacement` the slots were laid out with.
      numerics, swiglu_limit, weight_before_down: as for op ``moe_experts``.
      out_dtype: dtype of the result (default ``x.dtype``); the combine runs in float32 and rounds once.
      transport: ``"auto"``, ``"all_to_all"``, ``"ragged"`` or ``"ragged_emulated"`` (module docstring).

    Returns:
      :class:`MoEOutput` with ``out [T, H]`` and the rows each physical slot received.
    """
    dp, ep = mesh_sizes(mesh)
    mode = resolve_transport(transport, mesh)
    if x.ndim != 2:
        raise ValueError(f"ep_moe_experts: x must be [tokens, hidden], got shape {x.shape}")
    ids, weights = routing
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"ep_moe_experts: routing ids {ids.shape} / weights {weights.shape} do not match x {x.shape}"
        )
    missing = {"gate", "up", "down"} - set(slot_experts)
    if missing:
        raise ValueError(
            f"ep_moe_experts: slot_experts lack {sorted(missing)}; got keys {sorted(slot_experts)}"
        )
    slots = placement.num_slots
    if slots % ep:
        raise ValueError(f"placement: {slots} slots are not a multiple of expert_parallel_size = {ep}")
    for name, leaf in jax.tree_util.tree_leaves_with_path(dict(slot_experts)):
        if leaf.shape[0] != slots:
            where = ".".join(str(getattr(p, "key", p)) for p in name)
            raise ValueError(
                f"ep_moe_experts: slot_experts.{where} has shape {leaf.shape}; expected [{slots}, ...] slots"
            )
    devices = dp * ep
    tokens = x.shape[0]
    padded = max(devices, -(-tokens // devices) * devices)
    pad = padded - tokens
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    idp = jnp.pad(ids.astype(jnp.int32), ((0, pad), (0, 0)), constant_values=-1)
    wp = jnp.pad(weights.astype(jnp.float32), ((0, pad), (0, 0)))

    spread, by_ep, rep = PartitionSpec(ALL_AXES), PartitionSpec(EP), PartitionSpec()
    local = functools.partial(
        _local_moe,
        ep=ep,
        numerics=numerics,
        swiglu_limit=swiglu_limit,
        weight_before_down=weight_before_down,
        transport=mode,
        platform=mesh.devices.flat[0].platform,
    )
    expert_specs = jax.tree_util.tree_map(lambda _: by_ep, dict(slot_experts))
    placement_specs = ExpertPlacement(rep, rep, rep)
    # check_vma is off: op moe_experts skips experts without rows through a lax.cond whose skip branch returns
    # its (replicated) input while the compute branch returns device-varying values, which the varying-axes
    # checker refuses as mismatched branch types.
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spread, spread, spread, expert_specs, placement_specs),
        out_specs=(spread, spread),
        check_vma=False,
    )
    out, counts = fn(xp, idp, wp, dict(slot_experts), placement)
    slot_counts = counts.reshape(dp, slots).sum(axis=0)
    return MoEOutput(out=out[:tokens].astype(out_dtype or x.dtype), slot_counts=slot_counts)
