"""Expert-activation economics of an MoE target: one real-shaped MoE layer timed on the CPU at one
token and at verify blocks of K tokens, and DFlash's predicted speedup from tau and those costs.

    .venv/bin/python bench/moe_layer.py --preset gpt-oss-20b --formats bf16,int4 \\
        --blocks 1,4,8,16 --repeats 7 --json out/moe-layer.json --png out/moe-layer.png

Per format and (batch, block size K): experts touched (measured: the experts whose GEMMs ran, and
the uniform-routing formula E(1-(1-k/E)^(batch*K))), expert-weight bytes read (touched x bytes per
expert), median time per layer over ``--repeats`` draws, and the verify-cost ratio t(K)/t(1).
Random weights at the preset's shapes (:data:`dflash_trt.bench.moe_speedup.PRESETS`); routing
drawn uniformly at random (no router checkpoint is at hand) or from the stated ``sticky`` model.
Expert formats: see :data:`dflash_trt.bench.moe_layer.FORMATS` (``int4`` is the project's packed
int4 CPU linear, group 32, 5.0 bits/weight; not MXFP4). Then the speedup model of
:mod:`dflash_trt.bench.moe_speedup` (roofline on ``--gpu``, ``--num-gpus``), its verify-cost table,
predicted speedup against tau for each K>1, and a PNG of both. Bad input: one line, exit status 2.

One torch thread by default: on a CPU shared with other work, two OpenMP threads wait on each
other and a layer's time varies tenfold; ``--threads 0`` keeps torch's default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dflash_trt.bench.moe_layer import FORMATS, ROUTINGS, build_steps, run_layer_bench  # noqa: E402
from dflash_trt.bench.moe_speedup import (  # noqa: E402
    GPUS,
    PRESETS,
    describe_model,
    model_speedup,
    model_table,
    plot_moe,
)
from dflash_trt.errors import DFlashError  # noqa: E402


def _ints(s: str) -> list[int]:
    try:
        return [int(v) for v in s.split(",") if v]
    except ValueError:
        raise DFlashError(f"expected comma-separated integers, got {s!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="gpt-oss-20b", help="target shape")
    ap.add_argument("--formats", default="bf16,int4", help=f"expert formats among {', '.join(FORMATS)}")
    ap.add_argument("--blocks", default="1,4,8,16", help="tokens per verify block (1 = decode, always run)")
    ap.add_argument("--batch-sizes", default="1", help="sequences per step (each with a block of K tokens)")
    ap.add_argument("--repeats", type=int, default=7, help="timed routing draws per (batch, block) (median)")
    ap.add_argument("--routing", choices=ROUTINGS, default="uniform")
    ap.add_argument("--rho", type=float, default=0.5, help="sticky routing: probability a previous expert is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: stable on a shared machine; 0: torch's)"
    )
    ap.add_argument("--gpu", choices=tuple(GPUS), default="h100", help="GPU of the speedup model's plot")
    ap.add_argument("--num-gpus", type=int, default=1, help="GPUs the model splits the weights over (ideal)")
    ap.add_argument("--model-batch", type=int, default=32, help="the larger batch of the model's plot")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--png", default=None, help="write the figure here")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only draw --png from this earlier result")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def run(args: argparse.Namespace) -> dict:
    """Measure, then model; returns the JSON result."""
    from tqdm import tqdm

    if args.threads < 0:
        raise DFlashError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = PRESETS[args.preset]
    formats = [f for f in args.formats.split(",") if f]
    blocks, batches = _ints(args.blocks), _ints(args.batch_sizes)
    if args.num_gpus < 1 or args.model_batch < 1:
        raise DFlashError("--num-gpus and --model-batch must be >= 1")
    total = build_steps(target, formats, blocks, batches, max(args.repeats, 0))
    with tqdm(total=total, desc=f"{target.name} MoE layer", unit="step", disable=None) as bar:
        res = run_layer_bench(
            target, formats, blocks, batches, args.repeats, args.routing, args.rho, args.seed, progress=bar.update
        )
    res["command"] = " ".join(["bench/moe_layer.py", *args.argv])
    res["num_gpus"], res["model_batch"] = args.num_gpus, args.model_batch
    ks = [k for k in res["blocks"] if k > 1]
    model = {}
    for name, gpu in GPUS.items():
        model[name] = {
            "inputs": describe_model(target, gpu, args.num_gpus),
            "batch_1": model_table(target, gpu, tuple(res["blocks"]), 1, args.num_gpus),
            f"batch_{args.model_batch}": model_table(
                target, gpu, tuple(res["blocks"]), args.model_batch, args.num_gpus
            ),
            "speedup_batch_1": {
                str(k): {str(t): model_speedup(target, t, k, gpu, 1, args.num_gpus) for t in range(1, k + 1)}
                for k in ks
            },
        }
    res["speedup_model"] = model
    return res


def report(res: dict) -> None:
    """The tables on stdout."""
    print(f"# {res['preset']} MoE layer on {res['machine']['cpu']}, {res['machine']['torch_threads']} threads")
    print(f"# routing: {res['routing']}")
    m = res["machine"]
    print(f"# load average (1 min) before / after: {m['loadavg_1m_before']:.2f} / {m['loadavg_1m']:.2f}")
    hdr = f"{'format':>11} {'batch':>5} {'K':>3} {'touched':>8} {'formula':>8} {'MB read':>8} {'ms':>9} {'ratio':>6}"
    print(hdr)
    for fmt, f in res["formats"].items():
        for r in f["rows"]:
            print(
                f"{fmt:>11} {r['batch']:>5} {r['tokens_per_block']:>3} {r['experts_touched_mean']:>8.2f} "
                f"{r['experts_touched_formula']:>8.2f} {r['expert_bytes_read_mean'] / 1e6:>8.1f} "
                f"{r['time_ms_median']:>9.2f} {r['verify_cost_ratio']:>6.2f}"
            )
    for gpu, m in res["speedup_model"].items():
        rows = m["batch_1"]
        cells = ", ".join(f"K={r['tokens_per_block']}: {r['verify_cost_ratio']:.2f}" for r in rows)
        print(f"# model {gpu} batch 1 verify-cost ratio (whole step): {cells}; draft {rows[0]['draft_cost_ratio']:.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.replot:
            if not args.png:
                raise DFlashError("--replot needs --png")
            try:
                res = json.loads(Path(args.replot).read_text())
            except (OSError, ValueError) as e:
                raise DFlashError(f"cannot read {args.replot}: {e}") from None
            plot_moe(res, args.png, GPUS[args.gpu])
            return 0
        res = run(args)
        if args.png:
            plot_moe(res, args.png, GPUS[args.gpu])
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
