"""The DFlash drafter and the z-lab checkpoint format.

* our ``DFlashDrafter`` vs the z-lab reference ``dflash.model.DFlashDraftModel`` (PyPI
  ``dflash==0.1.0``, installed with ``--no-deps``) on the same weights and inputs, fp32;
* the drafter's context cache: context fed in chunks across calls (growing only by accepted
  positions, stale block slots overwritten) equals one call with the whole context; a ragged
  batch with padded context equals each row alone;
* ``init_drafter`` -> ``save_drafter`` -> ``load_drafter`` round trip and config parsing;
* ``validate_pair`` and ``load_drafter`` errors on bad input.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from dflash_trt.checkpoints.zlab import (
    drafter_config_from_json,
    drafter_config_to_json,
    init_drafter,
    load_drafter,
    save_drafter,
    validate_pair,
)
from dflash_trt.errors import DFlashError
from dflash_trt.models.config import TargetConfig
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.layers import AttentionMetadata
from dflash_trt.models.prefill import KVCache

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_target(**kw) -> TargetConfig:
    base = dict(
        family="llama",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    base.update(kw)
    return TargetConfig(**base)


#: the attention layouts a z-lab drafter may have besides one kind for every layer: gpt-oss's
#: (sliding and full layers in turn, z-lab's ``is_causal`` unset so the sliding ones are causal)
#: and the same kinds all non-causal (``is_causal: false``)
LAYOUTS = {
    "gpt-oss": lambda n: (tuple(("sliding_attention", "full_attention")[i % 2] for i in range(n)), True),
    "alternating": lambda n: (tuple(("sliding_attention", "full_attention")[i % 2] for i in range(n)), False),
}


def with_layout(model: DFlashDrafter, layout: str | None) -> DFlashDrafter:
    """``model`` with the :data:`LAYOUTS` ``layout`` (a new model with its weights), or
    ``model`` itself for None."""
    if layout is None:
        return model
    types, causal_sliding = LAYOUTS[layout](model.cfg.num_layers)
    causal = tuple(causal_sliding and t == "sliding_attention" for t in types)
    out = DFlashDrafter(dataclasses.replace(model.cfg, layer_types=types, causal_layers=causal))
    out.load_state_dict(model.state_dict())
    return out


def make_drafter(
    target: TargetConfig,
    layers: int = 3,
    block: int = 8,
    seed: int = 0,
    sliding_window: int | None = None,
    layout: str | None = None,
) -> DFlashDrafter:
    """A random drafter with non-trivial norms (unit norms would hide a missing norm); ``layout``
    a :data:`LAYOUTS` name (its sliding layers slide with ``sliding_window``)."""
    model = init_drafter(
        target, layers, block, mask_token_id=target.vocab_size - 1, seed=seed, sliding_window=sliding_window
    )
    model = with_layout(model, layout)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:  # std 0.02 keeps every layer near the identity: use 1/sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def fresh_cache(model: DFlashDrafter, batch: int, capacity: int) -> KVCache:
    c = model.cfg
    return KVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, capacity, torch.float32)


def draft_metas(cfg, pos, slots, start: torch.Tensor, K: int) -> list[AttentionMetadata]:
    """Contiguous-cache metadata of one draft of ``n`` blocks at ``start`` (int64 ``[n]``), one
    per drafter layer, written out from the z-lab rule: slot j visible to the query at position q
    iff j < start + K (causal layers: j <= q), and in a sliding layer of window W iff q - j < W."""
    n = start.numel()
    kv_len = int(start.max()) + K
    keys = torch.arange(kv_len).view(1, 1, 1, -1)
    query = (start.unsqueeze(1) + torch.arange(K)).view(n, 1, K, 1)
    metas = {}
    for causal, w in set(cfg.layer_kinds):
        mask = keys <= query if causal else (keys < (start + K).view(-1, 1, 1, 1)).expand(n, 1, K, kv_len)
        if w is not None:
            mask = mask & (query - keys < w)
        metas[causal, w] = AttentionMetadata(pos, slots, mask, kv_len)
    return [metas[kind] for kind in cfg.layer_kinds]


def draft_call(model, cache, block, ctx, ctx_pos, start, ctx_valid=None):
    """One drafter call the way the runner's proposer builds it (positions ``ctx_pos`` then
    ``start..start+K-1``, :func:`draft_metas`; invalid context -> trash slot)."""
    n, K, _ = block.shape
    start = torch.as_tensor(start).view(-1).expand(n)
    block_pos = start.unsqueeze(1) + torch.arange(K)
    if ctx_valid is None:
        ctx_valid = torch.ones_like(ctx_pos, dtype=torch.bool)
    pos = torch.cat([ctx_pos, block_pos], 1)
    slots = torch.cat([torch.where(ctx_valid, ctx_pos, cache.trash_slot), block_pos], 1)
    with torch.inference_mode():
        return model(block, ctx, draft_metas(model.cfg, pos, slots, start, K), cache.layers)


def max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


# --------------------------------------------------------------------------------------------
# our drafter vs the z-lab reference implementation
# --------------------------------------------------------------------------------------------


def zlab_model(ours: DFlashDrafter):
    model_mod = pytest.importorskip(
        "dflash.model", reason="needs the z-lab reference: pip install --no-deps dflash==0.1.0"
    )
    from transformers import Qwen3Config

    cfg = Qwen3Config(**drafter_config_to_json(ours.cfg))
    ref = model_mod.DFlashDraftModel(cfg).float().eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert list(ref.target_layer_ids) == list(ours.cfg.target_layer_ids)
    assert ref.block_size == ours.cfg.block_size and ref.mask_token_id == ours.cfg.mask_token_id
    return ref


@pytest.mark.parametrize(
    "rope,window,layout",
    [(None, None, None), ("llama3", None, None), (None, 12, None), (None, 12, "gpt-oss"), (None, 12, "alternating")],
)
def test_drafter_matches_zlab_reference(rope, window, layout):
    """Also the layouts z-lab's model reads from ``layer_types`` and ``is_causal`` (sliding and
    full layers mixed, causal sliding layers): each changes the output, our config file of it
    reads back equal."""
    target = tiny_target(rope_scaling=dict(LLAMA3_ROPE) if rope else None)
    ours = make_drafter(target, layers=3, block=8, seed=1, sliding_window=window, layout=layout)
    assert drafter_config_from_json(drafter_config_to_json(ours.cfg)) == ours.cfg
    ref = zlab_model(ours)
    if rope:
        inv = ref.rotary_emb.inv_freq.float()
        assert torch.allclose(ours.rope.inv_freq, inv, rtol=1e-6, atol=0)
        plain = DFlashDrafter(dataclasses.replace(ours.cfg, rope_scaling=None)).rope.inv_freq
        assert not torch.allclose(ours.rope.inv_freq, plain), "the llama3 scaling must change some frequencies"
    H, K, N = target.hidden_size, ours.cfg.block_size, 37
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(1, K, H, generator=g)
    ctx = torch.randn(1, N, len(ours.cfg.target_layer_ids) * H, generator=g)
    pos = torch.arange(N + K).unsqueeze(0)
    with torch.no_grad():
        want = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx, past_key_values=None, use_cache=False)
    got = draft_call(ours, fresh_cache(ours, 1, N + K), noise, ctx, pos[:, :N], N)
    d = max_diff(got, want)
    # the window and the layout must matter: the same weights without each give other outputs
    others = [dataclasses.replace(ours.cfg, sliding_window=None, layer_types=(), causal_layers=())] if window else []
    if layout:
        others += [dataclasses.replace(ours.cfg, layer_types=(), causal_layers=())]
    if ours.cfg.causal_layers:
        others += [dataclasses.replace(ours.cfg, causal_layers=())]
    for cfg in others:
        other = DFlashDrafter(cfg)
        other.load_state_dict(ours.state_dict())
        assert max_diff(draft_call(other, fresh_cache(other, 1, N + K), noise, ctx, pos[:, :N], N), want) > 1e-3
    print(
        f"\ndrafter vs z-lab DFlashDraftModel (rope={rope or 'default'}, window={window}, layout={layout}, "
        f"N={N}, K={K}): "
        f"max abs diff {d:.3g} "
        f"(max |out| {float(want.abs().max()):.2f})"
    )
    assert got.shape == want.shape == (1, K, H)
    assert d < 1e-4


@pytest.mark.parametrize("window,layout", [(None, None), (9, None), (9, "gpt-oss")])
def test_drafter_matches_zlab_with_cache_rounds(window, layout):
    """Several rounds as in z-lab's ``dflash_generate``: its DynamicCache is cropped to the
    committed length and receives only the newly accepted context; ours is indexed by position
    and gets the same new context. Block outputs agree every round (also with z-lab's
    non-causal sliding layers)."""
    pytest.importorskip("dflash.model", reason="needs the z-lab reference: pip install --no-deps dflash==0.1.0")
    from dflash.model import _crop_to, _make_cache

    target = tiny_target()
    ours = make_drafter(target, layers=2, block=6, seed=3, sliding_window=window, layout=layout)
    ref = zlab_model(ours)
    H, K = target.hidden_size, ours.cfg.block_size
    F = len(ours.cfg.target_layer_ids) * H
    g = torch.Generator().manual_seed(11)
    zcache = _make_cache(ref.config)
    cache = fresh_cache(ours, 1, 128)
    start, ctx_len = 20, 20  # the prompt: 20 context positions, first block at 20
    worst = 0.0
    for accepted in (2, 0, 5, 1):
        ctx = torch.randn(1, ctx_len, F, generator=g)
        noise = torch.randn(1, K, H, generator=g)
        pos = torch.arange(start - ctx_len, start + K).unsqueeze(0)
        with torch.no_grad():
            want = ref(
                position_ids=pos, noise_embedding=noise, target_hidden=ctx, past_key_values=zcache, use_cache=True
            )
        _crop_to(zcache, start)
        got = draft_call(ours, cache, noise, ctx, pos[:, :ctx_len], start)
        worst = max(worst, max_diff(got, want))
        ctx_len = accepted + 1  # anchor + accepted drafts become context; the bonus is the next anchor
        start += ctx_len
    print(f"\ndrafter vs z-lab over 4 cached rounds: max abs diff {worst:.3g}")
    assert worst < 1e-4


# --------------------------------------------------------------------------------------------
# the drafter's context cache
# --------------------------------------------------------------------------------------------


def test_context_fed_in_chunks_equals_one_call():
    target = tiny_target()
    ours = make_drafter(target, layers=3, block=8, seed=2)
    H, K, N1, N = target.hidden_size, ours.cfg.block_size, 13, 17  # N - N1 < K: stale block slots
    g = torch.Generator().manual_seed(5)
    ctx = torch.randn(1, N, len(ours.cfg.target_layer_ids) * H, generator=g)
    first = torch.randn(1, K, H, generator=g)
    block = torch.randn(1, K, H, generator=g)
    whole = draft_call(ours, fresh_cache(ours, 1, 64), block, ctx, torch.arange(N).unsqueeze(0), N)
    cache = fresh_cache(ours, 1, 64)
    draft_call(ours, cache, first, ctx[:, :N1], torch.arange(N1).unsqueeze(0), N1)
    chunked = draft_call(ours, cache, block, ctx[:, N1:], torch.arange(N1, N).unsqueeze(0), N)
    d = max_diff(chunked, whole)
    print(f"\ndrafter context in 2 chunks vs 1 call: max abs diff {d:.3g}")
    assert d < 1e-5
    # an empty chunk (N=0 new positions) is allowed too
    again = draft_call(ours, cache, block, ctx[:, :0], torch.zeros(1, 0, dtype=torch.long), N)
    assert max_diff(again, whole) < 1e-5


def test_ragged_drafter_batch_equals_rows_alone():
    """Two rows at different positions with padded new context (padding -> trash slot)."""
    target = tiny_target()
    ours = make_drafter(target, layers=2, block=4, seed=4)
    H, K = target.hidden_size, ours.cfg.block_size
    F = len(ours.cfg.target_layer_ids) * H
    g = torch.Generator().manual_seed(9)
    lens = [9, 4]
    ctx = [torch.randn(1, n, F, generator=g) for n in lens]
    blocks = torch.randn(2, K, H, generator=g)
    alone = [
        draft_call(ours, fresh_cache(ours, 1, 32), blocks[b : b + 1], ctx[b], torch.arange(n).unsqueeze(0), n)
        for b, n in enumerate(lens)
    ]
    T = max(lens)
    pad_ctx = torch.zeros(2, T, F)
    ctx_pos = torch.arange(T).expand(2, T).clone()
    valid = ctx_pos < torch.tensor(lens).unsqueeze(1)
    for b, n in enumerate(lens):
        pad_ctx[b, :n] = ctx[b][0]
        pad_ctx[b, n:] = 100.0  # garbage in padding must not leak
    ctx_pos = torch.where(valid, ctx_pos, 0)
    got = draft_call(ours, fresh_cache(ours, 2, 32), blocks, pad_ctx, ctx_pos, torch.tensor(lens), valid)
    d = max(max_diff(got[b], alone[b][0]) for b in range(2))
    print(f"\nragged drafter batch vs rows alone: max abs diff {d:.3g}")
    assert d < 1e-5


# --------------------------------------------------------------------------------------------
# checkpoint round trip and config parsing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope", [None, "llama3"])
def test_save_load_round_trip(tmp_path, rope):
    target = tiny_target(rope_scaling=dict(LLAMA3_ROPE) if rope else None)
    model = init_drafter(target, 2, 16, mask_token_id=5, seed=3, target_layer_ids=[0, 3, 7])
    out = save_drafter(model, tmp_path / "d")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["d"], "no temp dir left behind"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"block_size": 16, "mask_token_id": 5, "target_layer_ids": [0, 3, 7]}
    assert cfg["num_target_layers"] == 8
    back = load_drafter(out)
    assert back.cfg == model.cfg
    assert back.cfg.rope_scaling == model.cfg.rope_scaling
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    validate_pair(target, back.cfg)
    # bf16 save + load in bf16
    half = load_drafter(save_drafter(model, tmp_path / "h", dtype=torch.bfloat16), torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16
    assert torch.equal(half.fc.weight, model.fc.weight.to(torch.bfloat16))


def test_save_writes_the_draft_vocabulary_head_for_vllm(tmp_path):
    """With a draft vocabulary and the target's head, ``lm_head.weight`` holds the head's rows
    ``i + d2t[i]`` (what vLLM's DFlash model loads); our loader reads the drafter unchanged."""
    from safetensors.torch import load_file

    target = tiny_target()
    ids = torch.tensor([1, 4, 5, 9, 30])
    model = init_drafter(target, 1, 4, mask_token_id=5, seed=3, draft_token_ids=ids)
    head = torch.randn(target.vocab_size, target.hidden_size)
    out = save_drafter(model, tmp_path / "d", lm_head=head)
    sd = load_file(str(out / "model.safetensors"))
    assert torch.equal(sd["lm_head.weight"], head[ids])
    assert torch.equal(sd["d2t"], ids - torch.arange(5))
    back = load_drafter(out)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in back.state_dict().items())
    # a drafter over the whole vocabulary shares the target's head in vLLM: nothing written
    full = save_drafter(init_drafter(target, 1, 4, mask_token_id=5), tmp_path / "f", lm_head=head)
    assert "lm_head.weight" not in load_file(str(full / "model.safetensors"))


def zlab_json(**over) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 300,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_target_layers": 8,
        "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 5]},
    }
    cfg.update(over)
    return cfg


def test_config_block_size_locations():
    assert drafter_config_from_json(zlab_json(block_size=8)).block_size == 8  # top level (older files)
    inner = zlab_json(dflash_config={"mask_token_id": 7, "target_layer_ids": [1, 5], "block_size": 10})
    assert drafter_config_from_json(inner).block_size == 10  # inside dflash_config (newer files)
    both = dict(inner, block_size=8)
    assert drafter_config_from_json(both).block_size == 10  # dflash_config wins
    assert drafter_config_from_json(zlab_json()).block_size == 16  # z-lab's default
    cfg = drafter_config_from_json(zlab_json(block_size=8))
    assert cfg.mask_token_id == 7 and cfg.target_layer_ids == (1, 5) and cfg.num_target_layers == 8
    # target_layer_ids absent: z-lab's build_target_layer_ids rule
    no_ids = drafter_config_from_json(zlab_json(dflash_config={"mask_token_id": 7}))
    assert no_ids.target_layer_ids == (1, 5)
    # head_dim absent: hidden / heads
    no_hd = zlab_json()
    del no_hd["head_dim"]
    assert drafter_config_from_json(no_hd).head_dim == 16


@pytest.mark.parametrize("layout", ["top", "inner", "both", "default"])
def test_config_layouts_agree_with_zlab(layout):
    """block_size / target_layer_ids / mask_token_id are read from the same places as z-lab's
    ``_draft_value`` (``dflash_config`` first, then the top level, then the default)."""
    model_mod = pytest.importorskip(
        "dflash.model", reason="needs the z-lab reference: pip install --no-deps dflash==0.1.0"
    )
    from transformers import Qwen3Config

    cfg = zlab_json(dflash_config={})
    if layout in ("top", "both"):
        cfg.update(block_size=12, target_layer_ids=[2, 4], mask_token_id=9)
    if layout in ("inner", "both"):
        cfg["dflash_config"] = {"block_size": 6, "target_layer_ids": [0, 6], "mask_token_id": 3}
    if layout == "default":
        cfg["mask_token_id"] = 9
    ours = drafter_config_from_json(cfg)
    ref = model_mod.DFlashDraftModel(Qwen3Config(**cfg))
    assert (ours.block_size, list(ours.target_layer_ids), ours.mask_token_id) == (
        ref.block_size,
        list(ref.target_layer_ids),
        ref.mask_token_id,
    )


def test_config_unsupported_rope_type():
    with pytest.raises(DFlashError, match="rope_type 'dynamic'"):
        drafter_config_from_json(zlab_json(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))


def test_config_json_round_trip():
    cfg = drafter_config_from_json(zlab_json(block_size=8, rope_scaling=dict(LLAMA3_ROPE)))
    assert drafter_config_from_json(drafter_config_to_json(cfg)) == cfg


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(architectures=["Qwen3ForCausalLM"]), "not a DFlash"),
        (dict(dflash_config={"target_layer_ids": [1, 5]}), "mask_token_id"),
        # num_target_layers is optional (z-lab's gpt-oss drafters leave it out) unless needed for the ids
        (dict(num_target_layers=None, dflash_config={"mask_token_id": 7}), "nor 'num_target_layers'"),
        (dict(hidden_size="wide"), "bad value"),
    ],
)
def test_config_errors(bad, match):
    cfg = {k: v for k, v in zlab_json(**bad).items() if v is not None}  # None: key removed
    with pytest.raises(DFlashError, match=match):
        drafter_config_from_json(cfg)


def test_config_missing_required_key():
    cfg = zlab_json()
    del cfg["intermediate_size"]
    with pytest.raises(DFlashError, match="intermediate_size"):
        drafter_config_from_json(cfg)


def test_save_to_existing_path_refuses(tmp_path):
    model = init_drafter(tiny_target(), 1, 4, mask_token_id=5)
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DFlashError, match="exists"):
        save_drafter(model, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["exists"]
    first = save_drafter(model, tmp_path / "d")
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    with pytest.raises(DFlashError, match="exists"):
        save_drafter(init_drafter(tiny_target(), 1, 4, mask_token_id=6, seed=1), first)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before


# --------------------------------------------------------------------------------------------
# validation and corrupt input
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, init_drafter(target, 2, 8, mask_token_id=5).cfg


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_size=32), "hidden_size 32 != target's 64"),
        (dict(vocab_size=299), "vocab_size 299 != target's 300"),
        (dict(target_layer_ids=(1, 8)), r"target_layer_ids \[8\] outside 0\.\.7"),
        (dict(target_layer_ids=(-1, 3)), r"target_layer_ids \[-1\] outside"),
        (dict(mask_token_id=300), r"mask_token_id 300 outside the vocabulary \(0\.\.299\)"),
        (dict(num_target_layers=30), "made for a 30-layer target, this one has 8"),
        (dict(num_kv_heads=3), "not a multiple"),
        (dict(block_size=1), "block_size 1 < 2"),
    ],
)
def test_validate_pair_errors(pair, change, match):
    target, cfg = pair
    validate_pair(target, cfg)
    with pytest.raises(DFlashError, match=match) as e:
        validate_pair(target, dataclasses.replace(cfg, **change))
    assert "drafter does not match target" in str(e.value)


def test_validate_pair_lists_every_problem(pair):
    target, cfg = pair
    with pytest.raises(DFlashError) as e:
        validate_pair(target, dataclasses.replace(cfg, hidden_size=32, mask_token_id=1000))
    assert "hidden_size" in str(e.value) and "mask_token_id" in str(e.value)


def test_init_drafter_rejects_bad_settings():
    with pytest.raises(DFlashError, match="layers"):
        init_drafter(tiny_target(), 0, 8, mask_token_id=5)
    with pytest.raises(DFlashError, match="mask_token_id"):
        init_drafter(tiny_target(), 1, 8, mask_token_id=300)
    with pytest.raises(DFlashError, match="block_size"):
        init_drafter(tiny_target(), 1, 1, mask_token_id=5)


@pytest.fixture()
def saved(tmp_path):
    return save_drafter(init_drafter(tiny_target(), 2, 8, mask_token_id=5), tmp_path / "d")


def test_load_missing_dir(tmp_path):
    with pytest.raises(DFlashError, match="not found"):
        load_drafter(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError, match="not found"):
        load_drafter(tmp_path / "empty")  # no config.json


def test_load_garbage_weights(saved):
    (saved / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(DFlashError, match="corrupt"):
        load_drafter(saved)


def test_load_truncated_weights(saved):
    f = saved / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlashError, match="corrupt"):
        load_drafter(saved)


def test_load_empty_weights(saved):
    (saved / "model.safetensors").write_bytes(b"")
    with pytest.raises(DFlashError, match="corrupt"):
        load_drafter(saved)


def test_load_missing_weights_file(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(DFlashError, match="no model.safetensors"):
        load_drafter(saved)


def test_load_config_not_json(saved):
    (saved / "config.json").write_text("{ this is not json")
    with pytest.raises(DFlashError, match="not valid JSON"):
        load_drafter(saved)
    (saved / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DFlashError, match="not valid JSON"):
        load_drafter(saved)


def test_load_weights_not_matching_config(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="shape"):
        load_drafter(saved)
    cfg["intermediate_size"] = 96
    cfg["num_hidden_layers"] = 3
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="missing weights"):
        load_drafter(saved)


#: a small z-lab drafter config.json, every layer full attention
SMALL_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 100,
    "num_target_layers": 4,
    "dflash_config": {"mask_token_id": 0},
}


@pytest.mark.parametrize(
    "extra",
    [
        {"architectures": ["DFlash2DraftModel"]},
        {"layer_types": ["chunked_attention"]},
        {"input_embedding_scale": 2.0},
        {"dflash_config": {"mask_token_id": 0, "output_multiplier": 0.5}},
        {"final_logit_softcapping": 30.0},
    ],
)
def test_unsupported_zlab_variants_are_refused(extra):
    from dflash_trt.checkpoints.zlab import drafter_config_from_json

    cfg = SMALL_CONFIG | {"num_hidden_layers": 1}
    drafter_config_from_json(cfg)  # the plain config is fine
    with pytest.raises(DFlashError, match="not supported"):
        drafter_config_from_json({**cfg, **extra})


def test_attention_layouts_read_as_zlab_reads_them():
    """``layer_types``, ``is_causal``, ``use_sliding_window`` and ``sliding_window`` become each
    layer's ``(causal, window)`` the way z-lab's attention layer reads them (its defaults: a
    sliding layer is causal unless ``is_causal`` says otherwise; Qwen3Config keeps the window only
    with ``use_sliding_window``); inconsistent files get one line."""
    from dflash_trt.checkpoints.zlab import drafter_config_from_json

    cfg = SMALL_CONFIG | {"use_sliding_window": True, "sliding_window": 32}
    mixed = {"layer_types": ["full_attention", "sliding_attention"]}
    for extra, kinds in (
        (mixed, ((False, None), (True, 32))),
        (mixed | {"is_causal": False}, ((False, None), (False, 32))),
        (mixed | {"is_causal": True}, ((True, None), (True, 32))),
        ({"layer_types": ["sliding_attention"] * 2, "is_causal": False}, ((False, 32),) * 2),
        (mixed | {"use_sliding_window": False}, ((False, None),) * 2),  # no window: every layer sees all
        ({"is_causal": True}, ((True, None),) * 2),
    ):
        assert drafter_config_from_json(cfg | extra).layer_kinds == kinds, extra
    for extra, message in (
        ({"layer_types": ["full_attention"]}, "layer_types lists 1 layers for its num_hidden_layers 2"),
        (mixed | {"sliding_window": None}, "sliding_attention layers but no sliding_window"),
    ):
        with pytest.raises(DFlashError, match=message) as e:
            drafter_config_from_json(cfg | extra)
        assert "\n" not in str(e.value)
