"""``dflash-trt kernels-aot``: the drafter kernels compiled to cubins (no GPU needed)."""

from __future__ import annotations

from . import flags


def register(sub) -> None:
    ka = sub.add_parser(
        "kernels-aot", help="compile the drafter kernels to cubins for Hopper and Blackwell (no GPU needed)"
    )
    flags.add(ka, "out", out={"help": "directory to create: <arch>/<variant>.cubin + manifest.json"})
    ka.add_argument("--arch", default="sm_90a,sm_100a,sm_103a", help="comma list of sm_90a, sm_100a, sm_103a")
    ka.set_defaults(run=run)


def run(args) -> None:
    from ..kernels.aot import compile_all

    m = compile_all(args.out, [a for a in args.arch.split(",") if a])
    print(f"{'variant':<32} {'arch':<8} {'ptx target':<11} {'bytes':>8} {'warps':>5} {'smem':>6}")
    for e in m["cubins"]:
        print(
            f"{e['variant']:<32} {e['arch']:<8} {e['ptx_target']:<11} {e['bytes']:>8} {e['num_warps']:>5} "
            f"{e['shared_bytes']:>6}"
        )
    print(f"wrote {len(m['cubins'])} cubins to {args.out} (triton {m['triton']})")
