"""vLLM's CPU build loads our files unchanged and agrees with us (``make peers-test``; needs
``make peers``' .venv-vllm, so it is marked ``peers`` and left out of ``make test``): the default
target as our GGUF conversion writes it, the shipped drafter written by ``save_drafter`` with the
draft vocabulary's head; vLLM's greedy tokens, plain and DFlash, equal our plain decoding's."""

from __future__ import annotations

import json

import pytest
from helpers import plain_outputs, run

from dflash_trt.bench.vllm_peer import export_drafter, run_vllm
from dflash_trt.checkpoints.loader import default_drafter_path
from dflash_trt.checkpoints.zlab import load_drafter
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts

pytestmark = pytest.mark.peers
MAX_NEW = 24


def test_vllm_plain_and_dflash_equal_our_plain_decoding(smollm2, tmp_path):
    drafter = load_drafter(default_drafter_path(smollm2, True))
    assert drafter.d2t is not None, "the shipped drafter has a draft vocabulary: the case vLLM needs its head for"
    prompts = [chat_prompt_ids(smollm2.tokenizer, p) for p in mixed_prompts(4)]
    ours = plain_outputs(smollm2, prompts, MAX_NEW)
    head = smollm2.model.lm_head.weight
    export_drafter(drafter, head, tmp_path / "drafter")  # also what run_vllm does inside
    got = run_vllm(
        smollm2.path,
        drafter,
        head,
        prompts,
        MAX_NEW,
        head.dtype,
        smollm2.stop_token_ids,
        4,
        {1: prompts, 4: prompts},
        enforce_eager=True,  # what is checked here is the files and the tokens, not the speed
    )
    for name in ("vllm", "vllm-dflash"):
        for c, res in got[name].items():
            assert res.outputs == ours, (name, c)
    tau = got["vllm-dflash"][1].acceptance_length
    print(f"\nvLLM DFlash acceptance length {tau:.2f} (3 draft tokens)")
    # a drafter read with the wrong head rows drafts nothing that verifies (acceptance length 1.0)
    assert tau > 1.2


def test_load_bench_runs_vllm_next_to_ours_in_every_repeat(tmp_path):
    """``bench --concurrency 1,2 --repeats 2 --peers vllm``: each vLLM peer has a row per
    concurrency from as many runs as ours, each the same tokens as our plain decoding of that
    repeat, and the table gives ours / vLLM's ratio run by run."""
    out = tmp_path / "load.json"
    proc = run(
        *("bench", "--dataset", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "8", "--concurrency", "1,2"),
        *("--repeats", "2", "--threads", "1", "--dtype", "fp32", "--peers", "vllm", "--json", str(out)),
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["peer_errors"] == {}
    ours = {(x["concurrency"], x["mode"]): x for x in r["load"]}
    assert sorted((x["concurrency"], x["mode"]) for x in r["peers"]) == [
        (1, "vllm"),
        (1, "vllm-dflash"),
        (2, "vllm"),
        (2, "vllm-dflash"),
    ]
    for x in r["peers"]:
        runs = x["repeats_tok_s"]
        assert len(runs) == len(ours[x["concurrency"], "ar"]["repeats_tok_s"]) == 2
        assert x["output_tokens_per_s"] == min(runs) > 0  # the lower middle of two runs
        assert x["identical_to_ar"] is True and x["requests"] == max(2 * x["concurrency"], 2)
        assert (x["tau"] is None) == (x["mode"] == "vllm")
    peer_lines = [line for line in proc.stdout.splitlines() if line.split()[1:2] in (["vllm"], ["vllm-dflash"])]
    assert len(peer_lines) == 4 and all("2 runs" in line and " per run " in line for line in peer_lines)
