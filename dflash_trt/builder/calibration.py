"""Calibration data and passes for a build: real prompts through the target and the drafter.

Prompts: first-turn ShareGPT prompts (``calibration.dataset: sharegpt``, never an evaluation set)
or one of the bench prompt sets, in the target's chat template, cut to ``calibration.max_seq_len``.
The target runs them as prefill; the drafter runs one block per 8 positions of each prompt on the
target's own features (:meth:`DFlashDrafter.forward_train`), as in decoding.
"""

from __future__ import annotations

import sys

import torch

from ..errors import DFlashError
from ..models.prefill import target_features
from ..quantization.calibrate import calibrate_input_amax
from .config import BuildConfig


def calibration_ids(tokenizer, bc: BuildConfig) -> list[torch.Tensor]:
    """int64 token ids of ``calibration.num_samples`` prompts.

    Raises:
        DFlashError: unknown dataset or too few prompts.
    """
    from ..prompts import DATASETS, chat_prompt_ids, load_prompts, sharegpt_prompts

    c = bc.calibration
    if c.dataset == "sharegpt":
        texts = sharegpt_prompts(c.num_samples)
    elif c.dataset in DATASETS:
        texts = load_prompts(c.dataset, c.num_samples)
    else:
        raise DFlashError(f"unknown calibration dataset {c.dataset!r}; choose sharegpt or {', '.join(DATASETS)}")
    return [torch.tensor(chat_prompt_ids(tokenizer, t)[: c.max_seq_len]) for t in texts]


def calibrate_pair(
    target, drafter, bc: BuildConfig, progress: bool = True
) -> tuple[dict[str, float], dict[str, float]]:
    """Input amax of every linear of the target and of the drafter (``{module name: amax}``;
    empty for a model that is not quantized)."""
    from tqdm import tqdm

    model = target.model
    ids = calibration_ids(target.tokenizer, bc)
    bs = bc.calibration.batch_size
    batches = [ids[i : i + bs] for i in range(0, len(ids), bs)]

    dcfg = drafter.cfg
    # the drafter's features come out of the same prefill that calibrates the target (one pass)
    want = tuple(dcfg.target_layer_ids) if bc.drafter_quant != "none" else ()
    width = len(want) * model.cfg.hidden_size
    feats: list[torch.Tensor] = []

    def prefill(m, every_layer: bool):  # (the LM head is never quantized)
        capture = want + ((m.cfg.num_layers - 1,) if every_layer else ())
        feats.clear()
        for b in tqdm(
            batches,
            desc="calibrate target" if every_layer else "target features",
            unit="batch",
            disable=not progress,
            file=sys.stderr,
        ):
            out = target_features(m, b, capture)
            if want:
                feats.extend(f[:, :width] for f in out)

    if bc.target_quant != "none":
        t_amax = calibrate_input_amax(model, lambda m: prefill(m, True))
    else:
        t_amax = {}
        if want:
            prefill(model, False)
    d_amax = {}
    if want:

        def drafter_loop(d):  # one block every 8 positions, on the target's own features
            for x, f in tqdm(
                list(zip(ids, feats)), desc="calibrate drafter", unit="prompt", disable=not progress, file=sys.stderr
            ):
                anchors = torch.arange(1, len(x), 8)
                blocks = torch.full((len(anchors), dcfg.block_size), dcfg.mask_token_id)
                blocks[:, 0] = x[anchors]
                with torch.no_grad():
                    d.forward_train(model.embed(blocks), f, torch.arange(len(x)), anchors)

        d_amax = calibrate_input_amax(drafter, drafter_loop)
    return t_amax, d_amax
