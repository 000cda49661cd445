"""Time the batch-invariant linear (``dflash_cpu::bi_linear_packed`` over a weight packed once, as
:class:`~dflash_trt.models.batch_invariant.BatchInvariantLinear` runs it) against torch's
``F.linear`` (MKL / oneDNN) on the default target's GEMM shapes, in one process, the two taking
turns shape by shape (best of ``--repeats``).

    .venv/bin/python bench/bi_linear.py --threads 1 --dtype fp32

Prints one line per (weight shape, rows): milliseconds of each, their ratio and the kernel's
GFLOP/s. The shapes are SmolLM2-135M's: fused QKV [960, 576], gate/up [3072, 576], down
[576, 1536], LM head [49152, 576]; ``--rows`` the row counts (decode steps, verify blocks,
prompt chunks).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dflash_trt.kernels import cpu_ops

SHAPES = ((960, 576), (3072, 576), (576, 1536), (49152, 576))


def best_of(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rows", default="1,4,8,32,128")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_ops.load()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"{'weight':>12} {'rows':>5} {'bi_linear ms':>13} {'F.linear ms':>12} {'ratio':>6} {'GFLOP/s':>8}")
    for n, k in SHAPES:
        w = torch.randn(n, k).to(dtype)
        wp = torch.ops.dflash_cpu.bi_pack(w)
        repeats = max(3, args.repeats // 5) if n > 10000 else args.repeats
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).to(dtype)
            a = best_of(lambda x=x, wp=wp, n=n: torch.ops.dflash_cpu.bi_linear_packed(x, wp, n, None), repeats)
            b = best_of(lambda x=x, w=w: F.linear(x, w), repeats)
            gflops = 2 * m * n * k / a / 1e9
            print(f"{f'{n}x{k}':>12} {m:>5} {a * 1e3:>13.3f} {b * 1e3:>12.3f} {a / b:>6.2f} {gflops:>8.1f}")


if __name__ == "__main__":
    main()
