"""The drafter kernels as torch custom ops (``torch.library``): ``dflash::block_attention``,
``dflash::context_kv`` (writes the pools in place) and ``dflash::accept``.

Which implementation runs: the Triton kernels for CUDA tensors (when ``triton`` is installed),
the torch references otherwise. ``DFLASH_TRT_KERNELS=triton`` forces the Triton kernels on any
device — with ``TRITON_INTERPRET=1`` (set before Triton is first imported) they run on the CPU
through Triton's interpreter, which is how the tests check them without a GPU;
``DFLASH_TRT_KERNELS=torch`` forces the references.
"""

from __future__ import annotations

import os

import torch

from .acceptance import accept_reference, accept_triton
from .block_attention import block_attention_reference, block_attention_triton
from .context_kv import context_kv_reference, context_kv_triton

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


def use_triton(device: torch.device) -> bool:
    """Whether ops on tensors on ``device`` run the Triton kernels (see the module docstring)."""
    mode = os.environ.get("DFLASH_TRT_KERNELS", "")
    if mode == "torch":
        return False
    if mode == "triton":
        return HAVE_TRITON
    return HAVE_TRITON and device.type == "cuda"


@torch.library.custom_op("dflash::block_attention", mutates_args=())
def block_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    block: int,
    tokens_per_block: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """KV-injected block attention (:mod:`.block_attention`): ``[S * B, Hq * D]``."""
    fn = block_attention_triton if use_triton(q.device) else block_attention_reference
    return fn(q, k_pool, v_pool, block_tables, kv_lens, block, tokens_per_block, window, scale)


@block_attention.register_fake
def _(q, k_pool, v_pool, block_tables, kv_lens, block, tokens_per_block, window, scale):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("dflash::context_kv", mutates_args=("k_pools", "v_pools"))
def context_kv(
    kv: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_pools: torch.Tensor,
    v_pools: torch.Tensor,
) -> None:
    """Context-K/V materialisation (:mod:`.context_kv`) into every layer's pool."""
    fn = context_kv_triton if use_triton(kv.device) else context_kv_reference
    fn(kv, k_norm, eps, inv_freq, positions, slots, k_pools, v_pools)


@torch.library.custom_op("dflash::accept", mutates_args=())
def accept(drafts: torch.Tensor, target: torch.Tensor, n_draft: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per sequence (:mod:`.acceptance`): int32 ``[S]``."""
    return (accept_triton if use_triton(drafts.device) else accept_reference)(drafts, target, n_draft)


@accept.register_fake
def _(drafts, target, n_draft):
    return drafts.new_empty(drafts.shape[0], dtype=torch.int32)
