"""The generation task's KV cache: fixed slots over tensors allocated once, at load.

Each layer keeps keys and values of shape (slots, kv_heads, slot_tokens, head_dim) in the
model's dtype (half precision on CUDA). A sequence owns one slot for its whole life; a step
writes each row's new keys at that row's own positions and reads back its slot. Nothing is
allocated per request: a finished sequence's slot is reused as it is, since a row only ever
attends to positions written for its own tokens (stale entries past them are masked): by
itself, or, for a prompt's reused prefix, by the slot's last holder, whose tokens there
were the same (`app/engine/slot_table.py`).

`SlotKVCache` plugs into a Hugging Face model as its `cache`; `plan_step` is called before
each forward (the calling compute thread owns the cache for the forward's duration).

A prefill's rows are right-padded to the longest: the padding's keys and values go to one
sink row past every slot (`plan_step`'s `written`), never into a slot. Written there, they
were read back, masked, by the row's own queries in the same forward, and by its later
decode steps beside a longer sequence; a mask is added to a score, so a NaN or inf there (a
model overflowing its dtype on a run of its pad token) stayed NaN, and a request whose own
tokens were finite failed with non-finite logits.

Per step, every layer writes keys and values and reads its rows back, so the work that does
not depend on the layer (where each new key goes) is done once, in `plan_step`: each write is
then one `index_copy_` into a flat view of the layer's tensor (half the time of an indexed
assignment on two dimensions), and a read of rows in scattered slots copies only the
positions the step attends to, not the whole slots.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """Where one forward's rows live (built by `SlotKVCache.plan_step`): each row's slot, the
    rows of a layer's flat (slots x kv_heads x slot_tokens, head_dim) view that its new keys
    go to, in the order of the new keys (rows, kv_heads, query) flattened; keys
    0 .. `kv_length` - 1 are read."""

    row_slots: torch.Tensor  # (rows,) int64
    write_rows: torch.Tensor  # (rows * kv_heads * query length,) int64
    kv_length: int
    first_slot: int | None = None  # set when the rows are slots first_slot, first_slot + 1, ...


class SlotLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer's slots (compute threads only)."""

    is_compileable = False
    is_sliding = False

    def __init__(
        self, owner: SlotKVCache, flat_keys: torch.Tensor, flat_values: torch.Tensor
    ) -> None:
        """`flat_keys`, `flat_values`: (slots x kv_heads x slot_tokens + 1, head_dim), the
        target of `update`'s one-dimensional writes; the last row is the padding's sink."""
        super().__init__()  # type: ignore[no-untyped-call]
        shape = owner.shape
        size = (shape.slots, shape.kv_heads, shape.slot_tokens, shape.head_dim)
        self._owner = owner
        self.keys = keys = flat_keys[:-1].view(size)
        self.values = values = flat_values[:-1].view(size)
        self._slots = (keys, values)  # typed: the base class declares them optional
        self._flat_keys = flat_keys
        self._flat_values = flat_values
        self.is_initialized = True
        self.device = keys.device

    def clear(self, slot: int) -> None:
        """Zero `slot`'s keys and values (`SlotKVCache.clear_slot`)."""
        for tensor in self._slots:
            tensor[slot].zero_()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # allocated up front

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' new keys/values (rows, heads, query, dim) at their positions and
        return their slots' keys/values up to the plan's `kv_length`."""
        plan = self._owner.plan
        assert self.keys is not None and self.values is not None
        dim = key_states.shape[-1]
        # reshape flattens (rows, heads, query) in the order `plan.write_rows` lists them.
        self._flat_keys.index_copy_(
            0, plan.write_rows, key_states.reshape(-1, dim).to(self.keys.dtype)
        )
        self._flat_values.index_copy_(
            0, plan.write_rows, value_states.reshape(-1, dim).to(self.values.dtype)
        )
        length = plan.kv_length
        if plan.first_slot is not None:  # consecutive slots: a view, no copy of the cache
            rows_count = plan.row_slots.shape[0]
            return (
                self.keys[plan.first_slot : plan.first_slot + rows_count, :, :length],
                self.values[plan.first_slot : plan.first_slot + rows_count, :, :length],
            )
        # Narrowed first: the copy holds the positions read, not each slot's whole length.
        return (
            self.keys[:, :, :length].index_select(0, plan.row_slots),
            self.values[:, :, :length].index_select(0, plan.row_slots),
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
        self.shape = shape
        # Every slot's positions, then one more: the sink of the padding's writes.
        self.sink_row = shape.slots * shape.kv_heads * shape.slot_tokens
        flat = (self.sink_row + 1, shape.head_dim)
        layers: list[SlotLayer] = [
            SlotLayer(
                self,
                torch.zeros(flat, dtype=dtype, device=device),
                torch.zeros(flat, dtype=dtype, device=device),
            )
            for _ in range(shape.layers)
        ]
        super().__init__(layers=list[Any](layers))
        self._slot_layers = layers
        self.bytes_allocated = shape.bytes(dtype)  # the sink rows aside (a few KiB)
        # Offset of each kv head's first position within a slot, in rows of the flat view.
        self._head_rows = (
            torch.arange(shape.kv_heads, device=device).view(1, -1, 1) * shape.slot_tokens
        )
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.plan = StepPlan(empty, empty, 0)

    @property
    def slot_layers(self) -> Sequence[SlotLayer]:
        """Each layer's slots, in layer order."""
        return self._slot_layers

    def clear_slot(self, slot: int) -> None:
        """Zero `slot`'s keys and values in every layer (compute threads only). Stale entries
        are masked, but a mask is added to a score: a NaN or inf key or value left by an
        occupant whose activations overflowed stays NaN through it, and would poison every
        later occupant of the slot that attends past its own length (decoding beside a
        longer sequence)."""
        for layer in self._slot_layers:
            layer.clear(slot)

    def plan_step(
        self,
        row_slots: torch.Tensor,
        positions: torch.Tensor,
        kv_length: int,
        first_slot: int | None = None,
        written: torch.Tensor | None = None,
    ) -> None:
        """Set the next forward's plan: rows in slots `row_slots` (rows,) write their query
        tokens at `positions` (rows, query) and read keys 0 .. kv_length - 1; `first_slot`
        when the rows are consecutive slots from it; `written` (rows, query) bool, for
        right-padded rows: False where a token is padding, whose keys and values go to the
        sink row instead (one `where` per step, none per layer). The calling compute
        thread's."""
        per_slot = self.shape.kv_heads * self.shape.slot_tokens
        head_starts = row_slots.view(-1, 1, 1) * per_slot + self._head_rows  # (rows, heads, 1)
        write_rows = head_starts + positions.unsqueeze(1)  # (rows, heads, query)
        if written is not None:
            write_rows = torch.where(written.unsqueeze(1), write_rows, self.sink_row)
        self.plan = StepPlan(row_slots, write_rows.reshape(-1), kv_length, first_slot)
