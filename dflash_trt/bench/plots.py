"""PNG figures for a bench result: throughput of every mode and acceptance per draft position."""

from __future__ import annotations

from pathlib import Path


def plot_bench(result: dict, out: str | Path) -> Path:
    """Write a two-panel PNG for a :func:`dflash_trt.bench.runner.run_bench` result.

    Left: output tokens/s of plain decoding, DFlash and each peer. Right: P(draft position k
    accepted | position k reached) for k = 1..block_size-1. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = ["plain (ours)", f"DFlash K={result['block_size']}"] + [f"{n} (peer)" for n in result["peers"]]
    tps = [result["ar_tokens_per_s"], result["dflash_tokens_per_s"]] + [p["tokens_per_s"] for p in result["peers"].values()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    bars = a.bar(names, tps, color=["#888888", "#1f77b4"] + ["#bbbbbb"] * len(result["peers"]))
    a.bar_label(bars, fmt="%.1f")
    a.margins(y=0.12)
    a.set_ylabel("output tokens / s")
    a.set_title(f"{result['dataset']}, {result['num_prompts']} prompts, {result['dtype']}, {result['device']}", fontsize=9)
    a.tick_params(axis="x", labelrotation=15)
    acc = result["acceptance_per_position"]
    b.bar(range(1, len(acc) + 1), acc, color="#1f77b4")
    b.set_ylim(0, 1)
    b.set_xlabel("draft position k")
    b.set_ylabel("P(accepted | reached)")
    b.set_title(f"tau {result['tau']:.2f} (tokens per verify step)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
