"""Peers on the real SmolLM2 target and real GSM8K prompts, greedy, fp32: transformers'
``generate`` (``hf``) must equal a plain greedy loop over the model's forward, token for
token, and ``prompt-lookup`` and the z-lab reference loop must equal ``hf``."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.bench.peers import PEERS, PeerResult, run_llama_cpp_isolated, run_peer
from dflash_trt.errors import DFlashError
from dflash_trt.prompts import chat_prompt_ids, load_prompts

MAX_NEW = 8


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [chat_prompt_ids(smollm2.tokenizer, t) for t in load_prompts("gsm8k", 2)]


@pytest.fixture(scope="module")
def hf_result(smollm2, prompts):
    return run_peer("hf", smollm2.path, prompts, MAX_NEW, torch.float32, smollm2.stop_token_ids)


def greedy_loop(model, ids: list[int], n: int, stops) -> tuple[list[int], list[float]]:
    """Plain greedy loop over the model's forward (prefill, then one token per step with the
    forward's own KV cache; no ``generate``). Returns the new tokens and the top-2 logit margin
    at every step."""
    out, margins = [], []
    x, past = torch.tensor([ids]), None
    with torch.inference_mode():
        for _ in range(n):
            res = model(input_ids=x, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = res.past_key_values
            top = res.logits[0, -1].topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            t = int(top.indices[0])
            out.append(t)
            x = torch.tensor([[t]])
            if t in stops:
                break
    return out, margins


def test_hf_peer_equals_plain_greedy(smollm2, prompts, hf_result):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()
    assert isinstance(hf_result, PeerResult) and hf_result.name == "hf"
    assert len(hf_result.outputs) == len(prompts)
    for p, got in zip(prompts, hf_result.outputs):
        ref, margins = greedy_loop(model, p, MAX_NEW, set(smollm2.stop_token_ids))
        assert got == ref, f"hf peer {got} != plain greedy {ref} (top-2 margins {margins})"
        assert all(type(t) is int for t in got)
    assert hf_result.new_tokens == sum(map(len, hf_result.outputs)) == 2 * MAX_NEW
    assert hf_result.wall_s > 0 and hf_result.tokens_per_s == pytest.approx(hf_result.new_tokens / hf_result.wall_s)


def test_prompt_lookup_equals_hf(smollm2, prompts, hf_result):
    res = run_peer("prompt-lookup", smollm2.path, prompts, MAX_NEW, torch.float32, smollm2.stop_token_ids)
    assert res.name == "prompt-lookup"
    assert res.outputs == hf_result.outputs
    assert res.new_tokens == hf_result.new_tokens and res.wall_s > 0


def test_zlab_reference_loop_equals_hf(smollm2, random_drafter, prompts, hf_result):
    """The z-lab reference loop (PyPI ``dflash``) with our drafter's weights is lossless too."""
    res = run_peer(
        "zlab",
        smollm2.path,
        prompts,
        MAX_NEW,
        torch.float32,
        smollm2.stop_token_ids,
        drafter=random_drafter,
        block_size=4,
    )
    assert res.name == "zlab" and res.outputs == hf_result.outputs
    with pytest.raises(DFlashError, match="needs a drafter"):
        run_peer("zlab", smollm2.path, prompts, MAX_NEW, torch.float32, smollm2.stop_token_ids)


def test_stops_after_stop_token(smollm2, prompts, hf_result):
    # Make the 3rd greedy token of prompt 0 a stop token: output is cut right after it.
    stop = hf_result.outputs[0][2]
    res = run_peer("hf", smollm2.path, prompts[:1], MAX_NEW, torch.float32, (stop,))
    assert res.outputs == [hf_result.outputs[0][: hf_result.outputs[0].index(stop) + 1]]
    assert res.outputs[0][-1] == stop and res.new_tokens == len(res.outputs[0])


def test_bad_peer_args(smollm2, prompts):
    assert PEERS == ("hf", "prompt-lookup", "zlab", "llama.cpp", "vllm")
    with pytest.raises(DFlashError, match="unknown peer 'tgi'; choose from hf, prompt-lookup, zlab, llama.cpp"):
        run_peer("tgi", smollm2.path, prompts, MAX_NEW, torch.float32, smollm2.stop_token_ids)
    with pytest.raises(DFlashError, match="unknown peer 'vllm'"):  # vLLM runs through vllm_peer.run_vllm
        run_peer("vllm", smollm2.path, prompts, MAX_NEW, torch.float32, smollm2.stop_token_ids)
    with pytest.raises(DFlashError, match="max_new_tokens"):
        run_peer("hf", smollm2.path, prompts, 0, torch.float32, smollm2.stop_token_ids)
    with pytest.raises(DFlashError, match="config.json"):
        run_peer("hf", smollm2.path / "missing", prompts, MAX_NEW, torch.float32, smollm2.stop_token_ids)


def test_llama_cpp_crash_ends_the_peer_not_the_caller(tmp_path, monkeypatch, prompts):
    """llama.cpp runs in a child process: when its native code dies (here a stand-in
    ``llama_cpp`` package that raises SIGSEGV in its own process when loaded, as ggml's AMX
    buffer did on an AMX Xeon), the caller gets a one-line DFlashError and keeps running."""
    from dflash_trt.checkpoints.sources import default_target_gguf

    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os\nimport signal\n\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DFlashError, match=r"peer llama.cpp crashed \(exit code -11\)"):
        run_llama_cpp_isolated(default_target_gguf(), prompts, MAX_NEW, (), 1)


def test_llama_cpp_peer(smollm2, prompts, hf_result):
    """llama.cpp on the same Q4_1 GGUF and prompt ids (skipped without ``make peers``): greedy,
    prefill and decode timed apart. Its Q4_1 x Q8_1 dot products are not our fp32 dequantized
    model, so agreement with ``hf`` is reported, not required past the first token."""
    with pytest.raises(DFlashError, match="runs a GGUF target"):
        run_peer("llama.cpp", smollm2.path, prompts, MAX_NEW, torch.float32, smollm2.stop_token_ids)
    pytest.importorskip("llama_cpp")
    from dflash_trt.checkpoints.sources import default_target_gguf

    res = run_peer(
        "llama.cpp", smollm2.path, prompts, MAX_NEW, torch.float32, smollm2.stop_token_ids, gguf=default_target_gguf()
    )
    assert res.name == "llama.cpp" and [len(o) for o in res.outputs] == [MAX_NEW] * len(prompts)
    assert res.prefill_tokens == sum(map(len, prompts)) and res.prefill_s > 0 and res.decode_s > 0
    same = [a == b for a, b in zip(res.outputs, hf_result.outputs)]
    print(
        f"llama.cpp: decode {res.decode_tokens_per_s:.1f} tok/s, "
        f"prefill {res.prefill_tokens_per_s:.0f} tok/s; same as hf {same}"
    )
    assert all(a[0] == b[0] for a, b in zip(res.outputs, hf_result.outputs))


def test_interleaved_llama_cpp_crash_keeps_the_bench(tmp_path, monkeypatch):
    """``bench --peers llama.cpp`` interleaves llama.cpp with our modes prompt by prompt in a
    child process that stays up (:class:`LlamaCppSession`). A stand-in ``llama_cpp`` package
    answers the first prompts (its warm-up and prompt 0: a fixed token sequence) and dies of
    SIGSEGV on the next one, as native code does: the benchmark finishes with its own figures
    and reports the peer's crash in one line."""
    from dflash_trt.bench.batch1 import BenchConfig, run_bench
    from dflash_trt.engine_args import EngineArgs

    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "llama_cpp.py").write_text("def llama_model_default_params():\n    return None\n")
    (fake / "__init__.py").write_text(
        "import ctypes, os, signal\n"
        "import numpy as np\n"
        "from . import llama_cpp\n"
        "RESETS = 0\n"
        "LOGITS = np.zeros(8, dtype=np.float32)\n"
        "class Llama:\n"
        "    def __init__(self, **kw):\n"
        "        self.ctx = None\n"
        "    def n_vocab(self):\n"
        "        return 8\n"
        "    def reset(self):\n"
        "        global RESETS\n"
        "        RESETS += 1\n"
        "        if RESETS == 3:\n"
        "            os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    def eval(self, ids):\n"
        "        LOGITS[:] = 0\n"
        "        LOGITS[len(ids) % 8] = 1\n"
        "def llama_get_logits_ith(ctx, i):\n"
        "    return LOGITS.ctypes.data_as(ctypes.POINTER(ctypes.c_float))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = BenchConfig(EngineArgs(block_size=4), dataset="gsm8k", num_prompts=2, max_new_tokens=4, peers=("llama.cpp",))
    r = run_bench(cfg, progress=lambda m: None)
    assert r["ar_tokens"] == r["dflash_tokens"] == 8 and r["lossless"]
    for name in ("llama.cpp", "llama.cpp-repack"):  # both layouts run in children of their own
        assert name not in r["peers"]
        assert r["peer_errors"][name].startswith("peer llama.cpp crashed (exit code -11)")
