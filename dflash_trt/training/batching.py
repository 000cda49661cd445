"""Training data as the trainer sees it (paper arXiv:2602.06036 §4): samples cut into
:class:`TrainSequence`, a held-out split, the target features kept on the device
(:class:`FeatureStore`), and one step's :class:`Batch`: random anchors, blocks
``[token at anchor, MASK x (B-1)]`` and same-position labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import DFlashError
from .feature_cache import sequence_key

IGNORE = -100


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


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """The ``batch`` sequence indices (of ``n``) that 0-based ``step`` trains on: the data is read in
    epoch-wise permutations seeded by ``(seed, epoch)``, so a resumed run reads what an
    uninterrupted one would."""
    out, perms = [], {}
    for j in range(batch):
        flat = step * batch + j
        epoch = flat // n
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][flat % n]))
    return out


def step_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator of 0-based ``step``'s random draws (its anchors; with ``seed + 1``, its
    sampled-softmax vocabulary): seeded by ``(seed, step)`` alone, so a resumed run draws what an
    uninterrupted one would."""
    return torch.Generator().manual_seed((seed + 1) * 7_919_113 + step)
