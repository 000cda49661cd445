"""Mixture-of-experts targets (Qwen3-MoE, gpt-oss) on the compiled path (``--compile``,
``runtime/compiled.py``) and the CUDA-graph path (``runtime/cuda_graphs.py``, on the CPU every
step of it but the capture), where the expert layers take their static-shape path
(``MoEBlock.forward_static``: no host read of the routing) and gpt-oss's sliding-window layers
read the padded sliding mask (``pad_decode_meta``).

Tiny random transformers models (``test_moe.tiny_qwen3_moe``: 2 of its layers, the second
sparse; ``test_gpt_oss.tiny_gpt_oss`` at 2 layers: one sliding-window layer of window 4, one
full; sinks, biases and the SwiGLU clamp live), fp32: greedy tokens of plain decoding and of
DFlash with a random drafter on each path equal the eager engine's; dynamo traces the whole
target forward (no graph break; dynamo's graphs run by eager kernels, as in
``test_compiled.test_in_flight_batching_compiled_is_lossless``: inductor takes minutes per
target here) and inductor compiles the static expert layer itself (outputs against the eager
layer); the padded static-buffer forward's logits against the eager forward's."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from helpers import generate, make_engine, plain_outputs
from torch._dynamo.utils import counters

from dflash_trt.checkpoints.zlab import init_drafter
from dflash_trt.models.batch_invariant import set_batch_invariant
from dflash_trt.models.config import TargetConfig
from dflash_trt.models.moe import MoEBlock, static_experts
from dflash_trt.models.target import TargetModel
from dflash_trt.runtime import compiled as compiled_module
from dflash_trt.runtime.attention_meta import plan_packed
from dflash_trt.runtime.cuda_graphs import key_bucket, pad_decode_meta
from dflash_trt.runtime.kv_cache import PagedKVCache
from dflash_trt.runtime.request import Request

transformers = pytest.importorskip("transformers")

VOCAB = 256
MASK = VOCAB - 1  # the random drafter's mask token
NEW = 10  # tokens per request: the gpt-oss sequences pass its window (4) several times


def _ours(hf, layers: int) -> TargetModel:
    """Our target from transformers' model ``hf`` (its state dict), cut to its first ``layers``."""
    model = TargetModel(TargetConfig.from_hf(hf.config.to_dict()))
    model.load_hf_state_dict(hf.state_dict())
    model.cfg = dataclasses.replace(model.cfg, num_layers=layers)
    model.layers = model.layers[:layers]
    return model.eval()


@functools.cache
def _tiny(family: str) -> TargetModel:
    """The tiny target of ``family`` (module docstring), built once per process."""
    from test_gpt_oss import tiny_gpt_oss
    from test_moe import tiny_qwen3_moe

    if family == "qwen3_moe":
        model = _ours(tiny_qwen3_moe(VOCAB, True), 2)
    else:
        hf = tiny_gpt_oss(VOCAB, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
        model = _ours(hf, 2)
        assert model.cfg.has_sliding_layers
    assert any(isinstance(m, MoEBlock) for m in model.modules())
    return model


@pytest.fixture(params=["qwen3_moe", "gpt_oss"])
def target(request) -> TargetModel:
    return _tiny(request.param)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, MASK, (n,), generator=g).tolist() for n in (7, 12)]


def _static_calls(monkeypatch) -> list[int]:
    """Counts calls of ``MoEBlock.forward_static`` (the original runs)."""
    calls = [0]
    original = MoEBlock.forward_static

    def counted(self, *args):
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(MoEBlock, "forward_static", counted)
    return calls


def test_compiled_path_equals_eager(target, monkeypatch):
    """Batch 1 (the in-flight compiled path is the dense targets' subject, test_compiled.py;
    every batch shape is more graphs for dynamo to trace). The eager expert loop would break
    dynamo's graph at every MoE layer (``torch.unique(...).tolist()``): no graph break means the
    static path was traced."""
    prompts = _prompts()[1:]
    drafter = init_drafter(target.cfg, 1, 4, MASK, seed=0)
    ref = plain_outputs(target, prompts, NEW, stop_token_ids=())  # fp32: batch-invariant mode on
    monkeypatch.setattr(compiled_module, "BACKEND", "eager")
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        plain = plain_outputs(target, prompts, NEW, compile=True, stop_token_ids=())
        reqs = [Request(p, NEW) for p in prompts]
        dflash = [o.output_ids for o in generate(target, drafter, reqs, 4, compile=True, stop_token_ids=())]
    compiled_graphs = counters["stats"]["unique_graphs"] - graphs
    print(f"\n{target.cfg.family} compiled: {compiled_graphs} graphs")
    assert compiled_graphs > 0, "the compiled path compiled nothing"
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert all(len(r) == NEW for r in ref)
    assert plain == ref and dflash == ref


@pytest.mark.parametrize("invariant", [True, False], ids=["batch_invariant", "bmm"])
def test_inductor_compiles_the_static_expert_layer(invariant):
    """Inductor's kernels for the static expert path of gpt-oss's expert layer (router and expert
    biases, the SwiGLU clamp; Qwen3-MoE's layer is the same ops less those), with the
    batch-invariant GEMMs (as ``--compile`` runs fp32 targets by default) and without (batched
    GEMMs), against the eager layer, on two token counts (one dynamic graph)."""
    target = _tiny("gpt_oss")
    block = next(m for m in target.modules() if isinstance(m, MoEBlock))
    set_batch_invariant(target, invariant)
    try:
        fn = torch.compile(block, dynamic=True)
        g = torch.Generator().manual_seed(2)
        worst = 0.0
        with torch.no_grad():
            for n in (5, 9):
                x = torch.randn(n, target.cfg.hidden_size, generator=g)
                ref = block(x)  # eager: the per-expert loop
                worst = max(worst, float((fn(x) - ref).abs().max() / ref.abs().max()))
    finally:
        set_batch_invariant(target, False)
    print(f"\ngpt_oss expert layer, inductor vs eager (batch-invariant {invariant}): max relative diff {worst:.2g}")
    assert worst < 1e-5


def test_graph_path_equals_eager(target, monkeypatch):
    prompts = _prompts()
    drafter = init_drafter(target.cfg, 1, 4, MASK, seed=0)
    kw = dict(batch_invariant=False, stop_token_ids=())  # the graph path's mode, on both sides

    def reqs() -> list[Request]:
        return [Request(p, NEW) for p in prompts]

    ref = [o.output_ids for o in generate(target, None, reqs(), 1, **kw)]
    calls = _static_calls(monkeypatch)
    runs = {}
    for K in (1, 4):
        engine = make_engine(target, drafter if K > 1 else None, K, reqs(), cuda_graphs=True, **kw)
        runs[K] = [o.output_ids for o in engine.generate(reqs())], engine.runner.graphs.replays
    print(f"\n{target.cfg.family} graph path: replays {runs[1][1]} / {runs[4][1]}, static expert calls {calls[0]}")
    assert runs[1][1] >= NEW - 1 and runs[4][1] > 0 and calls[0] >= runs[1][1] + runs[4][1]
    assert all(len(r) == NEW for r in ref)
    assert runs[1][0] == ref and runs[4][0] == ref


def test_padded_graph_forward_logits(target):
    """A decode-only verify iteration (two sequences, 4 queries each, past the sliding window)
    through the graph path's padded static buffers (batch bucket 4, key bucket 256) and the
    static expert path, against the eager forward of the unpadded metadata."""
    cfg, tpb = target.cfg, 8
    prompts = _prompts()
    tables = [[0, 1, 2], [3, 4, 5]]

    def step(cache, seqs, queries, static, pad):
        starts = [len(p) for p in seqs] if queries else [0, 0]
        toks = queries or seqs
        lengths = [len(t) for t in toks]
        offs = [0, lengths[0]]
        window = cfg.sliding_window if cfg.has_sliding_layers else None
        plan = plan_packed(starts, lengths, offs, lengths, tables, tpb, cache.k.shape[1] - 1, target_window=window)
        meta = plan.build()
        ids = torch.tensor([[t for ts in toks for t in ts]])
        if pad:
            meta = pad_decode_meta(meta, 4, key_bucket(plan.groups[0].kv_len), cache.k.shape[1] - 1)
            ids = torch.cat([ids, ids.new_zeros(1, 4 * len(toks[0]) - ids.shape[1])], 1)
        with torch.no_grad():
            if static:
                with static_experts():
                    return target(ids, meta, cache.layers).logits[0, : sum(lengths)]
            return target(ids, meta, cache.layers).logits[0]

    queries = [[5, 6, 7, 8], [9, 10, 11, 12]]
    out = {}
    for graph in (False, True):
        cache = PagedKVCache(cfg.num_layers, 6, tpb, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        step(cache, [p[:5] for p in prompts], None, False, False)  # prefill, 5 tokens each (uniform)
        seqs = [p[:5] for p in prompts]
        out[graph] = step(cache, seqs, queries, graph, graph)
    d = float((out[True] - out[False]).abs().max() / out[False].abs().max())
    print(f"\n{cfg.family} padded static-buffer forward vs eager: max relative logit difference {d:.2g}")
    assert out[True].shape == out[False].shape == (8, VOCAB)
    assert d < 1e-5


def test_static_expert_path_equals_the_loop(target):
    """The static expert path run eagerly against the per-expert loop on the same rows: bit for
    bit in the batch-invariant mode (the same kernels per row, added in the same order), to
    rounding with the batched GEMMs; also on an expert-parallel rank's half of the experts (the
    other half adds nothing)."""
    block = next(m for m in target.modules() if isinstance(m, MoEBlock))
    x = torch.randn(7, target.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    half = block.gate_up.shape[0] // 2
    rank = MoEBlock.from_config(target.cfg)
    rank.load_state_dict(block.state_dict())
    for name in ("gate_up", "down", "gate_up_bias", "down_bias"):  # experts [half, E) only
        if getattr(block, name) is not None:
            setattr(rank, name, torch.nn.Parameter(getattr(block, name)[half:].clone(), requires_grad=False))
    rank.expert_offset = half
    worst = 0.0
    with torch.no_grad():
        for m in (block, rank):
            for invariant in (True, False):
                set_batch_invariant(target, invariant)
                m.batch_invariant = invariant
                try:
                    ref = m(x)
                    with static_experts():
                        got = m(x)
                finally:
                    set_batch_invariant(target, False)
                    m.batch_invariant = False
                if invariant:
                    assert torch.equal(got, ref), (m is rank, float((got - ref).abs().max()))
                worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    print(f"\n{target.cfg.family} static expert path vs the loop, batched GEMMs: max relative diff {worst:.2g}")
    assert worst < 1e-5
