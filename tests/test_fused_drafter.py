"""The drafter's layers in one ``dflash_cpu::dense_layer`` call each on the eager CPU path
(``models/fused_layer.plan_drafter_layers``, ``DFlashProposer._forward_fused``): the KV
injection written for every layer first through batch-invariant / packed copies of the
drafter's fc and stacked k/v projections, then the blocks. Drafts decide speed only, so the
fused path must draft what the torch modules draft (up to the order of float sums), which the
acceptance shows; the output stays plain decoding's."""

from __future__ import annotations

import pytest
import torch
from helpers import generate, plain_outputs

from dflash_trt.checkpoints.loader import load_pair
from dflash_trt.models.batch_invariant import BatchInvariantLinear
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts
from dflash_trt.quantization.packed import PackedLinear
from dflash_trt.runtime.request import LoopStats, Request
from dflash_trt.runtime.spec_decode.dflash import DFlashProposer


class Fused(DFlashProposer):
    """Counts the drafting forwards that took the fused path."""

    calls = 0

    def _forward_fused(self, *a):
        Fused.calls += 1
        return super()._forward_fused(*a)


class Modules(DFlashProposer):
    """Drafts through the torch modules (the path before the fused one)."""

    def fused_layers(self):
        return None


@pytest.mark.parametrize("weights,dtype", [(None, torch.bfloat16), ("int4", torch.bfloat16), (None, torch.float32)])
def test_fused_drafter_drafts_what_the_modules_draft(weights, dtype):
    target, drafter = load_pair(None, None, dtype, weights=weights)
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in mixed_prompts(3)]
    ref = plain_outputs(target, prompts, 24)
    Fused.calls = 0
    runs = {}
    for cls in (Fused, Modules):
        stats = LoopStats(4)
        outs = [generate(target, drafter, [Request(p, 24)], 4, stats, proposer_cls=cls)[0].output_ids for p in prompts]
        runs[cls] = outs, stats
    (fused, fs), (modules, ms) = runs[Fused], runs[Modules]
    print(f"\n{weights or 'dense'} {dtype}: tau fused {fs.tau:.3f}, modules {ms.tau:.3f}; {Fused.calls} fused forwards")
    assert Fused.calls == fs.draft_calls > 10
    assert fused == modules == ref
    assert fs.tau > 1.3 and abs(fs.tau - ms.tau) <= 0.05 * ms.tau
    # the KV injection's linears are the fast kinds (batch-invariant panels or packed codes)
    plan = DFlashProposer(drafter, target.model, 4, 16, 64).fused_layers()
    assert plan is not None and all(isinstance(m, (BatchInvariantLinear, PackedLinear)) for m in plan[1])
