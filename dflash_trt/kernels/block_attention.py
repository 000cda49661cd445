"""KV-injected block attention (DFlash drafting, paper arXiv:2602.06036 §3): every sequence's
``B`` block queries attend NON-causally to that sequence's keys in a paged pool — its injected
context K/V (positions before the block) and the block's own K/V — with grouped-query heads, an
optional z-lab sliding window, and one launch for the whole ragged batch.

Layout (shared by the Triton kernel and the torch reference):

- ``q``: ``[S * B, Hq, D]`` queries, RoPE applied, sequence ``i``'s block at rows ``i*B .. i*B+B-1``;
- ``k_pool``, ``v_pool``: ``[P, Hkv, D]`` slot pools (slot = block id * ``tokens_per_block`` + offset);
- ``block_tables``: int32 ``[S, max_blocks]``; ``kv_lens``: int32 ``[S]``, keys are positions
  ``0 .. kv_lens[i] - 1`` (the block's own positions last);
- query ``j`` of sequence ``i`` sits at position ``kv_lens[i] - B + j`` and sees key position
  ``p`` iff ``p < kv_lens[i]`` and (``window == 0`` or ``query_pos - p < window``).

Output ``[S * B, Hq * D]`` in ``q``'s dtype; accumulation in fp32 (online softmax).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch reference needs no triton
    triton = None


def block_attention_reference(
    q, k_pool, v_pool, block_tables, kv_lens, block: int, tokens_per_block: int, window: int, scale: float
) -> torch.Tensor:
    """The torch reference (the CPU path): gather each sequence's keys, one masked SDPA."""
    import torch.nn.functional as F

    S = kv_lens.numel()
    M, hq, d = q.shape
    lens = kv_lens.long()
    kv = int(lens.max())
    pos = torch.arange(kv, device=q.device)
    tables = block_tables.long()
    slots = tables[:, (pos // tokens_per_block)] * tokens_per_block + pos % tokens_per_block  # [S, kv]
    keys = k_pool[slots].transpose(1, 2).float()  # [S, Hkv, kv, D]
    values = v_pool[slots].transpose(1, 2).float()
    qs = q.view(S, block, hq, d).transpose(1, 2).float()  # [S, Hq, B, D]
    qpos = (lens - block).view(S, 1) + torch.arange(block, device=q.device)  # [S, B]
    mask = pos.view(1, 1, -1) < lens.view(S, 1, 1)
    if window:
        mask = mask & (qpos.unsqueeze(-1) - pos.view(1, 1, -1) < window)
    out = F.scaled_dot_product_attention(
        qs, keys, values, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=hq != k_pool.shape[1]
    )
    return out.transpose(1, 2).reshape(M, hq * d).to(q.dtype)


if triton is not None:

    @triton.jit
    def _block_attention_kernel(
        Q,
        K,
        V,
        Tables,
        Lens,
        stride_q_row,
        stride_q_head,
        stride_k_slot,
        stride_k_head,
        stride_t,
        window,
        Out,
        SCALE: tl.constexpr,
        B: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        TPB: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One program per (sequence, KV head): its ``G`` query heads x ``B`` block queries
        (``ROWS`` >= G*B rows) against the sequence's paged keys, ``BLOCK_N`` keys at a time.
        Arguments in TensorRT plugin order (inputs, int32 scalars, outputs, then constants:
        :mod:`.plugin_abi`); ``Out`` has ``Q``'s row stride (``Q`` contiguous)."""
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        kv_len = tl.load(Lens + seq)
        r = tl.arange(0, ROWS)
        g = r // B  # query head within the group
        j = r % B  # block slot
        row_ok = r < G * B
        qpos = kv_len - B + j
        offs_d = tl.arange(0, D)
        q_ptr = Q + (seq * B + j)[:, None] * stride_q_row + (kvh * G + g)[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        start = 0
        if window > 0:  # skip key tiles no query of the block can see
            start = tl.maximum(kv_len - B - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, kv_len, BLOCK_N):
            p = n0 + tl.arange(0, BLOCK_N)
            ok = p < kv_len
            blk = tl.load(Tables + seq * stride_t + p // TPB, mask=ok, other=0)
            slot = blk * TPB + p % TPB
            k = tl.load(
                K + slot[:, None] * stride_k_slot + kvh * stride_k_head + offs_d[None, :], mask=ok[:, None], other=0.0
            ).to(tl.float32)
            v = tl.load(
                V + slot[:, None] * stride_k_slot + kvh * stride_k_head + offs_d[None, :], mask=ok[:, None], other=0.0
            ).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * SCALE  # [ROWS, BLOCK_N], fp32
            vis = ok[None, :] & row_ok[:, None]
            if window > 0:
                vis = vis & (qpos[:, None] - p[None, :] < window)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            pr = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision=PREC)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = Out + (seq * B + j)[:, None] * stride_q_row + ((kvh * G + g) * D)[:, None] + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def block_attention_triton(
    q, k_pool, v_pool, block_tables, kv_lens, block: int, tokens_per_block: int, window: int, scale: float
) -> torch.Tensor:
    """The Triton kernel (see the module docstring); same arguments and result as the reference."""
    M, hq, d = q.shape
    S, hkv = kv_lens.numel(), k_pool.shape[1]
    g = hq // hkv
    rows = max(16, triton.next_power_of_2(g * block))
    out = torch.empty(M, hq * d, dtype=q.dtype, device=q.device)
    q = q.contiguous()
    _block_attention_kernel[(S, hkv)](
        q,
        k_pool,
        v_pool,
        block_tables,
        kv_lens,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        block_tables.stride(0),
        window,
        out,
        SCALE=scale,
        B=block,
        G=g,
        D=d,
        TPB=tokens_per_block,
        ROWS=rows,
        BLOCK_N=max(16, min(64, tokens_per_block)),
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
