"""DFlash drafter training (paper arXiv:2602.06036 §4 recipe) on a frozen target.

Per step, for ``batch`` sequences (prompt + target-generated response, ``loss_mask`` = 1 on
the response):
  * target features of every position, computed once per sequence with our ``TargetModel``
    (layers ``drafter.cfg.target_layer_ids``, no grad; cached in memory across epochs);
  * up to ``anchors_per_seq`` random anchors among the response positions; block ``b`` is
    ``[token at anchor_b, MASK x (B-1)]`` embedded with the target's frozen embedding, at
    positions ``anchor_b .. anchor_b + B - 1``; it sees the context positions strictly before
    its anchor (what the runtime's drafter sees when the block starts at the last committed
    token) and its own block, non-causally;
  * ONE drafter forward for all blocks of all sequences (:meth:`DFlashDrafter.forward_train`);
  * slot ``k`` (1..B-1) is labelled with the token at ``anchor + k`` (same-position labels);
    the anchor slot, slots past the sequence and slots outside the response are ignored;
  * loss = sum_k w_k CE_k / sum_k w_k with ``w_k = exp(-(k-1)/gamma)`` (gamma 7 for B=16,
    4 for B=8), CE through the target's frozen LM head, computed only at supervised slots in
    row chunks (logits never held whole: the 49K-vocabulary head dominates a step);
  * AdamW (lr 6e-4), linear warmup over ``warmup_frac`` of the steps then cosine decay,
    gradient clipping at 1.0. The target (embedding and LM head included) stays frozen.

Output directory::

    log.jsonl          one JSON line per step: loss, lr, acc per slot, tau_est, timings
    loss.png           loss and tau_est curves
    train_config.json  the effective TrainConfig
    ckpt-000500/       z-lab drafter (fp32 master weights) + train_state.pt (optimizer,
                       scheduler, step, RNG states); the newest one is resumed from
    drafter/           the final drafter, z-lab format (``export_dtype``)
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoints.loader import LoadedTarget, default_mask_token_id, parse_dtype
from ..checkpoints.zlab import init_drafter, load_drafter, save_drafter, validate_pair
from ..errors import DFlashError
from ..models.drafter import DFlashDrafter
from .draft_vocab import token_counts, top_tokens
from .feature_cache import FeatureCache, sequence_key

IGNORE = -100
CKPT_RE = re.compile(r"^ckpt-(\d{6,})$")


def autocast_dtype(autocast: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a run on ``device`` (None: full fp32); ``autocast`` as
    :attr:`TrainConfig.autocast`. ``auto`` picks bf16 only where bf16 GEMMs are native: a CUDA
    device that supports bf16, or a CPU with oneDNN bf16 (on an AVX2-only CPU bf16 autocast
    made a training step ~12x slower than fp32)."""
    if autocast == "auto":
        if device.type == "cuda":
            native = torch.cuda.is_bf16_supported()
        else:
            native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if native else None
    return None if autocast == "fp32" else parse_dtype(autocast)


@dataclass
class TrainConfig:
    """Settings of one training run (defaults: the paper's recipe where it gives one).

    Attributes:
        steps: optimizer steps in the whole run (the LR schedule spans them).
        batch: sequences per step (all their blocks go through one drafter forward).
        anchors_per_seq: random anchors (blocks) per sequence; capped by the sequence's
            response positions (paper: 512).
        block_size: B, tokens per block, anchor included (new drafters; an initial drafter
            given to :func:`train` keeps its own).
        num_layers: decoder layers of a new drafter.
        lr, warmup_frac, min_lr_ratio: peak LR, warmup fraction, final LR / peak (cosine).
        weight_decay, betas: AdamW settings.
        grad_clip: max global gradient norm (0 disables).
        gamma: loss decay ``w_k = exp(-(k-1)/gamma)``; None: 7 for B=16, 4 for B=8, linear
            in B in between and beyond (at least 1).
        save_every: checkpoint every this many steps (and at the end).
        keep_checkpoints: newest checkpoints kept (0 keeps all).
        seed: drafter init, data order and anchor sampling.
        autocast: ``auto`` (bf16 where the hardware has bf16 GEMMs: a CUDA GPU with bf16, a CPU
            with oneDNN bf16, i.e. AVX512-BF16 / AMX; else fp32), ``bf16`` (bf16 autocast; about
            twice as fast on CPUs with AVX512-BF16/AMX, ~12x slower than fp32 on an AVX2-only
            CPU), ``fp16`` or ``fp32`` (no autocast). Master weights and optimizer stay fp32.
        max_seq_len: sequences are cut to this many tokens.
        mask_token_id: MASK token of a new drafter (None: the tokenizer's mask/unk token).
        target_layer_ids: target layers a new drafter reads (None: the z-lab default spread).
        sliding_window: a new drafter's z-lab sliding window W (None: full context); its slot
            ``k`` then sees the last ``W - 1 - k`` context positions. A short window makes the
            anchor and the newest target features a large share of what each slot attends to.
        feature_cache: directory of the on-disk feature cache (:mod:`.feature_cache`; None:
            ``<out_dir>/feature-cache``). Every sequence costs one target forward ever: the cache
            is filled before the first step and shared by later runs that name it.
        feature_cache_gb: device memory kept for features across steps (past it they are read
            from the memory-mapped cache again).
        draft_vocab: a new drafter drafts over the top-N response tokens of the training data
            (:mod:`.draft_vocab`; CE over those N rows of the LM head, labels outside them are
            left out of the loss and counted); None: the whole vocabulary. A drafter given
            with ``init_drafter_dir`` or resumed keeps its own.
        holdout: share of the sequences held out (never trained on) for the evaluation below:
            those whose token ids hash (sha1) below this fraction, at least one, so the same
            sequences stay held out when more data directories are added to a later run.
        eval_every: every this many steps (and at the end) log accuracy per draft position
            and tau_est over a fixed set of held-out blocks (``eval`` records in ``log.jsonl``).
        ce_chunk: supervised rows per LM-head chunk (bounds the logits' memory).
        head_vocab: ``full`` (CE over the whole vocabulary, the paper) or ``seen`` (a sampled
            softmax: CE over the tokens that occur in the training sequences plus
            ``head_negatives`` other tokens drawn afresh each step; every label is in it).
            On SmolLM2's self-distilled data 10.5K of 49K tokens occur, so the LM-head GEMMs,
            most of a CPU step, shrink about 4x.
        head_negatives: random out-of-data tokens per step in the ``seen`` softmax.
        reg_weight: weight of a feature-regression term (EAGLE, arXiv:2401.15077 §4): slot
            ``k``'s hidden state is pulled towards the target's final normed hidden state at
            ``anchor + k - 1`` (whose LM-head output is the target's own distribution for that
            token), relative MSE. Needs the target's last layer in ``target_layer_ids``.
        export_dtype: dtype of the final ``drafter/`` (``bf16`` / ``fp32``).
        stop_after: stop (with a checkpoint) once this step is done, schedule unchanged
            (for time-boxed runs; resume later continues).
        max_minutes: a time-boxed run: the LR schedule follows ``max(step / steps, elapsed /
            max_minutes)`` (so warmup and cosine complete on time whatever the step rate) and
            the run stops, with a checkpoint and the exported drafter, once ``max_minutes`` of
            wall time have passed or ``steps`` are done. Wall time makes such a run
            non-reproducible step for step; None: the plain step schedule.
        progress: show a tqdm progress bar.
    """

    steps: int = 1000
    batch: int = 4
    anchors_per_seq: int = 512
    block_size: int = 16
    num_layers: int = 1
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gamma: float | None = None
    save_every: int = 500
    keep_checkpoints: int = 3
    seed: int = 0
    autocast: str = "auto"
    max_seq_len: int = 2048
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    sliding_window: int | None = None
    feature_cache: str | None = None
    feature_cache_gb: float = 4.0
    draft_vocab: int | None = None
    holdout: float = 0.0
    eval_every: int = 200
    ce_chunk: int = 256
    head_vocab: str = "full"
    head_negatives: int = 2048
    reg_weight: float = 0.0
    export_dtype: str = "bf16"
    stop_after: int | None = None
    max_minutes: float | None = None
    progress: bool = True
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raises DFlashError on impossible settings."""
        checks = [
            (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
            (self.batch >= 1, f"batch must be >= 1, got {self.batch}"),
            (self.anchors_per_seq >= 1, f"anchors per sequence must be >= 1, got {self.anchors_per_seq}"),
            (self.block_size >= 2, f"block size must be >= 2, got {self.block_size}"),
            (self.num_layers >= 1, f"layers must be >= 1, got {self.num_layers}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (0 <= self.warmup_frac < 1, f"warmup_frac must be in [0, 1), got {self.warmup_frac}"),
            (self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}"),
            (self.gamma is None or self.gamma > 0, f"gamma must be > 0, got {self.gamma}"),
            (self.save_every >= 1, f"save_every must be >= 1, got {self.save_every}"),
            (self.max_seq_len >= 2, f"max_seq_len must be >= 2, got {self.max_seq_len}"),
            (self.ce_chunk >= 1, f"ce_chunk must be >= 1, got {self.ce_chunk}"),
            (self.head_vocab in ("full", "seen"), f"head_vocab must be full or seen, got {self.head_vocab!r}"),
            (self.head_negatives >= 0, f"head_negatives must be >= 0, got {self.head_negatives}"),
            (self.reg_weight >= 0, f"reg_weight must be >= 0, got {self.reg_weight}"),
            (
                self.autocast in ("auto", "bf16", "fp16", "fp32"),
                f"autocast must be auto, bf16, fp16 or fp32, got {self.autocast!r}",
            ),
            (self.stop_after is None or self.stop_after >= 1, f"stop_after must be >= 1, got {self.stop_after}"),
            (self.max_minutes is None or self.max_minutes > 0, f"max_minutes must be > 0, got {self.max_minutes}"),
            (self.feature_cache_gb >= 0, f"feature_cache_gb must be >= 0, got {self.feature_cache_gb}"),
            (self.draft_vocab is None or self.draft_vocab >= 1, f"draft_vocab must be >= 1, got {self.draft_vocab}"),
            (0 <= self.holdout < 1, f"holdout must be in [0, 1), got {self.holdout}"),
            (self.eval_every >= 1, f"eval_every must be >= 1, got {self.eval_every}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise DFlashError(msg)
        parse_dtype(self.export_dtype)


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma of the paper: 7 for B=16, 4 for B=8; linear in B otherwise (>= 1)."""
    return max(1.0, 4.0 + 3.0 * (block_size - 8) / 8.0)


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """fp32 ``[B-1]``: ``exp(-(k-1)/gamma)`` for slots k = 1..B-1."""
    g = gamma if gamma is not None else default_gamma(block_size)
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / g)


# --------------------------------------------------------------------------------------------
# data: sequences, target features, batches
# --------------------------------------------------------------------------------------------


@dataclass
class TrainSequence:
    """One training sequence after cutting: ids and response mask (int64 / bool ``[S]``), the
    anchor candidates (response positions with a supervised next token), and where its labels
    come from: the text itself (``target_labels`` false: self-distilled answers, the target's
    own tokens) or the target's greedy predictions on the text (true: labelled text, see
    :mod:`.feature_cache`)."""

    ids: torch.Tensor
    mask: torch.Tensor
    candidates: torch.Tensor
    target_labels: bool = False


def holdout_split(seqs: list[TrainSequence], share: float) -> tuple[list[TrainSequence], list[TrainSequence]]:
    """``(trained, held out)``: a sequence is held out when the sha1 of its token ids, read as a
    fraction of 1, is below ``share`` (at least one sequence when ``share > 0``). The choice
    depends on each sequence alone, so a later run with more data directories keeps the same
    sequences out (its held-out figures stay comparable, and never include trained text).

    Raises:
        DFlashError: the split leaves no sequence to train on.
    """
    if share <= 0:
        return seqs, []
    frac = [int(sequence_key(s.ids)[:13], 16) / 16**13 for s in seqs]
    order = sorted(range(len(seqs)), key=frac.__getitem__)
    n_held = max(1, sum(f < share for f in frac))
    if n_held >= len(seqs):
        raise DFlashError(f"holdout {share} leaves no sequence to train on ({len(seqs)} in all)")
    return [seqs[i] for i in sorted(order[n_held:])], [seqs[i] for i in sorted(order[:n_held])]


def prepare_sequences(samples: Sequence, vocab_size: int, max_seq_len: int) -> list[TrainSequence]:
    """Turn samples (objects with ``input_ids`` and ``loss_mask`` lists, and optionally
    ``labels == "target"``) into sequences; samples without any anchor candidate are dropped.

    Raises:
        DFlashError: no samples, ragged sample, token ids outside the vocabulary, or no sample
            with a response of at least 2 tokens.
    """
    if not samples:
        raise DFlashError("no training samples")
    out = []
    for n, s in enumerate(samples):
        ids, mask = list(s.input_ids), list(s.loss_mask)
        if len(ids) != len(mask):
            raise DFlashError(f"sample {n}: input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not ids:
            continue
        t = torch.tensor(ids, dtype=torch.long)
        if int(t.min()) < 0 or int(t.max()) >= vocab_size:
            raise DFlashError(f"sample {n}: token ids outside the target's vocabulary (0..{vocab_size - 1})")
        m = torch.tensor(mask, dtype=torch.bool)
        cand = torch.nonzero(m[:-1] & m[1:]).flatten()  # anchor a in the response, a + 1 supervised
        if cand.numel():
            out.append(TrainSequence(t, m, cand, getattr(s, "labels", "text") == "target"))
    if not out:
        raise DFlashError("no training sample has a response of at least 2 tokens (loss_mask)")
    return out


class FeatureStore:
    """Target features and greedy predictions per sequence index: read from the on-disk
    :class:`~.feature_cache.FeatureCache` (filled once, up front) and kept on the training device
    in the compute dtype up to a memory budget.

    Args:
        cache: the filled feature cache.
        seqs: the training sequences (all in ``cache``).
        device, dtype: where and in which dtype :meth:`get` returns features.
        budget_bytes: device memory kept for features across steps (0: read every time).
    """

    def __init__(self, cache, seqs: list[TrainSequence], device: torch.device, dtype: torch.dtype, budget_bytes: float):
        self.disk, self.seqs, self.device, self.dtype, self.budget = cache, seqs, device, dtype, budget_bytes
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bytes = 0

    def get(self, idx: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per index, ``(features [S, F] in the compute dtype, predictions int64 [S])`` on the device."""
        out = []
        for i in idx:
            hit = self.kept.get(i)
            if hit is None:
                f, p = self.disk.get(self.seqs[i].ids)
                hit = (f.to(self.device, self.dtype), p.to(self.device))
                size = hit[0].numel() * hit[0].element_size()
                if self.bytes + size <= self.budget:
                    self.kept[i] = hit
                    self.bytes += size
            out.append(hit)
        return out


@dataclass
class Batch:
    """Tensors of one training step (N sequences, nb blocks each, block size B).

    Attributes:
        features: ``[N, S, F]`` target features (zero padding).
        positions, valid: int64 / bool ``[N, S]``.
        anchors: int64 ``[N, nb]`` (padding blocks: anchor 0, no labels).
        block_ids: int64 ``[N, nb, B]`` anchor token then MASK ids.
        labels: int64 ``[N, nb, B-1]`` token at ``anchor + k`` or ``IGNORE``.
        tokens: sequence tokens in the batch.
    """

    features: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    anchors: torch.Tensor
    block_ids: torch.Tensor
    labels: torch.Tensor
    tokens: int


def sample_anchors(seq: TrainSequence, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to ``n`` distinct random anchor positions among ``seq.candidates``, sorted."""
    c = seq.candidates
    if c.numel() <= n:
        return c.clone()
    return c[torch.randperm(c.numel(), generator=gen)[:n]].sort().values


def build_batch(
    seqs: list[TrainSequence],
    feats: list[torch.Tensor],
    anchors_per_seq: int,
    block_size: int,
    mask_token_id: int,
    gen: torch.Generator,
    device: torch.device | str = "cpu",
    preds: list[torch.Tensor] | None = None,
) -> Batch:
    """Sample anchors and lay out one step's tensors (see :class:`Batch`).

    Slot ``k`` of the block anchored at ``a`` is labelled with the token at ``a + k`` (inside the
    response). For a sequence with ``target_labels`` the label is instead the target's own
    greedy choice there (``preds[i][a + k - 1]``, needed then), and only while the text follows
    the target's greedy path from ``a + 1`` to ``a + k - 1`` (where it leaves the path, the
    target's choice after it is unknown, so later slots are not supervised).
    """
    N, B = len(seqs), block_size
    S = max(len(s.ids) for s in seqs)
    Fdim = feats[0].shape[-1]
    chosen = [sample_anchors(s, anchors_per_seq, gen) for s in seqs]
    nb = max(len(a) for a in chosen)
    features = torch.zeros(N, S, Fdim, dtype=feats[0].dtype, device=feats[0].device)
    valid = torch.zeros(N, S, dtype=torch.bool)
    anchors = torch.zeros(N, nb, dtype=torch.long)
    block_ids = torch.full((N, nb, B), mask_token_id, dtype=torch.long)
    labels = torch.full((N, nb, B - 1), IGNORE, dtype=torch.long)
    offs = torch.arange(1, B)
    for i, (s, f, a) in enumerate(zip(seqs, feats, chosen)):
        L, m = len(s.ids), len(a)
        features[i, :L] = f
        valid[i, :L] = True
        anchors[i, :m] = a
        block_ids[i, :m, 0] = s.ids[a]
        lp = a.unsqueeze(1) + offs  # [m, B-1] label positions
        inside = lp < L
        lpc = lp.clamp(max=L - 1)
        ok = inside & s.mask[lpc]
        if s.target_labels:
            p = preds[i].cpu()
            want = p[lpc - 1]  # the target's greedy token at a + k given the text before it
            on_path = torch.cat([torch.ones(m, 1, dtype=torch.bool), (s.ids[lpc] == want)[:, :-1]], 1).cummin(1).values
            labels[i, :m] = torch.where(ok & on_path, want, IGNORE)
        else:
            labels[i, :m] = torch.where(ok, s.ids[lpc], IGNORE)
    positions = torch.arange(S).expand(N, S).contiguous()
    return Batch(
        features.to(device, non_blocking=True),
        positions.to(device),
        valid.to(device),
        anchors.to(device),
        block_ids.to(device),
        labels.to(device),
        int(sum(len(s.ids) for s in seqs)),
    )


# --------------------------------------------------------------------------------------------
# loss
# --------------------------------------------------------------------------------------------


class _HeadCrossEntropy(torch.autograd.Function):
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
    total, pred = _HeadCrossEntropy.apply(rows, W, idx, w_ce, ce_chunk, amp or torch.float32)
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


# --------------------------------------------------------------------------------------------
# schedule, checkpoints, log
# --------------------------------------------------------------------------------------------


def lr_lambda(steps: int, warmup_frac: float, min_ratio: float):
    """Linear warmup over ``ceil(warmup_frac * steps)`` steps, then cosine to ``min_ratio``."""
    warm = math.ceil(warmup_frac * steps)

    def f(step: int) -> float:  # step = number of optimizer steps already taken
        if step < warm:
            return (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, steps - warm))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with ``train_state.pt``) as ``(step, path)``, oldest first."""
    found = []
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            m = CKPT_RE.match(p.name)
            if m and (p / "train_state.pt").is_file() and (p / "config.json").is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def _save_checkpoint(out_dir: Path, step: int, drafter, opt, sched, cfg: TrainConfig) -> Path:
    final = save_drafter(
        drafter,
        out_dir / f"ckpt-{step:06d}",
        replace=True,
        extra={
            "train_state.pt": lambda p: torch.save(
                {
                    "step": step,
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                    "config": asdict(cfg),
                },
                p,
            )
        },
    )
    if cfg.keep_checkpoints > 0:
        for _, old in list_checkpoints(out_dir)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _rewrite_log(log: Path, upto: int) -> None:
    """Keep only the log lines of steps <= ``upto`` (resume after a crash past a checkpoint)."""
    if not log.is_file():
        return
    keep = []
    for line in log.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= upto:
                keep.append(line)
        except json.JSONDecodeError:
            break
    log.write_text("".join(k + "\n" for k in keep))


def read_log(out_dir: str | os.PathLike, evals: bool = False) -> list[dict]:
    """The step records of ``out_dir/log.jsonl`` (or, with ``evals``, its held-out evaluation
    records ``{"step", "eval": {"loss", "acc", "tau_est", "supervised"}}``)."""
    log = Path(out_dir) / "log.jsonl"
    if not log.is_file():
        return []
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r for r in recs if ("eval" in r) == evals]


def plot_loss(out_dir: str | os.PathLike) -> Path | None:
    """Plot ``log.jsonl`` to ``loss.png``: the training loss with an EMA (and the held-out loss),
    tau_est and slot-1 accuracy of the training batches, and held-out accuracy at draft
    positions 1-3 when the run evaluates on held-out sequences."""
    recs = read_log(out_dir)
    evals = read_log(out_dir, evals=True)
    if not recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in recs]
    loss = [r["loss"] for r in recs]
    ema, e = [], loss[0]
    for v in loss:
        e = 0.95 * e + 0.05 * v
        ema.append(e)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a1.plot(steps, loss, lw=0.6, alpha=0.5, label="loss")
    a1.plot(steps, ema, lw=1.5, label="EMA 0.95")
    if evals:
        a1.plot([r["step"] for r in evals], [r["eval"]["loss"] for r in evals], "o-", ms=3, label="held-out")
    a1.set_ylabel("weighted CE")
    a1.set_yscale("log")
    a1.legend()
    a1.grid(alpha=0.3)
    a2.plot(steps, [r.get("tau_est", float("nan")) for r in recs], lw=0.8, label="tau_est (batch)")
    a2.plot(steps, [1 + r["acc"][0] if r.get("acc") else float("nan") for r in recs], lw=0.8, label="1 + acc slot 1")
    for k in range(min(3, len(evals[0]["eval"]["acc"]) if evals else 0)):
        a2.plot(
            [r["step"] for r in evals],
            [1 + r["eval"]["acc"][k] for r in evals],
            "o-",
            ms=3,
            label=f"1 + held-out acc slot {k + 1}",
        )
    a2.set_xlabel("step")
    a2.legend()
    a2.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_dir) / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


def _batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """Sequence indices of 0-based ``step``: epoch-wise permutations seeded by (seed, epoch)."""
    out, perms = [], {}
    for j in range(batch):
        flat = step * batch + j
        epoch = flat // n
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][flat % n]))
    return out


def _step_vocab(seen: torch.Tensor, negatives: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted token ids of one step's sampled softmax: every ``seen`` token plus up to
    ``negatives`` others drawn uniformly without replacement."""
    rest = torch.nonzero(~seen).flatten()
    extra = rest[torch.randperm(rest.numel(), generator=gen)[:negatives]]
    return torch.cat([torch.nonzero(seen).flatten(), extra]).sort().values


def evaluate(drafter, embed_w, head_w, batches: list[Batch], weights, amp, ce_chunk: int, vocab) -> dict:
    """Loss, accuracy per draft position and tau_est over fixed held-out batches (no grad),
    each averaged over the batches weighted by their supervised slots."""
    total, acc, tau, tau_w, loss = 0, None, 0.0, 0, 0.0
    with torch.no_grad():
        for b in batches:
            _, st = compute_loss(
                drafter, embed_w, head_w, b, weights, amp, ce_chunk, vocab, drop_outside=vocab is not None
            )
            n = st.supervised
            total += n
            loss += st.loss * n
            acc = [a * n for a in st.acc] if acc is None else [x + a * n for x, a in zip(acc, st.acc)]
            if st.tau_est == st.tau_est:  # NaN: no fully supervised block in this batch
                tau += st.tau_est * n
                tau_w += n
    total = max(total, 1)
    return {
        "loss": round(loss / total, 5),
        "acc": [round(a / total, 4) for a in acc or []],
        "tau_est": round(tau / tau_w, 4) if tau_w else float("nan"),
        "supervised": total,
    }


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed + 1) * 7_919_113 + step)


def train(
    target: LoadedTarget,
    samples: Sequence,
    out_dir: str | os.PathLike,
    cfg: TrainConfig,
    init_drafter_dir: str | os.PathLike | None = None,
    resume: bool = True,
) -> Path:
    """Train a DFlash drafter for ``target`` on ``samples`` and export it to ``out_dir/drafter``.

    Args:
        target: the frozen target (its dtype is used for the feature pass).
        samples: objects with ``input_ids`` and ``loss_mask`` (1 on response tokens).
        out_dir: run directory (see the module docstring).
        cfg: settings.
        init_drafter_dir: start from this z-lab drafter instead of a random one (its layers,
            block size, mask token and target layers win over ``cfg``).
        resume: continue from the newest checkpoint in ``out_dir`` (a run that is already
            finished is only re-exported).

    Returns:
        the path of the exported drafter.

    Raises:
        DFlashError: bad settings or data, an ``out_dir`` holding another run, a drafter that
            does not fit the target.
    """
    cfg.validate()
    out = Path(out_dir).expanduser()
    model = target.model
    dev = model.embed.weight.device
    tcfg = model.cfg
    ckpts = list_checkpoints(out)
    if ckpts and not resume:
        raise DFlashError(f"{out} already holds checkpoints; resume, or choose another output directory")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.partial-*"):  # left by a killed run (atomic_dir cleans up otherwise)
        shutil.rmtree(stale, ignore_errors=True)

    seqs = prepare_sequences(samples, tcfg.vocab_size, cfg.max_seq_len)
    seqs, held = holdout_split(seqs, cfg.holdout)

    start = 0
    state = None
    if ckpts:
        start, path = ckpts[-1]
        drafter = load_drafter(path, torch.float32)
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=False)
    elif init_drafter_dir is not None:
        drafter = load_drafter(init_drafter_dir, torch.float32)
    else:
        mask = (
            cfg.mask_token_id
            if cfg.mask_token_id is not None
            else default_mask_token_id(target.tokenizer, tcfg.vocab_size)
        )
        drafter = init_drafter(
            tcfg,
            cfg.num_layers,
            cfg.block_size,
            mask,
            seed=cfg.seed,
            target_layer_ids=list(cfg.target_layer_ids) if cfg.target_layer_ids else None,
            sliding_window=cfg.sliding_window,
            draft_token_ids=None
            if cfg.draft_vocab is None
            else top_tokens(token_counts(((s.ids, s.mask) for s in seqs), tcfg.vocab_size), cfg.draft_vocab),
        )
        with torch.no_grad():  # the drafter's output feeds the target's LM head, like the target's final norm
            drafter.norm.weight.copy_(model.norm.weight.float())
    validate_pair(tcfg, drafter.cfg)
    dcfg = drafter.cfg
    if (
        state is not None
        and init_drafter_dir is None
        and (dcfg.block_size, dcfg.num_layers) != (cfg.block_size, cfg.num_layers)
    ):
        raise DFlashError(
            f"{out} holds a run with block size {dcfg.block_size} and {dcfg.num_layers} layers, not "
            f"{cfg.block_size} and {cfg.num_layers}; use another output directory"
        )
    B = dcfg.block_size
    drafter = drafter.to(dev).float().train()
    model.requires_grad_(False)

    amp = autocast_dtype(cfg.autocast, dev)
    cache = FeatureCache(
        cfg.feature_cache or out / "feature-cache",
        str(target.path),
        dcfg.target_layer_ids,
        model.embed.weight.dtype,
        tcfg.hidden_size,
    )
    cache.fill(model, [s.ids for s in seqs + held], progress=cfg.progress)
    store = FeatureStore(cache, seqs, dev, amp or torch.float32, cfg.feature_cache_gb * 2**30)
    draft_ids = drafter.draft_token_ids()
    if draft_ids is not None and cfg.head_vocab == "seen":
        raise DFlashError("head_vocab 'seen' (a sampled softmax) and a draft vocabulary exclude each other")
    embed_w = model.embed.weight.detach()
    head_w = model.lm_head.weight.detach()
    if amp is not None:
        head_w = head_w.to(amp)
    weights = slot_weights(B, cfg.gamma).to(dev)
    if cfg.reg_weight > 0 and dcfg.target_layer_ids[-1] != tcfg.num_layers - 1:
        raise DFlashError(
            f"reg_weight needs the target's last layer ({tcfg.num_layers - 1}) as the drafter's last "
            f"target layer; it reads {list(dcfg.target_layer_ids)}"
        )
    seen = None
    if cfg.head_vocab == "seen":
        seen = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
        for sq in seqs:
            seen[sq.ids] = True

    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio))
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
    else:
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
    log = out / "log.jsonl"
    _rewrite_log(log, start) if start else log.unlink(missing_ok=True)
    effective = asdict(cfg) | {
        "block_size": B,
        "num_layers": dcfg.num_layers,
        "mask_token_id": dcfg.mask_token_id,
        "target_layer_ids": list(dcfg.target_layer_ids),
        # what the drafter has (with --init-drafter it comes from the drafter, not the flags)
        "sliding_window": dcfg.sliding_window,
        "draft_vocab": dcfg.draft_vocab_size,
        "target": str(target.path),
        "sequences": len(seqs),
        "gamma": cfg.gamma or default_gamma(B),
    }
    (out / "train_config.json").write_text(json.dumps(effective, indent=2, default=str) + "\n")

    eval_batches = []
    if held:  # fixed blocks of the held-out sequences: the same ones at every evaluation
        g = torch.Generator().manual_seed(cfg.seed + 999)
        for c in range(0, len(held), cfg.batch):
            part = held[c : c + cfg.batch]
            got = [cache.get(s.ids) for s in part]
            eval_batches.append(
                build_batch(
                    part,
                    [f.to(dev, amp or torch.float32) for f, _ in got],
                    min(cfg.anchors_per_seq, 64),
                    B,
                    dcfg.mask_token_id,
                    g,
                    dev,
                    preds=[p for _, p in got],
                )
            )

    def run_eval(logf) -> None:
        if eval_batches:
            ev = evaluate(drafter, embed_w, head_w, eval_batches, weights, amp, cfg.ce_chunk, draft_ids)
            logf.write(json.dumps({"step": step, "eval": ev}) + "\n")
            logf.flush()

    end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    step = start
    last_saved = start
    if start < end:
        from tqdm import tqdm

        bar = tqdm(
            total=end,
            initial=start,
            desc="train",
            unit="step",
            disable=not cfg.progress,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        t_run = time.perf_counter()
        max_s = 60 * cfg.max_minutes if cfg.max_minutes else None
        schedule = lr_lambda(cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio)
        try:
            with log.open("a") as logf:
                while step < end:
                    t0 = time.perf_counter()
                    if max_s is not None:  # time-boxed: the schedule advances with the clock too
                        at = max(step, int(cfg.steps * (t0 - t_run) / max_s))
                        for g in opt.param_groups:
                            g["lr"] = cfg.lr * schedule(min(at, cfg.steps - 1))
                    idx = _batch_indices(step, cfg.batch, len(seqs), cfg.seed)
                    got = store.get(idx)
                    t1 = time.perf_counter()
                    batch = build_batch(
                        [seqs[i] for i in idx],
                        [f for f, _ in got],
                        cfg.anchors_per_seq,
                        B,
                        dcfg.mask_token_id,
                        _step_generator(cfg.seed, step),
                        dev,
                        preds=[p for _, p in got],
                    )
                    vocab = (
                        draft_ids
                        if seen is None
                        else _step_vocab(seen, cfg.head_negatives, _step_generator(cfg.seed + 1, step)).to(dev)
                    )
                    loss, st = compute_loss(
                        drafter,
                        embed_w,
                        head_w,
                        batch,
                        weights,
                        amp,
                        cfg.ce_chunk,
                        vocab,
                        cfg.reg_weight,
                        drop_outside=draft_ids is not None,
                    )
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    gnorm = float(
                        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
                        if cfg.grad_clip > 0
                        else 0.0
                    )
                    lr = opt.param_groups[0]["lr"]
                    opt.step()
                    sched.step()
                    step += 1
                    dt = time.perf_counter() - t0
                    rec = {
                        "step": step,
                        "loss": round(st.loss, 5),
                        "lr": lr,
                        "grad_norm": round(gnorm, 4),
                        "tau_est": round(st.tau_est, 4),
                        "acc": [round(a, 4) for a in st.acc],
                        "tokens": batch.tokens,
                        "supervised": st.supervised,
                        "outside_vocab": st.outside_vocab,
                        "blocks": int(batch.anchors.numel()),
                        "step_s": round(dt, 4),
                        "target_s": round(t1 - t0, 4),
                        "elapsed_s": round(time.perf_counter() - t_run, 2),
                    }
                    logf.write(json.dumps(rec) + "\n")
                    logf.flush()
                    bar.set_postfix(loss=f"{st.loss:.3f}", tau=f"{st.tau_est:.2f}", lr=f"{lr:.1e}", refresh=False)
                    bar.update(1)
                    out_of_time = max_s is not None and time.perf_counter() - t_run >= max_s
                    if step % cfg.eval_every == 0 or step == end or out_of_time:
                        run_eval(logf)
                    if step % cfg.save_every == 0 or step == end or out_of_time:
                        _save_checkpoint(out, step, drafter, opt, sched, cfg)
                        plot_loss(out)
                        last_saved = step
                    if out_of_time:
                        print(f"time box: stopping after {cfg.max_minutes:g} min at step {step}", file=sys.stderr)
                        break
        except KeyboardInterrupt:
            if step > last_saved:
                _save_checkpoint(out, step, drafter, opt, sched, cfg)
                plot_loss(out)
            raise
        finally:
            bar.close()
    if last_saved != step or start == end:  # (every checkpoint in the loop redraws the plot)
        plot_loss(out)
    return save_drafter(drafter.eval(), out / "drafter", parse_dtype(cfg.export_dtype), replace=True)
