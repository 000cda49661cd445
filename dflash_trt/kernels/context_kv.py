"""Context-K/V materialisation for DFlash drafting (KV injection, paper arXiv:2602.06036 §3):
the target features of newly committed positions become K and V of EVERY drafter layer.

``ctx = hidden_norm(fc(features))`` is one GEMM; K and V of all ``L`` drafter layers come out
of ONE more GEMM over the layers' stacked ``[k_proj; v_proj]`` weights; the kernel then applies
each layer's per-head ``k_norm`` (RMSNorm) and RoPE at the tokens' absolute positions to K and
writes K and V straight into the layers' paged pools at the tokens' slots.

Layout (shared by the Triton kernel and the torch reference):

- ``kv``: ``[T, L * 2 * Hkv * D]`` the stacked GEMM's output: layer ``l``'s K then V heads;
- ``k_norm``: ``[L, D]`` weights, ``eps`` the drafter's ``rms_norm_eps``;
- ``inv_freq``: fp32 ``[D / 2]`` RoPE inverse frequencies (scaling applied; rotate-half convention);
- ``positions``, ``slots``: int64 ``[T]``;
- ``k_pools``, ``v_pools``: ``[L, P, Hkv, D]`` (every layer's pool, one tensor each).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def context_kv_reference(kv, k_norm, eps: float, inv_freq, positions, slots, k_pools, v_pools) -> None:
    """The torch reference (the CPU path), in the pools' dtype like the drafter's own layers."""
    T = kv.shape[0]
    L, _, hkv, d = k_pools.shape
    x = kv.view(T, L, 2, hkv, d)
    k, v = x[:, :, 0], x[:, :, 1]  # [T, L, Hkv, D]
    dtype = k.dtype
    kf = k.float()
    k = (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * k_norm.view(1, L, 1, d)
    ang = positions.float().view(T, 1) * inv_freq.view(1, -1)  # [T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype).view(T, 1, 1, d)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype).view(T, 1, 1, d)
    half = d // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], -1)
    k = k * cos + rotated * sin
    for layer in range(L):
        k_pools[layer][slots] = k[:, layer].to(k_pools.dtype)
        v_pools[layer][slots] = v[:, layer].to(v_pools.dtype)


if triton is not None:

    @triton.jit
    def _context_kv_kernel(
        KV,
        KNorm,
        InvFreq,
        Pos,
        Slots,
        KPin,
        VPin,
        stride_kv_row,
        stride_pool_layer,
        stride_pool_slot,
        stride_pool_head,
        KP,
        VP,
        EPS: tl.constexpr,
        L: tl.constexpr,
        HKV: tl.constexpr,
        HKV_P: tl.constexpr,
        D: tl.constexpr,
    ):
        """One program per (token, layer): that layer's K heads normed, rotated and stored, V stored.
        Arguments in TensorRT plugin order (:mod:`.plugin_abi`): the pools come in as inputs
        (``KPin``, ``VPin``) and, aliased, as the outputs written (``KP``, ``VP``)."""
        t = tl.program_id(0)
        layer = tl.program_id(1)
        half: tl.constexpr = D // 2
        h = tl.arange(0, HKV_P)[:, None]  # (a power of two: the last rows are masked off)
        hm = h < HKV
        i = tl.arange(0, half)[None, :]
        base = KV + t * stride_kv_row + layer * 2 * HKV * D
        k1 = tl.load(base + h * D + i, mask=hm, other=0.0).to(tl.float32)  # [HKV_P, D/2] first halves
        k2 = tl.load(base + h * D + half + i, mask=hm, other=0.0).to(tl.float32)
        rms = tl.rsqrt((tl.sum(k1 * k1, 1) + tl.sum(k2 * k2, 1)) / D + EPS)[:, None]
        w1 = tl.load(KNorm + layer * D + i).to(tl.float32)
        w2 = tl.load(KNorm + layer * D + half + i).to(tl.float32)
        k1 = k1 * rms * w1
        k2 = k2 * rms * w2
        ang = tl.load(Pos + t).to(tl.float32) * tl.load(InvFreq + i)
        c, s = tl.cos(ang), tl.sin(ang)
        slot = tl.load(Slots + t)
        dst = layer * stride_pool_layer + slot * stride_pool_slot + h * stride_pool_head
        tl.store(KP + dst + i, (k1 * c - k2 * s).to(KP.dtype.element_ty), mask=hm)
        tl.store(KP + dst + half + i, (k2 * c + k1 * s).to(KP.dtype.element_ty), mask=hm)
        v1 = tl.load(base + HKV * D + h * D + i, mask=hm, other=0.0)
        v2 = tl.load(base + HKV * D + h * D + half + i, mask=hm, other=0.0)
        tl.store(VP + dst + i, v1.to(VP.dtype.element_ty), mask=hm)
        tl.store(VP + dst + half + i, v2.to(VP.dtype.element_ty), mask=hm)


def context_kv_triton(kv, k_norm, eps: float, inv_freq, positions, slots, k_pools, v_pools) -> None:
    """The Triton kernel (see the module docstring); writes the pools like the reference."""
    T = kv.shape[0]
    if T == 0:
        return
    L, _, hkv, d = k_pools.shape
    kv = kv.contiguous()
    _context_kv_kernel[(T, L)](
        kv,
        k_norm.contiguous(),
        inv_freq.float().contiguous(),
        positions,
        slots,
        k_pools,
        v_pools,
        kv.stride(0),
        k_pools.stride(0),
        k_pools.stride(1),
        k_pools.stride(2),
        k_pools,
        v_pools,
        EPS=eps,
        L=L,
        HKV=hkv,
        HKV_P=triton.next_power_of_2(hkv),
        D=d,
    )
