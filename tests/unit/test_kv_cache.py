"""The slot KV cache: each row writes at its own slot and positions and reads its slot back;
consecutive slots are read without a copy; nothing is allocated after construction."""

from __future__ import annotations

import torch

from app.models.kv_cache import CacheShape, SlotKVCache

SHAPE = CacheShape(layers=2, slots=4, slot_tokens=8, kv_heads=2, head_dim=3)


def states(rows: int, query: int, value: float) -> torch.Tensor:
    """(rows, heads, query, dim) filled with value + row."""
    base = torch.full((rows, SHAPE.kv_heads, query, SHAPE.head_dim), value)
    return base + torch.arange(rows, dtype=torch.float32).view(rows, 1, 1, 1)


def test_allocates_every_layer_once_at_the_stated_size() -> None:
    cache = SlotKVCache(SHAPE, torch.float16, torch.device("cpu"))
    assert cache.bytes_allocated == 2 * 2 * (4 * 2 * 8 * 3) * 2
    layer = cache.layers[1]
    assert layer.keys is not None and layer.keys.shape == (4, 2, 8, 3)
    assert layer.keys.dtype == torch.float16


def test_rows_write_their_own_slots_and_positions() -> None:
    cache = SlotKVCache(SHAPE, torch.float32, torch.device("cpu"))
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]  # type: ignore[union-attr]
    # Slot 2 at positions 3 and 4, slot 0 at positions 1 and 2.
    cache.plan_step(torch.tensor([2, 0]), torch.tensor([[3, 4], [1, 2]]), kv_length=5)
    keys, _ = cache.update(states(2, 2, 10.0), states(2, 2, 20.0), 0)
    assert keys.shape == (2, 2, 5, 3)
    layer = cache.layers[0]
    assert layer.keys is not None and layer.values is not None
    assert torch.all(layer.keys[2, :, 3:5] == 10.0) and torch.all(layer.keys[0, :, 1:3] == 11.0)
    assert torch.all(layer.values[2, :, 3:5] == 20.0)
    assert torch.all(layer.keys[1] == 0) and torch.all(layer.keys[2, :, :3] == 0)
    # Returned in row order: row 0 is slot 2.
    assert torch.all(keys[0, :, 3:5] == 10.0) and torch.all(keys[1, :, 1:3] == 11.0)
    assert pointers == [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]  # type: ignore[union-attr]


def test_consecutive_slots_are_read_as_a_view() -> None:
    cache = SlotKVCache(SHAPE, torch.float32, torch.device("cpu"))
    cache.plan_step(torch.tensor([1, 2]), torch.tensor([[5], [6]]), 7, first_slot=1)
    keys, _ = cache.update(states(2, 1, 1.0), states(2, 1, 2.0), 1)
    layer = cache.layers[1]
    assert layer.keys is not None
    assert keys.data_ptr() == layer.keys[1].data_ptr()  # no copy
    assert torch.all(keys[0, :, 5] == 1.0) and torch.all(keys[1, :, 6] == 2.0)


def test_each_head_and_position_lands_in_its_own_place() -> None:
    """Distinct values per (row, head, query, dim): a write index that mixed up heads,
    positions or rows (the flat index_copy_ path) would put a value elsewhere."""
    cache = SlotKVCache(SHAPE, torch.float32, torch.device("cpu"))
    new = torch.arange(3 * 2 * 2 * 3, dtype=torch.float32).view(3, 2, 2, 3) + 1
    # A heads-second layout, as the model's transposed projections give it (not contiguous).
    new = new.transpose(1, 2).contiguous().transpose(1, 2)
    cache.plan_step(torch.tensor([3, 0, 2]), torch.tensor([[6, 7], [0, 1], [2, 3]]), 8)
    cache.update(new, -new, 0)
    layer = cache.layers[0]
    assert layer.keys is not None and layer.values is not None
    for row, slot in enumerate([3, 0, 2]):
        start = [6, 0, 2][row]
        assert torch.equal(layer.keys[slot, :, start : start + 2], new[row])
        assert torch.equal(layer.values[slot, :, start : start + 2], -new[row])
    assert torch.all(layer.keys[1] == 0)
    written = layer.keys.ne(0).sum().item()
    assert written == new.numel()  # nothing else touched


def test_scattered_slots_read_only_the_positions_attended() -> None:
    cache = SlotKVCache(SHAPE, torch.float32, torch.device("cpu"))
    cache.plan_step(torch.tensor([0, 1, 2, 3]), torch.tensor([[7], [7], [7], [7]]), 8)
    cache.update(states(4, 1, 5.0), states(4, 1, 6.0), 0)  # stale keys at position 7
    cache.plan_step(torch.tensor([3, 1]), torch.tensor([[2], [3]]), 4)
    keys, values = cache.update(states(2, 1, 1.0), states(2, 1, 2.0), 0)
    assert keys.shape == values.shape == (2, 2, 4, 3)  # not the slots' whole 8 positions
    assert torch.all(keys[0, :, 2] == 1.0) and torch.all(keys[1, :, 3] == 2.0)
    assert torch.all(values[0, :, 2] == 2.0) and torch.all(values[1, :, 3] == 3.0)
    assert torch.all(keys[0, :, :2] == 0) and torch.all(keys[1, :, :3] == 0)


def test_a_padded_row_s_padding_writes_to_the_sink_not_its_slot() -> None:
    """Right-padded rows (`written` False at their padding): the padding's keys and values
    went into the row's slot past its end, where its own queries, and its later decode
    steps beside a longer sequence, read them (masked, but a NaN there stayed NaN)."""
    cache = SlotKVCache(SHAPE, torch.float32, torch.device("cpu"))
    written = torch.tensor([[True, True, True], [True, False, False]])
    cache.plan_step(torch.tensor([0, 1]), torch.tensor([[0, 1, 2], [0, 1, 2]]), 3, 0, written)
    keys, values = cache.update(states(2, 3, 10.0), states(2, 3, 20.0), 0)
    layer = cache.layers[0]
    assert layer.keys is not None and layer.values is not None
    assert torch.all(layer.keys[0, :, :3] == 10.0) and torch.all(layer.keys[1, :, 0] == 11.0)
    assert torch.all(layer.keys[1, :, 1:] == 0) and torch.all(layer.values[1, :, 1:] == 0)
    assert torch.all(keys[1, :, 1:3] == 0) and torch.all(values[1, :, 1:3] == 0)
    assert layer.keys.shape == (4, 2, 8, 3)  # the slots alone: the sink lies past them
