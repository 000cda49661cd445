"""The drafter kernels against their torch references and against SDPA, on the drafter's shapes.

    .venv/bin/python bench/kernels.py --json out/kernels.json --plot out/kernels.png   # CUDA (triton)
    .venv/bin/python bench/kernels.py --device cpu --batch 1,2 --context 64 --block-sizes 4 --repeats 2
    .venv/bin/python bench/kernels.py --device cpu --interpret --batch 1 --context 32 --block-sizes 4 \
        --context-tokens 16 --repeats 1                # the Triton kernels through Triton's interpreter

Contenders, each called directly (not through the ``dflash::*`` custom ops, so that every
implementation is chosen explicitly), each checked against the reference in the same run (max
abs difference, so the figures are of equal outputs):

- ``block_attention`` (one drafter layer's KV-injected block attention over the paged pools):
  ``reference`` = :func:`~dflash_trt.kernels.block_attention.block_attention_reference`;
  ``sdpa`` = the torch-module way without kernels: each sequence's context K/V gathered from
  the pools by slot (``index_select``), the block's own K/V concatenated, one masked SDPA with
  GQA (``dflash_trt.models.layers._sdpa``: the runtime's backend choice; the mask is built
  outside the timing, as the runtime builds it once per iteration); ``kernel`` =
  :func:`~dflash_trt.kernels.block_attention.block_attention_triton`.
- ``context_kv`` (the per-iteration ingest of ``T`` context tokens into every layer's pool,
  after the stacked K/V GEMM): ``reference`` = ``context_kv_reference`` (the drafter modules'
  own arithmetic: k_norm, RoPE, pool writes), ``kernel`` = ``context_kv_triton``.
- ``accept`` (greedy acceptance of ``B - 1`` drafts per sequence): ``reference``, ``kernel``.

Defaults: the shipped drafter's geometry (``dflash_trt/drafters/smollm2-135m-instruct-dflash``:
9 query heads, 3 KV heads, head_dim 64, 2 layers, its eps, RoPE theta and sliding window) in
bf16 on CUDA, fp32 on the CPU; block sizes 4, 8, 16; 1, 8, 32 sequences with 256 and 2,048
context tokens each (``kv_len`` = context + block; all sequences alike); sliding window off and
the drafter's (``--windows``); 32 tokens per KV block; 16, 256 and 2,048 context tokens ingested.

Timing: on CUDA each call is timed with CUDA events from an idle GPU (synchronised before the
start event; the L2 cache flushed before each call unless ``--no-flush``), so a figure is one
eager call's latency, launch overheads included (the runtime replays the drafter's forward
from CUDA graphs under ``--cuda-graphs``, ``runtime/drafter_graphs.py``, where launches cost
less); median over ``--repeats`` (default 50) after ``--warmup`` calls, in microseconds. On
the CPU ``time.perf_counter`` around each call, median over ``--repeats`` (default 5). Without
CUDA the Triton kernels are skipped unless ``--interpret`` (``TRITON_INTERPRET=1``: the kernel
code run with numpy, very slow: only tiny sizes make sense, and its figures say nothing about
GPU speed; ``TRITON_INTERPRET=1`` in the environment counts as ``--interpret``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: the shipped drafter whose geometry the defaults take
SHIPPED_CONFIG = REPO / "dflash_trt" / "drafters" / "smollm2-135m-instruct-dflash" / "config.json"
L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any GPU's L2 (H200: 50 MB)


def int_list(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (argparse type; non-negative integers)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return out


# ---------------------------------------------------------------- inputs
def paged_pools(seqs: int, kv_len: int, tpb: int, hkv: int, d: int, dtype, device, gen):
    """Random K/V pools holding ``kv_len`` keys for each of ``seqs`` sequences in shuffled KV blocks.

    Returns:
        ``k_pool``, ``v_pool``: ``[P, Hkv, D]`` in ``dtype`` on ``device`` (P = (blocks + 3) * tpb);
        ``tables``: int32 ``[S, blocks]`` block tables; ``slots``: int64 ``[S, kv_len]`` the pool
        slot of every key position.
    """
    import torch

    need = math.ceil(kv_len / tpb)
    num_blocks = seqs * need + 3
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * need].view(seqs, need)
    pos = torch.arange(kv_len)
    slots = tables[:, pos // tpb] * tpb + pos % tpb
    k = torch.randn(num_blocks * tpb, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(num_blocks * tpb, hkv, d, generator=gen).to(device, dtype)
    return k, v, tables.to(device, torch.int32), slots.to(device)


def window_mask(seqs: int, block: int, kv_len: int, window: int, device):
    """bool ``[S, 1, B, kv_len]``: query ``j`` (position ``kv_len - B + j``) sees key ``p`` iff
    ``window == 0`` or ``query_pos - p < window`` (every key is below ``kv_len``)."""
    import torch

    from dflash_trt.models.drafter import sliding_visible

    qpos = kv_len - block + torch.arange(block).view(block, 1)
    vis = torch.ones(block, kv_len, dtype=torch.bool)
    if window:
        vis = sliding_visible(qpos, torch.arange(kv_len).view(1, -1), window)
    return vis.view(1, 1, block, kv_len).expand(seqs, 1, block, kv_len).contiguous().to(device)


# ---------------------------------------------------------------- the torch-module contenders
def sdpa_block_attention(q, k_pool, v_pool, ctx_slots, k_block, v_block, mask, block: int):
    """Block attention the way the drafter's torch modules do it, without kernels.

    Args:
        q: ``[S * B, Hq, D]`` queries (RoPE applied), sequence after sequence.
        k_pool, v_pool: ``[P, Hkv, D]`` pools holding every sequence's context K/V.
        ctx_slots: int64 ``[S, C]`` pool slot of each context position of each sequence.
        k_block, v_block: ``[S * B, Hkv, D]`` the blocks' own keys and values.
        mask: bool ``[S, 1, B, C + B]``, true where a query may attend.
        block: B.

    Returns:
        ``[S * B, Hq * D]`` in ``q``'s dtype (same layout as ``block_attention_reference``).
    """
    import torch

    from dflash_trt.models.layers import _sdpa

    s, c = ctx_slots.shape
    m, hq, d = q.shape
    hkv = k_pool.shape[1]
    flat = ctx_slots.reshape(-1)
    keys = torch.cat([torch.index_select(k_pool, 0, flat).view(s, c, hkv, d), k_block.view(s, block, hkv, d)], 1)
    values = torch.cat([torch.index_select(v_pool, 0, flat).view(s, c, hkv, d), v_block.view(s, block, hkv, d)], 1)
    qs = q.view(s, block, hq, d).transpose(1, 2)  # [S, Hq, B, D]
    out = _sdpa(qs, keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2), mask)
    return out.transpose(1, 2).reshape(m, hq * d)


# ---------------------------------------------------------------- timing
class Timer:
    """Median latency of one call in microseconds: CUDA events on CUDA (synchronised before each
    call, optionally with the L2 cache flushed), ``time.perf_counter`` on the CPU."""

    def __init__(self, device, warmup: int, repeats: int, flush: bool):
        import torch

        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.cuda = device.type == "cuda"
        self.scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if self.cuda and flush else None

    def __call__(self, fn: Callable[[], object]) -> float:
        """``fn``'s median latency over the repeats, microseconds (after the warm-up calls)."""
        import torch

        for _ in range(self.warmup):
            fn()
        times = []
        if not self.cuda:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        events = []
        for _ in range(self.repeats):
            if self.scratch is not None:
                self.scratch.zero_()
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def max_diff(a, b) -> float:
    """max |a - b| over all elements, in fp32."""
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


# ---------------------------------------------------------------- the benchmarks
def bench_block_attention(args, geo: dict, timer: Timer, dtype, device, kernels: bool) -> list[dict]:
    """Every (block, sequences, context, window) case: latency (us) and max |x - reference| per contender."""
    import torch

    from dflash_trt.kernels.block_attention import block_attention_reference, block_attention_triton

    hq, hkv, d, tpb = geo["heads"], geo["kv_heads"], geo["head_dim"], args.tokens_per_block
    scale = d**-0.5
    rows = []
    for block in args.block_sizes:
        for seqs in args.batch:
            for ctx in args.context:
                for window in args.windows:
                    gen = torch.Generator().manual_seed(1000 * block + 10 * seqs + ctx)
                    kv_len = ctx + block
                    k_pool, v_pool, tables, slots = paged_pools(seqs, kv_len, tpb, hkv, d, dtype, device, gen)
                    q = torch.randn(seqs * block, hq, d, generator=gen).to(device, dtype)
                    lens = torch.full((seqs,), kv_len, dtype=torch.int32, device=device)
                    ctx_slots = slots[:, :ctx].contiguous()
                    blk = slots[:, ctx:].reshape(-1)
                    k_block, v_block = k_pool[blk], v_pool[blk]  # [S * B, Hkv, D], also in the pools
                    mask = window_mask(seqs, block, kv_len, window, device)
                    inputs = (q, k_pool, v_pool, tables, lens, block, tpb, window, scale)
                    calls = {
                        "reference": partial(block_attention_reference, *inputs),
                        "sdpa": partial(
                            sdpa_block_attention, q, k_pool, v_pool, ctx_slots, k_block, v_block, mask, block
                        ),
                    }
                    if kernels:
                        calls["kernel"] = partial(block_attention_triton, *inputs)
                    ref = calls["reference"]()
                    row = {
                        "case": f"B{block} S{seqs} ctx{ctx}" + (f" w{window}" if window else ""),
                        "block": block,
                        "seqs": seqs,
                        "context": ctx,
                        "kv_len": kv_len,
                        "window": window,
                        "us": {},
                        "max_abs_diff": {},
                    }
                    for name, fn in calls.items():
                        if name != "reference":
                            row["max_abs_diff"][name] = max_diff(fn(), ref)
                        row["us"][name] = timer(fn)
                    rows.append(row)
                    print(f"  block_attention {row['case']}: done", file=sys.stderr, flush=True)
    return rows


def bench_context_kv(args, geo: dict, timer: Timer, dtype, device, kernels: bool) -> list[dict]:
    """Every ingest size ``T``: latency (us) of writing ``T`` tokens' K/V into all layers' pools,
    and the max |pool - reference pool| over the written slots per contender."""
    import torch

    from dflash_trt.kernels.context_kv import context_kv_reference, context_kv_triton
    from dflash_trt.models.layers import rope_inv_freq

    n_layers, hkv, d, eps = geo["layers"], geo["kv_heads"], geo["head_dim"], geo["eps"]
    max_pos = geo["max_positions"]
    inv_freq = rope_inv_freq(d, geo["rope_theta"], None).to(device)
    rows = []
    for t in args.context_tokens:
        gen = torch.Generator().manual_seed(t)
        pool_slots = 2 * t + 1
        kv = torch.randn(t, n_layers * 2 * hkv * d, generator=gen).to(device, dtype)
        knorm = (1 + 0.1 * torch.randn(n_layers, d, generator=gen)).to(device, dtype)
        start = int(torch.randint(0, max(1, max_pos - t), (1,), generator=gen))
        positions = (start + torch.arange(t)).to(device)  # an ingest is a run of positions
        slots = torch.randperm(pool_slots, generator=gen)[:t].to(device)
        pools = {
            name: (
                torch.zeros(n_layers, pool_slots, hkv, d, dtype=dtype, device=device),
                torch.zeros(n_layers, pool_slots, hkv, d, dtype=dtype, device=device),
            )
            for name in ("reference", "kernel")
        }
        inputs = (kv, knorm, eps, inv_freq, positions, slots)
        calls = {"reference": partial(context_kv_reference, *inputs, *pools["reference"])}
        if kernels:
            calls["kernel"] = partial(context_kv_triton, *inputs, *pools["kernel"])
        row = {"case": f"T{t} L{n_layers}", "tokens": t, "layers": n_layers, "us": {}, "max_abs_diff": {}}
        for fn in calls.values():
            fn()
        ref_k, ref_v = pools["reference"]
        for name, fn in calls.items():
            if name != "reference":
                k, v = pools[name]
                row["max_abs_diff"][name] = max(
                    max_diff(k[:, slots], ref_k[:, slots]), max_diff(v[:, slots], ref_v[:, slots])
                )
            row["us"][name] = timer(fn)
        rows.append(row)
        print(f"  context_kv {row['case']}: done", file=sys.stderr, flush=True)
    return rows


def bench_accept(args, timer: Timer, device, kernels: bool) -> list[dict]:
    """Every (block, sequences) case: acceptance of ``B - 1`` drafts per sequence; the
    difference is the largest |accepted - reference accepted| (0: equal)."""
    import torch

    from dflash_trt.kernels.acceptance import accept_reference, accept_triton

    rows = []
    for block in args.block_sizes:
        for seqs in args.batch:
            gen = torch.Generator().manual_seed(block * 100 + seqs)
            k = block - 1
            drafts = torch.randint(0, 5, (seqs, k), generator=gen)
            target = torch.randint(0, 5, (seqs, k + 1), generator=gen)
            agree = torch.randint(0, k + 1, (seqs,), generator=gen)
            take = torch.arange(k).view(1, -1) < agree.view(-1, 1)
            target[:, :k] = torch.where(take, drafts, target[:, :k])
            n = torch.full((seqs,), k, dtype=torch.int32)
            drafts, target, n = drafts.to(device), target.to(device), n.to(device)
            calls = {"reference": partial(accept_reference, drafts, target, n)}
            if kernels:
                calls["kernel"] = partial(accept_triton, drafts, target, n)
            ref = calls["reference"]()
            row = {"case": f"B{block} S{seqs}", "block": block, "seqs": seqs, "us": {}, "max_abs_diff": {}}
            for name, fn in calls.items():
                if name != "reference":
                    row["max_abs_diff"][name] = max_diff(fn(), ref)
                row["us"][name] = timer(fn)
            rows.append(row)
    return rows


# ---------------------------------------------------------------- output
def table(title: str, rows: list[dict], others: list[str]) -> str:
    """A Markdown table: latency of every contender (us), the kernel's speed-up over each other
    contender, the largest max |x - reference| among the non-reference contenders."""
    names = ["reference", *others, "kernel"]
    head = ["case", *(f"{n} us" for n in names), *(f"kernel vs {n}" for n in ["reference", *others]), "max |diff|"]
    lines = [f"{title}", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        us = r["us"]
        cells = [r["case"], *(f"{us[n]:.1f}" if n in us else "-" for n in names)]
        for n in ["reference", *others]:
            cells.append(f"{us[n] / us['kernel']:.2f}x" if "kernel" in us else "-")
        diffs = r["max_abs_diff"]
        cells.append(", ".join(f"{n} {v:.1e}" for n, v in diffs.items()) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str, result: dict) -> None:
    """Grouped bars (log-scale microseconds) per case, one panel per kernel, written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash_trt.atomic import atomic_write

    panels = [(k, result[k]) for k in ("block_attention", "context_kv", "accept") if result.get(k)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.45 * len(panels[0][1]) + 3), 3.6 * len(panels)))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (name, rows) in zip(axes, panels):
        contenders = list(dict.fromkeys(c for r in rows for c in r["us"]))
        width = 0.8 / len(contenders)
        for i, c in enumerate(contenders):
            xs = [j + (i - (len(contenders) - 1) / 2) * width for j, r in enumerate(rows) if c in r["us"]]
            ax.bar(xs, [r["us"][c] for r in rows if c in r["us"]], width, label=c)
        ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=60, ha="right", fontsize=7)
        heights = [us for r in rows for us in r["us"].values()]
        if max(heights) > 20 * min(heights):
            ax.set_yscale("log")
        ax.set_ylabel("us per call")
        ax.set_title(f"{name} ({result['device']}, {result['dtype']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    ap.add_argument("--interpret", action="store_true", help="CPU: run the Triton kernels through Triton's interpreter")
    ap.add_argument("--block-sizes", type=int_list, default=[4, 8, 16])
    ap.add_argument("--batch", type=int_list, default=[1, 8, 32], help="sequences per call")
    ap.add_argument("--context", type=int_list, default=[256, 2048], help="context tokens per sequence")
    ap.add_argument(
        "--windows", type=int_list, default=None, help="sliding windows (0: off); default 0 and the drafter's"
    )
    ap.add_argument("--tokens-per-block", type=int, default=32, help="KV block size (tokens)")
    ap.add_argument("--context-tokens", type=int_list, default=[16, 256, 2048], help="context_kv: tokens ingested")
    ap.add_argument("--layers", type=int, default=None, help="context_kv: drafter layers (default: the drafter's)")
    ap.add_argument("--drafter-config", default=str(SHIPPED_CONFIG), help="config.json giving the geometry")
    ap.add_argument("--kernels", default="block_attention,context_kv,accept", help="which benchmarks to run")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per contender (default 50 CUDA, 5 CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10 CUDA, 1 CPU)")
    ap.add_argument("--no-flush", action="store_true", help="CUDA: keep the L2 cache warm between calls")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch intra-op threads")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--plot", default=None, help="PNG with bars per case (matplotlib)")
    return ap.parse_args(argv)


def _device(args, torch):
    """The device the kernels run on (checked)."""
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise SystemExit(f"bench/kernels.py: --device must be cpu, cuda or cuda:N, got {args.device!r}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.interpret else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py: --device cuda but torch sees no CUDA device")
    if device.type == "cuda":
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"bench/kernels.py: no {device} (torch sees {torch.cuda.device_count()} CUDA devices)")
        torch.cuda.set_device(device.index or 0)  # events and Triton launches go to the current device
    return device


def _geometry(args) -> dict:
    """The drafter's attention geometry from its config, and the cases' settings checked
    (``args.windows`` defaults to no window and the drafter's own)."""
    try:
        cfg = json.loads(Path(args.drafter_config).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench/kernels.py: cannot read the drafter config {args.drafter_config}: {e}") from None
    geo = {
        "hidden": cfg["hidden_size"],
        "heads": cfg["num_attention_heads"],
        "kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        "layers": args.layers or cfg["num_hidden_layers"],
        "eps": cfg["rms_norm_eps"],
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "max_positions": cfg.get("max_position_embeddings", 8192),
        "sliding_window": cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
    }
    if geo["heads"] % geo["kv_heads"]:
        raise SystemExit(f"bench/kernels.py: {geo['heads']} query heads are not a multiple of {geo['kv_heads']}")
    if args.windows is None:
        args.windows = [0] + ([geo["sliding_window"]] if geo["sliding_window"] else [])
    if min(args.block_sizes) < 2 or args.tokens_per_block < 1:
        raise SystemExit("bench/kernels.py: block sizes must be >= 2 and --tokens-per-block >= 1")
    if any(0 < w < b for w in args.windows for b in args.block_sizes):
        raise SystemExit("bench/kernels.py: a sliding window must be 0 or at least the block size")
    if max(args.context_tokens) >= geo["max_positions"]:
        raise SystemExit(f"bench/kernels.py: --context-tokens must stay below {geo['max_positions']} positions")
    return geo


def _notes(args, ops, cuda: bool) -> tuple[list[str], bool]:
    """What the reader should know about the run, and whether the Triton kernels run."""
    notes = []
    kernels = ops.HAVE_TRITON and (cuda or args.interpret)
    if not ops.HAVE_TRITON:
        notes.append("triton is not installed: the Triton kernels are skipped (pip install -e .[kernels])")
    elif not kernels:
        notes.append("no CUDA: the Triton kernels are skipped (--interpret runs them through Triton's interpreter)")
    elif args.interpret:
        notes.append("Triton kernels run through Triton's interpreter (numpy): their times say nothing about GPU speed")
    if cuda:
        notes.append(
            "CUDA events per call from an idle GPU" + ("" if args.no_flush else ", L2 flushed before each call")
        )
    return notes, kernels


def _report(args, result: dict, geo: dict) -> None:
    """Print the tables; write the JSON and the plot when asked for."""
    print(
        f"{result['device']}; torch {result['torch']}, triton {result['triton']}; {result['dtype']}; "
        f"{geo['heads']}:{geo['kv_heads']} heads x {geo['head_dim']}, {args.tokens_per_block} tokens per KV block; "
        f"median us per call of {result['repeats']} after {result['warmup']} warm-up"
    )
    for note in result["notes"]:
        print(f"note: {note}")
    others = {"block_attention": ["sdpa"], "context_kv": [], "accept": []}
    for key in ("block_attention", "context_kv", "accept"):
        if key in result:
            print()
            print(table(key, result[key], others[key]))
    if args.json_out:
        from dflash_trt.atomic import write_json

        write_json(args.json_out, result)
        print(f"wrote {args.json_out}")
    if args.plot:
        plot(args.plot, result)
        print(f"wrote {args.plot}")


def main(argv=None) -> None:
    args = parse_args(argv)
    args.interpret = args.interpret or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # as if --interpret
    if args.interpret:
        if args.device not in (None, "cpu"):
            raise SystemExit("bench/kernels.py: --interpret (or TRITON_INTERPRET=1) runs the kernels on the CPU only")
        # before triton is first imported (it picks interpreter or compiler when a kernel is defined)
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from dflash_trt.kernels import ops

    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args, torch)
    cuda = device.type == "cuda"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtype = dtypes[args.dtype or ("bf16" if cuda else "fp32")]
    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = set(wanted) - {"block_attention", "context_kv", "accept"}
    if unknown or not wanted:
        raise SystemExit(f"bench/kernels.py: --kernels takes block_attention,context_kv,accept; got {args.kernels!r}")
    geo = _geometry(args)
    repeats = args.repeats if args.repeats is not None else (50 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    if repeats < 1 or warmup < 0:
        raise SystemExit("bench/kernels.py: --repeats must be >= 1 and --warmup >= 0")
    notes, kernels = _notes(args, ops, cuda)
    if cuda:
        name = torch.cuda.get_device_name(device)
    else:
        import platform

        name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    timer = Timer(device, warmup, repeats, flush=not args.no_flush)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "triton_interpret": bool(args.interpret),
        "cuda": torch.version.cuda,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
        "warmup": warmup,
        "flush_l2": cuda and not args.no_flush,
        "statistic": "median microseconds per call",
        "geometry": {**geo, "tokens_per_block": args.tokens_per_block, "drafter_config": args.drafter_config},
        "notes": notes,
    }
    with torch.inference_mode():
        if "block_attention" in wanted:
            result["block_attention"] = bench_block_attention(args, geo, timer, dtype, device, kernels)
        if "context_kv" in wanted:
            result["context_kv"] = bench_context_kv(args, geo, timer, dtype, device, kernels)
        if "accept" in wanted:
            result["accept"] = bench_accept(args, timer, device, kernels)
    _report(args, result, geo)


if __name__ == "__main__":
    main()
