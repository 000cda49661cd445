"""Drafter-training throughput: supervised draft-token predictions per second, one trainer
setting after another on the same data, model and threads (run nothing else meanwhile).

    python bench/train_throughput.py --data data/smollm2-sharegpt-gpu --num-samples 48 \
        --baseline-src /path/to/an/older/checkout --json out/train-throughput.json

Each setting is a ``dflash-trt train`` run in its own process (``--steps`` steps, the first
``--warmup`` left out of the figures) on the first ``--num-samples`` samples of ``--data``.
Predictions per second = supervised slots / (step wall time - target feature time): the
target's forward is left out for every setting (an older trainer computes it on first use and
keeps it in memory; ours reads it from the feature cache, filled before the first step), so
the figure is the drafter's training cost alone. ``--baseline-src`` runs the first setting with
the ``dflash_trt`` package of another checkout (e.g. the commit before a change).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETTINGS = [
    ("baseline: B=16, full-vocabulary CE", ["--block-size", "16"], True),
    ("B=16, full vocabulary, feature cache", ["--block-size", "16"], False),
    ("B=16, draft vocabulary 16K", ["--block-size", "16", "--draft-vocab", "16384"], False),
    ("B=8, draft vocabulary 16K", ["--block-size", "8", "--draft-vocab", "16384"], False),
]


def subset(data: Path, n: int, out: Path) -> Path:
    """The first ``n`` samples of ``data`` as a complete dataset in ``out``."""
    from dflash_trt.atomic import write_json
    from dflash_trt.training.dataset import MANIFEST, SHARD_TEMPLATE, load_dataset
    from dflash_trt.training.dataset import read_data_manifest as read_manifest
    from dflash_trt.training.dataset import write_shard as _write_shard

    samples = load_dataset(data, allow_incomplete=True)[:n]
    m = read_manifest(data)
    rows = [(s.prompt_index, s.input_ids, s.loss_mask, s.sampled, s.stopped) for s in samples]
    out.mkdir(parents=True)
    entry = _write_shard(out / SHARD_TEMPLATE.format(0), 0, n, rows, None, None)
    write_json(
        out / MANIFEST,
        {
            **m,
            "num_prompts": n,
            "shard_size": n,
            "num_shards": 1,
            "complete": True,
            "totals": {k: entry[k] for k in m["totals"]},
            "shards": [entry],
        },
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-samples", type=int, default=48)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline-src", help="checkout whose dflash_trt runs the baseline setting")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="train-throughput-"))
    data = subset(Path(args.data), args.num_samples, work / "data")
    cache = work / "feature-cache"
    rows = []
    for name, extra, baseline in SETTINGS:
        if baseline and not args.baseline_src:
            continue
        out = work / f"run{len(rows)}"
        cmd = [
            sys.executable,
            "-m",
            "dflash_trt.cli",
            "train",
            "--data",
            str(data),
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--batch",
            str(args.batch),
            "--anchors",
            str(args.anchors),
            "--dtype",
            "bf16",
            "--threads",
            str(args.threads),
            "--save-every",
            str(10 * args.steps),
            *extra,
        ]
        if not baseline:
            cmd += ["--feature-cache", str(cache), "--device", "cpu"]
        env = dict(os.environ, PYTHONPATH=str(Path(args.baseline_src).resolve() if baseline else REPO))
        print(f"{name} ...", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, env=env, cwd=work, capture_output=True)
        recs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
        recs = [r for r in recs if "eval" not in r][args.warmup :]
        sup = sum(r["supervised"] for r in recs)
        secs = sum(r["step_s"] - r.get("target_s", 0.0) for r in recs)
        rows.append(
            {
                "setting": name,
                "predictions_per_s": sup / secs,
                "step_s": secs / len(recs),
                "supervised_per_step": sup / len(recs),
            }
        )
    base = rows[0]["predictions_per_s"]
    print(
        f"{args.num_samples} samples, {args.layers}-layer drafter, {args.batch} seqs x {args.anchors} anchors "
        f"per step, bf16 autocast, {args.threads} threads"
    )
    print(f"{'setting':<40} {'predictions/s':>14} {'s/step':>8} {'vs first':>9}")
    for r in rows:
        print(
            f"{r['setting']:<40} {r['predictions_per_s']:>14.0f} {r['step_s']:>8.2f} "
            f"{r['predictions_per_s'] / base:>8.2f}x"
        )
    if args.json_out:
        from dflash_trt.atomic import write_json

        write_json(args.json_out, {"settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
