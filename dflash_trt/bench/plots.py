"""PNG figures for bench results: throughput of every mode and acceptance per draft position
(batch 1), and throughput against per-user speed under load (``--concurrency``)."""

from __future__ import annotations

from pathlib import Path


def plot_bench(result: dict, out: str | Path) -> Path:
    """Write a two-panel PNG for a :func:`dflash_trt.bench.batch1.run_bench` result.

    Left: output tokens/s of plain decoding, DFlash, DFlash + prompt lookup (when the result has
    it) and each peer. Right: P(draft position k accepted | position k reached) for
    k = 1..block_size-1, per DFlash mode. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    k = result["block_size"]
    # (label, tokens/s, colour, acceptance per position or None) per mode
    modes = [
        ("plain (ours)", result["ar_tokens_per_s"], "#888888", None),
        (f"DFlash K={k}", result["dflash_tokens_per_s"], "#1f77b4", result["acceptance_per_position"]),
    ]
    lk = result.get("prompt_lookup")
    if lk:
        modes.append((f"DFlash K={k}\n+ lookup", lk["tokens_per_s"], "#ff7f0e", lk["acceptance_per_position"]))
    modes += [(f"{n} (peer)", p["tokens_per_s"], "#bbbbbb", None) for n, p in result["peers"].items()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    bars = a.bar([m[0] for m in modes], [m[1] for m in modes], color=[m[2] for m in modes])
    a.bar_label(bars, fmt="%.1f")
    a.margins(y=0.12)
    a.set_ylabel("output tokens / s")
    a.set_title(
        f"{result['dataset']}, {result['num_prompts']} prompts, {result['dtype']}, {result['device']}", fontsize=9
    )
    a.tick_params(axis="x", labelrotation=20)
    drafting = [m for m in modes if m[3] is not None]
    width = 0.8 / len(drafting)
    for i, (label, _, colour, acc) in enumerate(drafting):
        at = [x + (i - (len(drafting) - 1) / 2) * width for x in range(1, len(acc) + 1)]
        b.bar(at, acc, width=width, color=colour, label=label.replace("\n", " "))
    b.set_ylim(0, 1)
    b.set_xticks(range(1, k))
    b.set_xlabel("draft position k")
    b.set_ylabel("P(accepted | reached)")
    title = f"tau {result['tau']:.2f} (tokens per verify step)"
    if lk:
        title = f"tau {result['tau']:.2f}, with prompt lookup {lk['tau']:.2f} (tokens per verify step)"
        b.legend(fontsize=8)
    b.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_load(result: dict, out: str | Path) -> Path:
    """Write a PNG for a :func:`dflash_trt.bench.load.run_load_bench` result: total output
    tokens/s (y) against per-user tokens/s (x), one line per mode, each point labelled with its
    concurrency. Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # label, colour, marker, label offset (points): ar labels above the points, dflash below
    styles = {
        "ar": ("plain decoding (K=1)", "#888888", "s", (4, 6)),
        "dflash": (
            f"DFlash (K={result['block_size']}{', adaptive' if result['adaptive'] else ''})",
            "#1f77b4",
            "o",
            (4, -13),
        ),
    }
    ctl_rows = [r for r in result["load"] if r.get("controller", {}).get("history")]
    if ctl_rows:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.1, 1]})
        _plot_controller(ax2, ctl_rows)
    else:
        fig, ax = plt.subplots(figsize=(7, 5))
    for mode in dict.fromkeys(r["mode"] for r in result["load"]):
        rows = sorted((r for r in result["load"] if r["mode"] == mode), key=lambda r: r["concurrency"])
        xs = [r["per_user_tokens_per_s"] for r in rows]
        ys = [r["output_tokens_per_s"] for r in rows]
        label, color, marker, offset = styles.get(mode, (mode, None, "o", (4, 6)))
        ax.plot(xs, ys, marker=marker, color=color, label=label)
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(
                f"C={r['concurrency']}", (x, y), textcoords="offset points", xytext=offset, fontsize=8, color=color
            )
    ax.set_xlabel("per-user output tokens / s (median over requests)")
    ax.set_ylabel("total output tokens / s")
    pts = [(r["per_user_tokens_per_s"] or 0.0, r["output_tokens_per_s"] or 0.0) for r in result["load"]]
    ax.set_xlim(0, max((x for x, _ in pts), default=1.0) * 1.18 or 1.0)
    ax.set_ylim(0, max((y for _, y in pts), default=1.0) * 1.12 or 1.0)
    rate = "all at t=0" if result["request_rate"] is None else f"{result['request_rate']:g} req/s"
    ax.set_title(
        f"{result['dataset']}, {result['max_new_tokens']} new tokens, arrivals {rate}, "
        f"{result['dtype']}, {result['device']}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_controller(ax, rows: list[dict]) -> None:
    """The adaptive controller's choice per iteration (draft tokens; exploration marked), one
    line per concurrency, with its guard overrides and final acceptance estimate in the legend."""
    for r in rows:
        c = r["controller"]
        hist = c["history"]
        its = [h[0] for h in hist]
        ax.step(
            its,
            [h[2] for h in hist],
            where="post",
            lw=1.0,
            label=f"C={r['concurrency']}: q1 {c['acceptance'][0]:.2f}, guard overrides {c['guard_overrides']}",
        )
        extra = [(h[0], h[2]) for h in hist if h[3] in ("explore", "probe", "probe-batch")]
        if extra:
            ax.plot(*zip(*extra), "x", ms=3, color="black", alpha=0.5)
    ax.set_xlabel("engine iteration (x: exploration)")
    ax.set_ylabel("draft tokens chosen (0 = plain decoding)")
    ax.set_title("adaptive draft length: what the controller chose", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
