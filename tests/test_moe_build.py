"""Mixture-of-experts targets in the builder: the memory plan from a ``config.json`` alone, and
the TensorRT-LLM checkpoint of a Qwen3-MoE build.

References (the tests name them):
* parameter counts: transformers 5.24's own ``GptOssForCausalLM`` / ``Qwen3MoeForCausalLM`` built
  at the real shapes on the meta device, and the published counts (OpenAI's gpt-oss model card:
  120b 116.83B total / 5.13B active, 20b 20.91B / 3.61B; Qwen's card: Qwen3-30B-A3B 30.5B / 3.3B);
* TensorRT-LLM checkpoint of Qwen3-MoE: ``tensorrt_llm/models/qwen/convert.py`` (MoE branch:
  ``rank_experts = mapping.ep_experts(E)``, w1/w3 split on dim 1 and w2 on dim 2 by
  ``moe_tp_size`` / ``moe_tp_rank``, ``mlp.fc = concat([w3, w1], dim=-2)``, ``mlp.proj = w2``,
  ``mlp.router`` fp32), ``tensorrt_llm/mapping.py`` (``moe_tp_rank = tp_rank // moe_ep_size``,
  ``moe_ep_rank = tp_rank % moe_ep_size``), ``layers/moe.py`` ``MOEWeightWrapper`` (stacked
  expert parameters), reimplemented here from the HF checkpoint that transformers wrote;
* quantized values: ModelOpt 0.47's ``NVFP4QTensor`` on each expert's fused [gate; up] and down
  weights, and ModelOpt's own ``export_hf_checkpoint`` of the same transformers model for the
  unified HF checkpoint's names, shapes and dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_trt.builder.config import BuildConfig
from dflash_trt.builder.moe_plan import MoEShape, param_counts
from dflash_trt.errors import DFlashError

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "build_configs" / "shapes"
transformers = pytest.importorskip("transformers")


def shape_json(name: str) -> dict:
    return json.loads((SHAPES / f"{name}.json").read_text())


# --------------------------------------------------------------------------------------------
# parameter counts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,cls",
    [
        ("gpt-oss-120b", "GptOss"),
        ("gpt-oss-20b", "GptOss"),
        ("qwen3-30b-a3b", "Qwen3Moe"),
        ("qwen3-coder-30b-a3b-instruct", "Qwen3Moe"),
    ],
)
def test_total_parameters_equal_transformers(name, cls):
    """The plan's total count is transformers' model's parameter count at the real shape."""
    cfg = shape_json(name)
    kw = {k: v for k, v in cfg.items() if k not in ("quantization_config", "architectures", "model_type")}
    with torch.device("meta"):
        ref = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**kw))
    n_ref = sum(p.numel() for p in ref.parameters())
    counts = param_counts(MoEShape.from_hf(cfg))
    print(f"\n{name}: {counts.total:,} parameters (transformers: {n_ref:,}), active {counts.active:,}")
    assert counts.total == n_ref


@pytest.mark.parametrize(
    "name,total,active",
    [("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9), ("qwen3-30b-a3b", 30.5e9, None)],
)
def test_counts_match_published(name, total, active):
    c = param_counts(MoEShape.from_hf(shape_json(name)))
    assert abs(c.total - total) / total < 0.01, c
    if active is not None:  # OpenAI's convention: the LM head counted, the embedding (a lookup) not
        assert abs(c.active - active) / active < 0.01, c
        assert abs(c.active - round(active / 1e8) * 1e8) / active < 0.01  # and the rounded 5.1B / 3.6B
    else:
        # Qwen's "3.3B activated" counts the embedding too: 3.353B, i.e. 3.3B at the card's two
        # significant digits (truncated); no convention is within 1 % of 3.30 (3.04B without it)
        assert int(c.active_with_embedding / 1e8) == 33 and abs(c.active - 3.04e9) < 0.01e9, c


# --------------------------------------------------------------------------------------------
# build config knobs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knobs,split",
    [({"tp_size": 8}, (8, 1)), ({"tp_size": 8, "moe_ep_size": 4}, (2, 4)), ({"tp_size": 4, "moe_tp_size": 1}, (1, 4))],
)
def test_moe_split_fills_in_like_trtllm_mapping(knobs, split):
    assert BuildConfig.from_dict(knobs).moe_split == split


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"tp_size": 4, "moe_tp_size": 2, "moe_ep_size": 4}, "moe_tp_size 2 x moe_ep_size 4 must equal tp_size 4"),
        ({"tp_size": 8, "moe_ep_size": 3}, "must equal tp_size 8"),
        ({"moe_tp_size": 0}, "moe_tp_size and moe_ep_size must be >= 1"),
        ({"expert_quant": "int4"}, "expert_quant must be one of auto, none, fp8, nvfp4, mxfp4"),
        ({"moe_ep_size": "two"}, "moe_ep_size must be int"),
    ],
)
def test_bad_moe_knobs(knobs, match):
    with pytest.raises(DFlashError, match=match):
        BuildConfig.from_dict(knobs)


# --------------------------------------------------------------------------------------------
# the plan per rank (TP attention, MoE-TP / EP experts)
# --------------------------------------------------------------------------------------------


def _plan(name: str, config: str, **overrides):
    from dflash_trt.builder.plan import memory_plan
    from dflash_trt.checkpoints.zlab import drafter_config_for
    from dflash_trt.models.config import TargetConfig

    bc = BuildConfig.load(ROOT / "build_configs" / f"{config}.yaml", overrides)
    tcfg = TargetConfig.from_hf(shape_json(name))
    return memory_plan(bc, tcfg, drafter_config_for(tcfg, 5, bc.block_size, 0)), bc


@pytest.mark.parametrize(
    "mtp,mep,fmt", [(1, 8, "nvfp4"), (2, 4, "nvfp4"), (8, 1, "fp8"), (2, 4, "mxfp4"), (1, 8, "none")]
)
def test_gpt_oss_120b_per_rank_bytes(mtp, mep, fmt):
    """gpt-oss-120b on 8 ranks: expert bytes per rank from the formats (NVFP4 0.5 + 1/16 B per
    weight + fp32 per-expert and activation scales; FP8 1 B + the same scales; MXFP4 0.5 + 1/32;
    bf16 2), the 2880-wide experts cut by MoE-TP and the 128 experts by EP; attention the same
    for every split; sliding layers counted at W + block_size tokens."""
    plan, bc = _plan("gpt-oss-120b", "b300x8-nvfp4-gpt-oss-120b", moe_tp_size=mtp, moe_ep_size=mep, expert_quant=fmt)
    L, H, E, Im, V = 36, 2880, 128, 2880, 201088
    e, im = E // mep, Im // mtp
    n = e * 2 * im * H + e * H * im  # fc + proj weights of one layer on one rank
    per_b = {"nvfp4": 0.5 + 1 / 16, "fp8": 1.0, "mxfp4": 0.5 + 1 / 32, "none": 2.0}[fmt]
    scales = {"nvfp4": 2 * (4 * e + 4), "fp8": 2 * (4 * e + 4), "mxfp4": 0, "none": 0}[fmt]
    roles = plan.target_weights_by_role
    assert roles["experts"] == pytest.approx(L * (n * per_b + scales), rel=1e-12)
    assert roles["expert_bias"] == pytest.approx(L * (e * 2 * im + e * H) * 2, rel=1e-12)
    q, kv = 64 * 64 // 8, 8 * 64 // 8  # per rank: 8 q heads, 1 KV head
    attn = L * (((q + 2 * kv) * H + H * q) * (0.5 + 1 / 16) + 2 * 8)  # NVFP4 qkv and o
    assert roles["attention"] == pytest.approx(attn, rel=1e-12)
    assert roles["router"] == L * (E * H + E) * 2  # bf16, replicated, never quantized
    assert roles["embedding"] == roles["lm_head"] == V // 8 * H * 2
    assert plan.tp_size == 8 and f"moe_tp_size {mtp} x moe_ep_size {mep}" in plan.moe_split
    # KV: 18 full layers x 1 KV head x 64 x (K, V) x fp8 per token; 18 sliding layers hold W + B tokens
    swa = min(bc.max_seq_len, 128 + bc.block_size) / bc.max_seq_len
    assert plan.target_kv_bytes_per_token == pytest.approx(18 * 128 + 18 * 128 * swa)
    assert plan.max_concurrency == min(bc.max_batch_size, int(plan.kv_token_capacity / bc.max_seq_len))


def test_gpt_oss_20b_on_one_h100_fp8():
    plan, bc = _plan("gpt-oss-20b", "hopper-fp8-gpt-oss-20b")
    plan.check()
    roles = plan.target_weights_by_role
    n = 24 * 32 * 3 * 2880 * 2880  # every expert weight, one byte each
    assert roles["experts"] == n + 24 * 2 * (4 * 32 + 4)
    assert plan.params == {"total": 20914757184, "active": 3608307264, "active_with_embedding": 4187440704}
    assert 20e9 < plan.target_weight_bytes < 24e9 and plan.max_concurrency == bc.max_batch_size


def test_plan_cli_prints_counts(capsys):
    from dflash_trt.cli import main

    capsys.readouterr()
    args = ["plan", "--config", str(ROOT / "build_configs" / "b300x8-nvfp4-gpt-oss-120b.yaml")]
    assert main(args + ["--target-config", str(SHAPES / "gpt-oss-120b.json")]) == 0
    out = capsys.readouterr().out
    assert "116.83B total, 5.13B active" in out and "16 of 128 experts per rank" in out
    assert "18 sliding-window layers (W 128) hold min(max_seq_len, W + block_size) = 144 tokens" in out


@pytest.mark.parametrize(
    "shape,extra,match",
    [
        ("gpt-oss-120b", ["--set", "moe_tp_size=2", "--set", "moe_ep_size=2"], "must equal tp_size 8"),
        ("gpt-oss-120b", ["--set", "moe_tp_size=8", "--set", "moe_ep_size=1"], "not whole nvfp4 blocks of 16"),
        ("gpt-oss-120b", ["--set", "moe_ep_size=0"], "must be >= 1"),
        (
            "experts125",
            ["--tp", "2", "--set", "moe_tp_size=1", "--set", "moe_ep_size=2"],
            "does not divide the target's 125 experts",
        ),
        ("experts125", ["--tp", "8"], "does not divide the target's 32 attention heads and 4 KV heads"),
    ],
)
def test_plan_bad_splits(tmp_path, capsys, shape, extra, match):
    from dflash_trt.cli import main

    if shape == "experts125":
        cfg = shape_json("qwen3-30b-a3b") | {"num_experts": 125}
        path = tmp_path / "c.json"
        path.write_text(json.dumps(cfg))
    else:
        path = SHAPES / f"{shape}.json"
    capsys.readouterr()
    cfg = str(ROOT / "build_configs" / "b300x8-nvfp4-gpt-oss-120b.yaml")
    rc = main(["plan", "--config", cfg, "--target-config", str(path), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("dflash-trt: error:") and match in err[0], err


@pytest.mark.parametrize("mtp,mep", [(2, 2), (1, 4), (4, 1)])
def test_expert_shards_reassemble(mtp, mep):
    """Every rank's expert part (``shard_experts``) reassembles to the whole (``unshard_experts``);
    rank r holds EP rank r % moe_ep's experts and MoE-TP rank r // moe_ep's slice of each half."""
    from dflash_trt.checkpoints import trtllm

    g = torch.Generator().manual_seed(mtp)
    fc, proj, per_expert, act = (
        torch.randn(8, 2 * 16, 12, generator=g),
        torch.randn(8, 12, 16, generator=g),
        torch.randn(8, 1, generator=g),
        torch.randn(1, generator=g),
    )
    for split, t in (
        (trtllm.EXPERT_FC, fc),
        (trtllm.EXPERT_PROJ, proj),
        (trtllm.EXPERT_FC, per_expert),
        (trtllm.EXPERT_FC, act),
    ):
        parts = [trtllm.shard_experts(t, split, mtp, mep, r) for r in range(mtp * mep)]
        assert torch.equal(trtllm.unshard_experts(parts, split, mtp, mep), t)
    r = mtp * mep - 1  # the last rank: last experts, last slice of gate and of up
    e0, w = 8 - 8 // mep, 16 // mtp
    part = trtllm.shard_experts(fc, trtllm.EXPERT_FC, mtp, mep, r)
    assert torch.equal(part, torch.cat([fc[e0:, 16 - w : 16], fc[e0:, 32 - w :]], 1))
    with pytest.raises(DFlashError, match="cannot split 8 experts over moe_ep_size 3"):
        trtllm.shard_experts(fc, trtllm.EXPERT_FC, 1, 3, 0)


# --------------------------------------------------------------------------------------------
# a Qwen3-MoE build: NVFP4, tp 4 = moe_tp 2 x moe_ep 2
# --------------------------------------------------------------------------------------------

E, IM, H, LAYERS, DENSE = 8, 32, 64, 4, 2  # experts, expert width, hidden, layers, the dense layer


def tiny_moe(vocab: int):
    """transformers' Qwen3-MoE: 4 layers (layer 2 dense), 8 experts of width 32, top 2, 4 KV
    heads (so tp 4 holds whole heads)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=IM,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=E,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[DENSE],
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def moe_build(smollm2, tmp_path_factory):
    pytest.importorskip("modelopt")
    from helpers import saved_drafter

    from dflash_trt.builder.builder import build_engine
    from dflash_trt.checkpoints.loader import load_target
    from dflash_trt.checkpoints.zlab import init_drafter

    d = tmp_path_factory.mktemp("moe")
    hf = tiny_moe(smollm2.model.cfg.vocab_size)
    hf.save_pretrained(str(d / "hf"))
    smollm2.tokenizer.save_pretrained(str(d / "hf"))
    target = load_target(str(d / "hf"))
    drafter = saved_drafter(init_drafter(target.model.cfg, 1, 4, 0, seed=0), d)
    bc = BuildConfig.load(
        ROOT / "build_configs" / "cpu-fp32.yaml",
        {
            "target_quant": "nvfp4",
            "tp_size": 4,
            "moe_tp_size": 2,
            "moe_ep_size": 2,
            "block_size": 4,
            "calibration.num_samples": 4,
            "calibration.max_seq_len": 32,
        },
    )
    out = d / "engine"
    build_engine(bc, str(d / "hf"), drafter, out, progress=False, log=lambda *a: None)
    return hf, d / "hf", out, bc, drafter


def _hf_experts(hf_dir: Path, layer: int, kind: str) -> torch.Tensor:
    """``[E, out, in]`` of one expert projection from the per-expert names transformers saved."""
    sd = load_file(str(hf_dir / "model.safetensors"))
    return torch.stack([sd[f"model.layers.{layer}.mlp.experts.{e}.{kind}.weight"] for e in range(E)])


def test_trtllm_layout_follows_the_converter(moe_build):
    """Names, shapes and dtypes of every rank file; the router fp32 and equal to HF ``mlp.gate``;
    expert fc / proj bitwise equal to ModelOpt's NVFP4 quantization of each expert, laid out per
    rank as ``qwen/convert.py`` does (EP experts, MoE-TP split, ``concat([w3, w1])``); dequantized,
    close to the converter's float tensors."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    from dflash_trt.quantization.nvfp4 import dequantize_nvfp4

    _, hf_dir, out, bc, _ = moe_build
    hf_sd = load_file(str(hf_dir / "model.safetensors"))
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert cfg["architecture"] == "Qwen3MoeForCausalLM" and cfg["qwen_type"] == "qwen3_moe"
    assert cfg["mapping"] == {"world_size": 4, "tp_size": 4, "pp_size": 1, "moe_tp_size": 2, "moe_ep_size": 2}
    assert cfg["moe"]["num_experts"] == E and cfg["moe"]["top_k"] == 2 and cfg["moe"]["normalization_mode"] == 1
    assert cfg["moe_intermediate_size"] == IM and cfg["mlp_only_layers"] == [DENSE]
    assert "*router" in cfg["quantization"]["exclude_modules"] and cfg["quantization"]["quant_algo"] == "NVFP4"

    mep, el, iml = 2, E // 2, IM // 2  # moe_tp 2: each rank half of an expert's width
    for layer in (0, 3):
        w1, w3, w2 = (_hf_experts(hf_dir, layer, k) for k in ("gate_proj", "up_proj", "down_proj"))
        # ModelOpt's quantization of each whole expert (gate and up fused: one global scale)
        fc_q = [NVFP4QTensor.quantize(torch.cat([w1[e], w3[e]]), 16) for e in range(E)]
        pr_q = [NVFP4QTensor.quantize(w2[e], 16) for e in range(E)]
        for rank in range(4):
            t = load_file(str(out / "target" / f"rank{rank}.safetensors"))
            p = f"transformer.layers.{layer}.mlp."
            tp_r, ep_r = rank // mep, rank % mep  # tensorrt_llm/mapping.py
            experts = range(ep_r * el, (ep_r + 1) * el)  # mapping.ep_experts
            assert t[p + "router.weight"].dtype == torch.float32
            assert torch.equal(t[p + "router.weight"], hf_sd[f"model.layers.{layer}.mlp.gate.weight"])
            shapes = {k[len(p) :]: (tuple(v.shape), v.dtype) for k, v in t.items() if k.startswith(p)}
            assert shapes == {
                "router.weight": ((E, H), torch.float32),
                "fc.weight": ((el, 2 * iml, H // 2), torch.uint8),
                "fc.weights_scaling_factor": ((el, 2 * iml, H // 16), torch.float8_e4m3fn),
                "fc.weights_scaling_factor_2": ((el, 1), torch.float32),
                "fc.activation_scaling_factor": ((1,), torch.float32),
                "proj.weight": ((el, H, iml // 2), torch.uint8),
                "proj.weights_scaling_factor": ((el, H, iml // 16), torch.float8_e4m3fn),
                "proj.weights_scaling_factor_2": ((el, 1), torch.float32),
                "proj.activation_scaling_factor": ((1,), torch.float32),
            }
            # convert.py: w3/w1 split on dim 1, w2 on dim 2, fc = concat([w3, w1], dim=-2)
            up = slice(IM + tp_r * iml, IM + (tp_r + 1) * iml)  # rows of up in the fused [gate; up]
            gate = slice(tp_r * iml, (tp_r + 1) * iml)
            for j, e in enumerate(experts):
                q, bs, s2 = fc_q[e]
                packed = q._quantized_data
                assert torch.equal(t[p + "fc.weight"][j], torch.cat([packed[up], packed[gate]]))
                assert torch.equal(
                    t[p + "fc.weights_scaling_factor"][j].view(torch.uint8),
                    torch.cat([bs[up], bs[gate]]).view(torch.uint8),
                )
                assert torch.equal(t[p + "fc.weights_scaling_factor_2"][j].reshape(()), s2.reshape(()))
                q2, bs2, s22 = pr_q[e]
                cols = slice(tp_r * iml // 2, (tp_r + 1) * iml // 2)
                assert torch.equal(t[p + "proj.weight"][j], q2._quantized_data[:, cols])
                assert torch.equal(
                    t[p + "proj.weights_scaling_factor"][j].view(torch.uint8), bs2[:, tp_r : tp_r + 1].view(torch.uint8)
                )
            ref_fc = torch.cat([w3.split(iml, 1)[tp_r], w1.split(iml, 1)[tp_r]], dim=-2)[list(experts)]
            got = torch.stack(
                [
                    dequantize_nvfp4(
                        t[p + "fc.weight"][j],
                        t[p + "fc.weights_scaling_factor"][j],
                        t[p + "fc.weights_scaling_factor_2"][j],
                    )
                    for j in range(el)
                ]
            )
            assert float((got - ref_fc).abs().max()) < 0.25 * float(ref_fc.abs().max())
    # the dense layer keeps the dense names (fc = gate_proj, gate = up_proj), TP 4 on the intermediate size
    t0 = load_file(str(out / "target" / "rank0.safetensors"))
    d = f"transformer.layers.{DENSE}.mlp."
    assert t0[d + "fc.weight"].shape == (128 // 4, H // 2) and t0[d + "proj.weight"].shape == (H, 128 // 4 // 2)
    assert not any(k.startswith(d + "router") for k in t0)
    scales = [
        load_file(str(out / "target" / f"rank{r}.safetensors"))["transformer.layers.0.mlp.fc.activation_scaling_factor"]
        for r in range(4)
    ]
    assert all(torch.equal(s, scales[0]) for s in scales) and float(scales[0]) > 0


def test_plan_is_what_build_writes(moe_build):
    """The memory plan's target bytes per rank are the bytes of each written rank file's target tensors."""
    from dflash_trt.builder.plan import memory_plan
    from dflash_trt.checkpoints.loader import load_target

    _, hf_dir, out, bc, _ = moe_build
    plan = memory_plan(bc, load_target(str(hf_dir)).model.cfg, None)
    m = json.loads((out / "engine.json").read_text())
    assert m["moe_split"] == {"moe_tp_size": 2, "moe_ep_size": 2}
    import yaml

    api = yaml.safe_load((out / "trtllm" / "llm_api.yaml").read_text())
    assert (api["tensor_parallel_size"], api["moe_tensor_parallel_size"], api["moe_expert_parallel_size"]) == (4, 2, 2)
    assert m["memory_plan"]["target_weight_bytes"] == plan.target_weight_bytes
    for r in range(4):
        t = load_file(str(out / "target" / f"rank{r}.safetensors"))
        assert sum(v.numel() * v.element_size() for v in t.values()) == plan.target_weight_bytes


def test_unified_hf_checkpoint_equals_modelopt_export(moe_build, tmp_path):
    """``hf/target`` has the names, shapes and dtypes of ModelOpt's own ``export_hf_checkpoint``
    of the same transformers model quantized with ``NVFP4_DEFAULT_CFG``; the router excluded."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    out = moe_build[2]
    hf = tiny_moe(moe_build[0].config.vocab_size)  # unsaved (save_pretrained leaves a dtype ModelOpt trips on)
    ids = torch.randint(0, 100, (2, 16))
    mtq.quantize(hf, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(hf, export_dir=str(tmp_path / "mo"))
    ref = load_file(str(tmp_path / "mo" / "model.safetensors"))
    ours = load_file(str(out / "hf" / "target" / "model.safetensors"))

    def layout(sd):
        return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}

    assert layout(ours) == layout(ref)
    assert_same_weights(ours, ref)
    q = json.loads((out / "hf" / "target" / "hf_quant_config.json").read_text())["quantization"]
    assert "model.layers.*.mlp.gate" in q["exclude_modules"] and q["quant_algo"] == "NVFP4"


def assert_same_weights(ours: dict, ref: dict) -> None:
    """Every tensor bitwise equal, but the activation scales (calibrated on other data)."""
    for k, v in ref.items():
        if not k.endswith("input_scale"):
            a, b = ours[k], v
            if a.dtype == torch.float8_e4m3fn:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a, b), k


def test_moe_engine_loads_on_every_rank(moe_build):
    """The NVFP4 tp 4 engine (moe_tp 2 x moe_ep 2) runs as 4 ranks only; each rank's sparse layers
    hold its 4 experts (``expert_offset`` from the EP rank) and its half of each expert's width,
    dequantized from its own rank file ([up; gate] rows back to [gate; up])."""
    from dflash_trt.checkpoints.engine_dir import load_engine
    from dflash_trt.quantization.nvfp4 import dequantize_nvfp4

    out = moe_build[2]
    with pytest.raises(DFlashError, match="has tp_size 4: run it as 4 ranks"):
        load_engine(out)
    for rank in (1, 2):
        t, _, _ = load_engine(out, rank=rank, world_size=4)
        m = t.model.layers[0].mlp
        assert t.model.engine_shard.moe == (2, 2) and m.expert_offset == (rank % 2) * E // 2
        assert m.gate_up.shape == (E // 2, IM, H) and m.down.shape == (E // 2, H, IM // 2)
        f = load_file(str(out / "target" / f"rank{rank}.safetensors"))
        p = "transformer.layers.0.mlp.fc."
        fc = dequantize_nvfp4(*(f[p + k][1] for k in ("weight", "weights_scaling_factor", "weights_scaling_factor_2")))
        assert torch.equal(m.gate_up[1], torch.cat([fc[IM // 2 :], fc[: IM // 2]]))


def test_build_bad_splits(moe_build, tmp_path, capsys):
    """moe_tp_size x moe_ep_size != tp_size, and an expert slice that is not whole NVFP4 blocks:
    one line, exit 2, nothing written."""
    from helpers import main_error

    _, hf_dir, _, _, drafter = moe_build
    cfg = str(ROOT / "build_configs" / "cpu-fp32.yaml")
    for extra, match in (
        (
            ["--tp", "4", "--set", "moe_tp_size=2", "--set", "moe_ep_size=1"],
            "moe_tp_size 2 x moe_ep_size 1 must equal tp_size 4",
        ),
        (["--tp", "4", "--set", "target_quant=nvfp4", "--set", "moe_tp_size=4"], "not whole nvfp4 blocks of 16"),
        (["--tp", "4", "--set", "moe_ep_size=3", "--set", "moe_tp_size=1"], "must equal tp_size 4"),
    ):
        out = tmp_path / "eng"
        args = ("build", "--config", cfg, "--target", str(hf_dir), "--drafter", drafter, "--out", str(out), *extra)
        assert match in main_error(capsys, *args)
        assert not out.exists() and not list(tmp_path.glob(".eng*"))


# --------------------------------------------------------------------------------------------
# a gpt-oss build: the unified HF checkpoint only (TensorRT-LLM has no gpt-oss converter)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss_build(smollm2, tmp_path_factory):
    pytest.importorskip("modelopt")
    from helpers import saved_drafter
    from test_gpt_oss import tiny_gpt_oss

    from dflash_trt.builder.builder import build_engine
    from dflash_trt.checkpoints.loader import load_target
    from dflash_trt.checkpoints.zlab import init_drafter

    d = tmp_path_factory.mktemp("gptoss")
    tiny_gpt_oss(smollm2.model.cfg.vocab_size).save_pretrained(str(d / "hf"))
    smollm2.tokenizer.save_pretrained(str(d / "hf"))
    drafter = saved_drafter(init_drafter(load_target(str(d / "hf")).model.cfg, 1, 4, 0, seed=0), d)
    bc = BuildConfig.load(
        ROOT / "build_configs" / "cpu-fp32.yaml",
        {
            "target_quant": "nvfp4",
            "tp_size": 2,
            "moe_ep_size": 2,
            "block_size": 4,
            "calibration.num_samples": 4,
            "calibration.max_seq_len": 32,
        },
    )
    out = d / "engine"
    build_engine(bc, str(d / "hf"), drafter, out, progress=False, log=lambda *a: None)
    return out, tiny_gpt_oss


def test_gpt_oss_build_equals_modelopt_export(gpt_oss_build, smollm2, tmp_path):
    """``hf/target`` of a gpt-oss NVFP4 build: ModelOpt's ``export_hf_checkpoint`` of the same
    transformers model has the same names, shapes and dtypes (fused experts ``[E, in, out]``,
    gate/up interleaved, one per-tensor scale over the experts, sinks and biases unquantized) and
    the same bytes but for activation scales; no ``target/`` TensorRT-LLM checkpoint; the
    router excluded; the engine is refused by this runtime in one line."""
    import modelopt.torch.quantization as mtq
    import yaml
    from modelopt.torch.export import export_hf_checkpoint

    from dflash_trt.checkpoints.engine_dir import load_engine

    out, tiny_gpt_oss = gpt_oss_build
    hf = tiny_gpt_oss(smollm2.model.cfg.vocab_size)
    hf.config.architectures = ["GptOssForCausalLM"]
    ids = torch.randint(0, 100, (2, 16))
    mtq.quantize(hf, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(hf, export_dir=str(tmp_path / "mo"))
    ref = load_file(str(tmp_path / "mo" / "model.safetensors"))
    ours = load_file(str(out / "hf" / "target" / "model.safetensors"))
    assert {k: (tuple(v.shape), v.dtype) for k, v in ours.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in ref.items()
    }
    assert ours["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64 // 2, 2 * 32)
    assert_same_weights(ours, ref)
    q = json.loads((out / "hf" / "target" / "hf_quant_config.json").read_text())["quantization"]
    assert "model.layers.*.mlp.router" in q["exclude_modules"] and q["quant_algo"] == "NVFP4"
    m = json.loads((out / "engine.json").read_text())
    assert not (out / "target").exists() and m["target_checkpoint"] == "hf/target"
    assert m["moe_split"] == {"moe_tp_size": 1, "moe_ep_size": 2}
    api = yaml.safe_load((out / "trtllm" / "llm_api.yaml").read_text())
    assert (api["moe_tensor_parallel_size"], api["moe_expert_parallel_size"]) == (1, 2)
    assert "exit 1" in (out / "trtllm" / "build.sh").read_text()
    with pytest.raises(DFlashError, match="gpt_oss \\(mixture-of-experts\\) target is not supported"):
        load_engine(out)
