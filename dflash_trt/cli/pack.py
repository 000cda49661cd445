"""``dflash-trt pack`` / ``unpack``: the model (in parts) and the prompt sets for an offline GPU
training run, and joining the parts again."""

from __future__ import annotations

from . import flags


def register(sub) -> None:
    pk = sub.add_parser("pack", help="pack the model (in parts) and the prompt sets for an offline GPU training run")
    flags.add(pk, "out", out={"help": "pack folder to create (see scripts/gpu_train.sh)"})
    pk.add_argument("--model-file", help="the target as one file, e.g. a .gguf (default: the SmolLM2 GGUF)")
    pk.add_argument(
        "--part-mib", type=int, default=32, help="largest model part in MiB (one transfer each, beside ~24 MiB of code)"
    )
    pk.add_argument("--num-train-prompts", type=int, default=None, help="ShareGPT training prompts (default: all)")
    pk.set_defaults(run=run_pack)

    up = sub.add_parser("unpack", help="join a pack's model parts (checked against its sha256)")
    up.add_argument("--pack", required=True, help="pack folder (its model-NN/ part folders may have travelled apart)")
    up.add_argument("--dest", required=True, help="folder to write the joined model file into")
    up.set_defaults(run=run_unpack)


def run_pack(args) -> None:
    from ..training.offline_pack import write_pack

    m = write_pack(args.out, args.model_file, args.part_mib, args.num_train_prompts)
    print(
        f"wrote {args.out}: {m['model']['file']} in {len(m['model']['parts'])} part(s) "
        f"({', '.join(p.split('/')[0] for p in m['model']['parts'])}), {m['prompts']['train_count']} training prompts"
    )


def run_unpack(args) -> None:
    from ..training.offline_pack import join_model

    print(join_model(args.pack, args.dest))
