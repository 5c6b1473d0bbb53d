"""The generation task's KV cache: fixed slots over tensors allocated once, at load.

Each layer keeps keys and values of shape (slots, kv_heads, slot_tokens, head_dim) in the
model's dtype (half precision on CUDA). A sequence owns one slot for its whole life; a step
writes each row's new keys at that row's own positions and reads back its slot. Nothing is
allocated per request: a finished sequence's slot is reused as it is, since a row only ever
attends to positions it wrote itself (stale entries past them are masked).

`SlotKVCache` plugs into a Hugging Face model as its `cache`; `plan` is set before each
forward (the calling compute thread owns the cache for the forward's duration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True, slots=True)
class CacheShape:
    """Sizes of the preallocated cache (per layer: keys and values of slots x kv_heads x
    slot_tokens x head_dim)."""

    layers: int
    slots: int
    slot_tokens: int
    kv_heads: int
    head_dim: int

    def bytes(self, dtype: torch.dtype) -> int:
        per_tensor = self.slots * self.kv_heads * self.slot_tokens * self.head_dim
        return 2 * self.layers * per_tensor * dtype.itemsize


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Where one forward's rows live: each row's slot, and the cache positions its query
    tokens are written to (rows x query length); keys 0 .. `kv_length` - 1 are read."""

    row_slots: torch.Tensor  # (rows,) int64
    positions: torch.Tensor  # (rows, query length) int64
    kv_length: int
    first_slot: int | None = None  # set when the rows are slots first_slot, first_slot + 1, ...


class SlotLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer's slots (compute threads only)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SlotKVCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = owner
        self.keys = keys
        self.values = values
        self.is_initialized = True
        self.device = keys.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # allocated up front

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' new keys/values (rows, heads, query, dim) at their positions and
        return their slots' keys/values up to the plan's `kv_length`."""
        plan = self._owner.plan
        assert self.keys is not None and self.values is not None
        rows = plan.row_slots.unsqueeze(1)  # (rows, 1) broadcast against positions
        # Advanced indices on dims 0 and 2 put (rows, query) first: (rows, query, heads, dim).
        self.keys[rows, :, plan.positions] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[rows, :, plan.positions] = value_states.transpose(1, 2).to(self.values.dtype)
        length = plan.kv_length
        if plan.first_slot is not None:  # consecutive slots: a view, no copy of the cache
            rows_count = plan.row_slots.shape[0]
            return (
                self.keys[plan.first_slot : plan.first_slot + rows_count, :, :length],
                self.values[plan.first_slot : plan.first_slot + rows_count, :, :length],
            )
        return (
            self.keys.index_select(0, plan.row_slots)[:, :, :length],
            self.values.index_select(0, plan.row_slots)[:, :, :length],
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.plan.kv_length, 0

    def get_seq_length(self) -> int:
        return self._owner.plan.kv_length

    def get_max_length(self) -> int:
        assert self.keys is not None
        return int(self.keys.shape[2])


class SlotKVCache(Cache):
    """Every layer's slots, allocated here once (the engine's buffer pool for generation)."""

    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> None:
        size = (shape.slots, shape.kv_heads, shape.slot_tokens, shape.head_dim)
        layers: list[Any] = [
            SlotLayer(
                self,
                torch.zeros(size, dtype=dtype, device=device),
                torch.zeros(size, dtype=dtype, device=device),
            )
            for _ in range(shape.layers)
        ]
        super().__init__(layers=layers)
        self.shape = shape
        self.bytes_allocated = shape.bytes(dtype)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.plan = StepPlan(empty, empty.view(0, 0), 0)
