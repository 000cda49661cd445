"""``dflash-trt bench``: plain decoding vs DFlash (and peers) on a real prompt set, one request
at a time; with ``--concurrency``, both under in-flight batching (the load benchmark)."""

from __future__ import annotations

import sys

from ..engine_args import EngineArgs
from ..errors import DFlashError
from . import flags

#: engine settings that only the load benchmark uses (the batch-1 comparison sizes its own
#: engines): given without --concurrency they are an error, not silently ignored
LOAD_ONLY = ("max_batch_size", "max_num_tokens", "tokens_per_block", "kv_capacity")


def register(sub) -> None:
    b = sub.add_parser("bench", help="plain decoding vs DFlash (and peers) on a real prompt set")
    b.add_argument("--dataset", default="gsm8k", help="gsm8k | humaneval | mtbench")
    flags.add(b, "prompts_file", "num_prompts", "max_new_tokens", "temperature", "seed", "threads", "json_out")
    b.add_argument(
        "--peers",
        default="",
        help="comma list of peers: hf, prompt-lookup, zlab (z-lab reference loop, same drafter), "
        "llama.cpp (the same GGUF through llama-cpp-python: `make peers`), vllm (vLLM's CPU build, plain "
        "and its DFlash with the same drafter: `make peers`; also with --concurrency)",
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
    ld.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of each concurrency's lanes; each mode reports its run of median tokens/s (default: 1)",
    )
    EngineArgs.add_cli_args(
        b,
        defaults=dict.fromkeys((*LOAD_ONLY, "adaptive")),
        helps={
            "adaptive": "the adaptive draft-length controller, as serving runs it (default: on for the load "
            "benchmark; off for batch 1, whose DFlash mode drafts block size - 1 tokens every step)"
        },
    )
    b.set_defaults(run=run)


def _rate(text: str | None) -> float | None:
    """``--request-rate``: a positive number of req/s, or inf; None stays None (all at t=0).

    Raises:
        DFlashError: not a positive number.
    """
    if text is None:
        return None
    try:
        r = float(text)
    except ValueError:
        raise DFlashError(f"--request-rate takes a number of requests per second or inf, got {text!r}") from None
    if not r > 0:
        raise DFlashError(f"--request-rate must be > 0 req/s (inf = all at once), got {text}")
    return r


def _settings(args) -> dict:
    """The :class:`~dflash_trt.bench.batch1.BenchConfig` fields both bench modes take."""
    return dict(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        json_out=args.json_out,
        seed=args.seed,
        prompts_file=args.prompts_file,
    )


def run(args) -> None:
    flags.setup_threads(args.threads)
    if args.concurrency is not None:
        return _run_load(args)
    given = [
        f"--{f.replace('_', '-')}"
        for f in (*LOAD_ONLY, "request_rate", "num_requests", "repeats")
        if getattr(args, f) is not None
    ]
    if given:
        raise DFlashError(f"{', '.join(given)}: load benchmark flag(s); add --concurrency")
    from ..bench.batch1 import BenchConfig, format_table, run_bench

    args.adaptive = bool(args.adaptive)
    cfg = BenchConfig(
        engine_args=EngineArgs.from_cli_args(args),
        peers=tuple(p for p in args.peers.split(",") if p),
        **_settings(args),
    )
    result = run_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(result))
    _outputs(args, result, "plot_bench")


def _run_load(args) -> None:
    from ..bench.load import LoadConfig, format_load_table, run_load_bench

    conc = flags.int_list(args.concurrency, "--concurrency")
    if not conc:
        raise DFlashError(f"--concurrency takes comma-separated integers >= 1, got {args.concurrency!r}")
    if args.adaptive is None:
        args.adaptive = True
    cfg = LoadConfig(
        engine_args=EngineArgs.from_cli_args(args),
        concurrency=conc,
        request_rate=_rate(args.request_rate),
        num_requests=args.num_requests,
        repeats=1 if args.repeats is None else args.repeats,
        peers=tuple(p for p in args.peers.split(",") if p),
        **_settings(args),
    )
    cfg.validate()
    result = run_load_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    if result is None:  # a TP worker rank under mpiexec
        return
    print(format_load_table(result))
    _outputs(args, result, "plot_load")


def _outputs(args, result: dict, plot: str) -> None:
    """Say where the JSON went; write the plot when asked for."""
    if args.json_out:
        print(f"wrote {args.json_out}")
    if args.plot:
        from ..bench import plots

        print(f"wrote {getattr(plots, plot)(result, args.plot)}")
