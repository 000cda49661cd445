"""Self-distillation data: ShareGPT prompts recovered from the real (truncated) package file, and
target responses generated with the real default target, stored, reloaded and resumed."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import generate
from safetensors.torch import load_file

from dflash_trt.errors import DFlashError
from dflash_trt.models.prefill import first_divergence, top2_margin
from dflash_trt.prompts import chat_prompt_ids, iter_json_array, load_prompts, sharegpt_prompts, sharegpt_stats
from dflash_trt.runtime.request import Request
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.training.dataset import load_dataset
from dflash_trt.training.distill import generate_dataset, request_seed
from dflash_trt.training.word_problems import word_problems


@pytest.mark.parametrize("chunk", [7, 1 << 22])  # tiny reads split items and UTF-8 characters
def test_json_array_recovery_drops_truncated_tail(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr("dflash_trt.prompts._CHUNK", chunk)
    path = tmp_path / "cut.json"
    items = [{"id": f"x_{i}", "v": "é" * i + "\u2603"} for i in range(5)]
    text = json.dumps(items, ensure_ascii=False, indent=2)
    path.write_text(text[: text.index('"x_4"') + 8], encoding="utf-8")  # cut inside item 4
    got = list(iter_json_array(path))
    assert [g for g, _ in got[:-1]] == items[:4]
    assert got[-1][0] is None and got[-1][1] > 0
    path.write_text(text, encoding="utf-8")  # an intact file has no tail
    assert [g for g, _ in iter_json_array(path)] == items
    path.write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(DFlashError, match="JSON array"):
        list(iter_json_array(path))


def test_sharegpt_prompts_complete_deduplicated_and_clean():
    prompts = sharegpt_prompts()
    assert len(prompts) > 1000
    assert all(p and p == p.strip() and 16 <= len(p) <= 2000 for p in prompts)
    assert len({" ".join(p.split()).lower() for p in prompts}) == len(prompts)
    stats = sharegpt_stats()
    assert stats["truncated_tail_chars"] > 0  # the package file is cut short, and we noticed
    assert stats["prompts"] >= len(prompts)
    gsm = [" ".join(q.split()) for q in load_prompts("gsm8k", 50)]
    flat = [" ".join(p.split()) for p in prompts]
    assert not any(q in p for q in gsm for p in flat)
    assert sharegpt_prompts(5) == prompts[:5]  # deterministic file order
    assert sharegpt_prompts(min_chars=1, max_chars=100) == [
        p for p in sharegpt_prompts(min_chars=1, max_chars=10**9) if len(p) <= 100
    ]
    with pytest.raises(DFlashError, match="asked for"):
        sharegpt_prompts(len(prompts) + 1)
    with pytest.raises(DFlashError, match=">= 1"):
        sharegpt_prompts(0)


def test_word_problems_seeded_distinct_and_clean():
    """Synthetic maths prompts: the same for a seed, new for another, distinct, and sharing no
    13-word sequence with any GSM8K test question (checked here by brute force, not the index)."""
    probs = word_problems(600)
    assert probs == word_problems(600) and probs[:50] != word_problems(50, seed=1)
    assert len(set(probs)) == 600 and all(p.endswith("?") for p in probs)
    gsm = {
        " ".join(w[i : i + 13])
        for q in load_prompts("gsm8k", 1319)
        for w in [re.findall(r"\w+", q.lower())]
        for i in range(len(w) - 12)
    }
    for p in probs:
        w = re.findall(r"\w+", p.lower())
        assert not any(" ".join(w[i : i + 13]) in gsm for i in range(len(w) - 12)), p
    with pytest.raises(DFlashError, match=">= 1"):
        word_problems(0)


def _same_or_tie(model, prompt_ids, got, ref):
    """Greedy outputs must match, except after a numerical tie (top-2 margin < 1e-4, fp32)."""
    k = first_divergence(got, ref)
    if k is None:
        return 0
    assert k < min(len(got), len(ref)), (got, ref)
    margin = top2_margin(model, prompt_ids + ref[:k])
    assert margin < 1e-4, f"greedy sample diverges from plain decoding at {k} with margin {margin}"
    return 1


def test_generate_load_resume(smollm2, tmp_path):
    prompts = sharegpt_prompts(4)
    out = tmp_path / "ds"
    kw = dict(max_new_tokens=8, batch_size=2, shard_size=2, progress=False)
    assert generate_dataset(smollm2, prompts, out, **kw) == out
    shards = sorted(out.glob("shard-*.safetensors"))
    assert [s.name for s in shards] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_prompts"] == 4 and manifest["target"] == str(smollm2.path)
    assert manifest["settings"]["max_new_tokens"] == 8
    assert [s["file"] for s in manifest["shards"]] == [s.name for s in shards]
    assert not list(out.glob(".*"))  # no temporary files left

    samples = load_dataset(out)
    assert [s.prompt_index for s in samples] == [0, 1, 2, 3]
    assert sum(s.sampled for s in samples) == 1  # round(0.25 * 4)
    assert manifest["totals"]["tokens"] == sum(len(s.input_ids) for s in samples)
    ties = 0
    for i, s in enumerate(samples):
        ids = chat_prompt_ids(smollm2.tokenizer, prompts[i])
        n = len(ids)
        assert s.input_ids[:n] == ids and s.response_start == n
        assert s.loss_mask == [0] * n + [1] * (len(s.input_ids) - n)
        resp = s.input_ids[n:]
        assert 1 <= len(resp) <= 8 and s.stopped == (resp[-1] in smollm2.stop_token_ids)
        sampling = SamplingParams(0.7, seed=request_seed(0, i)) if s.sampled else SamplingParams()
        ref = generate(smollm2, None, [Request(ids, 8, sampling)], 1)[0].output_ids
        if s.sampled:
            assert resp == ref  # per-request seed: independent of the batch it ran in
        else:
            ties += _same_or_tie(smollm2.model, ids, resp, ref)
    print(f"greedy divergences at numerical ties: {ties}")

    # resume: only the missing shard is regenerated, with the same contents
    before = {s.name: (s.stat().st_mtime_ns, load_file(s)) for s in shards}
    shards[-1].unlink()
    with pytest.raises(DFlashError, match="missing"):
        load_dataset(out)
    generate_dataset(smollm2, prompts, out, **kw)
    assert shards[0].stat().st_mtime_ns == before[shards[0].name][0]
    assert shards[-1].stat().st_mtime_ns != before[shards[-1].name][0]
    again, first = load_file(shards[-1]), before[shards[-1].name][1]
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert load_dataset(out) == samples

    # a finished dataset is left alone; other settings on the same directory are refused
    generate_dataset(smollm2, prompts, out, **kw)
    assert shards[0].stat().st_mtime_ns == before[shards[0].name][0]
    with pytest.raises(DFlashError, match="another settings"):
        generate_dataset(smollm2, prompts, out, **{**kw, "max_new_tokens": 9})
    with pytest.raises(DFlashError, match="another prompts_sha256"):
        generate_dataset(smollm2, prompts[::-1], out, **kw)


def test_bad_inputs(smollm2, tmp_path):
    with pytest.raises(DFlashError, match="does not exist"):
        load_dataset(tmp_path / "nope")
    with pytest.raises(DFlashError, match="no manifest.json"):
        load_dataset(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DFlashError, match="corrupt"):
        load_dataset(tmp_path)
    with pytest.raises(DFlashError, match="corrupt"):
        generate_dataset(smollm2, ["hi there"], tmp_path, max_new_tokens=1, progress=False)
    (tmp_path / "manifest.json").write_text('{"format": "something-else"}')
    with pytest.raises(DFlashError, match="not a dflash-trt-selfdistill manifest"):
        load_dataset(tmp_path)
    with pytest.raises(DFlashError, match="no prompts"):
        generate_dataset(smollm2, [], tmp_path / "x")
    with pytest.raises(DFlashError, match="sampled_fraction"):
        generate_dataset(smollm2, ["hi"], tmp_path / "x", sampled_fraction=1.5)
    with pytest.raises(DFlashError, match="temperature"):
        generate_dataset(smollm2, ["hi"], tmp_path / "x", temperature=0.0)
    with pytest.raises(DFlashError, match="batch_size"):
        generate_dataset(smollm2, ["hi"], tmp_path / "x", batch_size=0)
