"""Paged KV-cache bookkeeping: fixed-size blocks of ``tokens_per_block`` positions, a free list,
one block table per sequence (the vLLM / TensorRT-LLM ``KVCacheManager`` scheme).

Admission reserves a sequence's worst case (prompt + max new tokens + one verify block), the
policy TensorRT-LLM calls GUARANTEED_NO_EVICT: an admitted request never waits for memory and
is never evicted. Blocks are taken from the free list only as the sequence actually grows,
rolled back (freed) when verify rejects draft positions, and all returned when it ends.
"""

from __future__ import annotations

import torch


class BlockManager:
    """Allocates KV blocks to sequences.

    Args:
        num_blocks: blocks in the pool (``>= 1``).
        tokens_per_block: positions per block (``>= 1``).

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int):
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError(f"need num_blocks >= 1 and tokens_per_block >= 1, got {num_blocks}, {tokens_per_block}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}
        self._unreserved = num_blocks

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` positions."""
        return -(-tokens // self.tokens_per_block)

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (not held by any sequence)."""
        return len(self._free)

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
            table.append(self._free.pop())
        return table

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll back: keep positions ``[0, length)``, free the blocks past them."""
        table = self._tables[seq_id]
        keep = self.blocks_for(length)
        while len(table) > keep:
            self._free.append(table.pop())

    def release(self, seq_id: int) -> None:
        """Free all of ``seq_id``'s blocks and its reservation (no-op when it holds none)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        self._free.extend(reversed(table))
        self._unreserved += self._reserved.pop(seq_id)

    def table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def holders(self) -> list[int]:
        """Sequences holding a reservation."""
        return list(self._tables)


def slots_of(table: list[int] | torch.Tensor, positions: torch.Tensor, tokens_per_block: int) -> torch.Tensor:
    """Pool slots of ``positions`` (int64, any shape) for a sequence with block ``table``."""
    table = torch.as_tensor(table, dtype=torch.long)
    return table[positions // tokens_per_block] * tokens_per_block + positions % tokens_per_block
