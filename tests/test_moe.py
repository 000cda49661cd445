"""Qwen3-MoE targets (``models/moe.py``): a tiny random ``Qwen3MoeForCausalLM`` that transformers
builds and saves (routed experts in some layers, a dense MLP in the others, ``mlp_only_layers``,
``head_dim`` != hidden / heads, random q/k norms, ``norm_topk_prob`` on and off) loads through
our loader from the checkpoint's per-expert tensors and gives transformers' logits and hidden
states; in the engine, DFlash (an oracle proposer: long acceptances and mid-block rejections;
and a random drafter) equals plain decoding token for token at batch 1 and in flight (the
batch-invariant mode, on by default in fp32, covers the expert GEMMs); tensor parallelism
splits its experts (the 2-rank runs: test_moe_parallel.py); its engine build:
tests/test_moe_build.py."""

from __future__ import annotations

import pytest
import torch
from helpers import check_lossless_oracle_and_drafter, max_diff
from test_models import PROMPTS, full_forward, save_tiny

from dflash_trt.checkpoints.loader import load_target
from dflash_trt.models.moe import MoEBlock

transformers = pytest.importorskip("transformers")


def tiny_qwen3_moe(vocab: int, norm_topk_prob: bool, seed: int = 0):
    """transformers' Qwen3-MoE at a tiny size: 6 layers, sparse ones 1 and 5 (every second
    layer, layer 3 listed dense), 8 experts, top 2."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # the default init leaves the norms at 1: make them matter
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def moe_pair(request, smollm2, tmp_path_factory):
    """(transformers' model, ours loaded by our loader from the checkpoint transformers saved)."""
    hf = tiny_qwen3_moe(smollm2.model.cfg.vocab_size, request.param)
    out = save_tiny(hf, smollm2.tokenizer, tmp_path_factory.mktemp("qwen3moe"))
    return hf, load_target(str(out))


def test_logits_and_features_equal_transformers(moe_pair, smollm2):
    hf, ours = moe_pair
    cfg = ours.model.cfg
    assert cfg.family == "qwen3_moe" and cfg.qk_norm and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert [isinstance(layer.mlp, MoEBlock) for layer in ours.model.layers] == [cfg.is_moe_layer(i) for i in range(6)]
    ids = smollm2.tokenizer(PROMPTS[2])["input_ids"]
    layers = (1, 3, 5)
    got = full_forward(ours.model, ids, layers)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    d = max_diff(got.logits, ref.logits) / float(ref.logits.abs().max())
    h = cfg.hidden_size
    fd = max(
        max_diff(got.features[..., k * h : (k + 1) * h], ref.hidden_states[i + 1]) for k, i in enumerate(layers[:-1])
    )
    print(
        f"\ntiny qwen3_moe (norm_topk_prob {cfg.norm_topk_prob}) vs transformers: logits max relative {d:.2g}, "
        f"features max abs {fd:.2g}"
    )
    assert d < 1e-4 and fd < 1e-4
    # the experts matter: routing every token to expert 0 alone changes the logits
    moe = ours.model.layers[1].mlp
    saved = moe.route
    moe.route = lambda x: (torch.ones(x.shape[0], 1, dtype=x.dtype), torch.zeros(x.shape[0], 1, dtype=torch.long))
    try:
        assert max_diff(full_forward(ours.model, ids).logits, ref.logits) > 100 * max(d, 1e-6)
    finally:
        moe.route = saved


def test_dflash_equals_plain_decoding(moe_pair, smollm2):
    _, target = moe_pair
    prompts = [smollm2.tokenizer(p)["input_ids"] for p in PROMPTS]
    check_lossless_oracle_and_drafter(target, prompts, 16, "qwen3_moe")


def test_tensor_parallel_splits_the_experts(moe_pair):
    """By default (TensorRT-LLM's: MoE TP over all ranks, EP 1) rank 1 of 2 holds every
    expert's second half of the intermediate dimension: those rows of the gate and of the up
    half of ``gate_up``, those input columns of ``down``; the router stays whole."""
    import copy

    from dflash_trt.runtime.distributed import shard_target

    class Group:
        size, rank = 2, 1

    full = moe_pair[1].model
    model = shard_target(copy.deepcopy(full), Group())
    m, f = model.layers[1].mlp, full.layers[1].mlp
    n = f.intermediate // 2
    assert (m.intermediate, m.expert_offset, model.cfg.moe_intermediate_size) == (n, 0, n)
    assert torch.equal(m.gate_up, torch.cat([f.gate_up[:, n : 2 * n], f.gate_up[:, 3 * n :]], dim=1))
    assert torch.equal(m.down, f.down[:, :, n:])
    assert torch.equal(m.gate.weight, f.gate.weight)
