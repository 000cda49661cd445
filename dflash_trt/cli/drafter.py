"""``dflash-trt init-drafter``: a randomly initialised z-lab drafter matched to a target."""

from __future__ import annotations

import os

from ..errors import DFlashError
from . import flags


def register(sub) -> None:
    i = sub.add_parser("init-drafter", help="write a randomly initialised drafter matched to a target")
    flags.add(i, "model", "num_layers", "seed")
    flags.add(i, "block_size", block_size={"default": 16, "help": "tokens per block of the new drafter"})
    i.add_argument("--mask-token-id", type=int, default=None, help="MASK token (default: the tokenizer's mask/unk)")
    flags.add(i, "out", out={"help": "drafter directory to create"})
    i.set_defaults(run=run)


def run(args) -> None:
    from ..checkpoints.loader import default_mask_token_id, load_target
    from ..checkpoints.zlab import init_drafter, save_drafter

    if os.path.exists(args.out):
        raise DFlashError(f"output {args.out} already exists")
    target = load_target(args.model)
    cfg = target.model.cfg
    mask = args.mask_token_id
    if mask is None:
        mask = default_mask_token_id(target.tokenizer, cfg.vocab_size)
    model = init_drafter(cfg, args.num_layers, args.block_size, mask, seed=args.seed)
    save_drafter(model, args.out)
    print(
        f"wrote {args.out}: {args.num_layers} layers, block size {args.block_size}, "
        f"target_layer_ids {list(model.cfg.target_layer_ids)}, mask_token_id {mask}"
    )
