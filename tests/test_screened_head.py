"""The screened LM head (``models/screened_head.py``): the full head's argmax, token for token,
from an int8 screen and an exact pass over the tokens the screen cannot rule out."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine
from torch import nn

from dflash_trt.kernels import cpu_ops
from dflash_trt.kernels.cpu_ops import argmax_rows
from dflash_trt.models.batch_invariant import BatchInvariantLinear
from dflash_trt.models.screened_head import ScreenedHead
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts
from dflash_trt.runtime.request import Request


def _head(w: torch.Tensor) -> BatchInvariantLinear:
    cpu_ops.load()
    return BatchInvariantLinear(nn.Parameter(w.contiguous(), requires_grad=False))


def _near_ties(dtype: torch.dtype, vocab: int = 3000, k: int = 64, rows: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose rows 1000..1399 are one row plus perturbations far below the int8 codes'
    step (their logits all within the screen's error of each other), with exact copies of it
    below and above them (ties the first index must win), and hidden rows that favour it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, k, generator=g) * 0.05
    best = torch.randn(k, generator=g) * 0.3
    w[1000:1400] = best + torch.randn(400, k, generator=g) * 1e-4
    w[1700] = w[1200]
    w[300] = w[1300]
    x = best.expand(rows, k) * 4 + torch.randn(rows, k, generator=g) * 0.5
    return w.to(dtype), x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screened_head_gives_the_full_heads_argmax_at_near_ties(dtype):
    w, x = _near_ties(dtype)
    head = _head(w)
    screen = ScreenedHead(head)
    for m in (1, 3, 17):
        want = argmax_rows(head(x[:m]))
        assert torch.equal(screen(x[:m]), want), m
    # the screen kept the near-tie tokens it could not rule out (hundreds), not just the argmax
    assert len(screen.candidates(x[:1].contiguous())) > 50
    # without the bound (the screen's own best tokens only) the choice differs: the equality
    # above can fail
    screen.scale = 0.0
    assert any(not torch.equal(screen(x[i : i + 1]), argmax_rows(head(x[i : i + 1]))) for i in range(17))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screened_head_on_the_real_head(smollm2, dtype):
    """The default target's 49,152-token head: random directions at the real hidden states'
    scale (norm ~54) and rows of the embedding itself (each row's own token wins), at 1, 5 and
    33 rows; a row that is not finite returns None (the runner then runs the full head)."""
    w = smollm2.model.lm_head.weight.detach().to(dtype)
    head = _head(w)
    screen = ScreenedHead(head)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, w.shape[1], generator=g)
    x = (x / x.norm(dim=1, keepdim=True) * 54).to(dtype)
    x[20:] = w[torch.randint(0, w.shape[0], (20,), generator=g)] * 15
    for rows in (x[:1], x[:5], x[5:38], x[30:31]):
        assert torch.equal(screen(rows), argmax_rows(head(rows)))
    assert len(screen(x[:0])) == 0
    bad = x[:2].clone()
    bad[1, 3] = float("nan")
    assert screen(bad) is None


def test_plain_decoding_with_the_screened_head_is_the_full_heads(smollm2):
    """fp32 greedy decoding of real prompts, in a batch, through the engine's screened head and
    through the full head: the same tokens (and the screen did run)."""
    prompts = [chat_prompt_ids(smollm2.tokenizer, t) for t in mixed_prompts(4)]
    outs = {}
    for screened in (True, False):
        requests = [Request(p, 24) for p in prompts]
        engine = make_engine(smollm2, None, 1, requests)
        assert engine.runner.screen is not None  # (fp32, eager, batch-invariant: the default here)
        calls = []
        if screened:
            screen = engine.runner.screen
            screen.candidates = lambda x, f=screen.candidates, seen=calls: (seen.append(len(x)), f(x))[1]
        else:
            engine.runner.screen = None
        outs[screened] = [o.output_ids for o in engine.generate(requests)]
        assert not screened or sum(calls) >= 4 * 23
    assert outs[True] == outs[False]
