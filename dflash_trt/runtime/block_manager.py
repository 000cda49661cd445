"""Paged KV-cache bookkeeping: fixed-size blocks of ``tokens_per_block`` positions, a free list,
one block table per sequence (the vLLM / TensorRT-LLM ``KVCacheManager`` scheme).

Admission reserves a sequence's worst case (prompt + max new tokens + one verify block), the
policy TensorRT-LLM calls GUARANTEED_NO_EVICT: an admitted request never waits for memory and
is never evicted. Blocks are taken from the free list only as the sequence actually grows,
rolled back (freed) when verify rejects draft positions, and all returned when it ends.

Automatic prefix caching (vLLM's ``enable_prefix_caching``, on by default there too): when a
sequence ends, its full blocks are kept under a key that names their tokens exactly (the
parent block's cache entry and the block's own token ids: no hash collisions are possible), with
no holder. A new request whose prompt starts with cached blocks shares them (reference counts)
and prefills only the rest; blocks nobody holds stay cached until a new block is needed, then
the least recently used one is taken. With a DFlash drafter a block is usable only if the
drafter's K/V were written for it too, where the new sequence's drafts can see it (its drafter's
sliding window, or the whole context).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class BlockManager:
    """Allocates KV blocks to sequences.

    Args:
        num_blocks: blocks in the pool (``>= 1``).
        tokens_per_block: positions per block (``>= 1``).
        prefix_caching: keep ended sequences' full blocks for later prompts that start alike.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, prefix_caching: bool = False):
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError(f"need num_blocks >= 1 and tokens_per_block >= 1, got {num_blocks}, {tokens_per_block}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}
        self._unreserved = num_blocks
        self._refs = [0] * num_blocks  # holders of each block
        # the prefix cache: key (parent entry id, the block's token ids) -> block; per cached
        # block its key, entry id (unique per caching, so a reused parent block never matches a
        # stale child) and the first of its positions from which on the drafter's K/V are in it
        # (the block's end: none); cached blocks nobody holds, least recently used first
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._entry: dict[int, tuple[tuple[int, tuple[int, ...]], int, int]] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._next_entry = 1
        #: prompt tokens looked up in the prefix cache, and those found (vLLM's prefix_cache_queries / _hits)
        self.prefix_queries = 0
        self.prefix_hits = 0

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` positions."""
        return -(-tokens // self.tokens_per_block)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (free, or cached with no holder)."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (held or not)."""
        return len(self._entry)

    def _take(self) -> int:
        """A block for a sequence to write: a free one, else the least recently used cached one
        nobody holds (leaving the cache)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._idle.popitem(last=False)
            key, _, _ = self._entry.pop(b)
            del self._by_key[key]
        self._refs[b] = 1
        return b

    def _drop(self, b: int) -> None:
        """One holder fewer; a block nobody holds goes back free, or idle when it is cached."""
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if b in self._entry:
                self._idle[b] = None
            else:
                self._free.append(b)

    @property
    def num_unreserved_blocks(self) -> int:
        """Blocks not promised to any admitted sequence."""
        return self._unreserved

    def can_reserve(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self._unreserved

    def reserve(self, seq_id: int, tokens: int) -> None:
        """Admit ``seq_id`` with room for ``tokens`` positions.

        Raises:
            ValueError: ``seq_id`` already admitted, or not enough unreserved blocks.
        """
        n = self.blocks_for(tokens)
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if n > self._unreserved:
            raise ValueError(f"sequence {seq_id} needs {n} blocks, {self._unreserved} unreserved")
        self._unreserved -= n
        self._reserved[seq_id] = n
        self._tables[seq_id] = []

    def ensure(self, seq_id: int, length: int) -> list[int]:
        """Grow ``seq_id``'s table to cover positions ``[0, length)``; returns the table.

        Raises:
            ValueError: ``length`` exceeds the sequence's reservation.
        """
        table = self._tables[seq_id]
        need = self.blocks_for(length)
        if need > self._reserved[seq_id]:
            raise ValueError(
                f"sequence {seq_id}: {length} positions exceed its reservation of {self._reserved[seq_id]} blocks"
            )
        while len(table) < need:
            table.append(self._take())
        return table

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll back: keep positions ``[0, length)``, free the blocks past them."""
        table = self._tables[seq_id]
        keep = self.blocks_for(length)
        while len(table) > keep:
            self._drop(table.pop())

    def release(self, seq_id: int) -> None:
        """Free all of ``seq_id``'s blocks and its reservation (no-op when it holds none)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        for b in reversed(table):
            self._drop(b)
        self._unreserved += self._reserved.pop(seq_id)

    # ---- the prefix cache ----
    def _chunks(self, tokens: list[int], n: int):
        tpb = self.tokens_per_block
        return (tuple(tokens[i * tpb : (i + 1) * tpb]) for i in range(n))

    def share_prefix(self, seq_id: int, tokens: list[int], limit: int, drafter_from: int | None) -> int:
        """Give a newly admitted ``seq_id`` (holding no blocks yet) the cached blocks its
        ``tokens`` start with, at most ``limit`` positions' worth; returns the positions shared
        (a multiple of ``tokens_per_block``), whose K/V need no prefill.

        Args:
            drafter_from: positions from here on must hold the drafter's K/V too (0: a drafter
                that sees the whole context; the first position its first block's sliding
                window sees; None: no drafter).
        """
        if not self.prefix_caching:
            return 0
        tpb, table, parent = self.tokens_per_block, self._tables[seq_id], 0
        self.prefix_queries += len(tokens)
        for i, chunk in enumerate(self._chunks(tokens, limit // tpb)):
            b = self._by_key.get((parent, chunk))
            if b is None:
                break
            _, parent, drafted_from = self._entry[b]
            if drafter_from is not None and drafted_from > max(drafter_from, i * tpb):
                break
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1
            table.append(b)
        self.prefix_hits += len(table) * tpb
        return len(table) * tpb

    def cache_prefix(self, seq_id: int, tokens: list[int], cached: int, drafted: tuple[int, int] | None) -> None:
        """Before ``seq_id`` is released: enter its full blocks of positions ``[0, cached)``
        (their K/V written for ``tokens``) into the prefix cache; ``drafted``: the positions
        ``[lo, hi)`` whose drafter K/V it wrote (None: no drafter, or none written)."""
        if not self.prefix_caching:
            return
        tpb, table, parent = self.tokens_per_block, self._tables.get(seq_id, []), 0
        lo, hi = drafted or (0, 0)
        for i, chunk in enumerate(self._chunks(tokens, min(cached // tpb, len(table)))):
            b, key, end = table[i], (parent, chunk), (i + 1) * tpb
            drafted_from = max(lo, i * tpb) if lo < end <= hi else end
            if b in self._entry:  # shared from the cache, or entered before
                k, parent, was = self._entry[b]
                self._entry[b] = (k, parent, min(was, drafted_from))
                continue
            if key in self._by_key:  # the same tokens cached in another block: keep that one
                _, parent, _ = self._entry[self._by_key[key]]
                continue
            self._entry[b] = (key, self._next_entry, drafted_from)
            self._by_key[key] = b
            parent = self._next_entry
            self._next_entry += 1

    def table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def holders(self) -> list[int]:
        """Sequences holding a reservation."""
        return list(self._tables)


def slots_of(
    table: list[int] | torch.Tensor, positions: torch.Tensor | int, tokens_per_block: int
) -> torch.Tensor | int:
    """Pool slots of ``positions`` (int64, any shape) for a sequence with block ``table``; of one
    position (an int) in a list ``table``, its slot as an int (no tensor op).

    Raises:
        IndexError: a position past the end of ``table``.
    """
    if isinstance(positions, torch.Tensor):
        table = torch.as_tensor(table, dtype=torch.long)
    return table[positions // tokens_per_block] * tokens_per_block + positions % tokens_per_block
