"""The loss curves of a training run, drawn from its log (:mod:`.run_dir`) with matplotlib."""

from __future__ import annotations

import os
from pathlib import Path

from .run_dir import read_log


def plot_loss(out_dir: str | os.PathLike) -> Path | None:
    """Plot ``log.jsonl`` to ``loss.png``: the training loss with an EMA (and the held-out loss),
    tau_est and slot-1 accuracy of the training batches, and held-out accuracy at draft
    positions 1-3 when the run evaluates on held-out sequences.

    Returns:
        the path of ``loss.png``, or None when the log has no step record yet.
    """
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
