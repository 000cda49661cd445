"""Plain decoding through the screened LM head (``models/screened_head.py``) against the full
head, in the load benchmark's lanes: two plain engines in one process, one with the screen off
(``runner.screen = None``), their lanes interleaved step by step (``bench --concurrency``'s
lanes), so a noisy machine's slow periods fall on both alike.

    .venv/bin/python bench/screened_head_ab.py --dtype fp32 --concurrency 1 --runs 5
    .venv/bin/python bench/screened_head_ab.py --dtype bf16 --concurrency 16 --runs 3

Prints each run's tokens/s of both and their ratio (screened / full), then the median, and
whether the full head's outputs equal the screened one's (greedy, GSM8K prompts, all requests
arriving at t=0). For bf16 the screen is forced on at every row count, to measure where
``ScreenedHead.pays`` should draw its line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dflash_trt import EngineArgs  # noqa: E402
from dflash_trt.bench import load  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    c = a.concurrency
    cfg = load.LoadConfig(
        dataset="gsm8k",
        num_prompts=a.num_prompts,
        max_new_tokens=a.max_new_tokens,
        concurrency=(c,),
        engine_args=EngineArgs(adaptive=True, dtype=a.dtype),
        modes=("ar",),
    )
    cfg.validate()
    kv_cap, _ = load.kv_capacity_for(cfg)
    run = load._LoadRun(cfg, kv_cap, None, lambda msg: print(msg, file=sys.stderr))
    screened = run.engine_for("ar")
    if screened.runner.screen is None:
        print("error: this target's head cannot be screened here (see ScreenedHead.supports)", file=sys.stderr)
        return 2
    screened.runner.screen.pays = lambda rows: True
    del run.engines["ar"]
    full = run.engine_for("ar")
    full.runner.screen = None
    run.engines.update(ar=screened, full=full)
    run.cfg.modes = ("ar", "full")
    ratios = []
    for r in range(a.runs):
        rows = {x["mode"]: x for x in run._run_lanes(c)[0]}
        s, f = rows["ar"]["output_tokens_per_s"], rows["full"]["output_tokens_per_s"]
        ratios.append(s / f)
        same = not rows["full"]["divergences"]
        print(f"run {r + 1}/{a.runs}: screened {s:.1f} tok/s, full head {f:.1f}, {ratios[-1]:.3f}x; same: {same}")
    med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
    print(f"{a.dtype} C={c}: screened / full head median {med:.3f}x [{lo:.3f}, {hi:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
