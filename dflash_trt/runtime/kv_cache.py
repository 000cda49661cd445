"""The engine's KV-cache slot pools for the target and the drafter's context K/V (blocks handed
out by ``block_manager.py``). Whole-sequence forwards outside the engine use the contiguous
``models/prefill.KVCache``."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor of ``shape`` / ``dtype``. On the CPU its memory is an anonymous mapping,
    whose pages the kernel hands out zeroed when first touched: a pool costs time and resident
    memory only for the slots that are written (``torch.zeros`` wrote every page at start-up:
    ~0.5 s and 3 GiB resident for the default target's 65,536-slot fp32 pools, one thread).
    Elsewhere ``torch.zeros``."""
    n = math.prod(shape)
    if torch.device(device).type != "cpu" or n == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, n * dtype.itemsize)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=dtype, count=n).view(shape)


class PagedKVCache:
    """Slot pools of a paged KV cache: per layer ``(k, v)``, each
    ``[num_blocks * tokens_per_block + 1, num_kv_heads, head_dim]`` (views of :attr:`k` and
    :attr:`v`, ``[num_layers, ...]``).

    Slot ``block * tokens_per_block + offset`` holds the K/V of the token at
    ``offset`` within ``block``; which blocks belong to which sequence is the
    :class:`~dflash_trt.runtime.block_manager.BlockManager`'s business. The last slot is a
    never-read spare. The target and the drafter's context K/V each get a pool with the same
    block count and share one block table per sequence (both hold exactly the same positions).

    Memory: ``2 * num_layers * (num_blocks * tokens_per_block + 1) * num_kv_heads * head_dim``
    elements of ``dtype`` reserved; on the CPU resident only as slots are written (:func:`zeroed`).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        tokens_per_block: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_blocks * tokens_per_block + 1, num_kv_heads, head_dim)
        self.tokens_per_block = tokens_per_block
        # every layer's pool in one tensor (the drafter kernels write all layers in one launch)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)
        self.layers = [(self.k[i], self.v[i]) for i in range(num_layers)]
