"""vLLM's CPU build loads our files unchanged and agrees with us (``make peers-test``; needs
``make peers``' .venv-vllm, so it is marked ``peers`` and left out of ``make test``): the default
target as our GGUF conversion writes it, the shipped drafter written by ``save_drafter`` with the
draft vocabulary's head; vLLM's greedy tokens, plain and DFlash, equal our plain decoding's."""

from __future__ import annotations

import pytest
from helpers import plain_outputs

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
