"""The directory of one training run: its checkpoints and its log.

Layout::

    log.jsonl          one JSON line per step: loss, lr, acc per slot, tau_est, timings; and
                       ``{"step", "eval": {...}}`` lines of the held-out evaluations
    loss.png           loss and tau_est curves (:mod:`.plots`)
    train_config.json  the effective TrainConfig
    ckpt-000500/       z-lab drafter (fp32 master weights) + train_state.pt (optimizer,
                       scheduler, step, RNG states); the newest one is resumed from
    drafter/           the final drafter, z-lab format (``export_dtype``)
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from ..checkpoints.zlab import load_drafter, save_drafter
from ..errors import DFlashError
from ..models.drafter import DFlashDrafter
from .config import TrainConfig

CKPT_RE = re.compile(r"^ckpt-(\d{6,})$")
LOG = "log.jsonl"
TRAIN_STATE = "train_state.pt"


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with ``train_state.pt``) as ``(step, path)``, oldest first."""
    found = []
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            m = CKPT_RE.match(p.name)
            if m and (p / TRAIN_STATE).is_file() and (p / "config.json").is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def open_run_dir(out_dir: str | os.PathLike, resume: bool) -> tuple[Path, list[tuple[int, Path]]]:
    """Create ``out_dir`` (or find the run in it) and clear what a killed run left half-written.

    Returns:
        the expanded path and its complete checkpoints (:func:`list_checkpoints`).

    Raises:
        DFlashError: ``out_dir`` holds checkpoints and ``resume`` is false.
    """
    out = Path(out_dir).expanduser()
    ckpts = list_checkpoints(out)
    if ckpts and not resume:
        raise DFlashError(f"{out} already holds checkpoints; resume, or choose another output directory")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.partial-*"):  # left by a killed run (atomic_dir cleans up otherwise)
        shutil.rmtree(stale, ignore_errors=True)
    return out, ckpts


def load_checkpoint(path: Path) -> tuple[DFlashDrafter, dict]:
    """The fp32 drafter of checkpoint ``path`` and its train state (``step``, ``optimizer``,
    ``scheduler``, ``rng``: ``{"torch", "python"}``, ``config``)."""
    return load_drafter(path, torch.float32), torch.load(path / TRAIN_STATE, map_location="cpu", weights_only=False)


def save_checkpoint(out_dir: Path, step: int, drafter, opt, sched, cfg: TrainConfig) -> Path:
    """Write ``out_dir/ckpt-<step>`` atomically: the drafter (its dtype, fp32 in training) and
    ``train_state.pt`` (optimizer and scheduler state, the torch and Python RNG states, the
    config); then delete all but the newest ``cfg.keep_checkpoints`` (0 keeps all).

    Returns:
        the checkpoint's path.
    """
    final = save_drafter(
        drafter,
        out_dir / f"ckpt-{step:06d}",
        replace=True,
        extra={
            TRAIN_STATE: lambda p: torch.save(
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


def rewrite_log(out_dir: Path, upto: int) -> None:
    """Keep only the log lines of steps <= ``upto`` (resume after a crash past a checkpoint);
    ``upto`` 0 deletes the log (a fresh run)."""
    log = out_dir / LOG
    if not upto:
        log.unlink(missing_ok=True)
        return
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
    log = Path(out_dir) / LOG
    if not log.is_file():
        return []
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r for r in recs if ("eval" in r) == evals]
