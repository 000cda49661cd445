"""The flags more than one command takes, each declared once here (or, for engine settings,
once as an ``EngineArgs`` field), and the small conversions every command shares."""

from __future__ import annotations

import argparse

from ..engine_args import EngineArgs
from ..errors import DFlashError

#: flag name -> (flags, argparse keywords); a command takes them with :func:`add`, overriding
#: ``default`` / ``help`` where its meaning differs
SHARED = {
    "threads": (("--threads",), dict(type=int, default=None, help="CPU threads for torch (default: all cores)")),
    "seed": (("--seed",), dict(type=int, default=0, help="random seed")),
    "out": (("--out",), dict(required=True, help="output directory (must not exist)")),
    "json_out": (("--json",), dict(dest="json_out", help="write the result JSON here")),
    "num_prompts": (("--num-prompts",), dict(type=int, default=10, help="prompts to run")),
    "prompts_file": (
        ("--prompts-file",),
        dict(help='a JSONL prompt set: one {"prompt": ...} or {"messages": [...]} per line (chat template applied)'),
    ),
    "max_new_tokens": (("--max-new-tokens",), dict(type=int, default=128, help="most tokens generated per prompt")),
    "temperature": (("--temperature",), dict(type=float, default=0.0, help="0 = greedy")),
    "top_p": (("--top-p",), dict(type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")),
    "top_k": (("--top-k",), dict(type=int, default=0, help="keep the k most likely tokens; 0 = off")),
    "model_name": (("--model-name",), dict(help="the model id clients use (default: the target directory's name)")),
    "num_layers": (("--layers",), dict(dest="num_layers", type=int, default=2, help="decoder layers of a new drafter")),
    "max_minutes": (("--max-minutes",), dict(type=float, default=None, help="stop after this many minutes")),
    "max_seq_len": (("--max-seq-len",), dict(type=int, default=2048, help="sequences are cut to this many tokens")),
    "batch": (("--batch",), dict(type=int, default=16, help="sequences processed together")),
}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump)."""

    def error(self, message: str):
        raise DFlashError(f"{message} (see {self.prog} --help)")


def add(p: argparse.ArgumentParser, *names: str, **overrides: dict) -> None:
    """Add the shared flags ``names`` to ``p``: a name of :data:`SHARED`, or an ``EngineArgs``
    field (``model`` is ``--target``). ``overrides[name]`` replaces keywords (``default``,
    ``help``, ``required``) for this command."""
    for name in names:
        extra = overrides.get(name, {})
        if name in SHARED:
            flags, kw = SHARED[name]
            p.add_argument(*flags, **(kw | extra))
        else:
            defaults = {name: extra["default"]} if "default" in extra else None
            helps = {name: extra["help"]} if "help" in extra else None
            EngineArgs.add_cli_args(p, only=(name,), defaults=defaults, helps=helps)


def setup_threads(n: int | None) -> None:
    """``--threads``: torch's intra-op threads (None: all cores).

    Raises:
        DFlashError: ``n < 1``.
    """
    import torch

    if n is not None:
        if n < 1:
            raise DFlashError(f"--threads must be >= 1, got {n}")
        torch.set_num_threads(n)


def int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    """``"1,8,29"`` -> ``(1, 8, 29)``; None stays None.

    Raises:
        DFlashError: not comma-separated integers.
    """
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise DFlashError(f"{flag} takes comma-separated integers, got {text!r}") from None


def sampling_params(args):
    """The :class:`~dflash_trt.runtime.sampling.SamplingParams` of ``--max-new-tokens``,
    ``--temperature``, ``--top-p``, ``--top-k``, ``--seed`` (those a command has).

    Raises:
        ConfigError: a value out of range, named by its flag.
    """
    from ..errors import ConfigError
    from ..runtime.sampling import SamplingParams

    if args.max_new_tokens < 1:
        raise ConfigError("max_new_tokens", f"must be >= 1, got {args.max_new_tokens}")
    return SamplingParams(
        temperature=args.temperature,
        top_p=getattr(args, "top_p", 1.0),
        top_k=getattr(args, "top_k", 0),
        seed=args.seed,
        max_tokens=args.max_new_tokens,
    )
