"""``dflash-trt train``: train a DFlash drafter on self-distilled or target-labelled data (the
paper's recipe). Its settings are ``TrainConfig``'s fields; the flags shared with other
commands come from :mod:`.flags`."""

from __future__ import annotations

import os
import sys

from ..argspec import add_arguments, from_arguments
from ..errors import DFlashError
from ..training.config import TrainConfig
from . import flags


def register(sub) -> None:
    t = sub.add_parser("train", help="train a DFlash drafter on self-distilled data (paper recipe)")
    flags.add(t, "model")
    t.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="training data directories (distill: self-distilled answers; text-data: text the target labels), mixed",
    )
    flags.add(t, "out", out={"help": "run directory: log, loss.png, checkpoints, final drafter/"})
    flags.add(
        t,
        "num_layers",
        "batch",
        "seed",
        "max_seq_len",
        "device",
        "threads",
        num_layers={"default": 1},
        batch={"default": 4},
    )
    flags.add(
        t,
        "block_size",
        "dtype",
        "max_minutes",
        block_size={"default": 16, "help": "tokens per block of a new drafter"},
        dtype={"default": "fp32", "help": "target dtype for the feature pass: fp32 | bf16"},
        max_minutes={
            "help": "time box: the LR schedule follows the clock as well as the step, and the run stops "
            "(checkpoint + export) after this many minutes"
        },
    )
    add_arguments(t, TrainConfig)
    t.add_argument("--init-drafter", help="start from this z-lab drafter instead of a random one")
    t.add_argument("--no-resume", action="store_true", help="refuse to continue a run found in --out")
    t.set_defaults(run=run)


def run(args) -> None:
    from ..checkpoints.loader import load_target, parse_device, parse_dtype
    from ..training.run_dir import read_log
    from ..training.trainer import train

    cfg = from_arguments(TrainConfig, args)
    cfg.validate()
    for d in args.data:
        if not os.path.isdir(d):
            raise DFlashError(f"training data not found: {d}")
    flags.setup_threads(args.threads)
    samples = _samples(args.data)
    target = load_target(args.model, parse_dtype(args.dtype), parse_device(args.device))
    print(
        f"training a drafter for {target.path.name} on {len(samples)} samples from {', '.join(args.data)}",
        file=sys.stderr,
    )
    out = train(target, samples, args.out, cfg, init_drafter_dir=args.init_drafter, resume=not args.no_resume)
    recs = read_log(args.out)
    tail = recs[-min(len(recs), 20) :]
    if tail:
        loss = sum(r["loss"] for r in tail) / len(tail)
        taus = [r["tau_est"] for r in tail if r["tau_est"] == r["tau_est"]]  # NaN: no full block
        tau = sum(taus) / len(taus) if taus else float("nan")
        print(f"step {recs[-1]['step']}: loss {loss:.3f}, tau_est {tau:.2f} (mean of the last {len(tail)} steps)")
    evals = read_log(args.out, evals=True)
    if evals:
        e = evals[-1]["eval"]
        acc = " ".join(f"{a:.3f}" for a in e["acc"][:4])
        print(f"held-out: loss {e['loss']:.3f}, accuracy at draft positions 1-4 {acc}, tau_est {e['tau_est']:.2f}")
    print(f"wrote {out}")


def _samples(dirs: list[str]) -> list:
    """Every sample of the data directories (an incomplete one with a note: its shards so far)."""
    try:
        from ..training.dataset import load_dataset, read_data_manifest
    except ImportError as e:
        raise DFlashError(f"the training data reader is not available ({e})") from None
    samples = []
    for d in dirs:
        samples += load_dataset(d, allow_incomplete=True)
        m = read_data_manifest(d)
        if not m["complete"]:
            print(
                f"note: {d} is incomplete ({len(m['shards'])} of {m['num_shards']} shards): training on the "
                "shards written so far",
                file=sys.stderr,
            )
    return samples
