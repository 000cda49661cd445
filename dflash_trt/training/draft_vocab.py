"""Draft vocabulary: the target tokens a drafter drafts over (EAGLE-3 / vLLM speculators
convention; ../shared/DESIGN.md "Draft vocabulary").

The vocabulary is the top-N token ids by frequency over the training responses, sorted:
``used = sorted(top-N)``; ``d2t[i] = used[i] - i`` so that ``target_id = draft_id + d2t[draft_id]``
(int64 ``[N]``, stored in the drafter's safetensors; ``draft_vocab_size`` in its config). Training
computes the cross entropy over these rows of the target's LM head only; the runtime drafts
through the same rows (:meth:`dflash_trt.models.drafter.DFlashDrafter.propose`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..errors import DFlashError


def token_counts(sequences: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """int64 ``[vocab_size]`` counts of the tokens under a 1 of each ``(ids, loss_mask)`` pair
    (the response tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in sequences:
        ids_t, m = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids_t[m], minlength=vocab_size)[:vocab_size]
    return counts


def top_tokens(counts: torch.Tensor, n: int) -> torch.Tensor:
    """Sorted int64 ids of the ``n`` most frequent tokens (ties broken by the lower id).

    Raises:
        DFlashError: ``n`` outside ``1 .. len(counts)``.
    """
    if not 1 <= n <= counts.numel():
        raise DFlashError(f"draft vocabulary size must be 1..{counts.numel()}, got {n}")
    # stable descending sort over ids: equal counts keep ascending id order
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:n].sort().values


def d2t_from_ids(ids: torch.Tensor) -> torch.Tensor:
    """``d2t`` int64 ``[N]`` for sorted distinct target ids: ``ids - arange(N)``."""
    return ids.long() - torch.arange(ids.numel())


def coverage(counts: torch.Tensor, held_out: torch.Tensor, sizes: Sequence[int]) -> dict[int, float]:
    """Share of ``held_out`` token occurrences (an int64 ``[V]`` count vector) that fall inside the
    top-N of ``counts``, for each N in ``sizes``."""
    total = max(int(held_out.sum()), 1)
    return {n: float(held_out[top_tokens(counts, n)].sum()) / total for n in sizes}
