"""Drafter training (``dflash_trt.training.trainer``, ``DFlashDrafter.forward_train``, ``dflash-trt train``).

* the training forward (all anchors of a sequence in one pass, context strictly before each
  anchor) equals the inference path (``DFlashDrafter.forward`` with a fresh cache holding the
  context positions < anchor, and the runner's draft tokens), fp32, on real SmolLM2
  features; the trainer's truncated feature pass equals ``TargetModel.forward``'s features;
* the chunked LM-head cross entropy equals plain autograd; the batch layout (anchors only in
  the response, labels only on response tokens inside the sequence);
* 30 steps on 8 short real-text sequences lower the loss on a fixed batch clearly;
* checkpoint + resume reproduces an uninterrupted run exactly (weights and optimizer state);
* the exported drafter loads with ``load_drafter`` and decodes losslessly; ``dflash-trt train``.
"""

from __future__ import annotations

import shutil
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import engine_config, full_features, generate, plain_outputs
from test_zlab import draft_metas, with_layout

from dflash_trt.checkpoints.loader import default_mask_token_id
from dflash_trt.checkpoints.zlab import init_drafter, load_drafter
from dflash_trt.errors import DFlashError
from dflash_trt.models.layers import AttentionMetadata
from dflash_trt.models.prefill import KVCache, features_and_predictions, first_divergence, top2_margin
from dflash_trt.runtime.model_runner import ModelRunner, StepItem
from dflash_trt.runtime.request import Request
from dflash_trt.training.batching import IGNORE, TrainSequence, build_batch, holdout_split, prepare_sequences
from dflash_trt.training.config import TrainConfig, autocast_dtype, default_gamma
from dflash_trt.training.loss import HeadCrossEntropy, compute_loss, sampled_vocab, slot_weights
from dflash_trt.training.run_dir import read_log
from dflash_trt.training.trainer import Trainer, train

SENTENCES = [
    "The train left the station at dawn, carrying farmers and their baskets to the market in town.",
    "Bees collect nectar from flowers and turn it into honey, which they store in wax cells.",
    "A good night's sleep helps the brain sort memories and keeps the body healthy.",
    "The library opens at nine, and the children's corner fills up quickly on Saturdays.",
    "Rain fell all afternoon, so we stayed inside, played cards and baked bread.",
    "Mountains form when plates of the earth's crust push against each other for millions of years.",
    "To make tea, boil water, pour it over the leaves, and wait three to five minutes.",
    "The old lighthouse still guides fishing boats home through the fog every night.",
]
QUESTIONS = ["Tell me something.", "Write one sentence.", "Say anything.", "Go on."]


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]


@pytest.fixture(scope="module")
def samples(smollm2):
    """Chat-formatted question (masked out) + a real sentence as the response."""
    from dflash_trt.prompts import chat_prompt_ids

    tok = smollm2.tokenizer
    out = []
    for i, s in enumerate(SENTENCES):
        p = chat_prompt_ids(tok, QUESTIONS[i % len(QUESTIONS)])
        r = tok.encode(s) + [tok.eos_token_id]
        out.append(Sample(p + r, [0] * len(p) + [1] * len(r)))
    return out


def mask_id(smollm2) -> int:
    return default_mask_token_id(smollm2.tokenizer, smollm2.model.cfg.vocab_size)


def rough_drafter(smollm2, layers: int, block: int, seed: int, sliding_window: int | None = None, layout=None):
    """A random drafter far from the identity (std 0.02 would hide attention/masking bugs);
    ``layout``: a ``test_zlab.LAYOUTS`` name."""
    model = init_drafter(smollm2.model.cfg, layers, block, mask_id(smollm2), seed=seed, sliding_window=sliding_window)
    model = with_layout(model, layout)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def inference_hidden(drafter, block_embeds, feats, anchor):
    """``DFlashDrafter.forward`` the way the runtime used to call it (contiguous cache), fresh cache holding
    the context positions < anchor; ``block_embeds`` ``[1, B, H]``."""
    B = block_embeds.shape[1]
    c = drafter.cfg
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, c.head_dim, anchor + B, torch.float32)
    ctx_pos = torch.arange(anchor).unsqueeze(0)
    block_pos = anchor + torch.arange(B).unsqueeze(0)
    pos = torch.cat([ctx_pos, block_pos], 1)
    metas = draft_metas(c, pos, pos, torch.tensor([anchor]), B)
    with torch.inference_mode():
        return drafter(block_embeds, feats[:anchor].unsqueeze(0), metas, cache.layers)


@pytest.mark.parametrize("window,layout", [(None, None), (12, None), (12, "gpt-oss")])
def test_forward_train_equals_inference(smollm2, samples, window, layout):
    target = smollm2.model
    drafter = rough_drafter(smollm2, 2, 8, seed=3, sliding_window=window, layout=layout).eval()
    B, H = drafter.cfg.block_size, target.cfg.hidden_size
    capture = drafter.cfg.target_layer_ids
    seqs = [samples[0].input_ids, samples[5].input_ids]
    feats = [full_features(target, s, capture) for s in seqs]
    ours = [f for f, _ in features_and_predictions(target, [torch.tensor(s) for s in seqs], capture)]
    fd = max(float((a - b).abs().max()) for a, b in zip(ours, feats))
    assert fd < 1e-4, f"trainer feature pass differs from TargetModel.forward by {fd}"

    worst, tokens_checked = 0.0, 0
    # one sequence alone (unbatched API), then both in one padded batch
    S0 = len(seqs[0])
    anchors0 = torch.tensor([1, 7, S0 // 2, S0 - 3, S0 - 1])
    anchors1 = torch.tensor([2, len(seqs[1]) - 2, 11, 11, 0])  # duplicates and anchor 0 (no context) allowed
    ids = [torch.tensor(s) for s in seqs]
    blocks = []
    for s, a in zip(ids, (anchors0, anchors1)):
        blk = torch.full((len(a), B), drafter.cfg.mask_token_id)
        blk[:, 0] = s[a]
        blocks.append(blk)
    with torch.no_grad():
        single = drafter.forward_train(target.embed(blocks[0]), feats[0], torch.arange(S0), anchors0)
        S = max(len(s) for s in seqs)
        pf = torch.zeros(2, S, feats[0].shape[-1])
        valid = torch.zeros(2, S, dtype=torch.bool)
        for i, f in enumerate(feats):
            pf[i, : len(f)] = f
            pf[i, len(f) :] = 50.0  # garbage padding must not leak
            valid[i, : len(f)] = True
        batched = drafter.forward_train(
            target.embed(torch.stack(blocks)),
            pf,
            torch.arange(S).expand(2, S),
            torch.stack([anchors0, anchors1]),
            valid,
        )
    assert single.shape == (len(anchors0), B, H) and batched.shape == (2, len(anchors0), B, H)
    for i, (f, anchors) in enumerate(zip(feats, (anchors0, anchors1))):
        for j, a in enumerate(anchors.tolist()):
            want = inference_hidden(drafter, target.embed(blocks[i][j : j + 1]), f, a)[0]
            worst = max(worst, float((batched[i, j] - want).abs().max()))
            if i == 0:
                worst = max(worst, float((single[j] - want).abs().max()))
            if a == 0:
                continue
            # the engine's own draft call: its argmax tokens equal the LM head on our hidden states
            nb = -(-(a + B) // 16)
            cfg = engine_config(block_size=B, tokens_per_block=16, kv_capacity=nb * 16)
            runner = ModelRunner(target, drafter, cfg.with_defaults(B))
            runner.proposer.store_features(0, 0, f[:a])
            item = StepItem(0, [int(blocks[i][j, 0])], a, list(range(nb)), num_draft=B - 1)
            with runner.grad_mode():
                got = runner.proposer.propose([item], B)[0].tolist()
            assert got == target.lm_head(batched[i, j, 1:]).argmax(-1).tolist()
            tokens_checked += B - 1
    print(
        f"\nforward_train vs inference forward, fp32, 2 layers, B={B}, window {window} ({layout or 'every layer'}): "
        f"max abs diff {worst:.3g} "
        f"({tokens_checked} draft tokens equal to the runner's proposer); feature pass diff {fd:.3g}"
    )
    assert worst < 1e-4


def test_head_cross_entropy_matches_autograd():
    g = torch.Generator().manual_seed(0)
    M, Hd, V = 37, 16, 50
    h = torch.randn(M, Hd, generator=g)
    h[:3] *= 100  # some rows with p[label] underflowing to 0 (exact CE fallback)
    h.requires_grad_(True)
    W = torch.randn(V, Hd, generator=g)
    y = torch.randint(0, V, (M,), generator=g)
    w = torch.rand(M, generator=g)
    total, pred = HeadCrossEntropy.apply(h, W, y, w, 8, torch.float32)
    (total * 0.7).backward()
    h2 = h.detach().clone().requires_grad_(True)
    logits = h2 @ W.t()
    per_row = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    assert float(per_row.detach().max()) > 110  # exp(-110) underflows fp32: the fallback path ran
    want = (per_row * w).sum()
    (want * 0.7).backward()
    assert torch.allclose(total, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(h.grad, h2.grad, rtol=1e-4, atol=1e-6)
    assert pred.tolist() == logits.argmax(-1).tolist()


def test_batch_layout_and_weights(samples):
    assert default_gamma(16) == 7 and default_gamma(8) == 4
    w = slot_weights(16)
    assert w[0] == 1 and abs(float(w[7]) - torch.exp(torch.tensor(-1.0)).item()) < 1e-6
    seqs = prepare_sequences(samples, 49152, 2048)
    s = seqs[0]
    start = s.mask.int().argmax().item()  # first response position
    assert s.candidates.min() == start and s.candidates.max() == len(s.ids) - 2
    feats = [torch.zeros(len(x.ids), 4) for x in seqs[:2]]
    b = build_batch(seqs[:2], feats, 1000, 8, 7, torch.Generator().manual_seed(0))
    nb = b.anchors.shape[1]
    assert b.labels.shape == (2, nb, 7) and b.block_ids.shape == (2, nb, 8)
    for i, x in enumerate(seqs[:2]):
        n = len(x.candidates)  # 1000 > candidates: every response position is an anchor
        assert b.anchors[i, :n].tolist() == x.candidates.tolist()
        assert (b.block_ids[i, :n, 0] == x.ids[x.candidates]).all() and (b.block_ids[i, :, 1:] == 7).all()
        for j, a in enumerate(x.candidates.tolist()):
            for k in range(1, 8):
                want = int(x.ids[a + k]) if a + k < len(x.ids) and x.mask[a + k] else IGNORE
                assert int(b.labels[i, j, k - 1]) == want
        assert (b.labels[i, n:] == IGNORE).all()
    few = build_batch(seqs[:1], feats[:1], 5, 8, 7, torch.Generator().manual_seed(0))
    assert few.anchors.shape == (1, 5) and set(few.anchors[0].tolist()) <= set(seqs[0].candidates.tolist())
    with pytest.raises(DFlashError, match="no training sample"):
        prepare_sequences([Sample([1, 2, 3], [0, 0, 1])], 49152, 2048)
    with pytest.raises(DFlashError, match="vocabulary"):
        prepare_sequences([Sample([1, 99999], [1, 1])], 49152, 2048)
    with pytest.raises(DFlashError, match="batch"):
        TrainConfig(batch=0).validate()


def _fixed_batch_loss(smollm2, drafter, samples, B) -> float:
    seqs = prepare_sequences(samples, smollm2.model.cfg.vocab_size, 2048)
    feats = [f for f, _ in features_and_predictions(smollm2.model, [s.ids for s in seqs], drafter.cfg.target_layer_ids)]
    batch = build_batch(seqs, feats, 16, B, drafter.cfg.mask_token_id, torch.Generator().manual_seed(123))
    with torch.no_grad():
        loss, _ = compute_loss(
            drafter.float(), smollm2.model.embed.weight, smollm2.model.lm_head.weight, batch, slot_weights(B), None
        )
    return float(loss)


def test_sampled_softmax_and_feature_regression(smollm2, samples):
    """``head_vocab='seen'`` (softmax over a vocabulary subset) and ``reg_weight`` (pull towards
    the target's final hidden state), checked against direct computations."""
    target = smollm2.model
    L = target.cfg.num_layers
    drafter = init_drafter(target.cfg, 1, 8, mask_id(smollm2), seed=5, target_layer_ids=[3, L - 1]).float()
    seqs = prepare_sequences(samples[:3], target.cfg.vocab_size, 2048)
    feats = [f for f, _ in features_and_predictions(target, [s.ids for s in seqs], drafter.cfg.target_layer_ids)]
    batch = build_batch(seqs, feats, 8, 8, drafter.cfg.mask_token_id, torch.Generator().manual_seed(1))
    E, W, w = target.embed.weight, target.lm_head.weight, slot_weights(8)
    with torch.no_grad():
        full, st_full = compute_loss(drafter, E, W, batch, w, None)
        every, _ = compute_loss(drafter, E, W, batch, w, None, vocab=torch.arange(W.shape[0]))
        seen = torch.zeros(W.shape[0], dtype=torch.bool)
        for sq in seqs:
            seen[sq.ids] = True
        sub = sampled_vocab(seen, 100, torch.Generator().manual_seed(2))
        part, _ = compute_loss(drafter, E, W, batch, w, None, vocab=sub)
        reg, _ = compute_loss(drafter, E, W, batch, w, None, reg_weight=0.5)
        # the regression term by hand: slot k of block b vs the final normed hidden at anchor + k - 1
        hidden = drafter.forward_train(
            F.embedding(batch.block_ids, E), batch.features, batch.positions, batch.anchors, batch.valid
        )
        H = target.cfg.hidden_size
        num = den = 0.0
        for i in range(batch.labels.shape[0]):
            for j in range(batch.labels.shape[1]):
                for k in range(1, 8):
                    if batch.labels[i, j, k - 1] == IGNORE:
                        continue
                    t = feats[i][batch.anchors[i, j] + k - 1, -H:]
                    num += float(w[k - 1]) * float((hidden[i, j, k] - t).pow(2).mean() / t.pow(2).mean())
                    den += float(w[k - 1])
    # the last H feature columns are the target's final normed hidden state: its LM head gives the logits
    ids = seqs[0].ids
    cache = KVCache(L, 1, target.cfg.num_kv_heads, target.cfg.head_dim, len(ids), torch.float32)
    pos = torch.arange(len(ids)).unsqueeze(0)
    with torch.no_grad():
        logits = target(ids.unsqueeze(0), AttentionMetadata.causal(pos, len(ids)), cache.layers).logits[0]
        assert torch.allclose(target.lm_head(feats[0][:, -H:]), logits, atol=1e-3)
    assert len(sub) == int(seen.sum()) + 100 and bool(seen[sub].sum() == seen.sum())
    assert abs(float(every) - float(full)) < 1e-4
    assert float(part) < float(full) - 1e-3  # fewer competitors: lower CE on the same logits
    assert abs(float(reg) - float(full) - 0.5 * num / den) < 1e-3 * max(1.0, num / den)
    with pytest.raises(DFlashError, match="outside the training vocabulary"), torch.no_grad():
        compute_loss(drafter, E, W, batch, w, None, vocab=torch.arange(10))


@pytest.fixture(scope="module")
def trained(smollm2, samples, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    cfg = TrainConfig(
        steps=30,
        batch=4,
        anchors_per_seq=16,
        block_size=8,
        num_layers=1,
        save_every=10,
        seed=0,
        export_dtype="fp32",
        autocast="fp32",  # bf16 autocast is ~12x slower on an AVX2-only CPU (test_autocast_auto)
        progress=False,
    )
    path = train(smollm2, samples, out, cfg)
    return out, path, cfg


def test_loss_goes_down(smollm2, samples, trained):
    out, path, cfg = trained
    before = _fixed_batch_loss(smollm2, init_drafter(smollm2.model.cfg, 1, 8, mask_id(smollm2), seed=0), samples, 8)
    after = _fixed_batch_loss(smollm2, load_drafter(path), samples, 8)
    recs = read_log(out)
    print(
        f"\n30 steps (1 layer, B=8, 4 seq x 16 anchors, fp32): fixed-batch loss {before:.3f} -> {after:.3f}; "
        f"log loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}, "
        f"{sum(r['step_s'] for r in recs) / len(recs):.2f} s/step"
    )
    assert [r["step"] for r in recs] == list(range(1, 31))
    assert after < 0.5 * before
    assert len(recs[-1]["acc"]) == 7 and recs[-1]["lr"] < recs[5]["lr"]
    assert (out / "loss.png").stat().st_size > 1000
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000010", "ckpt-000020", "ckpt-000030"]


def test_trainer_by_hand(smollm2, samples, tmp_path):
    """``Trainer.step`` / ``evaluate`` / ``save`` one at a time: the log gets a record per step and
    per evaluation, a checkpoint is what a later ``Trainer`` resumes from, and an evaluation does
    not change the weights."""
    cfg = TrainConfig(steps=4, batch=2, anchors_per_seq=4, block_size=4, holdout=0.25, autocast="fp32", progress=False)
    out = tmp_path / "run"
    tr = Trainer(smollm2, samples, out, cfg)
    assert tr.steps_done == 0 and tr.held and len(tr.held) + len(tr.seqs) == len(samples)
    recs = [tr.step(), tr.step()]
    assert [r["step"] for r in recs] == [1, 2] and all(r["loss"] > 0 and r["supervised"] > 0 for r in recs)
    before = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    ev = tr.evaluate()
    assert all(torch.equal(before[k], v) for k, v in tr.drafter.state_dict().items())
    assert len(ev["acc"]) == 3 and ev["supervised"] > 0 and ev["loss"] > 0
    assert tr.evaluate() == ev  # fixed held-out blocks
    assert tr.save().name == "ckpt-000002" and (out / "loss.png").is_file()
    assert [r["step"] for r in read_log(out)] == [1, 2]
    assert read_log(out, evals=True) == [{"step": 2, "eval": ev}] * 2
    again = Trainer(smollm2, samples, out, cfg)
    assert again.steps_done == 2
    assert all(torch.equal(before[k], v) for k, v in again.drafter.state_dict().items())
    assert [r["step"] for r in read_log(out)] == [1, 2]


def test_resume_reproduces_uninterrupted_run(smollm2, samples, tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig(  # (bf16 autocast: ~8 s a step on an AVX2-only CPU, so 4 steps, 2 of them resumed)
        steps=4,
        batch=2,
        anchors_per_seq=8,
        block_size=8,
        num_layers=1,
        save_every=2,
        seed=1,
        keep_checkpoints=0,
        autocast="bf16",
        progress=False,
    )
    train(smollm2, samples, out, cfg)
    want = torch.load(out / "ckpt-000004" / "train_state.pt", weights_only=False)
    want_w = load_drafter(out / "ckpt-000004").state_dict()
    want_log = read_log(out)
    # interrupted after step 2: drop everything later, then resume
    shutil.rmtree(out / "ckpt-000004")
    shutil.rmtree(out / "drafter")
    train(smollm2, samples, out, cfg)
    got = torch.load(out / "ckpt-000004" / "train_state.pt", weights_only=False)
    got_w = load_drafter(out / "ckpt-000004").state_dict()
    assert got["step"] == 4 and got["scheduler"]["last_epoch"] == 4
    for k in want_w:
        assert torch.equal(want_w[k], got_w[k]), k
    for pid, st in want["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[name], got["optimizer"]["state"][pid][name]), (pid, name)
    got_log = read_log(out)
    assert [r["step"] for r in got_log] == list(range(1, 5))
    assert [r["loss"] for r in got_log] == [r["loss"] for r in want_log]
    # an existing run is not silently restarted or continued with another shape
    with pytest.raises(DFlashError, match="already holds checkpoints"):
        train(smollm2, samples, out, cfg, resume=False)
    with pytest.raises(DFlashError, match="block size"):
        train(smollm2, samples, out, TrainConfig(steps=4, block_size=4, progress=False))


def test_autocast_auto():
    """``auto`` is bf16 exactly where the CPU has oneDNN bf16 GEMMs, fp32 (None) elsewhere."""
    from dflash_trt.models.cpu_linear import onednn_available

    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if onednn_available() else None)
    assert autocast_dtype("fp32", cpu) is None and autocast_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(DFlashError, match="autocast must be auto"):
        TrainConfig(autocast="int8").validate()


def test_exported_drafter_is_lossless(smollm2, trained):
    from dflash_trt.prompts import chat_prompt_ids

    _, path, _ = trained
    drafter = load_drafter(path)
    assert drafter.cfg.block_size == 8 and drafter.cfg.num_layers == 1
    prompts = [chat_prompt_ids(smollm2.tokenizer, q) for q in ("Name a color.", "Why do birds sing?")]
    ref = plain_outputs(smollm2, prompts, 20, batched=True)
    got = [o.output_ids for o in generate(smollm2, drafter, [Request(p, 20) for p in prompts], 8)]
    for p, r, o in zip(prompts, ref, got):
        i = first_divergence(r, o)
        assert i is None or top2_margin(smollm2.model, p + r[:i]) < 1e-4, (r, o)


def test_cli_train(smollm2, samples, tmp_path, monkeypatch, capsys):
    from dflash_trt.cli import main

    data = tmp_path / "data"
    data.mkdir()
    fake = types.ModuleType("dflash_trt.training.dataset")
    fake.load_dataset = lambda d, allow_incomplete=False: samples
    fake.read_data_manifest = lambda d: {"complete": True, "shards": [], "num_shards": 0}
    monkeypatch.setitem(sys.modules, "dflash_trt.training.dataset", fake)
    monkeypatch.setattr("dflash_trt.checkpoints.loader.load_target", lambda spec, dtype=None, device=None: smollm2)
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "--data",
            str(data),
            "--out",
            str(out),
            "--steps",
            "2",
            "--layers",
            "1",
            "--block-size",
            "4",
            "--batch",
            "2",
            "--anchors",
            "4",
            "--threads",
            "1",
            "--target-layers",
            "2,29",
            "--sliding-window",
            "8",
            "--head-vocab",
            "seen",
            "--reg-weight",
            "0.5",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "wrote" in capsys.readouterr().out
    d = load_drafter(out / "drafter").cfg
    assert (d.block_size, d.target_layer_ids, d.sliding_window) == (4, (2, 29), 8)
    assert (
        main(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "r2"),
                "--steps",
                "2",
                "--target-layers",
                "2,5",
                "--reg-weight",
                "1",
            ]
        )
        == 2
    )
    assert "needs the target's last layer" in capsys.readouterr().err
    assert (
        main(["train", "--data", str(data), "--out", str(tmp_path / "r3"), "--steps", "2", "--target-layers", "a,b"])
        == 2
    )
    assert main(["train", "--data", str(data), "--out", str(out), "--steps", "0"]) == 2
    assert main(["train", "--data", str(tmp_path / "nope"), "--out", str(out), "--steps", "3"]) == 2
    assert "training data not found" in capsys.readouterr().err


def test_holdout_split_keeps_the_same_sequences_out_when_data_is_added():
    gen = torch.Generator().manual_seed(7)

    def seqs(n):
        out = []
        for _ in range(n):
            ids = torch.randint(0, 1000, (int(torch.randint(8, 40, (1,), generator=gen)),), generator=gen)
            out.append(TrainSequence(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(len(ids) - 1)))
        return out

    a, b = seqs(400), seqs(300)
    key = lambda s: tuple(s.ids.tolist())  # noqa: E731
    train_a, held_a = holdout_split(a, 0.1)
    train_ab, held_ab = holdout_split(b[:150] + a + b[150:], 0.1)
    assert 20 <= len(held_a) <= 60 and len(train_a) + len(held_a) == len(a)
    in_a = {key(s) for s in a}
    assert {key(s) for s in held_a} == {key(s) for s in held_ab if key(s) in in_a}  # the old ones stay out
    assert not {key(s) for s in held_ab} & {key(s) for s in train_ab}
    assert len(held_ab) > len(held_a)  # new data adds held-out sequences too
    assert holdout_split(a, 0.0) == (a, [])
    assert len(holdout_split(a[:3], 0.01)[1]) == 1  # at least one
    with pytest.raises(DFlashError, match="leaves no sequence"):
        holdout_split(a[:1], 0.5)
