"""``dflash-trt generate``: stream one completion, then print tau and tok/s."""

from __future__ import annotations

import sys
import time

from ..engine_args import EngineArgs
from ..errors import DFlashError
from . import flags


def register(sub) -> None:
    g = sub.add_parser("generate", help="stream one completion, then print tau and tok/s")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument(
        "--prompt-from", metavar="DATASET:INDEX", help="a real prompt, e.g. gsm8k:0 (gsm8k, humaneval, mtbench)"
    )
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    flags.add(g, "max_new_tokens", "temperature", "top_p", "top_k", "seed", "threads")
    flags.add(g, "json_out", json_out={"help": "write the prompt and output token ids, text and figures here (JSON)"})
    EngineArgs.add_cli_args(g)
    g.set_defaults(run=run)


def dataset_prompt(spec: str) -> str:
    """The prompt ``DATASET:INDEX`` (``--prompt-from``).

    Raises:
        DFlashError: not of that form, an unknown dataset, an index past its end.
    """
    from ..prompts import load_prompts

    name, _, index = spec.partition(":")
    if not index.isdigit():
        raise DFlashError(f"--prompt-from wants DATASET:INDEX (e.g. gsm8k:0), got {spec!r}")
    return load_prompts(name, int(index) + 1)[int(index)]


def run(args) -> None:
    import torch

    from ..atomic import write_json
    from ..prompts import chat_prompt_ids
    from ..runtime.engine_factory import create_engine, load_models
    from ..runtime.request import LoopStats, Request

    sampling = flags.sampling_params(args)
    flags.setup_threads(args.threads)
    eargs = EngineArgs.from_cli_args(args)
    models = load_models(eargs.create_engine_config())
    tok = models.target.tokenizer
    text = args.prompt if args.prompt is not None else dataset_prompt(args.prompt_from)
    ids = tok.encode(text) if args.raw else chat_prompt_ids(tok, text)
    if not ids:
        raise DFlashError("empty prompt")
    if eargs.kv_capacity is None:  # one sequence: a cache just large enough (a drafter block is <= 64)
        need = len(ids) + sampling.max_tokens + 64
        eargs = eargs.replace(kv_capacity=-(-need // eargs.tokens_per_block) * eargs.tokens_per_block)
    engine = create_engine(eargs.replace(max_batch_size=1), models)
    if engine is None:  # a tensor-parallel worker rank under mpiexec
        return
    if eargs.compile:  # compile before the timed run: tok/s below is decoding, not compiling
        print("--compile: compiling the target and drafter forwards (minutes on a cold cache) ...", file=sys.stderr)
        warm = engine.warm_up([ids, ids[:-1]] if len(ids) > 1 else [ids], sampling, 8)
        print(f"--compile: compiled in {warm:.0f} s (untimed)", file=sys.stderr)
    if args.prompt_from:
        print(f"[{args.prompt_from}] {text}\n", flush=True)
    stream = _Stream(tok)
    engine.stats = LoopStats(engine.block_size)
    t = time.perf_counter()
    sid = engine.add_request(Request(ids, sampling.max_tokens, sampling), on_tokens=stream)
    engine.run()
    wall = time.perf_counter() - t
    out = engine.result(sid)
    print()
    stats, K = engine.stats, engine.block_size
    lookup = (
        f" ({stats.lookup_steps} of {stats.verify_steps} steps with prompt lookup)" if eargs.prompt_lookup_min else ""
    )
    where = models.device.type if models.device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"[{len(out.output_ids)} tokens in {wall:.2f} s: {len(out.output_ids) / wall:.1f} tok/s | "
        f"block size {K} | tau {stats.tau:.2f}{lookup} | "
        f"{models.dtype}{f' + {eargs.weights} weights' if eargs.weights else ''} | {where} | "
        f"finish: {out.finish_reason}]"
    )
    if args.json_out:
        result = {
            "prompt": text,
            "prompt_ids": ids,
            "output_ids": out.output_ids,
            "text": tok.decode(out.output_ids, skip_special_tokens=True),
            "finish_reason": out.finish_reason,
            "block_size": K,
            "tau": stats.tau,
            "tokens_per_s": len(out.output_ids) / wall,
            "dtype": models.dtype,
        }
        write_json(args.json_out, result)


class _Stream:
    """Prints the text of the tokens committed so far as it grows (``on_tokens`` callback)."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], ""

    def __call__(self, _sid: int, new: list[int]) -> None:
        self.ids.extend(new)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text
