"""The drafter's packed int8 weights on the CPU (``--drafter-weights``, default ``auto``): which
format each setting resolves to, the packed drafter's drafts against the dense one's on the real
target and shipped drafter (DFlash stays token for token plain decoding; acceptance as dense),
and the dense weights it exports (vLLM's peer, the z-lab reference loop)."""

from __future__ import annotations

import pytest
import torch
from helpers import generate, main_error, plain_outputs

from dflash_trt.checkpoints.engine_dir import drafter_format
from dflash_trt.checkpoints.loader import load_pair
from dflash_trt.checkpoints.zlab import load_drafter, save_drafter
from dflash_trt.engine_args import EngineArgs
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts
from dflash_trt.quantization.packed import PackedLinear, dense_state_dict
from dflash_trt.runtime.request import LoopStats, Request

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def pairs():
    """The default target (bf16, dense) with the shipped drafter twice: packed int8 (what
    ``auto`` loads on a CPU) and dense."""
    target, packed = load_pair(None, None, BF16, drafter_weights="int8")
    _, dense = load_pair(None, None, BF16, drafter_weights="none")
    return target, packed, dense


def test_auto_resolves_to_int8_on_one_cpu_rank_only():
    """``auto``: int8 on one CPU rank, ``--weights``' packed format when it has one, dense on a
    GPU and over tensor-parallel ranks; a packed format named where it cannot run, or an unknown
    name, is a one-line error (also from the engine's settings)."""
    assert drafter_format("auto", None, "cpu", 1) == "int8"
    assert drafter_format("auto", "int4", "cpu", 1) == "int4"
    assert drafter_format("auto", "mxfp4", "cpu", 1) == "int8"
    assert drafter_format("auto", None, "cuda", 1) == "none"
    assert drafter_format("auto", None, "cpu", 2) == "none"
    assert drafter_format("none", "int4", "cpu", 1) == "none"
    assert drafter_format("int4", None, "cpu", 1) == "int4"
    for where in (("cuda", 1), ("cpu", 2)):
        with pytest.raises(DFlashError, match="packed CPU GEMMs on one rank"):
            drafter_format("int8", None, *where)
    with pytest.raises(DFlashError, match="unknown --drafter-weights"):
        drafter_format("fp8", None, "cpu", 1)
    with pytest.raises(ConfigError, match="drafter_weights"):
        EngineArgs(drafter_weights="fp8").create_engine_config()
    assert EngineArgs().create_engine_config().speculative.drafter_weights == "auto"


def test_packed_drafter_is_lossless_and_drafts_as_dense(pairs, smollm2):
    """The int8 drafter (every linear and the draft vocabulary's head rows packed, the target
    dense) gives plain decoding's tokens exactly, and its drafts are accepted about as often as
    the dense drafter's on the same prompts (bf16, block 4, 4 chat prompts x 24 tokens)."""
    target, packed, dense = pairs
    assert packed.head_format == "int8" and dense.head_format is None
    assert all(isinstance(m, PackedLinear) and m.fmt == "int8" for m in (packed.fc, packed.layers[1].mlp.up_proj))
    assert not isinstance(target.model.lm_head, PackedLinear)
    assert isinstance(packed._draft_head(target.model.lm_head), PackedLinear)
    assert not isinstance(dense._draft_head(target.model.lm_head), PackedLinear)
    prompts = [chat_prompt_ids(smollm2.tokenizer, t) for t in mixed_prompts(4)]
    ref = plain_outputs(target, prompts, 24, batched=True)
    tau = {}
    for name, drafter in (("int8", packed), ("dense", dense)):
        stats = LoopStats(4)
        got = [o.output_ids for o in generate(target, drafter, [Request(p, 24) for p in prompts], 4, stats)]
        assert got == ref, name
        tau[name] = stats.tau
    print(f"\ntau, block 4: int8 drafter {tau['int8']:.3f}, dense {tau['dense']:.3f}")
    assert tau["int8"] > 1.2 and tau["int8"] >= tau["dense"] - 0.15


def test_packed_drafter_exports_the_weights_it_runs(pairs, tmp_path):
    """A packed drafter saved as a z-lab directory (vLLM's peer exports it so) holds the dense
    keys with the weights its GEMMs multiply by, which load back into a dense drafter; they are
    the stored weights up to int8 rounding (half a step of each row's scale, which is stored in
    bf16)."""
    _, packed, dense = pairs
    sd = dense_state_dict(packed)
    assert sd.keys() == dense.state_dict().keys()
    out = save_drafter(packed, tmp_path / "d", torch.float32)
    back = load_drafter(out, torch.float32)
    stored = dense.state_dict()  # (its linears may be oneDNN-prepacked by now: no .weight)
    for name, mod in packed.named_modules():
        if isinstance(mod, PackedLinear):
            w = back.get_submodule(name).weight
            assert torch.equal(w, mod.dequantize(torch.float32)), name
            w0 = stored[f"{name}.weight"].float()
            step = w0.abs().amax(1, keepdim=True) / 127
            # half a step of rounding, and up to 127 codes x the bf16 scale's 2^-8 relative rounding
            assert ((w - w0).abs() <= step * (0.5 + 127 * 2**-8) + 1e-8).all(), name
    assert torch.equal(back.d2t, dense.d2t)


def test_cli_drafter_weights_errors(capsys):
    """``--drafter-weights int8`` on a GPU device is a one-line error before anything loads."""
    line = main_error(capsys, "generate", "--prompt", "Hi", "--drafter-weights", "int8", "--device", "cuda")
    assert "--drafter-weights int8" in line or "cuda" in line
