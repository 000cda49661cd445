"""The front door (``from dflash_trt import LLM, SamplingParams``) on the real default target
and its shipped drafter, fp32:

* three real prompts through ``LLM.chat`` in a fresh ``python -c`` process give token for token
  what ``dflash-trt generate --json`` gives for each, and carry their acceptance figures;
* vLLM's ``speculative_config`` forms: ``num_speculative_tokens`` sets the block size, method
  ``none`` is plain decoding (the same tokens: lossless), unknown keys are refused by name;
* ``SamplingParams``' request fields: ``max_tokens``, ``stop`` strings (text cut before them,
  token ids up to the token that completed one), ``stop_token_ids``, ``ignore_eos``;
* bad input fails the call with one line, before any work.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_trt import LLM, EngineArgs, SamplingParams
from dflash_trt.cli import main
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.prompts import load_prompts

MAX_NEW = 40
#: one fixed KV size for every LLM here (a few prompts at a time)
KV = 2048


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="fp32", kv_capacity=KV, speculative_config={"method": "dflash", "num_speculative_tokens": 3})


def test_llm_equals_cli_generate_token_for_token(tmp_path, capsys):
    """The front door in a fresh ``python -c`` process; ``dflash-trt generate`` through ``main``
    in this process (tests/test_cli.py runs the command as a process)."""
    script = (
        "import json, sys\n"
        "from dflash_trt import LLM, SamplingParams\n"
        "from dflash_trt.prompts import load_prompts\n"
        f"spec = {{'method': 'dflash', 'num_speculative_tokens': 3, 'adaptive': False}}\n"
        f"llm = LLM(dtype='fp32', kv_capacity={KV}, speculative_config=spec)\n"
        "msgs = [[{'role': 'user', 'content': t}] for t in load_prompts('gsm8k', 3)]\n"
        f"outs = llm.chat(msgs, SamplingParams(max_tokens={MAX_NEW}), use_tqdm=False)\n"
        "json.dump([dict(ids=o.outputs[0].token_ids, text=o.outputs[0].text, prompt=o.prompt_token_ids,\n"
        "  tau=o.spec_decode.acceptance_length, drafts=o.spec_decode.num_draft_tokens,\n"
        "  per_pos=o.spec_decode.accepted_per_position, reason=o.outputs[0].finish_reason)\n"
        "  for o in outs], sys.stdout)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = json.loads(proc.stdout)
    assert len(outs) == 3
    for i, o in enumerate(outs):
        out = tmp_path / f"g{i}.json"
        rc = main([
            "generate", "--prompt-from", f"gsm8k:{i}", "--dtype", "fp32", "--block-size", "4",
            "--max-new-tokens", str(MAX_NEW), "--json", str(out),
        ])  # fmt: skip
        assert rc == 0, capsys.readouterr().err[-3000:]
        ref = json.loads(out.read_text())
        assert ref["prompt_ids"] == o["prompt"]
        assert ref["output_ids"] == o["ids"], f"prompt {i}: LLM and dflash-trt generate differ"
        assert ref["text"] == o["text"]
        # the acceptance figures of a drafting run: 3 drafts per step, tau = committed per step
        assert o["drafts"] > 0 and len(o["per_pos"]) == 3 and o["per_pos"] == sorted(o["per_pos"], reverse=True)
        assert 1.0 <= o["tau"] <= 4.0
    print("LLM vs generate: taus", [round(o["tau"], 2) for o in outs])


def test_speculative_config_forms_and_plain_decoding(llm):
    assert llm.llm_engine.block_size == 4
    msgs = [[{"role": "user", "content": t}] for t in load_prompts("humaneval", 2)]
    params = SamplingParams(max_tokens=MAX_NEW)
    spec = llm.chat(msgs, params, use_tqdm=False)
    plain = LLM(dtype="fp32", kv_capacity=KV, speculative_config={"method": "none"})
    assert plain.llm_engine.block_size == 1 and plain.llm_engine.runner.drafter is None
    ref = plain.chat(msgs, params, use_tqdm=False)
    for s, r in zip(spec, ref):
        assert s.outputs[0].token_ids == r.outputs[0].token_ids  # lossless (batch-invariant fp32)
        assert r.spec_decode.num_draft_tokens == 0 and r.spec_decode.acceptance_length == 1.0
    with pytest.raises(ConfigError, match="speculative_config has unknown keys"):
        EngineArgs.from_speculative_config({"method": "dflash", "draft_model": "x"})
    with pytest.raises(ConfigError, match="method 'eagle' is unknown"):
        EngineArgs.from_speculative_config({"method": "eagle"})


def test_sampling_params_request_fields(llm):
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    [full] = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(full.outputs[0].token_ids) == 12 and full.outputs[0].finish_reason == "length"
    assert full.prompt == prompt and full.prompt_token_ids == tok.encode(prompt)
    text = full.outputs[0].text
    stop = text.strip()[:3]  # a stop string that occurs in the greedy answer
    [cut] = llm.generate(prompt, SamplingParams(max_tokens=12, stop=[stop]), use_tqdm=False)
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    assert c.token_ids == full.outputs[0].token_ids[: len(c.token_ids)]
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    # a stop token id ends the output with it included
    stop_id = full.outputs[0].token_ids[5]
    [st] = llm.generate([tok.encode(prompt)], SamplingParams(max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False)
    ids = st.outputs[0].token_ids
    assert ids[-1] == stop_id and stop_id not in ids[:-1] and st.outputs[0].finish_reason == "stop"
    assert st.prompt is None and st.outputs[0].stop_reason == stop_id


def test_bad_input_fails_the_call(llm):
    with pytest.raises(DFlashError, match="empty prompt"):
        llm.generate(["fine", ""], use_tqdm=False)
    with pytest.raises(DFlashError, match="not in the vocabulary"):
        llm.generate([[1, 2, 10**9]], use_tqdm=False)
    with pytest.raises(DFlashError, match="2 sampling parameters for 1 prompts"):
        llm.generate("hi", [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(DFlashError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="block_size 32 is above the drafter's block_size 8"):
        LLM(dtype="fp32", kv_capacity=KV, block_size=32)
    assert not llm.llm_engine.has_unfinished()  # nothing half-queued


def test_draft_length_adaptive_unless_turned_off(llm):
    """``LLM`` chooses the draft length per iteration (serve's default) unless ``adaptive`` is
    False, as a keyword or in ``speculative_config``; a keyword survives a dict that does not
    name it (it was dropped: the dict's field default won)."""
    assert llm.engine_args.adaptive and llm.llm_engine.controller is not None
    spec = {"method": "dflash", "num_speculative_tokens": 3}
    assert EngineArgs.from_speculative_config(spec, adaptive=True).adaptive
    assert not EngineArgs.from_speculative_config(spec, adaptive=False).adaptive
    assert not EngineArgs.from_speculative_config({**spec, "adaptive": False}, adaptive=True).adaptive
    assert EngineArgs.from_speculative_config(spec, prompt_lookup_min=2).prompt_lookup_min == 2
