"""Built mixture-of-experts engines in this runtime (``checkpoints/engine_dir.load_engine``).

A tiny random Qwen3-MoE saved by transformers (``test_moe.tiny_qwen3_moe``: sparse and dense
layers, 8 experts, top 2) is built by ``dflash-trt build`` into TensorRT-LLM rank files
(``mlp.router`` fp32, ``mlp.fc`` = ``[up; gate]`` per expert, ``mlp.proj``; split by
``moe_tp_size`` x ``moe_ep_size``) and run from them:

- tp_size 1, fp32 unquantized: the loaded target's weights equal those read from the HF
  checkpoint bitwise, its logits equal transformers' ``Qwen3MoeForCausalLM``'s within rounding,
  and greedy plain decoding and DFlash give the HF-loaded target's tokens, token for token;
- tp_size 1, FP8: every expert equals the FP8 round trip of the original expert (gate and up
  sharing its scale), the router stays exact, DFlash equals plain decoding on the engine;
- tp_size 2 as MoE TP 2 and as EP 2, under ``mpiexec -n 2`` (``tests/tp_engine_worker.py``):
  each rank reads only its own rank file and holds the expert slice / experts the engine's
  mapping gives it (TensorRT-LLM ``Mapping``: MoE-TP rank ``r // moe_ep``, EP rank ``r % moe_ep``);
  greedy outputs at block size 1 and 4 equal TP=1 plain decoding of the HF checkpoint (a
  divergence only at a numerical tie, as test_tp.py);
- bad input, one line each: a missing rank file, an engine whose MoE sizes do not give its
  ranks or differ from its manifest, run-time MoE sizes other than the engine's.

gpt-oss engines (``hf/target`` only) are refused in one line: ``test_moe_build.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import check_same, generate, saved_drafter
from test_moe import tiny_qwen3_moe
from test_tp import _mpiexec
from tp_worker import MAX_NEW, prompts_for
from tp_worker import engine_config as tp_engine_config

from dflash_trt.builder.builder import build_engine
from dflash_trt.builder.config import BuildConfig
from dflash_trt.checkpoints.engine_dir import load_engine
from dflash_trt.checkpoints.loader import load_target
from dflash_trt.checkpoints.zlab import init_drafter
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.models.moe import MoEBlock
from dflash_trt.runtime.engine import LLMEngine
from dflash_trt.runtime.request import Request

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("tp_engine_worker.py")
BLOCK = 4
#: engine name -> build settings over cpu-fp32.yaml
ENGINES = {
    "tp1": {},
    "moe_tp2": {"tp_size": 2, "moe_tp_size": 2, "moe_ep_size": 1},
    "ep2": {"tp_size": 2, "moe_tp_size": 1, "moe_ep_size": 2},
    "fp8": {"target_quant": "fp8", "calibration.num_samples": 4, "calibration.max_seq_len": 32},
}


@pytest.fixture(scope="module")
def moe(smollm2, tmp_path_factory):
    """``(transformers model, HF dir, HF-loaded target, drafter path, engine(name) -> dir)``;
    engines are built on first use."""
    d = tmp_path_factory.mktemp("moe_engine")
    hf = tiny_qwen3_moe(smollm2.model.cfg.vocab_size, True)
    hf.save_pretrained(str(d / "hf"))
    smollm2.tokenizer.save_pretrained(str(d / "hf"))
    target = load_target(str(d / "hf"), torch.float32)
    drafter = saved_drafter(init_drafter(target.model.cfg, 1, BLOCK, 0, seed=0), d)
    built: dict[str, Path] = {}

    def engine(name: str) -> Path:
        if name not in built:
            if name == "fp8":
                pytest.importorskip("modelopt")
            bc = BuildConfig.load(ROOT / "build_configs" / "cpu-fp32.yaml", {"block_size": BLOCK, **ENGINES[name]})
            build_engine(bc, str(d / "hf"), drafter, d / name, progress=False, log=lambda *a: None)
            built[name] = d / name
        return built[name]

    return hf, d / "hf", target, drafter, engine


def _decode(model, drafter, stops, prompts: list[list[int]], block_size: int) -> list[list[int]]:
    """Greedy outputs of ``prompts`` batched with ``tp_engine_worker.py``'s engine settings."""
    engine = LLMEngine(model, drafter, tuple(stops), tp_engine_config(block_size, False))
    sids = [engine.add_request(Request(p, MAX_NEW)) for p in prompts]
    engine.run()
    return [engine.result(s).output_ids for s in sids]


@pytest.fixture(scope="module")
def reference(moe):
    """TP=1 plain decoding of the HF-loaded target: the worker's prompts and engine settings."""
    target = moe[2]
    prompts = prompts_for(target.tokenizer)[:3]
    return prompts, _decode(target.model, None, target.stop_token_ids, prompts, 1)


def test_tp1_engine_equals_hf_checkpoint(moe, reference):
    hf, _, target, _, engine = moe
    t, drafter, m = load_engine(engine("tp1"))
    assert m["moe_split"] == {"moe_tp_size": 1, "moe_ep_size": 1}
    ours, ref = t.model.state_dict(), target.model.state_dict()
    assert ours.keys() == ref.keys()
    for k in ref:  # [up; gate] back to [gate; up], the fp32 router, the dense layer's fc / gate
        assert ours[k].dtype == torch.float32 and torch.equal(ours[k], ref[k]), k
    mlps = [layer.mlp for layer in t.model.layers]
    sparse = [m for m in mlps if isinstance(m, MoEBlock)]
    assert len(sparse) == 2 and all(m.expert_offset == 0 and m.gate_up.shape[0] == 8 for m in sparse)
    prompts, want = reference
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        hf_logits = hf(ids).logits[0]
    from tp_worker import forward_logits

    got = forward_logits(t.model, prompts[0])
    rel = float((got - hf_logits).abs().max() / hf_logits.abs().max())
    print(f"\nMoE engine (tp 1, fp32) vs transformers Qwen3MoeForCausalLM: max rel logit diff {rel:.2e}")
    assert rel < 1e-4
    plain = _decode(t.model, None, t.stop_token_ids, prompts, 1)  # the reference's settings
    assert plain == want  # token for token
    assert _decode(t.model, drafter, t.stop_token_ids, prompts, BLOCK) == want


def test_fp8_engine_experts(moe):
    """FP8 experts: each expert's fused [gate; up] and down are the FP8 round trip of the HF
    weights (one per-tensor scale per expert); greedy DFlash equals plain decoding on the engine."""
    from dflash_trt.quantization.fp8 import dequantize_fp8, quantize_fp8

    _, _, target, _, engine = moe
    t, drafter, _ = load_engine(engine("fp8"))
    for i in (1, 5):  # the sparse layers
        a, b = t.model.layers[i].mlp, target.model.layers[i].mlp
        assert torch.equal(a.gate.weight, b.gate.weight)  # the router: fp32, never quantized
        for e in range(a.gate_up.shape[0]):
            assert torch.equal(a.gate_up[e], dequantize_fp8(*quantize_fp8(b.gate_up[e])))
            assert torch.equal(a.down[e], dequantize_fp8(*quantize_fp8(b.down[e])))
        assert not torch.equal(a.gate_up, b.gate_up)
    ids = t.tokenizer.encode("The capital of France is")
    plain = generate(t, drafter, [Request(ids, 8)], 1)[0].output_ids
    assert generate(t, drafter, [Request(ids, 8)], BLOCK)[0].output_ids == plain and len(plain) == 8


@pytest.mark.parametrize("name,split", [("moe_tp2", (2, 1)), ("ep2", (1, 2))])
def test_two_rank_engine_equals_tp1(moe, reference, tmp_path, name, split):
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich mpi4py)")
    _, _, target, _, engine = moe
    d = engine(name)
    with pytest.raises(DFlashError, match="has tp_size 2: run it as 2 ranks"):
        load_engine(d)
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(WORKER), str(d), str(out), f"1,{BLOCK}"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and out.exists(), f"{name} run failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    res = json.loads(out.read_text())
    mtp, mep = split
    E, Im, H = 8, 32, 64
    assert res["experts_per_rank"] == [
        {"gate_up": [E // mep, 2 * Im // mtp, H], "down": [E // mep, H, Im // mtp], "offset": (r % mep) * E // mep}
        for r in range(2)
    ]
    prompts, want = reference
    ties = 0
    for K in ("1", str(BLOCK)):
        ties += sum(check_same(target.model, pr, w, o) for pr, w, o in zip(prompts, want, res["outputs"][K]))
    print(f"\n{name} engine (rank files, mpiexec -n 2): {2 * len(want) - ties}/{2 * len(want)} equal TP=1, {ties} ties")


def test_bad_engines(moe, tmp_path, capsys):
    """A missing rank file (also from the CLI: one line, non-zero exit), MoE sizes that do not
    give the ranks or differ from the manifest, and run-time MoE sizes other than the engine's:
    one line each."""
    from helpers import main_error
    from test_moe_parallel import Rank

    from dflash_trt.runtime.distributed import attach_engine_shard

    src = moe[4]("moe_tp2")
    d = tmp_path / "eng"
    shutil.copytree(src, d)
    t, _, _ = load_engine(d, rank=1, world_size=2)
    assert t.model.engine_shard.moe == (2, 1)
    with pytest.raises(ConfigError, match="differs from the engine's moe_ep_size 1 x moe_tp_size 2") as e:
        attach_engine_shard(t.model, Rank(1, 2), None, 2)
    assert "\n" not in str(e.value)
    (d / "target" / "rank1.safetensors").unlink()
    with pytest.raises(DFlashError, match="rank1.safetensors is missing"):
        load_engine(d, rank=1, world_size=2)
    one = tmp_path / "tp1"
    shutil.copytree(moe[4]("tp1"), one)
    (one / "target" / "rank0.safetensors").unlink()
    assert "rank0.safetensors is missing" in main_error(capsys, "generate", "--prompt", "hi", "--engine", str(one))
    cfg_path = d / "target" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["mapping"]["moe_ep_size"] = 2  # 2 x 2 experts splits on 2 ranks
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="moe_tp_size 2 x moe_ep_size 2 does not give its tp_size 2 ranks") as e:
        load_engine(d, rank=0, world_size=2)
    assert "\n" not in str(e.value)
    cfg["mapping"].update(moe_tp_size=1, moe_ep_size=2)  # a valid split, but not the manifest's
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="differs from target/config.json's moe_tp_size 1 x moe_ep_size 2"):
        load_engine(d, rank=0, world_size=2)
