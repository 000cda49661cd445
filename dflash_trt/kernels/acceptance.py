"""Acceptance on the device: per sequence, the longest prefix of its draft tokens equal to the
target's choices (greedy argmax, or one-hot sampled verification: the target's sample at each
position), so the host reads one small tensor per iteration.

Layout: ``drafts`` int64 ``[S, K]`` (row ``i`` holds ``n_draft[i]`` drafts, the rest ignored),
``target`` int64 ``[S, K + 1]`` the target's token after each block position, ``n_draft`` int32
``[S]``; result int32 ``[S]``, accepted drafts per sequence (the bonus token is
``target[i, result[i]]``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def accept_reference(drafts, target, n_draft) -> torch.Tensor:
    """The torch reference (the CPU path)."""
    K = drafts.shape[1]
    ok = (drafts == target[:, :K]) & (torch.arange(K, device=drafts.device) < n_draft.view(-1, 1))
    return ok.long().cumprod(1).sum(1).to(torch.int32)


if triton is not None:

    @triton.jit
    def _accept_kernel(Drafts, Target, N, stride_d, stride_t, Out, K_P: tl.constexpr):
        """One program per sequence; arguments in TensorRT plugin order (:mod:`.plugin_abi`)."""
        i = tl.program_id(0)
        n = tl.load(N + i)
        k = tl.arange(0, K_P)
        d = tl.load(Drafts + i * stride_d + k, mask=k < n, other=-1)
        t = tl.load(Target + i * stride_t + k, mask=k < n, other=-2)
        miss = tl.where((d != t) | (k >= n), k, K_P)
        tl.store(Out + i, tl.minimum(tl.min(miss, 0), n).to(tl.int32))


def accept_triton(drafts, target, n_draft) -> torch.Tensor:
    """The Triton kernel: one program per sequence."""
    S, K = drafts.shape
    out = torch.empty(S, dtype=torch.int32, device=drafts.device)
    if S:
        _accept_kernel[(S,)](
            drafts, target, n_draft, drafts.stride(0), target.stride(0), out, K_P=triton.next_power_of_2(max(K, 1))
        )
    return out
