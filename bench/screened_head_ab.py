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

from controller_ab import lane_arguments, lane_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    lane_arguments(ap, concurrency=1, runs=5, dtype="fp32")
    a = ap.parse_args(argv)
    c = a.concurrency
    run = lane_run(a, modes=("ar",))
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
