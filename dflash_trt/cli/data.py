"""``dflash-trt distill`` (the target's own answers to prompts) and ``text-data`` (ShareGPT's
conversations labelled by the target): drafter training data."""

from __future__ import annotations

from pathlib import Path

from ..errors import DFlashError
from . import flags


def register(sub) -> None:
    tx = sub.add_parser(
        "text-data",
        help="make drafter training data from ShareGPT conversations (labelled by the target, no generation)",
    )
    flags.add(tx, "model", "out", "max_seq_len", out={"help": "new data directory"})
    tx.add_argument("--num-conversations", type=int, default=None, help="the first N conversations (default: all)")
    tx.add_argument(
        "--skip-conversations", type=int, default=0, help="start after the first N conversations (default: 0)"
    )
    tx.set_defaults(run=run_text_data)

    d = sub.add_parser("distill", help="make drafter training data: the target's own answers to ShareGPT prompts")
    flags.add(d, "model", "out", out={"help": "data directory (resumable: re-run to continue)"})
    flags.add(
        d,
        "num_prompts",
        "prompts_file",
        "max_new_tokens",
        "batch",
        "max_minutes",
        "temperature",
        "seed",
        "device",
        "threads",
        "max_num_tokens",
        "dtype",
        num_prompts={
            "default": None,
            "help": "prompts to answer (default: 1000 ShareGPT first turns, or all of --prompts-file)",
        },
        prompts_file={"help": 'JSONL prompts instead of ShareGPT\'s: {"prompt": ...} or {"messages": [...]} per line'},
        max_new_tokens={"default": 256},
        batch={"help": "most sequences decoding together (in-flight batching)"},
        max_minutes={"help": "stop after the shard in progress when this much time has passed (re-run to continue)"},
        temperature={"default": 0.7, "help": "temperature of the sampled share (--sampled-fraction)"},
        max_num_tokens={"default": 4096},
        dtype={"default": "bf16", "help": "target dtype: fp32 | bf16"},
    )
    d.add_argument(
        "--word-problems",
        action="store_true",
        help="synthetic grade-school maths word problems (our own templates, seeded by --seed, "
        "checked against the evaluation sets) instead of ShareGPT's",
    )
    d.add_argument("--shard-size", type=int, default=256, help="prompts per shard (the unit of resumption)")
    d.add_argument("--sampled-fraction", type=float, default=0.25, help="share answered at --temperature (rest greedy)")
    d.set_defaults(run=run_distill)


def run_distill(args) -> None:
    from ..checkpoints.loader import load_target, parse_device, parse_dtype
    from ..training.dataset import read_data_manifest
    from ..training.distill import generate_dataset

    if args.max_new_tokens < 1 or args.batch < 1:
        raise DFlashError("--max-new-tokens and --batch must be >= 1")
    if not 0 <= args.sampled_fraction <= 1:
        raise DFlashError(f"--sampled-fraction must be in [0, 1], got {args.sampled_fraction}")
    if args.prompts_file and args.word_problems:
        raise DFlashError("give --prompts-file or --word-problems, not both")
    flags.setup_threads(args.threads)
    device = parse_device(args.device)
    prompts, source = _prompts(args)
    target = load_target(args.model, parse_dtype(args.dtype), device)
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


def _prompts(args) -> tuple[list, str]:
    """The prompts to answer and what they are."""
    from ..prompts import read_prompts_file, sharegpt_prompts

    if args.prompts_file:
        return read_prompts_file(args.prompts_file, args.num_prompts), f"prompts file {Path(args.prompts_file).name}"
    if args.word_problems:
        from ..training.word_problems import word_problems

        return word_problems(args.num_prompts or 1000, args.seed), f"synthetic word problems (seed {args.seed})"
    return sharegpt_prompts(args.num_prompts or 1000), "ShareGPT first turns"


def run_text_data(args) -> None:
    from ..checkpoints.loader import load_target
    from ..prompts import sharegpt_conversations
    from ..training.dataset import read_data_manifest
    from ..training.text_data import write_text_dataset

    skip = args.skip_conversations
    convs = sharegpt_conversations(args.num_conversations, skip=skip)
    target = load_target(args.model)
    source = "ShareGPT conversations" + (f" {skip}..{skip + len(convs) - 1}" if skip else "")
    out = write_text_dataset(target, convs, Path(args.out), args.max_seq_len, source=source)
    t = read_data_manifest(out)["totals"]
    print(f"wrote {out}: {t['samples']} conversations, {t['tokens']} tokens, {t['response_tokens']} assistant tokens")
