"""Prompt sets read from the real data packages (GSM8K, HumanEval, MT-Bench) and the chat
template applied with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.prompts import DATASETS, chat_prompt_ids, load_prompts, mixed_prompts

SIZES = {"gsm8k": 1319, "humaneval": 164, "mtbench": 80}


@pytest.mark.parametrize("name", DATASETS)
def test_full_set_sizes(name):
    n = SIZES[name]
    prompts = load_prompts(name, n)
    assert len(prompts) == n
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(set(prompts)) > 0.95 * n  # real, mostly distinct rows
    with pytest.raises(DFlashError, match=f"has {n} prompts"):
        load_prompts(name, n + 1)


def test_first_prompts_and_order():
    assert load_prompts("gsm8k", 1)[0].startswith("Janet")
    he = load_prompts("humaneval", 1)[0]
    assert he.startswith("Complete the following Python function:\n\n```python\n")
    assert "def has_close_elements(" in he and he.endswith("```")
    assert load_prompts("mtbench", 1)[0].startswith(
        "Compose an engaging travel blog post about a recent trip to Hawaii"
    )
    assert load_prompts("gsm8k", 5) == load_prompts("gsm8k", 20)[:5]


def test_bad_requests_raise():
    with pytest.raises(DFlashError, match="unknown dataset 'foo'; choose from gsm8k, humaneval, mtbench"):
        load_prompts("foo", 1)
    with pytest.raises(DFlashError, match=">= 1"):
        load_prompts("gsm8k", 0)
    with pytest.raises(DFlashError):
        mixed_prompts(0)


def test_mixed_prompts_interleave():
    g, h, m = (load_prompts(n, 2) for n in DATASETS)
    assert mixed_prompts(5) == [g[0], h[0], m[0], g[1], h[1]]
    many = mixed_prompts(300)  # mtbench (80) runs out after 240, then gsm8k/humaneval alternate
    g, h = load_prompts("gsm8k", 110), load_prompts("humaneval", 110)
    assert len(many) == 300
    assert many[240:] == [x for pair in zip(g[80:], h[80:]) for x in pair]


def test_chat_prompt_ids(smollm2):
    tok = smollm2.tokenizer
    text = load_prompts("gsm8k", 1)[0]
    ids = chat_prompt_ids(tok, text)
    assert isinstance(ids, list) and ids and all(type(t) is int for t in ids)
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert header[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-len(header) :] == header  # ends with the assistant generation prompt
    user = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    starts = [i for i in range(len(ids)) if ids[i : i + len(user)] == user]
    assert len(starts) == 1
    decoded = tok.decode(ids)
    assert text in decoded and decoded.endswith("<|im_start|>assistant\n")
