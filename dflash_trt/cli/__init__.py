"""``dflash-trt`` command line, one module per command (``generate``, ``bench``, ``serve``,
``triton-repo`` / ``triton-serve``, ``train``, ``distill`` / ``text-data``, ``init-drafter``,
``build`` / ``plan``, ``kernels-aot``, ``pack`` / ``unpack``). Engine settings come from
``EngineArgs``' fields and the other shared flags from :mod:`.flags`, so every flag is declared
once.

Errors a user can cause are printed as one line (``dflash-trt: error: ...``) with exit status 2;
a setting the lower layers name by its field (:class:`~dflash_trt.runtime.config.ConfigError`)
is shown as its flag.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import DFlashError
from . import bench, build, data, drafter, flags, generate, kernels, pack, serve, train

#: the command modules, in the order ``--help`` lists them
COMMANDS = (generate, bench, serve, train, data, drafter, build, kernels, pack)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (each module's ``register`` adds its own)."""
    parser = flags.Parser(prog="dflash-trt", description="DFlash speculative decoding: build, run and benchmark.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=flags.Parser)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dflash-trt`` console script; returns the exit status."""
    from ..engine_args import cli_error
    from ..errors import ConfigError

    try:
        args = build_parser().parse_args(argv)
        args.run(args)
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
