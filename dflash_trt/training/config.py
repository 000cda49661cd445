"""Settings of a drafter training run (:class:`TrainConfig`), the paper's loss-decay default
(:func:`default_gamma`, arXiv:2602.06036 §4) and the autocast dtype a run uses on its device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoints.loader import parse_dtype
from ..errors import DFlashError


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
            given to :func:`~.trainer.train` keeps its own).
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
