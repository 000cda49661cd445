"""``dflash-trt build`` (target + drafter -> a quantized, tensor-parallel engine directory) and
``plan`` (the memory plan of a build config)."""

from __future__ import annotations

from pathlib import Path

from ..errors import DFlashError
from . import flags


def register(sub) -> None:
    for name, text, run in (
        ("build", "target + drafter -> quantized, tensor-parallel engine directory", run_build),
        ("plan", "print the memory plan of a build config (shapes only, no weights read)", run_plan),
    ):
        c = sub.add_parser(name, help=text)
        c.add_argument("--config", required=True, help="build config YAML (see build_configs/)")
        flags.add(c, "model", "drafter")
        flags.add(c, "tensor_parallel_size", tensor_parallel_size={"default": None, "help": "override tp_size"})
        c.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config knob, e.g. --set target_quant=fp8 --set calibration.num_samples=16",
        )
        if name == "build":
            flags.add(c, "out", "threads", out={"help": "engine directory to create (must not exist)"})
        else:
            c.add_argument("--target-config", help="an HF config.json: plan for that shape (no weights needed)")
        c.set_defaults(run=run)


def build_config(args):
    """The build config of ``--config`` with ``--set`` / ``--tp`` applied.

    Raises:
        DFlashError: an unreadable config, an unknown or ill-typed knob.
    """
    from ..builder.config import BuildConfig, parse_override

    overrides = dict(parse_override(x) for x in args.set)
    if args.tensor_parallel_size is not None:
        overrides["tp_size"] = args.tensor_parallel_size
    return BuildConfig.load(args.config, overrides)


def run_build(args) -> None:
    from ..builder.builder import build_engine

    bc = build_config(args)
    flags.setup_threads(args.threads)
    build_engine(bc, args.model, args.drafter, args.out)


def run_plan(args) -> None:
    from ..builder.plan import memory_plan
    from ..checkpoints.sources import read_json
    from ..models.config import TargetConfig

    bc = build_config(args)
    if args.target_config:
        if args.model or args.drafter:
            raise DFlashError("--target-config plans a shape alone; drop --target / --drafter")
        from ..checkpoints.zlab import drafter_config_for

        # (a mixture-of-experts target is planned from these shapes by builder/moe_plan.py)
        tcfg = TargetConfig.from_hf(read_json(Path(args.target_config), "target"))
        dcfg = drafter_config_for(tcfg, 5, bc.block_size, 0)  # a 5-layer drafter, the z-lab default
    else:
        from ..checkpoints.loader import load_pair

        target, drafter = load_pair(args.model, args.drafter)
        tcfg, dcfg = target.model.cfg, drafter.cfg
    plan = memory_plan(bc, tcfg, dcfg)
    print(plan.table())
    plan.check()
