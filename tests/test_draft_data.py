"""Drafter training data beyond self-distillation, and the draft vocabulary, on the real
SmolLM2 target and real ShareGPT conversations:

* the on-disk feature cache holds exactly what the target's prefill gives (features and its
  greedy predictions), survives a restart, refuses a cache of another target layout, and drops
  the torn tail of an interrupted append;
* labelled text: ``text-data`` masks every assistant turn; a target-labelled sequence is
  supervised with the target's greedy choices, only along the target's greedy path;
* the draft vocabulary (d2t): chosen by frequency, saved and reloaded in the z-lab format with
  ``draft_vocab_size``, drafted through the sliced LM head (= the full head's argmax restricted
  to those rows), lossless, and trained on with out-of-vocabulary labels left out of the loss;
* held-out evaluation records in the training log.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import check_same, generate, main_error, plain_outputs

from dflash_trt.checkpoints.loader import LoadedTarget, default_mask_token_id
from dflash_trt.checkpoints.zlab import init_drafter, load_drafter, save_drafter
from dflash_trt.errors import DFlashError
from dflash_trt.models.prefill import features_and_predictions
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts, sharegpt_conversations
from dflash_trt.runtime.request import LoopStats, Request
from dflash_trt.training.batching import IGNORE, TrainSequence, build_batch
from dflash_trt.training.config import TrainConfig
from dflash_trt.training.dataset import Sample, load_dataset
from dflash_trt.training.draft_vocab import coverage, d2t_from_ids, token_counts, top_tokens
from dflash_trt.training.feature_cache import FeatureCache
from dflash_trt.training.run_dir import read_log
from dflash_trt.training.text_data import conversation_ids, write_text_dataset
from dflash_trt.training.trainer import train


@pytest.fixture(scope="module")
def convs():
    return sharegpt_conversations(6)


@pytest.fixture(scope="module")
def text_data(smollm2, convs, tmp_path_factory):
    out = tmp_path_factory.mktemp("text") / "data"
    write_text_dataset(smollm2, convs, out, max_seq_len=300, shard_size=4, progress=False)
    return out


def test_text_dataset_masks_assistant_turns(smollm2, convs, text_data):
    m = json.loads((text_data / "manifest.json").read_text())
    assert m["labels"] == "target" and m["complete"] and m["num_shards"] == 2
    samples = load_dataset(text_data)
    tok = smollm2.tokenizer
    kept = [i for i, c in enumerate(convs) if sum(conversation_ids(tok, c, smollm2.stop_token_ids)[1][:300]) >= 2]
    assert [s.prompt_index for s in samples] == kept and len(kept) >= 4  # (a long first turn leaves no answer)
    assert m["totals"]["skipped"] == 6 - len(kept) and all(s.labels == "target" for s in samples)
    for s in samples:
        c = convs[s.prompt_index]
        assert len(s.input_ids) <= 300
        # the masked spans decode to the assistant turns' text (each followed by the stop token)
        spans, cur = [], []
        for t, k in zip(s.input_ids, s.loss_mask):
            if k:
                cur.append(t)
            elif cur:
                spans.append(cur)
                cur = []
        if cur:
            spans.append(cur)
        answers = [m["content"] for m in c if m["role"] == "assistant"]
        assert spans and all(sp[-1] in smollm2.stop_token_ids for sp in spans[:-1])
        for sp, a in zip(spans, answers):
            text = tok.decode(sp, skip_special_tokens=True).strip()
            assert a.startswith(text[:200]) or text.startswith(a[:200]), (text[:80], a[:80])
        assert tok.decode([t for t, k in zip(s.input_ids, s.loss_mask) if not k]).count("<|im_start|>user") >= 1
    with pytest.raises(DFlashError, match="not an empty directory"):
        write_text_dataset(smollm2, convs, text_data, progress=False)
    ids, mask = conversation_ids(tok, convs[0][:2], smollm2.stop_token_ids)
    assert ids[: len(chat_prompt_ids(tok, convs[0][0]["content"]))] == chat_prompt_ids(tok, convs[0][0]["content"])
    assert sum(mask) >= 2
    # a later data directory continues where this one stopped, no overlap
    assert sharegpt_conversations(3, skip=4) == convs[4:] + sharegpt_conversations(7)[6:]
    total = len(sharegpt_conversations())
    for bad in (-1, True):
        with pytest.raises(DFlashError, match="to skip must be"):
            sharegpt_conversations(2, skip=bad)
    with pytest.raises(DFlashError, match="asked for"):
        sharegpt_conversations(2, skip=total - 1)


def test_feature_cache(smollm2, text_data, tmp_path):
    model = smollm2.model
    seqs = [torch.tensor(s.input_ids[:80]) for s in load_dataset(text_data)[:3]]
    cache = FeatureCache(tmp_path / "fc", "smollm2", (2, 15, 29), torch.float32, model.cfg.hidden_size)
    assert cache.fill(model, seqs, batch_tokens=100, progress=False) == 3  # three batches of one
    assert cache.fill(model, seqs, progress=False) == 0
    ref = features_and_predictions(model, seqs, (2, 15, 29))
    for s, (f, p) in zip(seqs, ref):
        got_f, got_p = cache.get(s)
        assert got_f.dtype == torch.bfloat16 and got_f.shape == (len(s), 3 * 576)
        assert torch.equal(got_f, f.to(torch.bfloat16)) and torch.equal(got_p, p)
        # predictions are the target's own greedy next tokens
        logits = model(s.unsqueeze(0), *_causal(model, len(s))).logits[0]
        assert torch.equal(p, logits.argmax(-1))
    again = FeatureCache(tmp_path / "fc", "smollm2", (2, 15, 29), torch.float32, 576)
    assert again.missing(seqs) == [] and torch.equal(again.get(seqs[1])[1], ref[1][1])
    with open(tmp_path / "fc" / "features.bin", "ab") as f:  # a torn append past meta.json
        f.write(b"\0" * 1000)
    again = FeatureCache(tmp_path / "fc", "smollm2", (2, 15, 29), torch.float32, 576)
    assert (tmp_path / "fc" / "features.bin").stat().st_size == again.rows * 3 * 576 * 2
    with pytest.raises(DFlashError, match="another capture"):
        FeatureCache(tmp_path / "fc", "smollm2", (2, 15), torch.float32, 576)


def _causal(model, n):
    from dflash_trt.models.layers import AttentionMetadata
    from dflash_trt.models.prefill import KVCache

    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, n, torch.float32)
    pos = torch.arange(n).unsqueeze(0)
    return AttentionMetadata.causal(pos, n), cache.layers


def test_target_labels_follow_the_greedy_path():
    ids = torch.tensor([5, 6, 10, 11, 12, 13, 14, 15])
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    seq = TrainSequence(ids, mask, torch.tensor([2, 3]), target_labels=True)
    # the target agrees with the text at 3 and 5, not at 4: preds[p] is its choice for p + 1
    preds = torch.tensor([0, 0, 11, 99, 13, 14, 77, 0])
    b = build_batch([seq], [torch.zeros(8, 4)], 10, 5, 1, torch.Generator().manual_seed(0), preds=[preds])
    assert b.anchors[0].tolist() == [2, 3]
    # anchor 2: slot 1 -> preds[2] = 11 (on path: 11 == ids[3]); slot 2 -> preds[3] = 99 (ids[4] = 12 is
    # off the path after it), so slots 3.. are unsupervised
    assert b.labels[0, 0].tolist() == [11, 99, IGNORE, IGNORE]
    # anchor 3: slot 1 -> preds[3] = 99; the text leaves the path at once
    assert b.labels[0, 1].tolist() == [99, IGNORE, IGNORE, IGNORE]
    text = build_batch(
        [TrainSequence(ids, mask, torch.tensor([2, 3]))],
        [torch.zeros(8, 4)],
        10,
        5,
        1,
        torch.Generator().manual_seed(0),
    )
    assert text.labels[0, 0].tolist() == [11, 12, 13, 14]


def test_draft_vocabulary_selection():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    ids = top_tokens(counts, 3)
    assert ids.tolist() == [2, 3, 5]  # 9, 9, 7; sorted by id
    assert (d2t_from_ids(ids) + torch.arange(3)).tolist() == [2, 3, 5]
    assert top_tokens(torch.tensor([3, 3, 3]), 2).tolist() == [0, 1]  # ties: lower ids first
    cov = coverage(counts, torch.tensor([1, 1, 1, 1, 0, 0]), [1, 3, 6])
    assert cov == {1: 0.25, 3: 0.5, 6: 1.0}
    assert token_counts([([1, 2, 2, 3], [0, 1, 1, 1])], 5).tolist() == [0, 0, 2, 1, 0]
    with pytest.raises(DFlashError, match="draft vocabulary size"):
        top_tokens(counts, 7)


@pytest.fixture(scope="module")
def d2t_drafter(smollm2):
    cfg = smollm2.model.cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(cfg.vocab_size, generator=g)[:4096].sort().values
    mask = default_mask_token_id(smollm2.tokenizer, cfg.vocab_size)
    return init_drafter(cfg, 1, 8, mask, seed=1, draft_token_ids=ids), ids


def test_d2t_format_roundtrip_and_zlab_reference(smollm2, d2t_drafter, tmp_path, capsys):
    d, ids = d2t_drafter
    path = save_drafter(d, tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 4096
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    assert sd["d2t"].dtype == torch.int64 and torch.equal(sd["d2t"] + torch.arange(4096), ids)
    back = load_drafter(path)
    assert back.cfg.draft_vocab_size == 4096 and torch.equal(back.draft_token_ids(), ids)
    # saved in bf16 (as the shipped drafters are), the weights are bf16 and d2t stays int64: a bf16
    # d2t keeps integers exactly only up to 256, and these offsets reach tens of thousands
    half = load_file(str(save_drafter(d, tmp_path / "bf16", dtype=torch.bfloat16) / "model.safetensors"))
    assert half["fc.weight"].dtype == torch.bfloat16 and half["d2t"].dtype == torch.int64
    assert torch.equal(half["d2t"] + torch.arange(4096), ids) and int(half["d2t"].max()) > 256
    # a float d2t in a file is refused, not cast (cast, it would still look sorted and distinct)
    half["d2t"] = half["d2t"].to(torch.bfloat16)
    save_file(half, str(tmp_path / "bf16" / "model.safetensors"))
    assert "d2t must be a 1-D int64 tensor, got torch.bfloat16" in main_error(
        capsys, "generate", "--prompt", "hi", "--drafter", str(tmp_path / "bf16")
    )
    # a corrupt d2t (not sorted distinct ids) is a one-line error
    sd["d2t"][5] = -10
    save_file(sd, str(path / "model.safetensors"))
    assert "d2t does not map" in main_error(capsys, "generate", "--prompt", "hi", "--drafter", str(path))
    # the z-lab reference (which drafts over the full vocabulary) still loads our drafter
    dflash_model = pytest.importorskip("dflash.model", reason="needs the z-lab reference: pip install dflash==0.1.0")
    from transformers import Qwen3Config

    ref = dflash_model.DFlashDraftModel(Qwen3Config(**cfg))
    missing, unexpected = ref.load_state_dict(d.state_dict(), strict=False)
    assert not missing and unexpected == ["d2t"]


def test_sliced_head_drafts_and_stays_lossless(smollm2, d2t_drafter):
    d, ids = d2t_drafter
    head = smollm2.model.lm_head
    h = torch.randn(3, 7, 576)
    full = head(h)
    want = ids[full[..., ids].argmax(-1)]
    assert torch.equal(d.propose(h, head), want)
    assert torch.equal(d.propose(h, head, sharded_head=True), want)
    assert bool(torch.isin(d.propose(h, head), ids).all())
    prompts = [chat_prompt_ids(smollm2.tokenizer, t) for t in mixed_prompts(4)]
    ref = plain_outputs(smollm2, prompts, 20, batched=True)
    stats = LoopStats(8)
    got = generate(smollm2, d, [Request(p, 20) for p in prompts], 8, stats)
    for p, r, o in zip(prompts, ref, got):
        check_same(smollm2.model, p, r, o.output_ids)


def test_training_with_draft_vocab_target_labels_and_holdout(smollm2, text_data, tmp_path):
    samples = load_dataset(text_data) + [
        Sample(s.input_ids, s.loss_mask, 100 + i, False, True) for i, s in enumerate(load_dataset(text_data)[:2])
    ]
    target = LoadedTarget(smollm2.model, smollm2.tokenizer, smollm2.path, smollm2.stop_token_ids)
    cfg = TrainConfig(
        steps=4,
        batch=2,
        anchors_per_seq=8,
        block_size=4,
        num_layers=1,
        draft_vocab=64,
        holdout=0.25,
        eval_every=2,
        save_every=10,
        max_seq_len=200,
        progress=False,
        feature_cache=str(tmp_path / "fc"),
    )
    out = train(target, samples, tmp_path / "run", cfg)
    d = load_drafter(out)
    assert d.cfg.draft_vocab_size == 64
    counts = token_counts(((s.input_ids[:200], s.loss_mask[:200]) for s in samples), 49152)
    ids = d.draft_token_ids()
    assert int(counts.argmax()) in ids.tolist() and len(set(ids.tolist())) == 64  # the data's commonest tokens
    recs, evals = read_log(tmp_path / "run"), read_log(tmp_path / "run", evals=True)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert any(r["outside_vocab"] > 0 for r in recs), "64 tokens cannot cover every label"
    assert [e["step"] for e in evals] == [2, 4] and len(evals[0]["eval"]["acc"]) == 3
    assert evals[-1]["eval"]["supervised"] > 0
    assert (Path(tmp_path / "fc") / "meta.json").is_file()
    with pytest.raises(DFlashError, match="exclude each other"):
        train(
            target,
            samples,
            tmp_path / "run2",
            TrainConfig(
                steps=2,
                block_size=4,
                draft_vocab=512,
                head_vocab="seen",
                progress=False,
                feature_cache=str(tmp_path / "fc"),
            ),
        )
