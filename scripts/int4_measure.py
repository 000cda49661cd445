"""Measurements behind the packed int4 / int8 CPU path (issue 16), side by side in one process.

    .venv/bin/python scripts/int4_measure.py linears --threads 2        # per-row GEMM costs
    .venv/bin/python scripts/int4_measure.py models --threads 2 --prompts 5 --new 64

``linears``: one SmolLM2 layer's GEMM shapes and the LM head, bf16 vs int4 (group 32) vs int8,
1/2/4/8/16 rows; repetitions interleaved across the three, median and min in microseconds.

``models``: the default target as bf16 dense (GGUF dequantized: the reference), and packed
int4 with the LM head dense / int8 / int4, and packed int8. Per variant: max |logit - reference|
over a prefill of real prompts, greedy agreement with the reference over ``--new`` tokens
(identical prompts, first divergence and the reference's top-2 margin there), plain decoding
tok/s (interleaved prompt by prompt) and the bytes of every linear weight.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def linears(args) -> None:
    g = 32
    shapes = {
        "qkv [960x576]": (960, 576),
        "o [576x576]": (576, 576),
        "gate_up [3072x576]": (3072, 576),
        "down [576x1536]": (576, 1536),
        "issue [1536x576]": (1536, 576),
        "lm_head [49152x576]": (49152, 576),
    }
    from dflash_trt.quantization.packed import PackedLinear

    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; microseconds per GEMM, median (min) of {args.reps} interleaved reps")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k) * 0.05
        mods = {
            "bf16": torch.nn.Linear(k, n, bias=False).to(torch.bfloat16),
            "int4": PackedLinear.quantize(w, "int4", g),
            "int8": PackedLinear.quantize(w, "int8"),
        }
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            inner = max(3, min(300, int(3e8 / (n * k * max(m, 4)))))
            times: dict[str, list[float]] = {key: [] for key in mods}
            with torch.inference_mode():
                for mod in mods.values():
                    mod(x)
                for _ in range(args.reps):
                    for key, mod in mods.items():
                        t = time.perf_counter()
                        for _ in range(inner):
                            mod(x)
                        times[key].append((time.perf_counter() - t) / inner * 1e6)
            med = {key: statistics.median(v) for key, v in times.items()}
            mins = {key: min(v) for key, v in times.items()}
            cells = "  ".join(
                f"{key} {med[key]:8.1f} ({mins[key]:7.1f})"
                + (f" {med[key] / med['bf16']:.2f}x" if key != "bf16" else "")
                for key in mods
            )
            print(f"{name:22s} rows {m:2d}  {cells}", flush=True)


def models(args) -> None:
    from dflash_trt import EngineArgs, LLMEngine
    from dflash_trt.checkpoints.loader import load_target
    from dflash_trt.models.layers import AttentionMetadata
    from dflash_trt.models.prefill import KVCache, first_divergence, top2_margin
    from dflash_trt.prompts import chat_prompt_ids, load_prompts
    from dflash_trt.quantization.packed import packed_summary
    from dflash_trt.runtime.engine_factory import LoadedModels
    from dflash_trt.runtime.request import Request

    bf = torch.bfloat16
    ref = load_target(None, bf)
    variants = {"bf16 (dequantized GGUF)": ref}
    for weights, head in [("int4", "none"), ("int4", "int8"), ("int4", "int4"), ("int8", "int8")]:
        variants[f"{weights}, head {head}"] = load_target(None, bf, weights=weights, head=head)
    tok = ref.tokenizer
    prompts = [chat_prompt_ids(tok, t) for t in load_prompts(args.dataset, args.prompts)]

    def logits(model, ids):
        cfg = model.cfg
        cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), bf, "cpu")
        pos = torch.arange(len(ids)).unsqueeze(0)
        out = model(torch.tensor([ids]), AttentionMetadata.causal(pos, len(ids)), cache.layers)
        return out.logits[0].float()

    plain = EngineArgs(block_size=1, max_batch_size=1, kv_capacity=4096)
    engines = {k: LLMEngine.from_engine_args(plain, LoadedModels.of(v)) for k, v in variants.items()}
    outs: dict[str, list] = {k: [] for k in variants}
    walls = dict.fromkeys(variants, 0.0)
    for p in prompts:
        for k, e in engines.items():
            e.generate([Request(p, 4)])
            t = time.perf_counter()
            outs[k].append(e.generate([Request(p, args.new)])[0].output_ids)
            walls[k] += time.perf_counter() - t
    base = "bf16 (dequantized GGUF)"
    for k, v in variants.items():
        diff = max(float((logits(v.model, p) - logits(ref.model, p)).abs().max()) for p in prompts)
        same, notes = 0, []
        for i, (a, b) in enumerate(zip(outs[base], outs[k])):
            d = first_divergence(a, b)
            if d is None:
                same += 1
            else:
                notes.append(f"p{i}@{d} margin {top2_margin(ref.model, prompts[i] + a[:d]):.3g}")
        s = packed_summary(v.model)
        toks = sum(map(len, outs[k]))
        print(
            f"{k:26s} {toks / walls[k]:6.1f} tok/s  max|dlogit| {diff:.4f}  identical {same}/{len(prompts)} "
            f"{'; '.join(notes)}  linear bytes {s['weight_bytes'] / 1e6:.1f} MB",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("linears", "models"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    linears(args) if args.what == "linears" else models(args)


if __name__ == "__main__":
    main()
