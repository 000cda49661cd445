"""The builder: build configs, ModelOpt FP8 / NVFP4 formats, TP shards, engine directory, memory plan.

Reference formats (the test names its sources):
* TensorRT-LLM checkpoint names/splits: ``tensorrt_llm/models/llama/convert.py`` (NVIDIA/TensorRT-LLM
  @04a2cacb, ``load_weights_from_hf_model``: ``mlp.fc`` = HF gate_proj, ``mlp.gate`` = up_proj,
  qkv split per q/k/v, dense/proj split on dim 1) and ``tensorrt_llm/quantization/layers.py``
  (FP8Linear / FP4Linear parameter names), ``models/modeling_utils.py`` (``PretrainedConfig``
  required keys, ``QuantConfig`` keys).
* Unified HF checkpoint: ModelOpt 0.47 ``modelopt/torch/export/unified_export_hf.py`` /
  ``quant_utils.py`` (``weight_scale``, ``weight_scale_2``, ``input_scale``, ``hf_quant_config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import generate
from safetensors.torch import load_file

from dflash_trt.builder.config import BuildConfig
from dflash_trt.checkpoints import trtllm
from dflash_trt.errors import DFlashError
from dflash_trt.models.config import TargetConfig
from dflash_trt.quantization.fp8 import dequantize_fp8, quantize_fp8
from dflash_trt.quantization.nvfp4 import dequantize_nvfp4, quantize_nvfp4

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "build_configs").glob("*.yaml"))

# TensorRT-LLM PretrainedConfig (modeling_utils.py) required keys and QuantConfig's allowed keys
TRTLLM_REQUIRED = {"architecture", "dtype", "hidden_size", "num_hidden_layers", "num_attention_heads"}
QUANT_KEYS = {
    "quant_algo",
    "kv_cache_quant_algo",
    "group_size",
    "smoothquant_val",
    "clamp_val",
    "use_meta_recipe",
    "has_zero_point",
    "pre_quant_scale",
    "exclude_modules",
}
# per-layer names of a LLaMA checkpoint (llama/convert.py) and the quantized parameters (quantization/layers.py)
LLAMA_LAYER = {
    "input_layernorm.weight",
    "attention.qkv.weight",
    "attention.dense.weight",
    "post_layernorm.weight",
    "mlp.fc.weight",
    "mlp.gate.weight",
    "mlp.proj.weight",
}
FP8_PARAMS = {"weights_scaling_factor", "activation_scaling_factor"}
NVFP4_PARAMS = {"weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor"}


# --------------------------------------------------------------------------------------------
# build configs
# --------------------------------------------------------------------------------------------


def test_shipped_configs_load():
    names = {p.stem for p in CONFIGS}
    assert {"cpu-fp32", "hopper-fp8", "blackwell-nvfp4", "b300x8-nvfp4"} <= names
    for p in CONFIGS:
        bc = BuildConfig.load(p)
        assert bc.name == p.stem
        text = p.read_text()
        for key in (
            "dtype",
            "target_quant",
            "drafter_quant",
            "kv_cache_dtype",
            "tp_size",
            "max_batch_size",
            "max_seq_len",
            "max_num_tokens",
            "tokens_per_block",
            "block_size",
            "gpu",
            "calibration",
        ):
            assert f"\n{key}:" in text, f"{p.name} lacks {key}"
    b = BuildConfig.load(ROOT / "build_configs" / "b300x8-nvfp4.yaml")
    assert (b.tp_size, b.target_quant, b.gpu, b.device.arch) == (8, "nvfp4", "b300", "sm_103a")


@pytest.mark.parametrize(
    "text,match",
    [
        ("dtype: fp32\ntp_sise: 2\n", "unknown key tp_sise"),
        ("calibration:\n  samples: 3\n", "unknown key calibration.samples"),
        ("tp_size: two\n", "tp_size must be int"),
        ("target_quant: int3\n", "target_quant must be one of"),
        ("target_quant: int4\ngroup_size: 48\n", "group_size must be one of 32, 64, 128, 256"),
        ("head_quant: int8\n", "head_quant int8 needs target_quant int4 or int8"),
        ("target_quant: int4\ntp_size: 2\n", "int4 / int8 engines are single-rank"),
        ("tokens_per_block: 24\n", "power of two"),
        ("[1, 2]\n", "mapping"),
        ("dtype: [\n", "not valid YAML"),
    ],
)
def test_bad_configs(tmp_path, text, match):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(DFlashError, match=match):
        BuildConfig.load(p)


def test_overrides():
    cpu = ROOT / "build_configs" / "cpu-fp32.yaml"  # (a MoE config pins moe_tp_size x moe_ep_size = tp_size)
    bc = BuildConfig.load(cpu, {"tp_size": 3, "calibration.num_samples": 5})
    assert bc.tp_size == 3 and bc.calibration.num_samples == 5
    with pytest.raises(DFlashError, match="unknown key"):
        BuildConfig.load(cpu, {"bogus": 1})
    moe = ROOT / "build_configs" / "b300x8-nvfp4-gpt-oss-120b.yaml"
    assert BuildConfig.load(moe, {"tp_size": 4, "moe_ep_size": 4}).moe_split == (1, 4)
    with pytest.raises(DFlashError, match="moe_tp_size 1 x moe_ep_size 8 must equal tp_size 3"):
        BuildConfig.load(moe, {"tp_size": 3})


# --------------------------------------------------------------------------------------------
# formats vs ModelOpt
# --------------------------------------------------------------------------------------------


def test_quantized_formats_equal_modelopt():
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * torch.rand(96, 1, generator=g) * 3
    packed, bs, s2 = quantize_nvfp4(w)
    ref, ref_bs, ref_s2 = qtensor.NVFP4QTensor.quantize(w, 16)
    assert packed.dtype == torch.uint8 and packed.shape == (96, 32)
    assert bs.dtype == torch.float8_e4m3fn and bs.shape == (96, 4) and s2.shape == (1,)
    assert torch.equal(packed, ref._quantized_data)
    assert torch.equal(bs.view(torch.uint8), ref_bs.view(torch.uint8)) and torch.equal(
        s2.reshape(()), ref_s2.reshape(())
    )
    deq = ref.dequantize(torch.float32, scale=ref_bs, double_scale=ref_s2, block_sizes={-1: 16})
    assert torch.equal(dequantize_nvfp4(packed, bs, s2), deq)
    assert float((deq - w).abs().max()) < 0.2 * float(w.abs().max())
    # FP8: ModelOpt's FP8QTensor with an fp32 input computes the same scale and bytes
    q, s = quantize_fp8(w)
    rq, rs = qtensor.FP8QTensor.quantize(w)
    assert torch.equal(q.view(torch.uint8), rq._quantized_data.view(torch.uint8)) and torch.allclose(
        s.reshape(()), rs.reshape(())
    )
    assert torch.equal(dequantize_fp8(q, s), rq.dequantize(torch.float32, scale=rs))


def test_nibble_order_and_rounding():
    """Low nibble = even element; e2m1 codes and round-half-to-even (ModelOpt packing)."""
    pytest.importorskip("modelopt")
    w = torch.zeros(1, 16)
    w[0, :4] = torch.tensor([6.0, -0.5, 1.25, 5.0])  # amax 6: block scale 1 x global 6/2688
    packed, bs, s2 = quantize_nvfp4(w)
    assert int(packed[0, 0]) == 0x97  # 6.0 -> code 7 (low), -0.5 -> code 9 (high)
    assert dequantize_nvfp4(packed, bs, s2)[0, :4].tolist() == pytest.approx([6.0, -0.5, 1.0, 4.0], rel=1e-6)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_shard_round_trip(tp):
    g = torch.Generator().manual_seed(tp)
    q, k, v = 12 * 16, 4 * 16 if tp != 3 else 3 * 16, 4 * 16 if tp != 3 else 3 * 16
    qkv = torch.randn(q + k + v, 96, generator=g)
    for split, t, extra in (
        (trtllm.QKV, qkv, (q, k, v)),
        (trtllm.COLUMN, torch.randn(48, 96, generator=g), None),
        (trtllm.ROW, torch.randn(96, 96, generator=g), None),
        (trtllm.VOCAB, torch.randn(101, 32, generator=g), None),
    ):
        parts = [trtllm.shard(t, split, tp, r, extra) for r in range(tp)]
        assert len({p.shape for p in parts}) == 1
        assert torch.equal(trtllm.unshard(parts, split, extra, rows=t.shape[0]), t)
    if tp > 1:
        with pytest.raises(DFlashError, match="does not divide"):
            trtllm.check_tp(TargetConfig("llama", 49152, 576, 1536, 30, 9, 3, 64), 2, "target")


# --------------------------------------------------------------------------------------------
# a real build: SmolLM2 target (NVFP4, TP 3) + drafter (FP8)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory, smollm2):
    pytest.importorskip("modelopt")
    from dflash_trt.builder.builder import build_engine

    out = tmp_path_factory.mktemp("eng") / "nvfp4-tp3"
    bc = BuildConfig.load(
        ROOT / "build_configs" / "cpu-fp32.yaml",
        {
            "target_quant": "nvfp4",
            "drafter_quant": "fp8",
            "kv_cache_dtype": "fp8",
            "tp_size": 3,
            "calibration.num_samples": 4,
            "calibration.max_seq_len": 64,
        },
    )
    build_engine(bc, None, None, out, progress=False, log=lambda *a: None)
    return out, bc


def test_engine_directory_layout(built, smollm2):
    out, bc = built
    m = json.loads((out / "engine.json").read_text())
    assert m["tp_size"] == 3 and m["memory_plan"]["kv_token_capacity"] > 0
    from dflash_trt.checkpoints.engine_dir import engine_files_ok

    assert engine_files_ok(out) == [] and len(m["files"]) >= 14
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert set(cfg) >= TRTLLM_REQUIRED and set(cfg["quantization"]) <= QUANT_KEYS
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["mapping"] == {"world_size": 3, "tp_size": 3, "pp_size": 1}
    assert cfg["quantization"]["quant_algo"] == "NVFP4" and cfg["quantization"]["group_size"] == 16
    tc = smollm2.model.cfg
    for r in range(3):
        t = load_file(str(out / "target" / f"rank{r}.safetensors"))
        layer0 = {k[len("transformer.layers.0.") :] for k in t if k.startswith("transformer.layers.0.")}
        assert layer0 >= LLAMA_LAYER
        for lin in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
            assert {f"{lin}.{p}" for p in NVFP4_PARAMS} <= layer0
        assert "attention.kv_cache_scaling_factor" in layer0
        qkv_rows = (tc.num_heads + 2 * tc.num_kv_heads) * tc.head_dim // 3
        assert t["transformer.layers.0.attention.qkv.weight"].shape == (qkv_rows, tc.hidden_size // 2)
        assert t["transformer.layers.0.attention.qkv.weights_scaling_factor"].dtype == torch.float8_e4m3fn
        assert t["transformer.layers.0.attention.dense.weight"].shape == (tc.hidden_size, tc.hidden_size // 3 // 2)
        assert t["transformer.layers.0.mlp.proj.weight"].shape == (tc.hidden_size, tc.intermediate_size // 3 // 2)
        assert (
            t["lm_head.weight"].shape == (tc.vocab_size // 3, tc.hidden_size)
            and t["lm_head.weight"].dtype == torch.float32
        )
        d = load_file(str(out / "drafter" / f"rank{r}.safetensors"))
        assert d["transformer.layers.0.attention.qkv.weight"].dtype == torch.float8_e4m3fn
        assert {"transformer.fc.weight", "transformer.hidden_norm.weight", "transformer.ln_f.weight"} <= set(d)
    hq = json.loads((out / "hf" / "target" / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["kv_cache_quant_algo"] == "FP8"
    hf = load_file(str(out / "hf" / "target" / "model.safetensors"))
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        base = f"model.layers.0.self_attn.{n}"
        assert {base + s for s in (".weight", ".weight_scale", ".weight_scale_2", ".input_scale")} <= set(hf)
        assert hf[base + ".weight_scale_2"].dim() == 0
    # q/k/v share the global scale (ModelOpt preprocess_linear_fusion)
    assert len({float(hf[f"model.layers.0.self_attn.{n}.weight_scale_2"]) for n in ("q_proj", "k_proj", "v_proj")}) == 1
    assert (
        json.loads((out / "hf" / "target" / "config.json").read_text())["quantization_config"]["quant_method"]
        == "modelopt"
    )
    y = (out / "trtllm" / "llm_api.yaml").read_text()
    assert "decoding_type: DFlash" in y and f"max_draft_len: {bc.block_size - 1}" in y
    assert "trtllm-build --checkpoint_dir target" in (out / "trtllm" / "build.sh").read_text()
    # the draft vocabulary travels with the drafter (int64, every rank file and hf/drafter)
    from dflash_trt.checkpoints.loader import default_drafter_path

    d2t = load_file(str(default_drafter_path(smollm2, True) / "model.safetensors"))["d2t"]
    files = [out / "drafter" / f"rank{r}.safetensors" for r in range(3)]
    files.append(out / "hf" / "drafter" / "model.safetensors")
    for f in files:
        assert torch.equal(load_file(str(f))["d2t"], d2t)
    # the drafter plugins: every kernel variant named is one that `kernels-aot` compiles
    plugins = json.loads((out / "trtllm" / "plugins.json").read_text())
    assert plugins["plugins"] == ["dflash::context_kv", "dflash::block_attention", "dflash::accept"]
    abi = pytest.importorskip("dflash_trt.kernels.plugin_abi")
    assert set(plugins["kernels"]) <= {s.name for s in abi.specs()} == abi.variant_names()
    # the k_norm eps is compiled into the context-K/V kernel: the variant is the drafter's own
    eps = json.loads((default_drafter_path(smollm2, True) / "config.json").read_text())["rms_norm_eps"]
    assert plugins["rms_norm_eps"] == eps and abi.context_kv_variant(64, 3, eps) in plugins["kernels"]
    assert "_eps1e-05" in abi.context_kv_variant(64, 3, eps)
    expect_unsupported = (
        [] if plugins["tokens_per_block"] == 32 else [f"tokens_per_block {plugins['tokens_per_block']}"]
    )
    assert [u.split(":")[0] for u in plugins["unsupported"]] == expect_unsupported
    from dflash_trt.checkpoints.zlab import load_drafter

    shipped = load_drafter(default_drafter_path(smollm2, True)).cfg
    assert plugins["layer_windows"] == [shipped.sliding_window or 0] * shipped.num_layers


def test_plugins_name_the_drafter_layers_the_kernels_cannot_run():
    """A drafter of z-lab's gpt-oss layout (a causal sliding layer, a full one): the plugins get
    each layer's window, and the causal layer is listed as unsupported (the torch runtime drafts it)."""
    from test_zlab import make_drafter, tiny_target

    from dflash_trt.builder.builder import plugins_json
    from dflash_trt.builder.config import BuildConfig

    dcfg = make_drafter(tiny_target(), layers=2, block=8, sliding_window=12, layout="gpt-oss").cfg
    plugins = json.loads(json.dumps(plugins_json(BuildConfig(name="t", block_size=8), dcfg)))
    assert plugins["layer_windows"] == [12, 0] and plugins["sliding_window"] == 12
    assert any(u.startswith("causal drafter layers") for u in plugins["unsupported"])


def test_tp_shards_reassemble_to_modelopt_quantization(built, smollm2):
    """Rank files joined back equal ModelOpt's NVFP4 quantization of the original weights, bitwise."""
    out, _ = built
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    tc = smollm2.model.cfg
    ranks = [load_file(str(out / "target" / f"rank{r}.safetensors")) for r in range(3)]
    sd = smollm2.model.state_dict()
    qkv = trtllm.qkv_sizes(tc.num_heads, tc.num_kv_heads, tc.head_dim)
    for i in (0, tc.num_layers - 1):
        for name, src, rows, split in (
            ("attention.qkv", f"layers.{i}.attn.qkv.weight", None, trtllm.QKV),
            ("attention.dense", f"layers.{i}.attn.o.weight", None, trtllm.ROW),
            ("mlp.gate", f"layers.{i}.mlp.gate_up.weight", (tc.intermediate_size, None), trtllm.COLUMN),
            ("mlp.proj", f"layers.{i}.mlp.down.weight", None, trtllm.ROW),
        ):
            key = f"transformer.layers.{i}.{name}"
            packed = trtllm.unshard([r[key + ".weight"] for r in ranks], split, qkv)
            bs = trtllm.unshard([r[key + ".weights_scaling_factor"] for r in ranks], split, qkv)
            s2 = ranks[0][key + ".weights_scaling_factor_2"]
            assert all(torch.equal(r[key + ".weights_scaling_factor_2"], s2) for r in ranks)
            full = sd[src].float()
            amax_src = full  # fused gate/up share one global scale over the whole gate_up weight
            if rows:
                full = full[rows[0] :]
            ref_s2 = amax_src.abs().max() / 2688.0
            ref_bs, _ = qtensor.NVFP4QTensor.get_weights_scaling_factor(full, 16, ref_s2)
            ref = qtensor.NVFP4QTensor.quantize(full, 16, ref_bs, ref_s2)[0]._quantized_data
            assert torch.equal(packed, ref), key
            assert torch.equal(bs.view(torch.uint8), ref_bs.view(torch.uint8)), key
            assert torch.equal(s2.reshape(()), ref_s2.float()), key
    emb = trtllm.unshard([r["transformer.vocab_embedding.weight"] for r in ranks], trtllm.VOCAB, rows=tc.vocab_size)
    assert torch.equal(emb, sd["embed.weight"])


def test_tp_engine_loads_on_every_rank(built, smollm2):
    """Every rank of the NVFP4 TP-3 engine loads its target shard and the same drafter; the fp8
    KV cache's per-tensor ``kv_cache_scaling_factor`` in each rank file is not a weight's scale
    (reassembling the drafter from its rank files once raised KeyError on it)."""
    from dflash_trt.checkpoints.engine_dir import load_engine

    out, _ = built
    tc = smollm2.model.cfg
    drafters = []
    for r in range(3):
        t, d, _ = load_engine(out, rank=r, world_size=3)
        assert t.model.engine_shard.rank == r and t.model.engine_shard.embed_rows.shape == (
            tc.vocab_size // 3,
            tc.hidden_size,
        )
        qkv_rows = (tc.num_heads + 2 * tc.num_kv_heads) * tc.head_dim // 3
        assert t.model.layers[0].attn.qkv.weight.shape == (qkv_rows, tc.hidden_size)
        drafters.append(d.state_dict())
    for sd in drafters[1:]:
        assert sd.keys() == drafters[0].keys() and all(torch.equal(sd[k], drafters[0][k]) for k in sd)


def test_memory_plan_numbers(smollm2):
    from dflash_trt.builder.plan import memory_plan
    from dflash_trt.checkpoints.sources import read_json
    from dflash_trt.models.config import TargetConfig

    bc = BuildConfig.load(ROOT / "build_configs" / "b300x8-nvfp4.yaml")
    t70 = TargetConfig.from_hf(read_json(ROOT / "build_configs" / "shapes" / "llama-3.1-70b.json", "t"))
    plan = memory_plan(bc, t70, None)
    # 80 layers x 1 KV head per rank x 128 x 2 (K and V) x 1 byte (fp8)
    assert plan.target_kv_bytes_per_token == 2 * 80 * 1 * 128
    # NVFP4 linears: 0.5 + 1/16 bytes per parameter; bf16 vocab-parallel embedding + LM head
    lin = 80 * (8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672) / 8
    emb = 2 * 128256 * 8192 * 2 / 8
    assert abs(plan.target_weight_bytes - (lin * (0.5 + 1 / 16) + emb)) < 1e-3 * plan.target_weight_bytes
    assert plan.kv_token_capacity > 1_000_000
    small = BuildConfig.load(ROOT / "build_configs" / "hopper-fp8.yaml", {"gpu_memory_gb": 10, "tp_size": 1})
    with pytest.raises(DFlashError, match="does not fit"):
        memory_plan(small, t70, None).check()


# --------------------------------------------------------------------------------------------
# the runtime on engines; bad input from the CLI
# --------------------------------------------------------------------------------------------


def test_fp8_engine_runs_in_the_runtime(tmp_path, smollm2):
    """An FP8 engine (tp 1) loads, its dequantized weights match the FP8 round trip of the
    originals, and greedy DFlash on it equals plain decoding on the same engine."""
    pytest.importorskip("modelopt")
    from dflash_trt.builder.builder import build_engine
    from dflash_trt.checkpoints.engine_dir import load_engine
    from dflash_trt.runtime.request import Request
    from dflash_trt.runtime.sampling import SamplingParams

    out = tmp_path / "fp8"
    bc = BuildConfig.load(
        ROOT / "build_configs" / "cpu-fp32.yaml",
        {"target_quant": "fp8", "drafter_quant": "nvfp4", "calibration.num_samples": 4, "calibration.max_seq_len": 64},
    )
    build_engine(bc, None, None, out, progress=False, log=lambda *a: None)
    target, drafter, m = load_engine(out)
    w0 = smollm2.model.layers[3].attn.qkv.weight
    q, s = quantize_fp8(w0)
    assert torch.equal(target.model.layers[3].attn.qkv.weight, dequantize_fp8(q, s))
    assert not torch.equal(target.model.layers[3].attn.qkv.weight, w0)
    assert torch.equal(target.model.embed.weight, smollm2.model.embed.weight)
    ids = target.tokenizer.encode("The capital of France is")
    greedy = SamplingParams()
    plain = generate(target, drafter, [Request(ids, 12, greedy)], 1)[0].output_ids
    spec = generate(target, drafter, [Request(ids, 12, greedy)], 8)[0].output_ids
    assert plain == spec and len(plain) == 12

    # FP8 GEMMs (torch._scaled_mm over the engine's own e4m3 bytes and calibrated input scale)
    from dflash_trt.checkpoints.sources import load_safetensors_file
    from dflash_trt.quantization.fp8 import Fp8Linear

    t8, d8, _ = load_engine(out, fp8_gemm=True)
    qkv = t8.model.layers[3].attn.qkv
    assert isinstance(qkv, Fp8Linear) and isinstance(t8.model.layers[3].mlp.gate_up, Fp8Linear)
    assert not isinstance(t8.model.lm_head, Fp8Linear) and not isinstance(d8.fc, Fp8Linear)  # drafter is NVFP4
    rank = load_safetensors_file(out / "target" / "rank0.safetensors", "t")
    a = rank["transformer.layers.3.attention.qkv.activation_scaling_factor"]
    assert torch.equal(qkv.input_scale.reshape(1), a)
    x = torch.randn(5, qkv.in_features) * 0.5
    xq = (x / a).clamp(-448, 448).to(torch.float8_e4m3fn).float() * a  # fake-quantized activation
    want = xq @ target.model.layers[3].attn.qkv.weight.detach().t()
    got = qkv(x)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    # on the CPU the layer's GEMM is an fp32 one over the same e4m3 values: torch._scaled_mm's
    # own result up to the summation order (torch's CPU _scaled_mm takes ~0.2 s for this one)
    x8 = (x / a).clamp(-448, 448).to(torch.float8_e4m3fn)
    direct = torch._scaled_mm(x8, qkv.weight.t(), scale_a=a.reshape(()), scale_b=qkv.weight_scale, out_dtype=x.dtype)
    assert float((got - direct).abs().max()) < 1e-5 * float(direct.abs().max())
    p8 = generate(t8, d8, [Request(ids, 12, greedy)], 1)[0].output_ids
    assert len(p8) == 12 and generate(t8, d8, [Request(ids, 12, greedy)], 8)[0].output_ids == p8


def _cli(capsys, *args: str) -> tuple[int, str]:
    """``dflash-trt ARGS`` in this process: ``(exit status, stderr)``."""
    from dflash_trt.cli import main

    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().err


def test_build_bad_input(tmp_path, capsys):
    cfg = str(ROOT / "build_configs" / "cpu-fp32.yaml")
    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text("tp_size: 1\nmax_batch: 3\n")
    other = tmp_path / "drafter24"
    assert _cli(capsys, "init-drafter", "--out", str(other), "--layers", "1")[0] == 0
    c = json.loads((other / "config.json").read_text())
    c["num_target_layers"] = 24
    (other / "config.json").write_text(json.dumps(c))
    corrupt = tmp_path / "corrupt"
    assert _cli(capsys, "init-drafter", "--out", str(corrupt), "--layers", "1")[0] == 0
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 100)
    exists = tmp_path / "exists"
    exists.mkdir()
    cases = [
        (["--config", cfg, "--tp", "2"], "does not divide"),
        (["--config", cfg, "--drafter", str(other)], "24-layer target"),
        (["--config", str(bad_key)], "unknown key max_batch"),
        (["--config", cfg, "--drafter", str(corrupt)], "corrupt"),
        (["--config", cfg, "--set", "block_size=32"], "above the drafter"),
    ]
    for extra, match in cases:
        out = tmp_path / "eng"
        rc, err = _cli(capsys, "build", *extra, "--out", str(out))
        assert rc == 2, (extra, err[-500:])
        lines = [x for x in err.strip().splitlines() if x.startswith("dflash-trt: error:")]
        assert lines and match in lines[-1] and "Traceback" not in err, (extra, err[-500:])
        assert not out.exists() and not list(tmp_path.glob(".eng*"))
    rc, err = _cli(capsys, "build", "--config", cfg, "--out", str(exists))
    assert rc == 2 and "already exists" in err and list(exists.iterdir()) == []
