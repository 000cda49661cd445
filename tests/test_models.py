"""Our target implementation against transformers' own models, fp32.

* the real SmolLM2-135M target vs ``LlamaForCausalLM`` from the same checkpoint: logits and
  captured target features (HF ``hidden_states[i + 1]``);
* tiny random Qwen2 (q/k/v bias, tied head), Qwen3 (q_norm / k_norm, head_dim != hidden/heads)
  and Llama-3.1-style (``rope_type: llama3``, untied head) checkpoints written by transformers
  and loaded through our ``load_target`` (single file and sharded);
* KV-cache consistency: prefill + token-by-token / chunked decoding equals one full forward, and
  a right-padded ragged batch equals each prompt alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import max_diff, rel_diff

from dflash_trt.checkpoints.loader import load_target
from dflash_trt.checkpoints.sources import load_safetensors_dir
from dflash_trt.models.config import TargetConfig
from dflash_trt.models.layers import AttentionMetadata, rope_inv_freq
from dflash_trt.models.prefill import KVCache
from dflash_trt.models.target import TargetModel

PROMPTS = [
    "The capital of France is",
    "Write a short Python function that returns the n-th Fibonacci number, and explain how it works.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step before answering.",
]
FEATURE_LAYERS = (1, 15, 27, 29)  # 29 = SmolLM2's last layer: post-final-norm, like HF


causal_meta = AttentionMetadata.causal  # the runtime's metadata: slot j visible at position p iff j <= p


def new_cache(model: TargetModel, batch: int, capacity: int) -> KVCache:
    c = model.cfg
    return KVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, capacity, model.embed.weight.dtype)


def full_forward(model: TargetModel, ids: list[int], capture: tuple[int, ...] = ()):
    """One forward of the whole sequence with a fresh cache."""
    T = len(ids)
    pos = torch.arange(T).unsqueeze(0)
    return model(torch.tensor([ids]), causal_meta(pos, T), new_cache(model, 1, T).layers, capture)


# --------------------------------------------------------------------------------------------
# real SmolLM2 vs transformers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    ids = [smollm2.tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "prompts should have different lengths"
    return ids


def test_smollm2_logits_and_features_match_hf(smollm2, hf_smollm2, prompt_ids):
    worst_logit, worst_feat = 0.0, 0.0
    for ids in prompt_ids:
        ours = full_forward(smollm2.model, ids, FEATURE_LAYERS)
        with torch.no_grad():
            ref = hf_smollm2(torch.tensor([ids]), output_hidden_states=True)
        d = max_diff(ours.logits, ref.logits)
        scale = float(ref.logits.abs().max())
        print(f"\nSmolLM2 vs HF, {len(ids)} tokens: logits max abs diff {d:.3g} (max |logit| {scale:.1f})")
        assert torch.equal(ours.logits.argmax(-1), ref.logits.argmax(-1))
        worst_logit = max(worst_logit, d)
        H = smollm2.model.cfg.hidden_size
        assert ours.features.shape == (1, len(ids), len(FEATURE_LAYERS) * H)
        for k, layer in enumerate(FEATURE_LAYERS):
            # relative to the layer's scale: the middle layers carry activations of ~2.3e4, where one
            # fp32 ulp is 2e-3 and a GEMM's summation order (MKL's, ours, the CPU's vector width) moves
            # the last few bits
            fd = rel_diff(ours.features[..., k * H : (k + 1) * H], ref.hidden_states[layer + 1])
            print(f"  feature layer {layer}: max relative diff {fd:.3g}")
            worst_feat = max(worst_feat, fd)
    print(f"SmolLM2 vs HF worst: logits {worst_logit:.3g}, features {worst_feat:.3g}")
    assert worst_logit < 1e-3
    assert worst_feat < 1e-5


def test_smollm2_logits_index(smollm2, prompt_ids):
    """``logits_index`` picks rows; features still cover every position."""
    ids = prompt_ids[1]
    T = len(ids)
    full = full_forward(smollm2.model, ids, (3,))
    pos = torch.arange(T).unsqueeze(0)
    idx = torch.tensor([[0, T // 2, T - 1]])
    out = smollm2.model(torch.tensor([ids]), causal_meta(pos, T), new_cache(smollm2.model, 1, T).layers, (3,), idx)
    assert out.logits.shape == (1, 3, smollm2.model.cfg.vocab_size)
    assert max_diff(out.logits, full.logits[:, idx[0]]) < 1e-4
    assert out.features.shape[1] == T


# --------------------------------------------------------------------------------------------
# KV-cache consistency on the real model
# --------------------------------------------------------------------------------------------


def test_prefill_then_decode_equals_full_forward(smollm2, prompt_ids):
    model = smollm2.model
    ids = prompt_ids[2]
    T = len(ids)
    P = T - 12
    full = full_forward(model, ids, (5, 29))
    cache = new_cache(model, 1, T + 4)
    pos = torch.arange(P).unsqueeze(0)
    out = model(torch.tensor([ids[:P]]), causal_meta(pos, P), cache.layers, (5, 29))
    got_logits, got_feats = [out.logits], [out.features]
    # token by token (plain decoding) for 6 tokens ...
    for p in range(P, P + 6):
        pos = torch.tensor([[p]])
        out = model(torch.tensor([[ids[p]]]), causal_meta(pos, p + 1), cache.layers, (5, 29))
        got_logits.append(out.logits)
        got_feats.append(out.features)
    # ... then two verify-style chunks of 3, kv_len covering the whole chunk
    for p in range(P + 6, T, 3):
        pos = torch.arange(p, p + 3).unsqueeze(0)
        out = model(torch.tensor([ids[p : p + 3]]), causal_meta(pos, p + 3), cache.layers, (5, 29))
        got_logits.append(out.logits)
        got_feats.append(out.features)
    d = max_diff(torch.cat(got_logits, 1), full.logits)
    fd = max_diff(torch.cat(got_feats, 1), full.features)
    print(f"\nprefill {P} + decode {T - P} vs full forward ({T} tokens): logits {d:.3g}, features {fd:.3g}")
    assert d < 1e-4
    assert fd < 1e-4


def test_stale_slots_after_rollback_are_ignored(smollm2, prompt_ids):
    """Rejected draft tokens leave K/V in slots past the committed length; re-decoding from the
    committed length must give the same logits as if they had never been written."""
    model = smollm2.model
    ids = prompt_ids[1]
    T = len(ids)
    P = T - 4
    cache = new_cache(model, 1, T + 8)
    pos = torch.arange(P).unsqueeze(0)
    model(torch.tensor([ids[:P]]), causal_meta(pos, P), cache.layers)
    # a "draft" block of 6 wrong tokens at positions P..P+5, then roll back to P
    pos = torch.arange(P, P + 6).unsqueeze(0)
    model(torch.tensor([[7, 8, 9, 10, 11, 12]]), causal_meta(pos, P + 6), cache.layers)
    pos = torch.arange(P, T).unsqueeze(0)
    out = model(torch.tensor([ids[P:]]), causal_meta(pos, P + 6), cache.layers)  # kv_len covers stale slots P+4, P+5
    d = max_diff(out.logits, full_forward(model, ids).logits[:, P:])
    print(f"\nafter rollback: logits max abs diff {d:.3g}")
    assert d < 1e-4


def test_ragged_batch_equals_single(smollm2, prompt_ids):
    model = smollm2.model
    B = len(prompt_ids)
    lens = torch.tensor([len(i) for i in prompt_ids])
    T = int(lens.max())
    cache = new_cache(model, B, T + 2)
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompt_ids):
        ids[b, : len(p)] = torch.tensor(p)
    pos = torch.arange(T).expand(B, T)
    valid = pos < lens.unsqueeze(1)
    meta = causal_meta(pos, T, torch.where(valid, pos, cache.trash_slot))
    out = model(ids, meta, cache.layers, (2, 29), logits_index=(lens - 1).unsqueeze(1))
    # one batched decode step, each row at its own position
    nxt = out.logits[:, 0].argmax(-1)
    step = model(nxt.unsqueeze(1), causal_meta(lens.unsqueeze(1), T + 1), cache.layers, (2, 29))
    worst = 0.0
    for b, p in enumerate(prompt_ids):
        alone = full_forward(model, p + [int(nxt[b])], (2, 29))
        L = len(p)
        d = max(
            rel_diff(out.logits[b, 0], alone.logits[0, L - 1]),
            rel_diff(out.features[b, :L], alone.features[0, :L]),
            rel_diff(step.logits[b, 0], alone.logits[0, L]),
            rel_diff(step.features[b, 0], alone.features[0, L]),
        )
        worst = max(worst, d)
    print(f"\nragged batch of {B} (lengths {lens.tolist()}) vs alone: max relative diff {worst:.3g}")
    # fp32 rounding is ~1e-7 relative; a wrong mask, position or slot moves logits by O(1)
    assert worst < 1e-5


# --------------------------------------------------------------------------------------------
# tiny random HF checkpoints of each supported family
# --------------------------------------------------------------------------------------------

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that with head_dim 8 and theta 10000 (wavelengths 6.3, 63, 628, 6283) the
    # three llama3 regimes (kept, smoothed, divided by factor) all occur
    "original_max_position_embeddings": 64,
}


def tiny_hf_model(family: str, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=vocab,
        num_hidden_layers=3,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        bos_token_id=1,
        max_position_embeddings=256,
    )
    if family == "qwen2":
        cfg = Qwen2Config(
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            **common,
        )
        cls = Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = Qwen3Config(
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            **common,
        )
        cls = Qwen3ForCausalLM
    else:
        cfg = LlamaConfig(
            hidden_size=32,
            intermediate_size=80,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling=dict(LLAMA3_ROPE),
            **common,
        )
        cls = LlamaForCausalLM
    torch.manual_seed({"qwen2": 1, "qwen3": 2, "llama": 3}[family])
    model = cls(cfg).eval()
    # HF init (std 0.02, unit norms, zero biases) makes every check trivially small: use larger
    # weights, non-unit norms and non-zero biases
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


@pytest.fixture(scope="module")
def tiny_ids(smollm2):
    ids = smollm2.tokenizer(PROMPTS[2])["input_ids"]
    assert len(ids) > 40
    return ids


def save_tiny(model, tokenizer, out, **kw):
    model.save_pretrained(str(out), **kw)
    tokenizer.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_tiny_family_matches_hf(family, smollm2, tiny_ids, tmp_path):
    vocab = smollm2.model.cfg.vocab_size  # the SmolLM2 tokenizer is saved next to the weights
    hf = tiny_hf_model(family, vocab)
    save_tiny(hf, smollm2.tokenizer, tmp_path / family)
    assert (tmp_path / family / "model.safetensors").is_file()
    loaded = load_target(str(tmp_path / family))
    cfg = loaded.model.cfg
    assert cfg.family == family
    assert cfg.attention_bias == (family == "qwen2")
    assert cfg.qk_norm == (family == "qwen3")
    assert cfg.tie_word_embeddings == (family == "qwen2")
    assert 2 in loaded.stop_token_ids
    if family == "qwen3":
        assert cfg.head_dim == 16 != cfg.hidden_size // cfg.num_heads
    if family == "llama":
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
        ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
        ref = hf.model.rotary_emb.inv_freq.float()
        print(
            f"\nllama3 inv_freq ours {ours.tolist()}\n              HF   {ref.tolist()}\n"
            f"         unscaled  {plain.tolist()}"
        )
        assert torch.allclose(ours, ref, rtol=1e-6, atol=0)
        ratio = plain / ours
        assert ratio[0] == 1 and ratio[-1] == 8 and 1 < ratio[1] < 8, "all three llama3 regimes must occur"
    ids = tiny_ids
    layers = (0, 1, 2)
    ours = full_forward(loaded.model, ids, layers)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    d = max_diff(ours.logits, ref.logits)
    fd = max(
        max_diff(ours.features[..., k * cfg.hidden_size : (k + 1) * cfg.hidden_size], ref.hidden_states[i + 1])
        for k, i in enumerate(layers)
    )
    print(
        f"\ntiny {family} vs HF ({len(ids)} tokens): logits max abs diff {d:.3g} "
        f"(max |logit| {float(ref.logits.abs().max()):.1f}), features {fd:.3g}"
    )
    assert d < 1e-4
    assert fd < 1e-4
    if family == "llama":
        # the scaled RoPE must actually matter at these positions: plain RoPE gives other logits
        plain_model = TargetModel(TargetConfig(**{**cfg.__dict__, "rope_scaling": None}))
        plain_model.load_state_dict(loaded.model.state_dict())
        dp = max_diff(full_forward(plain_model, ids).logits, ref.logits)
        print(f"  same weights with unscaled RoPE: logits max abs diff {dp:.3g}")
        assert dp > 100 * max(d, 1e-6)


def test_sharded_checkpoint_loads(smollm2, tiny_ids, tmp_path):
    hf = tiny_hf_model("qwen3", smollm2.model.cfg.vocab_size)
    single = save_tiny(hf, smollm2.tokenizer, tmp_path / "single")
    sharded = save_tiny(hf, smollm2.tokenizer, tmp_path / "sharded", max_shard_size="100KB")
    index = sharded / "model.safetensors.index.json"
    assert index.is_file() and not (sharded / "model.safetensors").exists()
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) > 1
    a = load_safetensors_dir(single, "target")
    b = load_safetensors_dir(sharded, "target")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    la = full_forward(load_target(str(sharded)).model, tiny_ids).logits
    with torch.no_grad():
        ref = hf(torch.tensor([tiny_ids])).logits
    d = max_diff(la, ref)
    print(f"\nsharded ({len(shards)} shards) qwen3 vs HF: logits max abs diff {d:.3g}")
    assert d < 1e-4


def test_missing_shard_and_weight_raise(smollm2, tmp_path):
    from dflash_trt.errors import DFlashError

    hf = tiny_hf_model("llama", smollm2.model.cfg.vocab_size)
    out = save_tiny(hf, smollm2.tokenizer, tmp_path / "m", max_shard_size="100KB")
    shard = sorted(out.glob("model-*.safetensors"))[0]
    shard.rename(out / "moved.bin")
    with pytest.raises(DFlashError, match="missing"):
        load_target(str(out))
    # a config that does not match the weights
    out2 = save_tiny(hf, smollm2.tokenizer, tmp_path / "m2")
    cfg = json.loads((out2 / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (out2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="shape"):
        load_target(str(out2))


def test_unsupported_rope_type_is_a_user_error(smollm2, tmp_path):
    """A checkpoint with a RoPE scaling we do not implement fails with DFlashError, not a traceback."""
    from dflash_trt.errors import DFlashError

    out = save_tiny(tiny_hf_model("qwen3", smollm2.model.cfg.vocab_size), smollm2.tokenizer, tmp_path / "dynamic")
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1000000.0}  # dynamic NTK
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="rope_type 'dynamic'"):
        load_target(str(out))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"])
def test_target_tokenizer_is_what_autotokenizer_loads(family, smollm2, tmp_path):
    """The loader's tokenizer for a directory (the default target's tokenizer files under a
    config of each supported model type) is what ``AutoTokenizer.from_pretrained`` gives: the
    same class (``TokenizersBackend`` where it loads that class directly, ``Qwen2Tokenizer`` for
    qwen2), token ids, special ids and chat-template text."""
    import shutil

    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    from dflash_trt.checkpoints.loader import GENERIC_TOKENIZER_FAMILIES, _tokenizer

    for f in smollm2.path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, model_type=family)))
    ours = _tokenizer(str(tmp_path), (family,))
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(auto)
    assert (family in GENERIC_TOKENIZER_FAMILIES) == (
        family not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        and TOKENIZER_MAPPING_NAMES.get(family) != "MistralCommonBackend"
    )
    chat = [{"role": "user", "content": PROMPTS[2]}]
    for text in PROMPTS:
        assert ours.encode(text) == auto.encode(text)
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        auto.eos_token_id,
        auto.bos_token_id,
        auto.pad_token_id,
        auto.unk_token_id,
    )
