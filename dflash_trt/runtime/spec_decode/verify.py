"""Verification on the device: the target's token after every logits row of an iteration, and
each drafting sequence's accepted prefix (paper arXiv:2602.06036 §3, Alg. 1).

Greedy rows take the argmax. A sampled row takes one sample from its request's processed
distribution with the uniform its request drew when the step was planned
(:func:`~..sampling.sample_rows`); a draft is accepted while it equals the target's token, which
for greedy (one-hot) drafts is exactly rejection sampling (Leviathan et al. 2023, §2.3), so the
output follows the target's distribution. Below a request's ``min_tokens`` its stop tokens are
masked on the rows that could end it. Every row depends only on its own logits, settings and
uniform: nothing here looks at the other rows of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import ops
from ...models.layers import argmax_last
from ..sampling import sample_rows


@dataclass
class SampledRows:
    """The logits rows that are sampled, with their settings (all ``[S]`` on the device).

    Attributes:
        rows: int64 row indices.
        temperature: fp32, > 0.
        top_k: int64; 0 keeps every token.
        top_p: fp32 in (0, 1]; 1 keeps every token.
        uniforms: fp32 in [0, 1), one per row.
        truncate: some row has top-k or top-p below 1 (a host flag: a sort is needed).
    """

    rows: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniforms: torch.Tensor
    truncate: bool


def target_tokens(
    logits: torch.Tensor,
    sampled: SampledRows | None = None,
    banned: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The target's token after each row of ``logits`` (``[R, vocab]``, any float dtype).

    Args:
        sampled: rows sampled instead of taking the argmax.
        banned: ``(rows, token ids)``, int64 ``[N]`` each: logits set to -inf before choosing
            (a request's stop tokens on its rows below ``min_tokens``).

    Returns:
        int64 ``[R]`` on the logits' device.
    """
    if banned is not None:
        logits = logits.index_put(banned, logits.new_tensor(float("-inf")))
    choice = argmax_last(logits)
    if sampled is not None:
        s = sampled
        choice[s.rows] = sample_rows(logits[s.rows], s.temperature, s.top_k, s.top_p, s.uniforms, truncate=s.truncate)
    return choice


def accepted(drafts: torch.Tensor, targets: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per sequence: the longest prefix of its ``num_draft`` drafts equal to the
    target's tokens at the same block positions (``dflash::accept``: the Triton kernel on CUDA,
    the torch reference on the CPU).

    Args:
        drafts: int64 ``[S, K]`` (row ``i``'s first ``num_draft[i]`` count).
        targets: int64 ``[S, K + 1]``, the target's token after each block position.
        num_draft: int32 ``[S]``.

    Returns:
        int32 ``[S]``; the bonus token of sequence ``i`` is ``targets[i, result[i]]``.
    """
    return ops.accept(drafts, targets, num_draft)
