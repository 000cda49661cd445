"""What the batch-invariant mode costs: plain decoding and DFlash with the mode on and off, side by
side in one run, at batch 1 and under in-flight batching at concurrency C.

    .venv/bin/python bench/batch_invariant_cost.py --dtype bf16 --json out/bi-cost-bf16.json
    .venv/bin/python bench/batch_invariant_cost.py --weights int4 --concurrency 16

Two copies of the target are loaded (one per mode: switching one copy's layout would re-pack its
weights inside the timed runs), with the shipped drafter. Batch 1: for every prompt the four
contenders run back to back (plain off, plain on, DFlash off, DFlash on, at the drafter's block
size or ``--block-size``), so that machine noise falls on all four alike; tok/s = all output
tokens / the sum of wall times. Concurrency C: the ``--num-prompts`` requests are served by the
in-flight engine with at most C running (all arriving at t=0, DFlash with the adaptive draft
length as ``bench --concurrency``), the four contenders alternating over ``--rounds`` rounds.
Greedy; each contender's outputs are compared with plain decoding with the mode off and with
the mode on ("identical N/N").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dflash_trt import EngineArgs, LLMEngine  # noqa: E402
from dflash_trt.checkpoints.loader import load_pair, parse_dtype  # noqa: E402
from dflash_trt.prompts import chat_prompt_ids, load_prompts  # noqa: E402
from dflash_trt.runtime.engine_factory import LoadedModels  # noqa: E402
from dflash_trt.runtime.request import Request  # noqa: E402

CONTENDERS = (("plain", False), ("plain", True), ("dflash", False), ("dflash", True))


def engine(pairs, mode: str, on: bool, K: int, kv: int, **kw) -> LLMEngine:
    """The contender's engine on its loaded pair (plain decoding: no drafter)."""
    t, d = pairs[on]
    args = EngineArgs(block_size=K if mode == "dflash" else 1, batch_invariant=on, kv_capacity=kv, **kw)
    return LLMEngine.from_engine_args(args, LoadedModels.of(t, d))


def batch1(pairs, prompts, K, max_new) -> dict:
    """Batch-1 runs, interleaved per prompt: {(mode, on): (outputs, wall seconds)}."""
    kv = -(-(max(map(len, prompts)) + max_new + K) // 32) * 32
    engines = {c: engine(pairs, *c, K, kv, max_batch_size=1) for c in CONTENDERS}
    for eng in engines.values():  # warm-up: kernels built, layouts applied, caches touched
        eng.generate([Request(prompts[0], 8)])
    res = {c: ([], 0.0) for c in CONTENDERS}
    for i, p in enumerate(prompts):
        for c in CONTENDERS:
            t = time.perf_counter()
            out = engines[c].generate([Request(p, max_new)])[0].output_ids
            outs, wall = res[c]
            res[c] = (outs + [out], wall + time.perf_counter() - t)
        print(f"  batch 1: prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    return res


def loaded(pairs, prompts, K, max_new, C, rounds) -> dict:
    """In-flight runs at concurrency ``C``, contenders alternating per round."""
    kv = C * (max(map(len, prompts)) + max_new + 2 * K + 64)
    engines = {c: engine(pairs, *c, K, kv, max_batch_size=C, adaptive=c[0] == "dflash") for c in CONTENDERS}

    def serve(eng) -> list[list[int]]:
        ids = [eng.add_request(Request(p, max_new)) for p in prompts]
        eng.run()
        return [eng.result(i).output_ids for i in ids]

    for eng in engines.values():  # warm-up
        ids = [eng.add_request(Request(p, 8)) for p in prompts[:2]]
        eng.run()
        for i in ids:
            eng.result(i)
    res = {c: ([], 0.0) for c in CONTENDERS}
    for r in range(rounds):
        for c in CONTENDERS:
            t = time.perf_counter()
            outs = serve(engines[c])
            res[c] = (outs, res[c][1] + time.perf_counter() - t)
        print(f"  C={C}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return {c: (outs, wall / rounds) for c, (outs, wall) in res.items()}


def summarize(res: dict) -> list[dict]:
    """One row per contender: tok/s, ratios to plain-off and plain-on, identical counts."""
    base = {on: res[("plain", on)] for on in (False, True)}
    tps = {c: sum(map(len, outs)) / wall for c, (outs, wall) in res.items()}
    rows = []
    for (mode, on), (outs, _) in res.items():
        rows.append(
            {
                "mode": mode,
                "batch_invariant": on,
                "tokens_per_s": tps[(mode, on)],
                "vs_plain_off": tps[(mode, on)] / tps[("plain", False)],
                "vs_plain_on": tps[(mode, on)] / tps[("plain", True)],
                "identical_to_plain_off": sum(a == b for a, b in zip(outs, base[False][0])),
                "identical_to_plain_on": sum(a == b for a, b in zip(outs, base[True][0])),
                "n": len(outs),
            }
        )
    return rows


def table(title: str, rows: list[dict]) -> str:
    lines = [
        title,
        f"{'contender':<22} {'tok/s':>8} {'vs plain off':>13} {'vs plain on':>12}  identical to plain off / on",
    ]
    for r in rows:
        name = f"{r['mode']} mode {'on' if r['batch_invariant'] else 'off'}"
        lines.append(
            f"{name:<22} {r['tokens_per_s']:>8.1f} {r['vs_plain_off']:>12.3f}x {r['vs_plain_on']:>11.3f}x  "
            f"{r['identical_to_plain_off']}/{r['n']} / {r['identical_to_plain_on']}/{r['n']}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default=None, help="fp32 | bf16 (default bf16)")
    ap.add_argument("--weights", choices=("int4", "int8"), default=None)
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None, help="DFlash block size (default: the drafter's)")
    ap.add_argument("--concurrency", default="1,16", help="comma list; 1 = the batch-1 comparison")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per concurrency > 1")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype or "bf16")
    pairs = {on: load_pair(None, None, dtype, weights=args.weights) for on in (False, True)}
    target, drafter = pairs[False]
    K = args.block_size or drafter.cfg.block_size
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in load_prompts(args.dataset, args.num_prompts)]
    what = f"{args.dtype or 'bf16'}{' + ' + args.weights if args.weights else ''}"
    threads = torch.get_num_threads()
    head = f"{args.dataset} {len(prompts)} x {args.max_new_tokens}, {what}, DFlash K={K}, {threads} threads"
    result = {"dtype": args.dtype or "bf16", "weights": args.weights, "block_size": K, "runs": {}}
    for C in (int(c) for c in args.concurrency.split(",")):
        if C == 1:
            rows = summarize(batch1(pairs, prompts, K, args.max_new_tokens))
            title = f"batch 1 ({head})"
        else:
            rows = summarize(loaded(pairs, prompts, K, args.max_new_tokens, C, args.rounds))
            title = f"concurrency {C}, adaptive DFlash, {args.rounds} rounds ({head})"
        result["runs"][str(C)] = rows
        print(table(title, rows), flush=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
