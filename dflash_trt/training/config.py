"""Settings of a drafter training run (:class:`TrainConfig`), the paper's loss-decay default
(:func:`default_gamma`, arXiv:2602.06036 §4) and the autocast dtype a run uses on its device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..argspec import arg
from ..checkpoints.loader import parse_dtype
from ..errors import ConfigError


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

    steps: int = arg("optimizer steps (the LR schedule spans them)", default=1000, required=True)
    batch: int = 4
    anchors_per_seq: int = arg("random anchors (blocks) per sequence", "--anchors", default=512)
    block_size: int = 16
    num_layers: int = 1
    lr: float = arg("peak learning rate", default=6e-4)
    warmup_frac: float = arg("warmup fraction of the steps", "--warmup", default=0.04)
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gamma: float | None = arg("loss decay (default: 7 for B=16, 4 for B=8)")
    save_every: int = arg("checkpoint every N steps", default=500)
    keep_checkpoints: int = 3
    seed: int = 0
    autocast: str = arg(
        "auto (bf16 where the GPU or CPU has bf16 GEMMs, else fp32) | bf16 | fp16 | fp32 (no autocast)",
        default="auto",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    max_seq_len: int = 2048
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = arg(
        "comma-separated target layer ids a new drafter reads (default: the z-lab spread)", "--target-layers"
    )
    sliding_window: int | None = arg(
        "a new drafter attends to the last W - 1 - k context positions at slot k (z-lab sliding layers)"
    )
    feature_cache: str | None = arg(
        "on-disk target feature cache, shared by runs on the same target (default: OUT/feature-cache)"
    )
    feature_cache_gb: float = arg("target features kept in (device) memory", default=4.0)
    draft_vocab: int | None = arg(
        "a new drafter drafts over the top-N response tokens of the data (d2t; default: the whole vocabulary)"
    )
    holdout: float = arg("share of sequences held out for evaluation", default=0.0)
    eval_every: int = arg("held-out evaluation every N steps", default=200)
    ce_chunk: int = arg("supervised rows per LM-head chunk (GPU: thousands)", default=256)
    head_vocab: str = arg(
        "full | seen: CE over the whole vocabulary, or a sampled softmax over the tokens in the data",
        default="full",
        choices=("full", "seen"),
    )
    head_negatives: int = 2048
    reg_weight: float = arg(
        "weight of the pull towards the target's final hidden state (needs its last layer)", default=0.0
    )
    export_dtype: str = arg("dtype of the exported drafter: bf16 | fp32", default="bf16")
    stop_after: int | None = arg("stop (with a checkpoint) after this step")
    max_minutes: float | None = None
    progress: bool = True
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raises ConfigError (named by field) on impossible settings."""
        checks = [
            (self.steps >= 1, "steps", f"must be >= 1, got {self.steps}"),
            (self.batch >= 1, "batch", f"must be >= 1, got {self.batch}"),
            (self.anchors_per_seq >= 1, "anchors_per_seq", f"must be >= 1, got {self.anchors_per_seq}"),
            (self.block_size >= 2, "block_size", f"must be >= 2, got {self.block_size}"),
            (self.num_layers >= 1, "num_layers", f"must be >= 1, got {self.num_layers}"),
            (self.lr > 0, "lr", f"must be > 0, got {self.lr}"),
            (0 <= self.warmup_frac < 1, "warmup_frac", f"must be in [0, 1), got {self.warmup_frac}"),
            (self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}"),
            (self.gamma is None or self.gamma > 0, "gamma", f"must be > 0, got {self.gamma}"),
            (self.save_every >= 1, "save_every", f"must be >= 1, got {self.save_every}"),
            (self.max_seq_len >= 2, "max_seq_len", f"must be >= 2, got {self.max_seq_len}"),
            (self.ce_chunk >= 1, "ce_chunk", f"must be >= 1, got {self.ce_chunk}"),
            (self.head_vocab in ("full", "seen"), "head_vocab", f"must be full or seen, got {self.head_vocab!r}"),
            (self.head_negatives >= 0, "head_negatives", f"must be >= 0, got {self.head_negatives}"),
            (self.reg_weight >= 0, "reg_weight", f"must be >= 0, got {self.reg_weight}"),
            (
                self.autocast in ("auto", "bf16", "fp16", "fp32"),
                "autocast",
                f"must be auto, bf16, fp16 or fp32, got {self.autocast!r}",
            ),
            (self.stop_after is None or self.stop_after >= 1, "stop_after", f"must be >= 1, got {self.stop_after}"),
            (self.max_minutes is None or self.max_minutes > 0, "max_minutes", f"must be > 0, got {self.max_minutes}"),
            (self.feature_cache_gb >= 0, "feature_cache_gb", f"must be >= 0, got {self.feature_cache_gb}"),
            (self.draft_vocab is None or self.draft_vocab >= 1, "draft_vocab", f"must be >= 1, got {self.draft_vocab}"),
            (0 <= self.holdout < 1, "holdout", f"must be in [0, 1), got {self.holdout}"),
            (self.eval_every >= 1, "eval_every", f"must be >= 1, got {self.eval_every}"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ConfigError(name, msg)
        parse_dtype(self.export_dtype)


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma of the paper: 7 for B=16, 4 for B=8; linear in B otherwise (>= 1)."""
    return max(1.0, 4.0 + 3.0 * (block_size - 8) / 8.0)
