"""oneDNN-prepacked bf16 CPU linears (``models/cpu_linear.py``): the GEMM against ``F.linear``,
what the runner packs, and DFlash lossless against plain decoding on the prepacked bf16 target.

The prepacked GEMM is oneDNN's bf16 GEMM with the weight in its blocked layout: it equals
``F.linear`` on the same bf16 operands up to summation order (fp32 accumulation, one bf16
rounding of the output), so results are compared at bf16 resolution, not bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ROWS_TIE, OracleProposer, generate, plain_outputs, same_or_tie
from torch import nn

from dflash_trt.checkpoints.loader import DEFAULT_DRAFTER, SHIPPED_DRAFTERS, load_pair
from dflash_trt.checkpoints.zlab import load_drafter
from dflash_trt.models.cpu_linear import OneDNNLinear, onednn_available, pack_linears, unpack_linears
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts
from dflash_trt.runtime.request import LoopStats, Request

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch / CPU has no oneDNN bf16")


@pytest.mark.parametrize("out_f,in_f,bias", [(3072, 576, False), (576, 1536, False), (960, 576, True), (49, 17, True)])
def test_prepacked_gemm_equals_f_linear(out_f, in_f, bias):
    """1..16 rows and a 3-D input: every output within one bf16 rounding step (relative 2^-8)
    of the fp32 product of the same bf16 operands, like ``F.linear``'s own bf16 result."""
    g = torch.Generator().manual_seed(out_f + in_f)
    lin = nn.Linear(in_f, out_f, bias=bias).to(BF16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g).to(BF16))
    packed = OneDNNLinear.from_linear(lin)
    assert packed.weight is None and packed.out_features == out_f
    for shape in [(1, in_f), (4, in_f), (16, in_f), (2, 3, in_f)]:
        x = torch.randn(*shape, generator=g).to(BF16)
        exact = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
        with torch.no_grad():
            got, ref = packed(x), lin(x)
        assert got.shape == ref.shape and got.dtype == BF16
        scale = exact.abs().clamp_min(1.0)
        err_packed = float(((got.float() - exact) / scale).abs().max())
        err_linear = float(((ref.float() - exact) / scale).abs().max())
        print(f"{shape}: max relative error prepacked {err_packed:.2e}, F.linear {err_linear:.2e}")
        assert err_packed <= 2**-8


def test_pack_linears_swaps_bf16_cpu_linears_once():
    """Only bf16 ``nn.Linear`` s are swapped; ``keep`` leaves ``.weight`` reachable (the very
    tensor, not a copy), ``skip`` leaves modules alone, a second call packs nothing more."""
    model = nn.ModuleDict(
        {
            "a": nn.Linear(32, 64).to(BF16),
            "lm_head": nn.Linear(32, 64, bias=False).to(BF16),
            "k_proj": nn.Linear(32, 16).to(BF16),
        }
    )
    model["fp32"] = nn.Linear(8, 8)
    head_w = model["lm_head"].weight
    assert pack_linears(model, skip=("k_proj",)) == 2
    assert isinstance(model["a"], OneDNNLinear) and model["a"].weight is None
    assert isinstance(model["lm_head"], OneDNNLinear) and model["lm_head"].weight is head_w
    assert type(model["k_proj"]) is nn.Linear and type(model["fp32"]) is nn.Linear
    assert pack_linears(model, skip=("k_proj",)) == 0
    with pytest.raises(ValueError, match="bf16 CPU"):
        OneDNNLinear.from_weight(torch.zeros(4, 4))


def test_packed_module_keeps_its_weights_reachable():
    """A packed model's ``state_dict`` equals the original's bit for bit (the z-lab peer and
    ``save_drafter`` read it after an engine has run), ``load_state_dict`` repacks, ``.float()``
    falls back to ``F.linear`` on the exact fp32 weight, and :func:`unpack_linears` restores
    ``nn.Linear`` s with the same weights."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(BF16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 64, generator=g).to(BF16)
    with torch.no_grad():
        y = model(x)
        assert pack_linears(model) == 2
        assert model.state_dict().keys() == before.keys()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        assert torch.allclose(model(x).float(), y.float(), rtol=2**-7, atol=1e-2)
        twice = {k: v * 2 for k, v in before.items()}
        model.load_state_dict(twice)
        assert torch.equal(model.state_dict()["2.weight"], twice["2.weight"])
        model.load_state_dict(before)
        model.float()
        assert model[0].packed is None and model[0].weight.dtype == torch.float32
        assert torch.equal(
            model(x.float()),
            F.linear(
                F.silu(F.linear(x.float(), before["0.weight"].float(), before["0.bias"].float())),
                before["2.weight"].float(),
            ),
        )
        model.to(BF16)
        assert model[0].packed is not None
        assert unpack_linears(model) == 2 and type(model[0]) is nn.Linear
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.fixture(scope="module")
def bf16_pair():
    return load_pair(None, None, BF16)


def test_dflash_lossless_on_prepacked_bf16(bf16_pair, smollm2):
    """The runner prepacks the bf16 target and drafter (k/v projections stay dense for the
    stacked context-K/V GEMM); DFlash equals plain decoding on the same prepacked target token
    for token, up to bf16 ties (1-row vs K-row GEMMs): oracle drafts for long acceptances, then
    the shipped drafter's own drafts."""
    target, drafter = bf16_pair
    prompts = [chat_prompt_ids(smollm2.tokenizer, t) for t in mixed_prompts(3)]
    ref = plain_outputs(target, prompts, 20, batch_invariant=False)  # the mode off: prepacked linears
    assert isinstance(target.model.layers[0].mlp.gate_up, OneDNNLinear)
    assert isinstance(target.model.lm_head, OneDNNLinear) and target.model.lm_head.weight is target.model.embed.weight
    ties = 0
    OracleProposer.continuations = [p + r for p, r in zip(prompts, ref)]
    stats = LoopStats(4)
    reqs = [Request(p, 20) for p in prompts]
    got = generate(target, drafter, reqs, 4, stats, proposer_cls=OracleProposer, batch_invariant=False)
    outs = [o.output_ids for o in got]
    ties += sum(same_or_tie(target.model, p, r, o, ROWS_TIE) for p, r, o in zip(prompts, ref, outs))
    assert stats.tau > 1.5
    assert isinstance(drafter.fc, OneDNNLinear) and type(drafter.layers[0].self_attn.k_proj) is nn.Linear
    saved = load_drafter(SHIPPED_DRAFTERS / DEFAULT_DRAFTER, BF16).state_dict()  # the z-lab peer reads this after a run
    assert drafter.state_dict().keys() == saved.keys()
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in saved.items())
    stats = LoopStats(4)
    outs = [generate(target, drafter, [Request(p, 20)], 4, stats, batch_invariant=False)[0].output_ids for p in prompts]
    ties += sum(same_or_tie(target.model, p, r, o, ROWS_TIE) for p, r, o in zip(prompts, ref, outs))
    print(f"shipped drafter block 4: tau {stats.tau:.2f}; {ties} of {2 * len(prompts)} runs parted at a tie")
    assert stats.tau > 1.2
    assert ties <= len(prompts)


def test_prepacked_logits_as_close_to_fp32_as_f_linear(smollm2):
    """Logits of the real target in bf16 with prepacked linears are as close to the fp32 target's
    as the same bf16 target's through ``F.linear`` (both are bf16 GEMMs; only the layout differs)."""
    from dflash_trt.checkpoints.loader import load_target
    from dflash_trt.models.layers import AttentionMetadata
    from dflash_trt.models.prefill import KVCache

    def logits(model, ids):
        cfg = model.cfg
        dt = model.embed.weight.dtype
        cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), dt, "cpu")
        pos = torch.arange(len(ids)).unsqueeze(0)
        return model(torch.tensor([ids]), AttentionMetadata.causal(pos, len(ids)), cache.layers).logits[0].float()

    ids = chat_prompt_ids(smollm2.tokenizer, mixed_prompts(1)[0])
    exact = logits(smollm2.model, ids)
    model = load_target(None, BF16).model
    dense = logits(model, ids)
    assert pack_linears(model) > 0
    packed = logits(model, ids)
    d_dense, d_packed = float((dense - exact).abs().max()), float((packed - exact).abs().max())
    agree = float((packed.argmax(-1) == exact.argmax(-1)).float().mean())
    print(f"max |logit - fp32| over {len(ids)} positions: F.linear {d_dense:.3f}, prepacked {d_packed:.3f}")
    print(f"argmax agreement with fp32 {agree:.3f}")
    assert d_packed < 1.5 * d_dense + 0.1
    assert agree >= 0.95
