"""fp32 vs FP8 vs NVFP4 engines of the same target + drafter, on real prompts.

Builds an FP8 and an NVFP4 engine with ``dflash-trt build`` (config ``cpu-fp32`` with the
target and drafter quantization overridden; ModelOpt calibration on ShareGPT prompts), loads
each engine the way the runtime does, and reports per format:

- ``weight_rel_l2``: ||W_engine - W_fp32|| / ||W_fp32|| over all target linears (dequantized);
- per dataset (GSM8K, HumanEval): ``identical``: fraction of greedy outputs (plain decoding)
  equal to the fp32 target's, ``token_match``: fraction of output positions equal, and ``tau``
  of DFlash on that engine (block size 16 unless ``--block-size``), plus whether DFlash equals
  plain decoding on the same engine.

Usage: ``.venv/bin/python bench/formats.py --num-prompts 10 --max-new-tokens 64 --json out/formats.json``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def weight_error(ref: torch.nn.Module, got: torch.nn.Module) -> float:
    """Relative L2 error over every 2-D weight of the decoder layers (the quantizable linears)."""
    num = den = 0.0
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    for name, w in ref_sd.items():
        if name.startswith("layers.") and w.dim() == 2:
            num += float((got_sd[name].float() - w.float()).pow(2).sum())
            den += float(w.float().pow(2).sum())
    return (num / den) ** 0.5


def build_formats(args) -> dict:
    """The fp32 pair and its fp8 and nvfp4 engines (built here, loaded dequantized): per format
    ``(target, drafter, weight relative L2 error, build seconds)``."""
    from dflash_trt.builder.builder import build_engine
    from dflash_trt.builder.config import BuildConfig
    from dflash_trt.checkpoints.engine_dir import load_engine
    from dflash_trt.checkpoints.loader import load_pair

    target, drafter = load_pair(None, None, torch.float32)
    models = {"fp32": (target, drafter, 0.0, 0.0)}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("fp8", "nvfp4"):
            bc = BuildConfig.load(
                ROOT / "build_configs" / "cpu-fp32.yaml",
                {"target_quant": fmt, "drafter_quant": fmt, "calibration.num_samples": args.calibration_samples},
            )
            t0 = time.perf_counter()
            build_engine(bc, None, None, Path(tmp) / fmt, progress=True, log=lambda m: print(m, file=sys.stderr))
            built = time.perf_counter() - t0
            t, d, _ = load_engine(Path(tmp) / fmt, torch.float32)
            models[fmt] = (t, d, weight_error(target.model, t.model), built)
    return models


def measure(args, t, d, tokenizer, reference: dict) -> dict:
    """One format's figures per dataset: plain decoding against the fp32 reference (identical
    answers, matching tokens) and DFlash on the same engine (tau, equal to plain decoding)."""
    from tqdm import tqdm

    from dflash_trt import EngineArgs, LLMEngine
    from dflash_trt.prompts import chat_prompt_ids, load_prompts
    from dflash_trt.runtime.engine_factory import LoadedModels
    from dflash_trt.runtime.request import LoopStats, Request

    engines = {
        k: LLMEngine.from_engine_args(EngineArgs(block_size=k, kv_capacity=16384), LoadedModels.of(t, d))
        for k in (1, args.block_size)
    }
    row = {}
    for ds in args.datasets.split(","):
        prompts = [chat_prompt_ids(tokenizer, x) for x in load_prompts(ds, args.num_prompts)]
        reqs = [Request(p, args.max_new_tokens) for p in prompts]
        with tqdm(total=2, desc=ds, leave=False) as bar:
            plain = [o.output_ids for o in engines[1].generate(reqs)]
            bar.update()
            spec_engine = engines[args.block_size]
            spec_engine.stats = LoopStats(args.block_size)  # this set's figures only
            spec = [o.output_ids for o in spec_engine.generate(reqs)]
            bar.update()
        ref = reference.setdefault(ds, plain)
        match = sum(x == y for a, b in zip(plain, ref) for x, y in zip(a, b))
        row[ds] = {
            "identical": sum(a == b for a, b in zip(plain, ref)) / len(ref),
            "token_match": match / sum(max(len(a), len(b)) for a, b in zip(plain, ref)),
            "tau": spec_engine.stats.tau,
            "dflash_equals_plain": spec == plain,
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--datasets", default="gsm8k,humaneval")
    ap.add_argument("--calibration-samples", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    models = build_formats(args)
    tokenizer = models["fp32"][0].tokenizer
    result = {
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "block_size": args.block_size,
        "dtype": "fp32",
        "threads": torch.get_num_threads(),
        "formats": {},
    }
    reference: dict[str, list[list[int]]] = {}
    for fmt, (t, d, err, built) in models.items():
        result["formats"][fmt] = {"weight_rel_l2": err, "build_s": built} | measure(args, t, d, tokenizer, reference)

    datasets = args.datasets.split(",")
    head = "| format | weight rel. L2 | " + " | ".join(f"{ds} identical / tokens / tau" for ds in datasets) + " |"
    lines = [head, "|" + "---|" * (2 + len(datasets))]
    for fmt, row in result["formats"].items():
        cells = [
            f"{row[ds]['identical']:.0%} / {row[ds]['token_match']:.0%} / {row[ds]['tau']:.2f}"
            + ("" if row[ds]["dflash_equals_plain"] else " (DFlash != plain!)")
            for ds in datasets
        ]
        lines.append(f"| {fmt} | {row['weight_rel_l2']:.3f} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.json_out:
        from dflash_trt.atomic import write_json

        write_json(args.json_out, result)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
