"""gpt-oss targets: a tiny random ``GptOssForCausalLM`` that transformers builds and saves (4
layers, sliding-window layers alternating with full ones, attention sinks, q/k/v/o biases, router
and expert biases, YaRN RoPE, 8 experts top 2 with the SwiGLU clamp active, intermediate width
!= hidden) loads through our loader and gives transformers' logits (eager attention and experts,
fp32) on every attention path the runtime runs: one prefill, chunked prefill then paged decode,
and a ragged in-flight batch (a prompt chunk, decode steps and verify blocks in one forward), with
the batch-invariant mode on and off; an MXFP4-packed checkpoint in the official layout
(``*_blocks`` / ``*_scales``) dequantizes exactly as transformers' own conversion; in the engine,
DFlash (an oracle proposer and a random drafter) equals plain decoding token for token at batch 1
and in flight; bad inputs give one line."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from helpers import check_lossless_oracle_and_drafter
from test_models import PROMPTS, save_tiny

from dflash_trt.checkpoints.loader import load_target
from dflash_trt.checkpoints.mxfp4 import dequantize_mxfp4
from dflash_trt.checkpoints.zlab import init_drafter, validate_pair
from dflash_trt.errors import DFlashError
from dflash_trt.models.batch_invariant import set_batch_invariant
from dflash_trt.models.config import TargetConfig
from dflash_trt.models.moe import MoEBlock
from dflash_trt.runtime.attention_meta import plan_packed
from dflash_trt.runtime.kv_cache import PagedKVCache

transformers = pytest.importorskip("transformers")

WINDOW = 4  # sliding window: every sequence below crosses it
TPB = 8  # tokens per KV block in the paged tests
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def tiny_gpt_oss(vocab: int, seed: int = 0, **overrides):
    """transformers' gpt-oss at a tiny size, with every gpt-oss code path live: sinks ~N(0, 1),
    random biases (their init is 0), and expert weights scaled so that the SwiGLU clamp (7.0)
    cuts a share of the gates and ups. Head dim 16 with YaRN (factor 32 over 4096 positions):
    the ramp spans dims 2-4, so extrapolated, blended and interpolated frequencies all occur.
    ``overrides``: config fields set on top (e.g. more KV heads for a wider tensor-parallel split)."""
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=131072,
        rope_parameters=dict(YARN),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a, e = layer.self_attn, layer.mlp.experts
            a.sinks.normal_(0, 1.0)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(a, n).bias.normal_(0, 0.1)
            layer.mlp.router.bias.normal_(0, 0.5)
            e.gate_up_proj_bias.normal_(0, 0.1)
            e.down_proj_bias.normal_(0, 0.1)
            e.gate_up_proj.mul_(100)
            layer.input_layernorm.weight.normal_(1.0, 0.2)
    return model


@pytest.fixture(scope="module")
def gpt_oss_pair(smollm2, tmp_path_factory):
    """(transformers' model, ours loaded by our loader from the checkpoint transformers saved)."""
    hf = tiny_gpt_oss(smollm2.model.cfg.vocab_size)
    out = save_tiny(hf, smollm2.tokenizer, tmp_path_factory.mktemp("gptoss"))
    return hf, load_target(str(out))


@pytest.fixture(scope="module")
def sequences(smollm2, gpt_oss_pair):
    """Three token sequences (prompts extended with random tokens to 13-30 tokens) and
    transformers' logits for each, over the whole sequence at once (no cache): the oracle for
    every row our paged forwards produce at any position."""
    hf = gpt_oss_pair[0]
    g = torch.Generator().manual_seed(1)
    seqs = []
    for p, extra in zip(PROMPTS, (9, 3, 14)):
        ids = smollm2.tokenizer(p)["input_ids"][:16]
        seqs.append(ids + torch.randint(3, hf.config.vocab_size, (extra,), generator=g).tolist())
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0] for s in seqs]
    return seqs, refs


def test_config_and_layers(gpt_oss_pair):
    hf, ours = gpt_oss_pair
    cfg = ours.model.cfg
    assert cfg.family == "gpt_oss" and cfg.attention_bias and cfg.o_bias and cfg.attn_sinks
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == WINDOW
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert (cfg.moe_routing, cfg.moe_activation, cfg.swiglu_limit, cfg.swiglu_alpha) == (
        "topk_softmax",
        "clamped_swiglu",
        7.0,
        1.702,
    )
    assert [layer.attn.window for layer in ours.model.layers] == [WINDOW, None, WINDOW, None]
    assert all(isinstance(layer.mlp, MoEBlock) for layer in ours.model.layers)
    # YaRN: transformers' inverse frequencies bitwise, and its attention factor
    assert torch.equal(ours.model.rope.inv_freq, hf.model.rotary_emb.inv_freq.float())
    assert ours.model.rope.attention_factor == hf.model.rotary_emb.attention_scaling == pytest.approx(1.3465736)
    # an official config.json (rope_scaling, experts_per_token, no layer_types) parses the same
    official = {k: v for k, v in hf.config.to_dict().items() if k not in ("rope_parameters", "layer_types")}
    official |= {"rope_theta": 150000, "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"}}
    official["experts_per_token"] = official.pop("num_experts_per_tok")
    assert TargetConfig.from_hf(official) == cfg


@pytest.mark.parametrize("path", ["sdpa", "matmul", "bi_attention"])
def test_sink_attention_equals_transformers_eager(path):
    """Every attention path with sinks (SDPA with the sink as an extra key column, the matmul
    path torch.compile runs on the CPU, the batch-invariant kernel) against transformers'
    ``eager_attention_forward`` of gpt-oss, GQA 6:2, a causal sliding-window mask."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from dflash_trt.kernels.cpu_ops import bi_attention
    from dflash_trt.models.layers import _matmul_attention, _sdpa

    g = torch.Generator().manual_seed(0)
    s, h, hkv, t, d = 2, 6, 2, 9, 16
    q, k, v = (torch.randn(s, n, t, d, generator=g) for n in (h, hkv, hkv))
    sinks = torch.randn(h, generator=g) * 2
    pos = torch.arange(t)
    mask = ((pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 3)).expand(s, 1, t, t)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, h // hkv
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    ref = eager_attention_forward(module, q, k, v, additive, d**-0.5)[0].transpose(1, 2)
    if path == "sdpa":
        got = _sdpa(q, k, v, mask, sinks=sinks)
    elif path == "matmul":
        got = _matmul_attention(q, k, v, mask, sinks)
    else:
        got = bi_attention(q, k, v, mask, d**-0.5, sinks)
    assert float((got - ref).abs().max()) < 1e-5
    # and the sinks matter: without them the rows sum to 1 again
    plain = _sdpa(q, k, v, mask)
    assert float((plain - ref).abs().max()) > 1e-2


def _paged_forwards(model, steps, cache, tables, window):
    """Run ``steps`` (each a list of (sequence, first position, tokens)) as packed paged
    forwards over ``cache``; returns {(sequence, position): logits row}."""
    rows = {}
    for step in steps:
        starts = [p for _, p, _ in step]
        lengths = [len(t) for _, _, t in step]
        offsets = [sum(lengths[:i]) for i in range(len(step))]
        tabs = [tables[s] for s, _, _ in step]
        plan = plan_packed(starts, lengths, offsets, lengths, tabs, TPB, cache.k.shape[1] - 1, target_window=window)
        ids = torch.tensor([[t for _, _, ts in step for t in ts]])
        logits = model(ids, plan.build(), cache.layers).logits[0]
        for (s, p, ts), off in zip(step, offsets):
            for j in range(len(ts)):
                rows[s, p + j] = logits[off + j]
    return rows


def _schedules(seqs):
    """Three runs over the sequences: whole prompts in one prefill each; chunked prefill (chunks
    of 5) then paged decode one token at a time; and a ragged in-flight batch where every
    forward mixes a long prompt chunk (> 16 queries: its own attention group), decode steps and
    verify blocks of 4."""
    whole = [[(s, 0, seq)] for s, seq in enumerate(seqs)]
    chunked = []
    for s, seq in enumerate(seqs):
        p = 0
        while p < 10:
            chunked.append([(s, p, seq[p : p + 5])])
            p += 5
        chunked += [[(s, q, seq[q : q + 1])] for q in range(p, len(seq))]
    a, b, c = seqs
    ragged = [
        [(0, 0, a[:6]), (1, 0, b[:3])],
        [(0, 6, a[6:7]), (1, 3, b[3:7]), (2, 0, c[:17])],
        [(2, 17, c[17:21]), (0, 7, a[7:11]), (1, 7, b[7:8])],
        [(1, 8, b[8:]), (2, 21, c[21:22]), (0, 11, a[11:])],
        [(2, 22, c[22:26])],
        [(2, 26, c[26:])],
    ]
    return {"prefill": whole, "chunked prefill + paged decode": chunked, "ragged in flight": ragged}


@pytest.mark.parametrize("invariant", [False, True], ids=["sdpa", "batch_invariant"])
def test_logits_equal_transformers(gpt_oss_pair, sequences, invariant):
    _, ours = gpt_oss_pair
    model, cfg = ours.model, ours.model.cfg
    seqs, refs = sequences
    blocks = [-(-len(s) // TPB) for s in seqs]
    tables = [list(range(sum(blocks[:i]), sum(blocks[: i + 1]))) for i in range(len(seqs))]
    set_batch_invariant(model, invariant)
    try:
        worst = {}
        for name, steps in _schedules(seqs).items():
            cache = PagedKVCache(cfg.num_layers, sum(blocks), TPB, cfg.num_kv_heads, cfg.head_dim, torch.float32)
            rows = _paged_forwards(model, steps, cache, tables, cfg.sliding_window)
            assert len(rows) == sum(len(s) for s in seqs)
            worst[name] = max(float((rows[s, p] - refs[s][p]).abs().max() / refs[s][p].abs().max()) for s, p in rows)
    finally:
        set_batch_invariant(model, False)
    print(f"\ntiny gpt_oss vs transformers (batch-invariant {invariant}), max relative logit difference: {worst}")
    assert max(worst.values()) < 1e-4


def test_every_gpt_oss_feature_matters(gpt_oss_pair, sequences):
    """The comparison above can fail: dropping the sinks, the window, the clamp or the YaRN
    factor each moves the logits far past its tolerance."""
    _, ours = gpt_oss_pair
    model, cfg = ours.model, ours.model.cfg
    seqs, refs = sequences
    seq, ref = seqs[2], refs[2]

    def rel() -> float:
        cache = PagedKVCache(cfg.num_layers, 4, TPB, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        rows = _paged_forwards(model, [[(0, 0, seq)]], cache, [[0, 1, 2, 3]], cfg.sliding_window)
        return max(float((rows[0, p] - ref[p]).abs().max() / ref[p].abs().max()) for p in range(len(seq)))

    base = rel()
    attn, moe, rope = model.layers[0].attn, model.layers[1].mlp, model.rope
    changes = {
        "sinks": (attn, "sinks", None),
        "window": (attn, "window", None),
        "clamp": (moe, "limit", 1e9),
        "yarn factor": (rope, "cos_table", rope.cos_table / rope.attention_factor),
    }
    for name, (obj, attr, value) in changes.items():
        saved = getattr(obj, attr)
        setattr(obj, attr, value)
        try:
            assert rel() > 100 * max(base, 1e-6), name
        finally:
            setattr(obj, attr, saved)


def _openai_state_dict(sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """transformers' gpt-oss state dict under the names of OpenAI's reference
    (``gpt_oss/torch/model.py``: fused ``qkv``, ``mlp1_weight [E, 2I, H]`` = ``gate_up_proj``
    transposed, gate/up still interleaved, ``mlp2_weight [E, H, I]``)."""
    new = {"embedding.weight": sd["model.embed_tokens.weight"], "norm.scale": sd["model.norm.weight"]}
    new["unembedding.weight"] = sd["lm_head.weight"]
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"block.{i}."
        a, m = p + "self_attn.", p + "mlp."
        new[b + "attn.norm.scale"] = sd[p + "input_layernorm.weight"]
        for kind in ("weight", "bias"):
            new[b + "attn.qkv." + kind] = torch.cat([sd[f"{a}{n}_proj.{kind}"] for n in "qkv"])
            new[b + "attn.out." + kind] = sd[f"{a}o_proj.{kind}"]
            new[b + "mlp.gate." + kind] = sd[f"{m}router.{kind}"]
        new[b + "attn.sinks"] = sd[a + "sinks"]
        new[b + "mlp.norm.scale"] = sd[p + "post_attention_layernorm.weight"]
        new[b + "mlp.mlp1_weight"] = sd[m + "experts.gate_up_proj"].transpose(1, 2)
        new[b + "mlp.mlp1_bias"] = sd[m + "experts.gate_up_proj_bias"]
        new[b + "mlp.mlp2_weight"] = sd[m + "experts.down_proj"].transpose(1, 2)
        new[b + "mlp.mlp2_bias"] = sd[m + "experts.down_proj_bias"]
    return new


def test_logits_equal_openai_reference(gpt_oss_pair, sequences):
    """Against OpenAI's own reference torch implementation (the ``gpt-oss`` package). It declares
    Python >= 3.12, so it is not a dependency of the package; the Makefile's install puts it in
    with ``pip install --no-deps --ignore-requires-python gpt-oss==0.0.9`` (its ``gpt_oss.torch``
    needs only torch and safetensors), and without it this test fails."""
    import gpt_oss.torch.model as ref_model

    hf, ours = gpt_oss_pair
    c = hf.config
    oc = ref_model.ModelConfig(
        num_hidden_layers=c.num_hidden_layers,
        num_experts=c.num_local_experts,
        experts_per_token=c.num_experts_per_tok,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        swiglu_limit=c.swiglu_limit,
        head_dim=c.head_dim,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        sliding_window=c.sliding_window,
        initial_context_length=YARN["original_max_position_embeddings"],
        rope_theta=YARN["rope_theta"],
        rope_scaling_factor=YARN["factor"],
        rope_ntk_alpha=YARN["beta_slow"],
        rope_ntk_beta=YARN["beta_fast"],
    )
    openai = ref_model.Transformer(oc, device=torch.device("cpu")).float().eval()
    openai.load_state_dict(_openai_state_dict(hf.state_dict(), c.num_hidden_layers), strict=True)
    model, cfg = ours.model, ours.model.cfg
    worst = 0.0
    for seq in sequences[0]:
        with torch.no_grad():
            ref = openai(torch.tensor(seq))
        cache = PagedKVCache(cfg.num_layers, 4, TPB, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        rows = _paged_forwards(model, [[(0, 0, seq)]], cache, [[0, 1, 2, 3]], cfg.sliding_window)
        got = torch.stack([rows[0, p] for p in range(len(seq))])
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    print(f"\ntiny gpt_oss vs OpenAI's reference (gpt_oss.torch.model): max relative logit difference {worst:.2g}")
    assert worst < 1e-4


def _mxfp4_checkpoint(hf, out, tokenizer, seed: int = 0):
    """``hf`` saved in the official gpt-oss MXFP4 layout: each layer's ``experts.gate_up_proj`` /
    ``down_proj`` replaced by random ``*_blocks`` (u8 ``[E, out, in / 32, 16]``) and ``*_scales``
    (u8 ``[E, out, in / 32]``, exponents 2^-9 .. 2^-4), with ``quantization_config`` mxfp4."""
    from safetensors.torch import load_file, save_file

    save_tiny(hf, tokenizer, out)
    sd = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, fan_in, fan_out = sd.pop(name).shape
        sd[name + "_blocks"] = torch.randint(0, 256, (e, fan_out, fan_in // 32, 16), dtype=torch.uint8, generator=g)
        sd[name + "_scales"] = torch.randint(118, 124, (e, fan_out, fan_in // 32), dtype=torch.uint8, generator=g)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return sd


def test_mxfp4_checkpoint_equals_transformers(gpt_oss_pair, sequences, smollm2, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = gpt_oss_pair[0]
    sd = _mxfp4_checkpoint(hf, tmp_path / "mxfp4", smollm2.tokenizer)
    # our decoding equals transformers' conversion, bitwise (E2M1 x 2^k is exact in fp32)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"):
        b, s = sd[name + "_blocks"], sd[name + "_scales"]
        ref = convert_moe_packed_tensors(b, s, dtype=torch.float32)
        assert torch.equal(dequantize_mxfp4(b, s, torch.float32), ref)
    # and the model loaded by transformers' quantizer (dequantizing) gives our logits
    ref_model = transformers.GptOssForCausalLM.from_pretrained(
        str(tmp_path / "mxfp4"),
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    ours = load_target(str(tmp_path / "mxfp4")).model
    seq = sequences[0][2]
    with torch.no_grad():
        ref = ref_model(torch.tensor([seq])).logits[0]
    cfg = ours.cfg
    cache = PagedKVCache(cfg.num_layers, 4, TPB, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    rows = _paged_forwards(ours, [[(0, 0, seq)]], cache, [[0, 1, 2, 3]], cfg.sliding_window)
    got = torch.stack([rows[0, p] for p in range(len(seq))])
    d = float((got - ref).abs().max() / ref.abs().max())
    print(f"\nMXFP4 tiny gpt_oss vs transformers (dequantized): max relative logit difference {d:.2g}")
    assert d < 1e-4


def test_mxfp4_kept_packed_equals_dequantized(gpt_oss_pair, sequences, smollm2, tmp_path):
    """``--weights mxfp4``: the experts stay MXFP4 codes (4.25 bits a weight) decoded per GEMM,
    and give the logits of the checkpoint dequantized at load bit for bit: the eager expert loop,
    the batch-invariant mode, the static (graph) path, every schedule of the reference test; an
    expert-parallel and a tensor-parallel rank's slices of the codes give the dense slices'
    (a tensor-parallel split inside a 32-element block gets one line); DFlash on it equals
    plain decoding; a checkpoint without MXFP4 tensors gets one line."""
    import copy

    from dflash_trt.models.moe import static_experts
    from dflash_trt.quantization.mxfp4 import MXFP4Experts
    from dflash_trt.runtime.distributed import _shard_experts

    _mxfp4_checkpoint(gpt_oss_pair[0], tmp_path / "mxfp4", smollm2.tokenizer)
    dense = load_target(str(tmp_path / "mxfp4")).model
    packed_target = load_target(str(tmp_path / "mxfp4"), weights="mxfp4")
    packed = packed_target.model
    moe = list(zip(*([m for m in model.modules() if isinstance(m, MoEBlock)] for model in (dense, packed))))
    assert len(moe) == 4 and all(isinstance(p.gate_up, MXFP4Experts) for _, p in moe)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    dense_b = size(t for d, _ in moe for t in (d.gate_up, d.down))
    packed_b = size(t for _, p in moe for t in p.buffers())
    print(f"\nMXFP4 experts kept packed: {packed_b} bytes against {dense_b} dequantized (fp32)")
    assert packed_b * 7 < dense_b

    seqs, cfg = sequences[0], dense.cfg
    blocks = [-(-len(x) // TPB) for x in seqs]
    tables = [list(range(sum(blocks[:i]), sum(blocks[: i + 1]))) for i in range(len(seqs))]
    for invariant, static in ((False, False), (True, False), (False, True), (True, True)):
        rows = []
        for model in (dense, packed):
            set_batch_invariant(model, invariant)
            try:
                with static_experts() if static else contextlib.nullcontext():
                    for steps in _schedules(seqs).values():
                        shape = (cfg.num_layers, sum(blocks), TPB, cfg.num_kv_heads, cfg.head_dim)
                        cache = PagedKVCache(*shape, torch.float32)
                        rows.append(_paged_forwards(model, steps, cache, tables, cfg.sliding_window))
            finally:
                set_batch_invariant(model, False)
        half = len(rows) // 2
        assert all(torch.equal(a[k], b[k]) for a, b in zip(rows[:half], rows[half:]) for k in a), (invariant, static)

    # an expert-parallel rank: half the experts
    h = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    E, inter = cfg.num_experts, cfg.moe_intermediate_size
    d, p = copy.deepcopy(moe[0][0]), copy.deepcopy(moe[0][1])
    _shard_experts(d, E // 2, E // 2, 0, inter)
    _shard_experts(p, E // 2, E // 2, 0, inter)
    with torch.no_grad():
        assert torch.equal(d(h), p(h))
    # a tensor-parallel rank's slices of the codes (rows anywhere, columns on 32-element blocks)
    g = torch.Generator().manual_seed(1)
    codes = MXFP4Experts(
        torch.randint(0, 256, (4, 6, 3, 16), dtype=torch.uint8, generator=g),
        torch.randint(118, 124, (4, 6, 3), dtype=torch.uint8, generator=g),
    )
    rows = torch.tensor([0, 1, 4])
    assert torch.equal(codes.select(slice(1, 3), rows, slice(32, 96)).dense(), codes.dense()[1:3][:, rows][..., 32:96])
    with pytest.raises(DFlashError, match="columns 16..32: not on 32-element blocks") as e:
        _shard_experts(copy.deepcopy(moe[0][1]), 0, E, inter // 2, inter // 2)  # I = 32 split in two
    assert "\n" not in str(e.value)

    prompts = [smollm2.tokenizer(x)["input_ids"] for x in PROMPTS]
    check_lossless_oracle_and_drafter(packed_target, prompts, 8, "gpt_oss, MXFP4 experts kept packed")
    with pytest.raises(DFlashError, match="has no MXFP4 expert weights") as e:
        load_target(str(gpt_oss_pair[1].path), weights="mxfp4")
    assert "\n" not in str(e.value)


def test_dflash_equals_plain_decoding(gpt_oss_pair, smollm2):
    """The sequences pass the target's sliding window many times over; the drafter has z-lab's
    gpt-oss layout (a causal sliding layer, window 6, then a full one)."""
    from test_zlab import with_layout

    _, target = gpt_oss_pair
    prompts = [smollm2.tokenizer(p)["input_ids"] for p in PROMPTS]
    drafter = with_layout(init_drafter(target.model.cfg, 2, 4, 0, seed=0, sliding_window=6), "gpt-oss")
    assert drafter.cfg.layer_kinds == ((True, 6), (False, None))
    check_lossless_oracle_and_drafter(target, prompts, 16, "gpt_oss", drafter)


def test_bad_inputs_one_line(gpt_oss_pair, smollm2, tmp_path):
    hf = gpt_oss_pair[0]
    # an unsupported family
    cfg = hf.config.to_dict() | {"model_type": "mixtral"}
    with pytest.raises(DFlashError, match="unsupported target model_type 'mixtral'"):
        TargetConfig.from_hf(cfg)
    # an MXFP4 tensor of the wrong shape: scales for 64 rows where gate_up has 2 * 32
    out = tmp_path / "bad"
    sd = _mxfp4_checkpoint(hf, out, smollm2.tokenizer)
    from safetensors.torch import save_file

    name = "model.layers.1.mlp.experts.gate_up_proj"
    sd[name + "_blocks"] = sd[name + "_blocks"][:, :48].contiguous()
    sd[name + "_scales"] = sd[name + "_scales"][:, :48].contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DFlashError) as e:
        load_target(str(out))
    assert "\n" not in str(e.value) and "gate_up_proj_blocks" in str(e.value) and "[8, 64, 2, 16]" in str(e.value)
    # a drafter reading target layers the target does not have
    target_cfg = gpt_oss_pair[1].model.cfg
    drafter = init_drafter(target_cfg, 1, 4, 0, seed=0)
    bad = drafter.cfg.__class__(**{**drafter.cfg.__dict__, "target_layer_ids": (1, 4)})
    with pytest.raises(DFlashError, match=r"target_layer_ids .* outside"):
        validate_pair(target_cfg, bad)


#: z-lab's gpt-oss-20b-DFlash config.json as quoted by a third party (it may be abridged: no
#: layer_types, no num_target_layers), with its layers listed as full attention
ZLAB_GPT_OSS_20B = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "block_size": 8,
    "bos_token_id": 199998,
    "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
    "dtype": "bfloat16",
    "eos_token_id": 200002,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 7680,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_hidden_layers": 8,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "vocab_size": 201088,
}


def test_zlab_gpt_oss_drafter_config():
    """A gpt-oss drafter config means what transformers' ``GptOssConfig`` makes of it: its RoPE
    (YaRN, never written in the file) equals transformers' bitwise, ``num_target_layers`` may be
    absent, ``model_type`` survives a round trip; a file without ``layer_types`` gets
    ``GptOssConfig``'s (sliding and full layers in turn), each layer's window and causality read
    as z-lab's own attention layer reads them from that config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dflash_trt.checkpoints.zlab import drafter_config_from_json, drafter_config_to_json
    from dflash_trt.models.layers import RotaryEmbedding

    zlab = pytest.importorskip("dflash.model", reason="needs the z-lab reference: pip install --no-deps dflash==0.1.0")
    mixed = drafter_config_from_json(ZLAB_GPT_OSS_20B)
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    hf = transformers.GptOssConfig(**{k: v for k, v in ZLAB_GPT_OSS_20B.items() if k != "model_type"} | small)
    theirs = [zlab.Qwen3DFlashAttention(hf, i) for i in range(hf.num_hidden_layers)]
    assert mixed.layer_kinds == tuple((a.is_causal, a.sliding_window) for a in theirs)
    assert {w for _, w in mixed.layer_kinds} == {None, 128} and any(c for c, _ in mixed.layer_kinds)
    assert drafter_config_from_json(drafter_config_to_json(mixed)) == mixed
    raw = ZLAB_GPT_OSS_20B | {"layer_types": ["full_attention"] * 8}
    d = drafter_config_from_json(raw)
    skip = ("architectures", "model_type", "dflash_config")
    ref = transformers.AutoConfig.for_model("gpt_oss", **{k: v for k, v in raw.items() if k not in skip})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](ref, "cpu")
    rope = RotaryEmbedding(d.head_dim, d.rope_theta, d.rope_scaling, 16)
    assert torch.equal(rope.inv_freq, inv) and rope.attention_factor == factor
    assert d.attention_bias == ref.attention_bias and d.rms_norm_eps == ref.rms_norm_eps
    assert d.sliding_window is None and d.num_target_layers is None
    assert (d.block_size, d.mask_token_id, d.target_layer_ids) == (8, 200000, (1, 6, 11, 16, 21))
    target_json = {k: v for k, v in raw.items() if k not in skip} | {"model_type": "gpt_oss", "layer_types": None}
    validate_pair(TargetConfig.from_hf(target_json | {"num_hidden_layers": 24}), d)  # ids range-checked only
    with pytest.raises(DFlashError, match=r"target_layer_ids \[16, 21\] outside 0..11"):
        validate_pair(TargetConfig.from_hf(target_json | {"num_hidden_layers": 12}), d)
    out = drafter_config_to_json(d)
    assert out["model_type"] == "gpt_oss" and "num_target_layers" not in out
    assert drafter_config_from_json(out) == d
    for key, value in (("use_swa", True), ("causal", True)):
        bad = raw | {"dflash_config": raw["dflash_config"] | {key: value}}
        with pytest.raises(DFlashError, match=f"dflash_config.{key}"):
            drafter_config_from_json(bad)
