"""Memory planning for paged caches: how many blocks fit a byte budget after the per-sequence state.

A model family describes its caches by a :class:`CacheLayout` (bytes of one block across all layers, bytes of
one per-sequence state slot); :func:`plan_memory` sizes the block pool from ``kv_cache_memory``: the budget
minus reservations (the engine's sampling state) minus the state slots, in whole blocks, at least two (block 0
is reserved). :meth:`MemoryPlan.describe` is the breakdown an engine prints when it starts.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CacheLayout", "MemoryPlan", "PagedCacheSpec", "plan_memory"]

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Per-unit device bytes of a family's caches.

    Attributes:
      block_size: tokens per cache block.
      bytes_per_block: bytes of one block across every layer that stores paged data.
      bytes_per_slot: bytes of one state slot (window rings, compression state; 0 when the family has none).
      dtype: the storage precision in words (``"float32"``, ``"bfloat16"``, or a format summary).
      lines: human-readable lines describing the records (printed by the memory breakdown).
    """

    block_size: int
    bytes_per_block: int
    bytes_per_slot: int
    dtype: str
    lines: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PagedCacheSpec:
    """The sized cache of one engine: block and slot counts with the family's layout."""

    layout: CacheLayout
    num_blocks: int
    num_slots: int

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def dtype(self) -> str:
        return self.layout.dtype

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    @property
    def bytes_per_token(self) -> float:
        """Paged bytes per cached token (all layers); state slots are per sequence, not per token."""
        return self.layout.bytes_per_block / self.layout.block_size

    @property
    def usable_tokens(self) -> int:
        """Token capacity of the allocatable blocks (all but the reserved block 0)."""
        return (self.num_blocks - 1) * self.layout.block_size

    @property
    def block_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def slot_bytes(self) -> int:
        return self.num_slots * self.layout.bytes_per_slot


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The outcome of :func:`plan_memory`: one device's sized spec and the numbers behind it, and the mesh.

    Attributes:
      spec, budget_bytes, reserved_bytes: one device's cache (``budget_bytes`` is that device's share).
      dp, ep: the engine's ``(dp, ep)`` mesh (``(1, 1)`` for one device).
      total_budget_bytes: ``kv_cache_memory`` of the whole engine (each device plans ``total // (dp·ep)``).
      max_num_seqs, max_num_batched_tokens: each device's step budgets (0 = not recorded).
      expert_slots: ``(layer path, logical experts, physical slots)`` of every MoE layer laid out in slots;
        each device holds ``slots / ep`` of a layer's slots.
    """

    spec: PagedCacheSpec
    budget_bytes: int
    reserved_bytes: int
    dp: int = 1
    ep: int = 1
    total_budget_bytes: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    expert_slots: tuple[tuple[str, int, int], ...] = ()

    @property
    def num_devices(self) -> int:
        return self.dp * self.ep

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.reserved_bytes - self.spec.slot_bytes - self.spec.block_bytes

    def describe(self) -> str:
        """A multi-line human-readable breakdown (printed when an engine starts); on a mesh of several devices,
        the layout of the mesh first, then one device's breakdown."""
        s, lay = self.spec, self.spec.layout
        mesh: list[str] = []
        if self.num_devices > 1:
            mesh.append(
                f"mesh: dp={self.dp} x ep={self.ep} = {self.num_devices} devices; each owns its sequences, a "
                f"cache of {s.num_blocks} blocks and {s.num_slots} state slots, and runs up to "
                f"{self.max_num_seqs} sequences / {self.max_num_batched_tokens} tokens per step "
                f"(kv_cache_memory {self.total_budget_bytes / _MIB:.1f} MiB in total)"
            )
            if self.expert_slots:
                shapes = sorted({(e, p) for _, e, p in self.expert_slots})
                layout = ", ".join(f"{e} experts in {p} slots ({p // self.ep} per device)" for e, p in shapes)
                mesh.append(
                    f"routed experts: {len(self.expert_slots)} MoE layers sharded over ep={self.ep}: {layout}; "
                    "everything else replicated"
                )
            mesh.append("per device:")
        lines = [
            *mesh,
            f"KV cache plan: budget {self.budget_bytes / _MIB:.1f} MiB ({lay.dtype})",
            f"  per-slot sampling state and other reservations: {self.reserved_bytes / _MIB:.2f} MiB",
            *(f"  {line}" for line in lay.lines),
            f"  state slots: {s.num_slots} x {lay.bytes_per_slot} B = {s.slot_bytes / _MIB:.2f} MiB",
            f"  block: {lay.block_size} tokens, {lay.bytes_per_block} B over all layers",
            f"  blocks: {s.num_blocks} ({s.num_blocks - 1} usable + reserved block 0) = "
            f"{s.block_bytes / _MIB:.2f} MiB, {s.usable_tokens} tokens",
            f"  unused: {self.unused_bytes / _MIB:.2f} MiB",
        ]
        return "\n".join(lines)


def plan_memory(
    layout: CacheLayout,
    budget_bytes: int,
    *,
    num_slots: int,
    reserved_bytes: int = 0,
    num_blocks: int | None = None,
) -> MemoryPlan:
    """Size the block pool: the budget minus reservations and state slots, in whole blocks.

    ``num_blocks`` fixes the count instead (it must still fit). At least two blocks (the reserved one and one
    usable) must fit, else ``ValueError`` naming what one block and the slots take.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"kv_cache_memory: expected a positive number of bytes, got {budget_bytes!r}")
    if isinstance(reserved_bytes, bool) or not isinstance(reserved_bytes, int) or reserved_bytes < 0:
        raise ValueError(f"reserved_bytes: expected an int >= 0, got {reserved_bytes!r}")
    slots = num_slots * layout.bytes_per_slot
    available = budget_bytes - reserved_bytes - slots
    per_block = max(layout.bytes_per_block, 1)
    fitting = available // per_block if available > 0 else 0
    if num_blocks is None:
        num_blocks = int(fitting)
    elif num_blocks > fitting:
        raise ValueError(
            f"cache.num_blocks = {num_blocks}: needs {num_blocks * per_block} B but kv_cache_memory leaves "
            f"{max(available, 0)} B after {reserved_bytes} B of sampling state and {slots} B of state slots"
        )
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory = {budget_bytes} B: too small for the paged cache; one block of {layout.block_size} "
            f"tokens takes {per_block} B, at least 2 blocks (one reserved) plus {slots} B of state slots "
            f"({num_slots} x {layout.bytes_per_slot} B) and {reserved_bytes} B of sampling state are needed "
            f"({2 * per_block + slots + reserved_bytes} B)"
        )
    return MemoryPlan(PagedCacheSpec(layout, int(num_blocks), num_slots), budget_bytes, reserved_bytes)
