"""DFlash drafter training (paper arXiv:2602.06036 §4 recipe) on a frozen target.

Per step, for ``batch`` sequences (prompt + target-generated response, ``loss_mask`` = 1 on
the response):
  * target features of every position, computed once per sequence with our ``TargetModel``
    (layers ``drafter.cfg.target_layer_ids``, no grad; cached on disk and on the device,
    :mod:`.feature_cache`, :class:`~.batching.FeatureStore`);
  * up to ``anchors_per_seq`` random anchors among the response positions; block ``b`` is
    ``[token at anchor_b, MASK x (B-1)]`` embedded with the target's frozen embedding, at
    positions ``anchor_b .. anchor_b + B - 1``; it sees the context positions strictly before
    its anchor (what the runtime's drafter sees when the block starts at the last committed
    token) and its own block, non-causally (:mod:`.batching`);
  * ONE drafter forward for all blocks of all sequences (:meth:`DFlashDrafter.forward_train`);
  * slot ``k`` (1..B-1) is labelled with the token at ``anchor + k`` (same-position labels);
    the anchor slot, slots past the sequence and slots outside the response are ignored;
  * loss = sum_k w_k CE_k / sum_k w_k with ``w_k = exp(-(k-1)/gamma)`` (gamma 7 for B=16,
    4 for B=8), CE through the target's frozen LM head, computed only at supervised slots in
    row chunks (:mod:`.loss`: logits never held whole, the 49K-vocabulary head dominates a step);
  * AdamW (lr 6e-4), linear warmup over ``warmup_frac`` of the steps then cosine decay,
    gradient clipping at 1.0. The target (embedding and LM head included) stays frozen.

The run directory (checkpoints, log, the exported drafter) is described in :mod:`.run_dir`;
the settings in :mod:`.config`. Use::

    trainer = Trainer(target, samples, out_dir, TrainConfig(steps=1000))
    drafter_dir = trainer.run()  # step() / evaluate() / save() until done, then export()
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from ..checkpoints.loader import LoadedTarget, default_mask_token_id, parse_dtype
from ..checkpoints.zlab import init_drafter, load_drafter, save_drafter, validate_pair
from ..errors import DFlashError
from ..models.drafter import DFlashDrafter
from .batching import FeatureStore, batch_indices, build_batch, holdout_split, prepare_sequences, step_generator
from .config import TrainConfig, autocast_dtype, default_gamma
from .draft_vocab import token_counts, top_tokens
from .feature_cache import FeatureCache
from .loss import compute_loss, sampled_vocab, slot_weights
from .plots import plot_loss
from .run_dir import LOG, load_checkpoint, open_run_dir, rewrite_log, save_checkpoint


def lr_lambda(steps: int, warmup_frac: float, min_ratio: float) -> Callable[[int], float]:
    """The LR factor after ``step`` optimizer steps: linear warmup over ``ceil(warmup_frac *
    steps)`` steps, then cosine to ``min_ratio`` at ``steps``."""
    warm = math.ceil(warmup_frac * steps)

    def f(step: int) -> float:  # step = number of optimizer steps already taken
        if step < warm:
            return (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, steps - warm))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


class Trainer:
    """One training run of a DFlash drafter for a frozen target (see the module docstring).

    Building it prepares everything a step needs: the sequences and the held-out split, the
    drafter (resumed from the newest checkpoint in ``out_dir``, loaded from
    ``init_drafter_dir``, or new), the target features of every sequence (one target forward
    per sequence ever, :mod:`.feature_cache`), the optimizer and LR schedule, the log and
    ``train_config.json``. Then :meth:`step` trains one step, :meth:`evaluate` measures the
    held-out blocks, :meth:`save` checkpoints, :meth:`export` writes the drafter, and
    :meth:`run` does them in order until the run is done.

    Args:
        target: the frozen target (its dtype is used for the feature pass).
        samples: objects with ``input_ids`` and ``loss_mask`` (1 on response tokens) lists, and
            optionally ``labels == "target"`` (:class:`~.batching.TrainSequence`).
        out_dir: the run directory (:mod:`.run_dir`).
        cfg: settings.
        init_drafter_dir: start from this z-lab drafter instead of a random one (its layers,
            block size, mask token and target layers win over ``cfg``).
        resume: continue from the newest checkpoint in ``out_dir``.

    Attributes:
        steps_done: optimizer steps taken in the run so far (resumed ones included).
        drafter: the fp32 drafter being trained, on the target's device.

    Raises:
        DFlashError: bad settings or data, an ``out_dir`` holding another run (or any run, with
            ``resume`` false), a drafter that does not fit the target, settings that exclude
            each other (a draft vocabulary with ``head_vocab='seen'``, ``reg_weight`` without
            the target's last layer).
    """

    def __init__(
        self,
        target: LoadedTarget,
        samples: Sequence,
        out_dir: str | os.PathLike,
        cfg: TrainConfig,
        init_drafter_dir: str | os.PathLike | None = None,
        resume: bool = True,
    ):
        cfg.validate()
        self.cfg, self.target = cfg, target
        self.out, ckpts = open_run_dir(out_dir, resume)
        self.device = target.model.embed.weight.device
        seqs = prepare_sequences(samples, target.model.cfg.vocab_size, cfg.max_seq_len)
        self.seqs, self.held = holdout_split(seqs, cfg.holdout)
        self.start = self.steps_done = self.last_saved = ckpts[-1][0] if ckpts else 0
        state = self._init_drafter(ckpts[-1][1] if ckpts else None, init_drafter_dir)
        self._init_features()
        self._init_loss()
        self._init_optimizer(state)
        self._init_log()
        self.eval_batches = self._held_out_batches()
        self.max_s = 60 * cfg.max_minutes if cfg.max_minutes else None
        self.t_run: float | None = None  # when training began (the time box counts from it)

    # ---------------------------------------------------------------------------- set-up

    def _init_drafter(self, ckpt: Path | None, init_drafter_dir) -> dict | None:
        """Resume, load or create the drafter; returns the checkpoint's train state (or None)."""
        cfg, tcfg = self.cfg, self.target.model.cfg
        state = None
        if ckpt is not None:
            drafter, state = load_checkpoint(ckpt)
        elif init_drafter_dir is not None:
            drafter = load_drafter(init_drafter_dir, torch.float32)
        else:
            drafter = self._new_drafter()
        validate_pair(tcfg, drafter.cfg)
        dcfg = drafter.cfg
        if (
            state is not None
            and init_drafter_dir is None
            and (dcfg.block_size, dcfg.num_layers) != (cfg.block_size, cfg.num_layers)
        ):
            raise DFlashError(
                f"{self.out} holds a run with block size {dcfg.block_size} and {dcfg.num_layers} layers, not "
                f"{cfg.block_size} and {cfg.num_layers}; use another output directory"
            )
        self.drafter: DFlashDrafter = drafter.to(self.device).float().train()
        self.target.model.requires_grad_(False)
        return state

    def _new_drafter(self) -> DFlashDrafter:
        """A random drafter of ``cfg``'s shape whose final norm starts as the target's."""
        cfg, model = self.cfg, self.target.model
        tcfg = model.cfg
        mask = (
            cfg.mask_token_id
            if cfg.mask_token_id is not None
            else default_mask_token_id(self.target.tokenizer, tcfg.vocab_size)
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
            else top_tokens(token_counts(((s.ids, s.mask) for s in self.seqs), tcfg.vocab_size), cfg.draft_vocab),
        )
        with torch.no_grad():  # the drafter's output feeds the target's LM head, like the target's final norm
            drafter.norm.weight.copy_(model.norm.weight.float())
        return drafter

    def _init_features(self) -> None:
        """Fill the feature cache for every sequence (held-out ones too) and open the store."""
        cfg, model = self.cfg, self.target.model
        self.amp = autocast_dtype(cfg.autocast, self.device)
        self.cache = FeatureCache(
            cfg.feature_cache or self.out / "feature-cache",
            str(self.target.path),
            self.drafter.cfg.target_layer_ids,
            model.embed.weight.dtype,
            model.cfg.hidden_size,
        )
        self.cache.fill(model, [s.ids for s in self.seqs + self.held], progress=cfg.progress)
        self.store = FeatureStore(
            self.cache, self.seqs, self.device, self.amp or torch.float32, cfg.feature_cache_gb * 2**30
        )

    def _init_loss(self) -> None:
        """The frozen target weights the loss reads, the slot weights, and the vocabulary the
        softmax runs over (the drafter's draft vocabulary, or the tokens of the data)."""
        cfg, model, dcfg = self.cfg, self.target.model, self.drafter.cfg
        tcfg = model.cfg
        self.draft_ids = self.drafter.draft_token_ids()
        if self.draft_ids is not None and cfg.head_vocab == "seen":
            raise DFlashError("head_vocab 'seen' (a sampled softmax) and a draft vocabulary exclude each other")
        self.embed_w = model.embed.weight.detach()
        head_w = model.lm_head.weight.detach()
        self.head_w = head_w.to(self.amp) if self.amp is not None else head_w
        self.weights = slot_weights(dcfg.block_size, cfg.gamma).to(self.device)
        if cfg.reg_weight > 0 and dcfg.target_layer_ids[-1] != tcfg.num_layers - 1:
            raise DFlashError(
                f"reg_weight needs the target's last layer ({tcfg.num_layers - 1}) as the drafter's last "
                f"target layer; it reads {list(dcfg.target_layer_ids)}"
            )
        self.seen = None
        if cfg.head_vocab == "seen":
            self.seen = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
            for sq in self.seqs:
                self.seen[sq.ids] = True

    def _init_optimizer(self, state: dict | None) -> None:
        """AdamW and the LR schedule; a resumed run also gets back its RNG states."""
        cfg = self.cfg
        self.opt = torch.optim.AdamW(
            self.drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
        self.schedule = lr_lambda(cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.schedule)
        if state is not None:
            self.opt.load_state_dict(state["optimizer"])
            self.sched.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
        else:
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)

    def _init_log(self) -> None:
        """Cut the log back to the resumed step and write ``train_config.json``: the settings
        as the run has them (with ``init_drafter_dir`` the drafter's shape, not ``cfg``'s)."""
        rewrite_log(self.out, self.start)
        dcfg = self.drafter.cfg
        effective = asdict(self.cfg) | {
            "block_size": dcfg.block_size,
            "num_layers": dcfg.num_layers,
            "mask_token_id": dcfg.mask_token_id,
            "target_layer_ids": list(dcfg.target_layer_ids),
            "sliding_window": dcfg.sliding_window,
            "draft_vocab": dcfg.draft_vocab_size,
            "target": str(self.target.path),
            "sequences": len(self.seqs),
            "gamma": self.cfg.gamma or default_gamma(dcfg.block_size),
        }
        (self.out / "train_config.json").write_text(json.dumps(effective, indent=2, default=str) + "\n")

    def _held_out_batches(self) -> list:
        """Fixed blocks of the held-out sequences: the same ones at every evaluation."""
        cfg, dcfg, amp = self.cfg, self.drafter.cfg, self.amp
        batches = []
        g = torch.Generator().manual_seed(cfg.seed + 999)
        for c in range(0, len(self.held), cfg.batch):
            part = self.held[c : c + cfg.batch]
            got = [self.cache.get(s.ids) for s in part]
            feats = [f.to(self.device, amp or torch.float32) for f, _ in got]
            anchors = min(cfg.anchors_per_seq, 64)
            batches.append(
                build_batch(
                    part, feats, anchors, dcfg.block_size, dcfg.mask_token_id, g, self.device, preds=[p for _, p in got]
                )
            )
        return batches

    # ---------------------------------------------------------------------------- the run

    def _log(self, rec: dict) -> None:
        with (self.out / LOG).open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def step(self) -> dict:
        """Train one step (the next batch of :func:`~.batching.batch_indices`) and append its
        record to the log.

        Returns:
            the record: ``step`` (steps done), ``loss``, ``lr``, ``grad_norm``, ``tau_est``,
            ``acc`` per draft position, ``tokens``, ``supervised``, ``outside_vocab``,
            ``blocks``, and the seconds ``step_s``, ``target_s`` (reading features) and
            ``elapsed_s`` (since training began).
        """
        cfg, dcfg, n = self.cfg, self.drafter.cfg, self.steps_done
        t0 = time.perf_counter()
        if self.t_run is None:
            self.t_run = t0
        if self.max_s is not None:  # time-boxed: the schedule advances with the clock too
            at = max(n, int(cfg.steps * (t0 - self.t_run) / self.max_s))
            for g in self.opt.param_groups:
                g["lr"] = cfg.lr * self.schedule(min(at, cfg.steps - 1))
        idx = batch_indices(n, cfg.batch, len(self.seqs), cfg.seed)
        got = self.store.get(idx)
        t1 = time.perf_counter()
        seqs, feats, preds = [self.seqs[i] for i in idx], [f for f, _ in got], [p for _, p in got]
        gen = step_generator(cfg.seed, n)
        batch = build_batch(
            seqs, feats, cfg.anchors_per_seq, dcfg.block_size, dcfg.mask_token_id, gen, self.device, preds=preds
        )
        vocab = self.draft_ids
        if self.seen is not None:
            vocab = sampled_vocab(self.seen, cfg.head_negatives, step_generator(cfg.seed + 1, n)).to(self.device)
        loss, st = compute_loss(
            self.drafter,
            self.embed_w,
            self.head_w,
            batch,
            self.weights,
            self.amp,
            cfg.ce_chunk,
            vocab,
            cfg.reg_weight,
            drop_outside=self.draft_ids is not None,
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        clip = cfg.grad_clip > 0
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip) if clip else 0.0)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.steps_done += 1
        t2 = time.perf_counter()
        rec = {
            "step": self.steps_done,
            "loss": round(st.loss, 5),
            "lr": lr,
            "grad_norm": round(gnorm, 4),
            "tau_est": round(st.tau_est, 4),
            "acc": [round(a, 4) for a in st.acc],
            "tokens": batch.tokens,
            "supervised": st.supervised,
            "outside_vocab": st.outside_vocab,
            "blocks": int(batch.anchors.numel()),
            "step_s": round(t2 - t0, 4),
            "target_s": round(t1 - t0, 4),
            "elapsed_s": round(time.perf_counter() - self.t_run, 2),
        }
        self._log(rec)
        return rec

    def evaluate(self) -> dict | None:
        """Loss, accuracy per draft position and tau_est over the fixed held-out blocks (no grad),
        each averaged over the batches weighted by their supervised slots; appended to the log as
        ``{"step", "eval": ...}``.

        Returns:
            ``{"loss", "acc", "tau_est", "supervised"}``, or None when nothing is held out.
        """
        if not self.eval_batches:
            return None
        total, acc, tau, tau_w, loss = 0, None, 0.0, 0, 0.0
        vocab = self.draft_ids
        with torch.no_grad():
            for b in self.eval_batches:
                _, st = compute_loss(
                    self.drafter,
                    self.embed_w,
                    self.head_w,
                    b,
                    self.weights,
                    self.amp,
                    self.cfg.ce_chunk,
                    vocab,
                    drop_outside=vocab is not None,
                )
                n = st.supervised
                total += n
                loss += st.loss * n
                acc = [a * n for a in st.acc] if acc is None else [x + a * n for x, a in zip(acc, st.acc)]
                if st.tau_est == st.tau_est:  # NaN: no fully supervised block in this batch
                    tau += st.tau_est * n
                    tau_w += n
        total = max(total, 1)
        ev = {
            "loss": round(loss / total, 5),
            "acc": [round(a / total, 4) for a in acc or []],
            "tau_est": round(tau / tau_w, 4) if tau_w else float("nan"),
            "supervised": total,
        }
        self._log({"step": self.steps_done, "eval": ev})
        return ev

    def save(self) -> Path:
        """Checkpoint the run at :attr:`steps_done` (:func:`~.run_dir.save_checkpoint`) and
        redraw ``loss.png``. Returns the checkpoint's path."""
        path = save_checkpoint(self.out, self.steps_done, self.drafter, self.opt, self.sched, self.cfg)
        plot_loss(self.out)
        self.last_saved = self.steps_done
        return path

    def export(self) -> Path:
        """Write the drafter to ``out_dir/drafter`` (z-lab format, ``cfg.export_dtype``) and
        return that path."""
        return save_drafter(
            self.drafter.eval(),
            self.out / "drafter",
            parse_dtype(self.cfg.export_dtype),
            replace=True,
            lm_head=self.target.model.lm_head.weight,
        )

    def run(self) -> Path:
        """Train until ``cfg.steps`` (or ``cfg.stop_after``, or the time box) are done,
        evaluating every ``eval_every`` and checkpointing every ``save_every`` steps and at the
        end (also on Ctrl-C, which is re-raised); then export.

        Returns:
            the path of the exported drafter.
        """
        cfg = self.cfg
        end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
        if self.steps_done < end:
            self._train_until(end)
        if self.last_saved != self.steps_done or self.start == end:  # (every checkpoint redraws the plot)
            plot_loss(self.out)
        return self.export()

    def _train_until(self, end: int) -> None:
        from tqdm import tqdm

        cfg = self.cfg
        bar = tqdm(
            total=end,
            initial=self.steps_done,
            desc="train",
            unit="step",
            disable=not cfg.progress,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        self.t_run = time.perf_counter()
        try:
            while self.steps_done < end:
                rec = self.step()
                bar.set_postfix(
                    loss=f"{rec['loss']:.3f}", tau=f"{rec['tau_est']:.2f}", lr=f"{rec['lr']:.1e}", refresh=False
                )
                bar.update(1)
                n = self.steps_done
                out_of_time = self.max_s is not None and time.perf_counter() - self.t_run >= self.max_s
                if n % cfg.eval_every == 0 or n == end or out_of_time:
                    self.evaluate()
                if n % cfg.save_every == 0 or n == end or out_of_time:
                    self.save()
                if out_of_time:
                    print(f"time box: stopping after {cfg.max_minutes:g} min at step {n}", file=sys.stderr)
                    break
        except KeyboardInterrupt:
            if self.steps_done > self.last_saved:
                self.save()
            raise
        finally:
            bar.close()


def train(
    target: LoadedTarget,
    samples: Sequence,
    out_dir: str | os.PathLike,
    cfg: TrainConfig,
    init_drafter_dir: str | os.PathLike | None = None,
    resume: bool = True,
) -> Path:
    """Train a DFlash drafter for ``target`` on ``samples`` and export it to ``out_dir/drafter``
    (``Trainer(...).run()``; a run that is already finished is only re-exported).

    Args, Raises: as :class:`Trainer`.

    Returns:
        the path of the exported drafter.
    """
    return Trainer(target, samples, out_dir, cfg, init_drafter_dir, resume).run()
