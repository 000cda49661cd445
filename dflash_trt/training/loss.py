"""The drafter's training loss (paper arXiv:2602.06036 §4): same-position cross-entropy through
the target's frozen LM head, slot ``k`` weighted ``exp(-(k-1)/gamma)``, computed in row chunks
(:class:`HeadCrossEntropy`: logits never held whole), with an optional softmax over a vocabulary
subset and an optional feature-regression term; and what a step saw (:class:`StepStats`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import DFlashError
from ..models.drafter import DFlashDrafter
from .batching import IGNORE, Batch
from .config import default_gamma


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """fp32 ``[B-1]``: ``exp(-(k-1)/gamma)`` for slots k = 1..B-1."""
    g = gamma if gamma is not None else default_gamma(block_size)
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / g)


def sampled_vocab(seen: torch.Tensor, negatives: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted int64 token ids of one step's sampled softmax: every token marked in ``seen``
    (bool ``[V]``, the tokens of the training data) plus up to ``negatives`` others drawn
    uniformly without replacement with ``gen``."""
    rest = torch.nonzero(~seen).flatten()
    extra = rest[torch.randperm(rest.numel(), generator=gen)[:negatives]]
    return torch.cat([torch.nonzero(seen).flatten(), extra]).sort().values


class HeadCrossEntropy(torch.autograd.Function):
    """Weighted CE through a frozen LM head, in row chunks, gradient computed in the forward.

    ``forward(h [M, H], W [V, H], labels [M], weights [M], chunk, dtype)`` returns
    ``(sum_m w_m CE_m, argmax [M])``. Each chunk's logits live only while its loss and its
    gradient ``((softmax - onehot) * w) @ W`` are computed: two GEMMs per chunk (the same as
    forward + backward w.r.t. ``h``), memory ``chunk x V``. ``W`` gets no gradient.
    """

    @staticmethod
    def forward(ctx, h, W, labels, weights, chunk, dtype):
        # One fused softmax per chunk (torch's standalone exp / logsumexp are several times
        # slower on CPU); CE = -log p[label], recomputed exactly where p[label] underflows.
        with torch.autocast(h.device.type, enabled=False):
            Wc = W if W.dtype == dtype else W.to(dtype)
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad = torch.empty_like(h)
            pred = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
            for s in range(0, h.shape[0], chunk):
                logits = h[s : s + chunk].to(dtype) @ Wc.t()
                y, w = labels[s : s + chunk], weights[s : s + chunk]
                r = torch.arange(len(y), device=h.device)
                p = torch.softmax(logits, dim=-1, dtype=torch.float32)
                pred[s : s + chunk] = p.argmax(-1)
                p_y = p[r, y]
                ce = -torch.log(p_y)
                tiny = p_y < 1e-30
                if bool(tiny.any()):
                    lt = logits[tiny].float()
                    ce[tiny] = torch.logsumexp(lt, dim=-1) - lt.gather(1, y[tiny].unsqueeze(1)).squeeze(1)
                total += (ce * w).sum()
                p[r, y] -= 1.0
                p.mul_(w.unsqueeze(1))
                grad[s : s + chunk] = (p.to(dtype) @ Wc).to(h.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(pred)
        return total, pred

    @staticmethod
    def backward(ctx, grad_total, _grad_pred):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


@dataclass
class StepStats:
    """What one :func:`compute_loss` saw: its loss, accuracy per draft position, tau_est, the
    supervised slots, and how many of their labels fell outside the draft vocabulary."""

    loss: float
    acc: list[float]
    tau_est: float
    supervised: int
    outside_vocab: int = 0


def compute_loss(
    drafter: DFlashDrafter,
    embed_w: torch.Tensor,
    head_w: torch.Tensor,
    batch: Batch,
    weights: torch.Tensor,
    amp: torch.dtype | None,
    ce_chunk: int = 256,
    vocab: torch.Tensor | None = None,
    reg_weight: float = 0.0,
    drop_outside: bool = False,
) -> tuple[torch.Tensor, StepStats]:
    """Weighted same-position CE of one batch (see the module docstring).

    Args:
        embed_w, head_w: the target's frozen embedding and LM-head weights (``head_w`` may
            be a pre-cast copy in the autocast dtype).
        weights: ``[B-1]`` slot weights.
        amp: autocast dtype, or None for full fp32.
        vocab: optional sorted int64 ``[V']`` token ids: the softmax runs over these rows of
            the LM head only (a sampled softmax, or the drafter's draft vocabulary).
        drop_outside: labels outside ``vocab`` are left out of the loss (and count as wrong
            predictions in the accuracy); otherwise such a label is an error.
        reg_weight: weight of the relative-MSE pull of each supervised slot's hidden state
            towards the target's final normed hidden state at ``anchor + k - 1`` (the last
            ``hidden`` columns of ``batch.features``, which must come from the target's last
            layer); 0 disables it.

    Returns:
        the loss (a scalar with grad) and its statistics: accuracy per slot (argmax equals
        the label), ``tau_est`` (1 + mean accepted prefix over blocks whose B-1 slots are all
        supervised: the tau this batch would give under greedy verification), supervised slots.
    """
    dev = embed_w.device
    embeds = F.embedding(batch.block_ids, embed_w)
    with torch.autocast(dev.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        hidden = drafter.forward_train(
            embeds,
            batch.features.float() if amp is None else batch.features,
            batch.positions,
            batch.anchors,
            batch.valid,
        )
    sup = batch.labels != IGNORE  # [N, nb, B-1]
    rows = hidden[:, :, 1:][sup]  # [M, H]
    y = batch.labels[sup]
    w = weights.to(dev).expand_as(batch.labels)[sup]
    W, idx, w_ce = head_w, y, w
    outside = 0
    if vocab is not None:  # labels become indices into the (sorted) subset
        idx = torch.searchsorted(vocab, y).clamp(max=len(vocab) - 1)
        inside = vocab[idx] == y
        outside = int((~inside).sum())
        if outside and not drop_outside:
            raise DFlashError("a label is outside the training vocabulary subset")
        w_ce = w * inside  # a label the drafter can never draft teaches nothing
        W = head_w[vocab]
    denom = w_ce.sum().clamp_min(1e-12)
    total, pred = HeadCrossEntropy.apply(rows, W, idx, w_ce, ce_chunk, amp or torch.float32)
    if vocab is not None:
        pred = vocab[pred]
    loss = total / denom
    if reg_weight > 0:
        H = rows.shape[-1]
        B1 = batch.labels.shape[-1]
        S = batch.features.shape[1]
        src = (batch.anchors.unsqueeze(-1) + torch.arange(B1, device=dev)).clamp(max=S - 1)  # [N, nb, B-1]
        tgt = torch.gather(batch.features[..., -H:], 1, src.flatten(1).unsqueeze(-1).expand(-1, -1, H))
        tgt = tgt.view(*src.shape, H)[sup].float()
        err = (rows.float() - tgt).pow(2).mean(-1) / tgt.pow(2).mean(-1).clamp_min(1e-6)
        loss = loss + reg_weight * (err * w).sum() / denom
    with torch.no_grad():
        correct = torch.zeros_like(sup)
        correct[sup] = pred == y
        per_slot = sup.sum((0, 1)).clamp_min(1)
        acc = (correct.sum((0, 1)) / per_slot).tolist()
        full = sup.all(-1)
        if bool(full.any()):
            run = correct[full].long().cumprod(-1).sum(-1).float()
            tau = 1.0 + float(run.mean())
        else:
            tau = float("nan")
    return loss, StepStats(float(loss.detach()), acc, tau, int(sup.sum()), outside)
