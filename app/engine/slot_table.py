"""Which KV-cache slots of a generate model are free, and which tokens each free slot still
holds (prefix reuse, vLLM's automatic prefix caching in the slot design). Pure: no torch,
no asyncio, no clock; the generation host (event loop thread) calls it, unit tests directly.

A freed slot keeps the keys and values its last holder wrote; `give` records which tokens
those are (positions 0..n-1). A joining prompt takes the free slot sharing its longest
prefix and starts past it (`choose`). Finding that slot must stay cheap: it runs on the
engine's event loop for every joiner, and comparing a 2,000-token prompt with 64 slots'
records token by token took ~5.6 ms a join (docs/BENCHMARKS.md Session 21). So each free
slot's record is also indexed by blocks: the hash of its first 16 tokens, of its first 32
(chained on the first), and so on; a prompt walks its own chain through the index, one
dict lookup a block, and only the last, partial block is compared token by token.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from app.engine.protocol import SamplingParams

# The fewest resident tokens a joining sequence reuses, and the index's block (one vLLM
# block): a shorter reuse saves next to nothing and would change the rounding of short
# prompts.
MIN_REUSED_TOKENS = 16
BLOCK_TOKENS = MIN_REUSED_TOKENS


def block_chain(tokens: Sequence[int], blocks: int) -> list[int]:
    """Hashes naming `tokens`' first 16, 32, ... `16 x blocks` tokens: each chains the one
    before with its block, so equal hashes mean equal prefixes (but for a collision,
    which `SlotTable.choose` rules out by comparing the slot it picks)."""
    chain: list[int] = []
    previous = 0
    for start in range(0, blocks * BLOCK_TOKENS, BLOCK_TOKENS):
        previous = hash((previous, tuple(tokens[start : start + BLOCK_TOKENS])))
        chain.append(previous)
    return chain


def _common_length(held: tuple[int, ...], wanted: tuple[int, ...]) -> int:
    """How many leading tokens two short (within a block) tuples share."""
    length = min(len(held), len(wanted))
    if held[:length] == wanted[:length]:  # the common case, compared in C
        return length
    return next(i for i in range(length) if held[i] != wanted[i])


class SlotTable:
    """The cache's slots, each free or held by one sequence. Without `reuse`, the lowest
    free slot, so a light load keeps to the first rows (read as a view, not copied:
    `kv_cache.py`). With it, a joining prompt takes the free slot whose resident tokens
    share its longest prefix and starts past them; one reusing nothing takes the lowest
    free slot holding nothing, else the one given back longest ago, as vLLM evicts its
    least recently used blocks: a hot prefix outlives strangers' prompts (`choose`), at the
    price of scattered rows, whose keys and values each layer copies. Event loop thread
    only."""

    def __init__(self, slots: int, reuse: bool = False) -> None:
        self.capacity = slots
        self.reuse = reuse
        self._free = list(range(slots))
        heapq.heapify(self._free)
        self._resident: list[tuple[int, ...]] = [()] * slots
        self._chains: list[list[int]] = [[] for _ in range(slots)]
        # Free slots by the block hashes of their resident tokens (`block_chain`).
        self._index: dict[int, set[int]] = {}
        # Slots zeroed (`forget`) since taken: their holder's tokens are not resident.
        self._spoiled: set[int] = set()
        # When each slot was last given back (a count of `give`s): the eviction order.
        self._given_at = [0] * slots
        self._gives = 0

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def held(self) -> int:
        return self.capacity - len(self._free)

    def resident(self, slot: int) -> tuple[int, ...]:
        return self._resident[slot]

    def choose(self, prompt: Sequence[int], sampling: SamplingParams) -> tuple[int, int]:
        """The free slot a sequence of `prompt` takes, and how many of its prompt tokens are
        resident there already (reused: it starts past them). The longest shared prefix
        wins, ties to the lowest slot, capped at all but the prompt's last token (a step
        must feed one for its logits); below `MIN_REUSED_TOKENS`, none. Never for a request
        of prompt log probabilities (those positions must be computed), nor without
        `reuse`. Reusing nothing, `_spare`'s."""
        if not self._free:
            raise RuntimeError("no KV-cache slot is free")
        cap = len(prompt) - 1
        if not self.reuse or sampling.prompt_logprobs is not None or cap < MIN_REUSED_TOKENS:
            return self._spare(), 0
        # The deepest full block of the prompt (within `cap`) that some free slot holds.
        candidates: set[int] = set()
        blocks = 0
        previous = 0
        for start in range(0, cap - cap % BLOCK_TOKENS, BLOCK_TOKENS):
            previous = hash((previous, tuple(prompt[start : start + BLOCK_TOKENS])))
            holders = self._index.get(previous)
            if not holders:
                break
            candidates, blocks = holders, blocks + 1
        if not blocks:
            return self._spare(), 0
        # Then, within the next (partial) block, the slot sharing the most tokens.
        start = blocks * BLOCK_TOKENS
        end = min(start + BLOCK_TOKENS, cap)
        wanted = tuple(prompt[start:end])
        best_slot, best = -1, -1
        for slot in sorted(candidates):
            shared = _common_length(self._resident[slot][start:end], wanted)
            if shared > best:
                best_slot, best = slot, shared
        reused = start + best
        if self._resident[best_slot][:start] != tuple(prompt[:start]):  # a hash collision
            return self._spare(), 0
        return best_slot, reused

    def _spare(self) -> int:
        """For a sequence reusing nothing: the lowest free slot (without `reuse`); else the
        lowest holding nothing, else the one given back longest ago."""
        if not self.reuse:
            return self._free[0]
        empty = [slot for slot in self._free if not self._resident[slot]]
        if empty:
            return min(empty)
        return min(self._free, key=lambda slot: (self._given_at[slot], slot))

    def take(self, slot: int | None = None) -> int:
        """Hold `slot` (free), or the lowest free slot."""
        if not self._free:
            raise RuntimeError("no KV-cache slot is free")
        if slot is None:
            slot = heapq.heappop(self._free)
        else:
            self._free.remove(slot)  # ValueError if it is not free
            heapq.heapify(self._free)
        self._unindex(slot)
        self._spoiled.discard(slot)
        return slot

    def give(self, slot: int, resident: tuple[int, ...] = ()) -> None:
        """Free `slot`, `resident` the tokens whose keys and values its holder's steps wrote
        there (none if it was zeroed meanwhile: `forget`)."""
        if slot in self._free or not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} is not held")
        heapq.heappush(self._free, slot)
        self._gives += 1
        self._given_at[slot] = self._gives
        self._record(slot, () if slot in self._spoiled else resident)

    def wrote(self, slot: int, resident: tuple[int, ...]) -> None:
        """A step that ran after its holder left (cancelled, expired) wrote `resident` in
        the free `slot`; ignored for a held or zeroed one."""
        if slot in self._free and slot not in self._spoiled:
            self._record(slot, resident)

    def forget(self, slot: int) -> None:
        """`slot` is zeroed or may hold anything (a failed step): nothing there is resident,
        neither now nor, if held, when its holder gives it back."""
        self._record(slot, ())
        self._spoiled.add(slot)

    def forget_all(self) -> None:
        for slot in range(self.capacity):
            self.forget(slot)

    def _record(self, slot: int, resident: tuple[int, ...]) -> None:
        """`slot`'s resident tokens; indexed by block while it is free (with `reuse`)."""
        self._unindex(slot)
        self._resident[slot] = resident
        if self.reuse and slot in self._free:
            chain = block_chain(resident, len(resident) // BLOCK_TOKENS)
            self._chains[slot] = chain
            for block in chain:
                self._index.setdefault(block, set()).add(slot)

    def _unindex(self, slot: int) -> None:
        for block in self._chains[slot]:
            holders = self._index[block]
            holders.discard(slot)
            if not holders:
                del self._index[block]
        self._chains[slot] = []
