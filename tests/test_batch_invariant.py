"""The batch-invariant mode (``models/batch_invariant.py``): each row of a target forward gets the
same bits whatever else is in the forward, so that DFlash gives plain decoding's tokens exactly
in bf16 (dense and int4 weights), at batch 1 and in flight.

Kernel tests use random inputs and check both properties a kernel of the mode needs: a row's
output is bit-identical alone and among any other rows (in any position), and it is the right
value (against ``F.linear`` / SDPA in fp32, to rounding). Model tests run the real SmolLM2 target
with the shipped drafter on real prompts and compare tokens with ``==`` (no tie tolerance).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import engine_config, generate
from torch import nn

from dflash_trt.checkpoints.loader import load_pair
from dflash_trt.errors import DFlashError
from dflash_trt.kernels.context_kv import context_kv_reference
from dflash_trt.kernels.cpu_ops import (
    _cpu_flags,
    argmax_rows,
    bf16_gemm,
    bi_attention,
    bi_linear,
    bi_paged_attention,
    context_kv,
    load,
    rms_norm,
)
from dflash_trt.models.batch_invariant import BatchInvariantLinear, check_batch_invariant, set_batch_invariant
from dflash_trt.models.layers import RMSNorm
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts
from dflash_trt.quantization.packed import PackedLinear, quantize_activations
from dflash_trt.runtime.engine import LLMEngine
from dflash_trt.runtime.request import LoopStats, Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from batch_invariance import forward_rows, row_diff  # noqa: E402

MAX_NEW = 40


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_bi_linear_rows_independent(wdt, xdt):
    for n, k in ((100, 33), (576, 192), (70, 1536)):
        w, b = torch.randn(n, k).to(wdt) * 0.05, torch.randn(n)
        x = torch.randn(34, k).to(xdt)  # (17 .. 32 rows: AMX row-tile pairs; 33, 34: a pair and a tile)
        full = bi_linear(x, w, b)
        assert full.dtype == xdt and full.shape == (34, n)
        ref = F.linear(x.float(), w.float(), b)
        tol = (1e-5 if xdt == torch.float32 else 2e-2) * max(ref.abs().max().item(), 1.0)
        assert (full.float() - ref).abs().max().item() <= tol
        perm = torch.randperm(34)
        assert torch.equal(bi_linear(x[perm], w, b), full[perm])  # any position among any rows
        for m in range(1, 34):
            assert torch.equal(bi_linear(x[:m], w, b), full[:m]), m
        for r in (0, 5, 16, 22, 31, 33):
            assert torch.equal(bi_linear(x[r : r + 1], w, b)[0], full[r])
        big = torch.randn(150, k).to(xdt)  # several row and column cache blocks
        out = bi_linear(big, w, b)
        for r in (0, 63, 64, 149):
            assert torch.equal(bi_linear(big[r : r + 1], w, b)[0], out[r])
        # the module packs its weight once: the same products; packed again when the weight changes
        mod = BatchInvariantLinear(nn.Parameter(w.clone(), requires_grad=False), nn.Parameter(b, requires_grad=False))
        assert mod.packed.shape == (-(-n // mod.packed.shape[2]), k, mod.packed.shape[2])
        with torch.no_grad():
            assert torch.equal(mod(x), full) and torch.equal(mod(x[3:4]), full[3:4])
            mod.weight.mul_(2)
            assert torch.equal(mod(x), bi_linear(x, w * 2, b))


def test_bf16_gemm_is_the_best_kernel_this_cpu_has():
    """bf16 x bf16 runs on AMX tiles where the CPU (and the kernel, which grants the tile state on
    request) has them, else on vdpbf16ps with AVX512-BF16, else widened to fp32; on an AMX CPU a
    bf16 GEMM with inputs a multiple of 32 then differs from the vdpbf16ps order in some last
    bits, and the rows stay invariant (test_bi_linear_rows_independent: 192 and 1536 inputs)."""
    flags = set(_cpu_flags().split())
    kind = bf16_gemm()
    if "amx_bf16" in flags and "amx_tile" in flags and "avx512_bf16" in flags:
        assert kind == "amx"
    elif "avx512_bf16" in flags:
        assert kind == "avx512-bf16"
    else:
        assert kind == "fma"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int8", 0)])
def test_packed_int_linear_rows_independent(fmt, group, dtype):
    """``dflash_cpu::int4_linear`` / ``int8_linear`` (the packed modules' GEMMs): a row alone,
    among other rows and in any position gives the same bits, for every register-tile height
    (1-6 rows and more; on a CPU with AMX-INT8, the tiles of 8 rows and more, 16 at a time),
    and the values are those of the format's arithmetic in fp64 to the output's rounding, over
    the activations as :func:`quantize_activations` rounds them: int8 Q8_0 x Q8_0's block sums
    times the row's scale, int4 Q4_1 x Q8_1's (and within the activations' rounding of
    ``x @ w.T``)."""
    torch.manual_seed(group)
    for n, k in ((48, 256), (592, 512), (1040, 256)):  # 6, 74, 130 panels: full and partial tiles
        w, b = torch.randn(n, k) * 0.05, torch.randn(n)
        mod = PackedLinear.quantize(w, fmt, group or 32, b, dtype)
        deq = mod.dequantize()
        x = torch.randn(23, k).to(dtype)
        full = mod(x)
        assert full.dtype == dtype and full.shape == (23, n)
        exact = F.linear(x.double(), deq.double()) + b.to(dtype).double()
        q, s, z = (t.double() if t is not None else None for t in mod.int_weight())
        xq, d = quantize_activations(x)
        blocks = k // 32
        dots = (q.view(1, n, blocks, 32) * xq.double().view(23, 1, blocks, 32)).sum(-1) * d.double()[:, None]
        if fmt == "int4":
            a = dots.view(23, n, k // group, group // 32).sum(-1)
            xs = (xq.double().view(23, blocks, 32).sum(-1) * d.double()).view(23, 1, k // group, group // 32).sum(-1)
            ref = (a * s.to(dtype).double() + z.to(dtype).double() * xs).sum(-1) + b.to(dtype).double()
        else:
            ref = dots.sum(-1) * s.to(dtype).double() + b.to(dtype).double()
        assert (full.double() - exact).abs().max().item() <= 0.03 * exact.abs().max().item()
        tol = 2e-5 * ref.abs().max().item() if dtype == torch.float32 else 2e-2 * ref.abs().max().item()
        assert (full.double() - ref).abs().max().item() <= tol
        perm = torch.randperm(23)
        assert torch.equal(mod(x[perm]), full[perm])
        for m in range(1, 15):
            assert torch.equal(mod(x[:m]), full[:m]), m
        for r in (0, 5, 22):
            assert torch.equal(mod(x[r : r + 1])[0], full[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_activation_codes_are_quantize_activations(dtype):
    """``int4_linear`` rounds the activations exactly as :func:`quantize_activations` says
    (the kernel's vectorized rounding against torch's): with an identity weight (code 1 on the
    diagonal, scale 1, zero 0) output ``n`` is ``d * q`` of input ``n`` in fp32, bit for bit;
    the inputs include halfway cases (``x / d`` = j + 0.5, to nearest even), zeros and an
    all-zero block."""
    from dflash_trt.quantization.int4 import Int4Linear

    k = 256
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, k, generator=g)
    x[1, :32] = 0  # an all-zero block: d = 0, codes 0
    x[2, 32:64] = torch.arange(32) - 15.5  # amax 16.5 -> d = 16.5 / 127
    x[3, 64:96] = torch.arange(32) - 15.5  # with 127 in the block d = 1: x / d exact halves, ties
    x[3, 64] = 127
    x = x.to(dtype)
    eye = torch.eye(k, dtype=torch.uint8)
    ones, zeros = torch.ones(k, k // 32), torch.zeros(k, k // 32)
    mod = Int4Linear.from_codes((eye, ones, zeros), 32, None, torch.float32)
    q, d = quantize_activations(x)
    want = q.float() * d.repeat_interleave(32, -1)
    assert torch.equal(mod(x.float()), want)
    assert torch.equal(q[1, :32], torch.zeros(32, dtype=torch.int8)) and q.abs().max() <= 127
    assert q[3, 65:96].tolist() == [round(v - 14.5) for v in range(31)]  # Python's round: to even


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_equals_torch_and_rows_independent(dtype):
    """``dflash_cpu::rms_norm`` against the torch path of :class:`RMSNorm` (``weight *
    F.rms_norm``): the same bits in bf16 (one rounding after the fp32 normalization, one after
    the weight), within 2 fp32 ulps of the output's scale in fp32 (the mean square summed in
    another order); each row the same bits alone, among others, and from a strided view (the
    q/k norms read heads out of a fused QKV output); the module switches with ``cpu_kernel``."""
    for d in (576, 64, 37):  # a hidden size, a head size, a tail shorter than a vector
        w = (1 + 0.1 * torch.randn(d)).to(dtype)
        x = (3 * torch.randn(40, d)).to(dtype)
        ref = w * F.rms_norm(x, (d,), eps=1e-5)
        got = rms_norm(x, w, 1e-5)
        assert got.dtype == dtype and got.shape == x.shape
        if dtype == torch.bfloat16:
            assert torch.equal(got, ref)
        else:
            assert (got - ref).abs().max().item() <= 2 * torch.finfo(dtype).eps * ref.abs().max().item()
        for r in (0, 7, 39):
            assert torch.equal(rms_norm(x[r : r + 1], w, 1e-5), got[r : r + 1])
        for m in (1, 3, 17):
            assert torch.equal(rms_norm(x[:m], w, 1e-5), got[:m])
        wide = torch.cat([x, x], 1).view(40, 2, d)[:, 1]  # every other row of d: not contiguous
        assert torch.equal(rms_norm(wide, w, 1e-5), got)
        norm = RMSNorm(d, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
            assert torch.equal(norm(x.view(4, 10, d)).view(40, d), ref)
            norm.cpu_kernel = True
            assert torch.equal(norm(x.view(4, 10, d)).view(40, d), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype):
    """``dflash_cpu::argmax_rows`` (the greedy choice of logits rows, ``argmax_last`` on the CPU)
    gives ``torch.argmax``'s index: random rows, rows of a few integer values (ties everywhere:
    the first maximum), rows shorter than a vector and with a tail past the last full vector,
    NaN (the first NaN), +-inf, strided rows (a view of every other row); refuses fp16."""
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 1), (3, 15), (5, 17), (7, 49152), (13, 8192), (4, 33)):
        for _ in range(10):
            for x in (torch.randn(*shape, generator=g), torch.randint(-3, 4, shape, generator=g).float()):
                x = x.to(dtype)
                assert torch.equal(argmax_rows(x), x.float().argmax(-1)), shape
    x = torch.randn(6, 1000, generator=g).to(dtype)
    x[1, 999] = float("inf")
    x[2, 500] = x[2, 700] = float("nan")
    x[3] = float("-inf")
    x[4, 5] = x[4, 900] = float("inf")
    x[5, 17] = float("nan")
    x[5, 3] = float("inf")
    want = x.float().argmax(-1)
    assert want.tolist()[1:] == [999, 500, 0, 5, 17]
    assert torch.equal(argmax_rows(x), want)
    assert torch.equal(argmax_rows(x[::2]), want[::2])
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        argmax_rows(x.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_kv_kernel_equals_the_reference(dtype):
    """``dflash_cpu::context_kv`` (the drafter's KV injection writes in one call) against
    :func:`~dflash_trt.kernels.context_kv.context_kv_reference`: the same bits in bf16, within
    2 fp32 ulps of the scale in fp32 (the mean square summed in another order); V copied as it
    is; nothing written outside the given slots, from 1 token to the parallel sizes (512
    tokens); a slot outside the pools is refused before anything is written. (``context_kv``
    falls back to the reference where the kernels are not loaded: they are, here.)"""
    load()
    L, hkv, d, P = 2, 3, 64, 1100
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (100000 ** (torch.arange(0, d, 2).float() / d))
    knorm = (1 + 0.1 * torch.randn(L, d, generator=g)).to(dtype)
    for T in (1, 7, 512):
        kv = (3 * torch.randn(T, L * 2 * hkv * d, generator=g)).to(dtype)
        positions = torch.randint(0, 8192, (T,), generator=g)
        slots = torch.randperm(P, generator=g)[:T]
        ref = [torch.zeros(L, P, hkv, d, dtype=dtype) for _ in range(2)]
        got = [torch.zeros(L, P, hkv, d, dtype=dtype) for _ in range(2)]
        context_kv_reference(kv, knorm, 1e-5, inv_freq, positions, slots, *ref)
        context_kv(kv, knorm, 1e-5, inv_freq, positions, slots, *got)
        assert torch.equal(got[1], ref[1])
        if dtype == torch.bfloat16:
            assert torch.equal(got[0], ref[0])
        else:
            scale = ref[0].abs().max().item()
            assert (got[0] - ref[0]).abs().max().item() <= 2 * torch.finfo(dtype).eps * scale
        untouched = torch.ones(P, dtype=torch.bool)
        untouched[slots] = False
        assert got[0][:, untouched].abs().sum() == 0 and got[1][:, untouched].abs().sum() == 0
    pools = [torch.zeros(L, P, hkv, d, dtype=dtype) for _ in range(2)]
    with pytest.raises(RuntimeError, match="out of the pools' range"):
        context_kv(kv[:2], knorm, 1e-5, inv_freq, positions[:2], torch.tensor([3, P]), *pools)
    assert pools[0].abs().sum() == 0 and pools[1].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bi_attention_queries_independent(dtype):
    """A query's output alone over exactly its keys (a decode step) equals its output in a causal
    block (a verify block) and in a padded batch of other sequences (in flight), bit for bit."""
    S, H, Hkv, D, L, T = 3, 9, 3, 64, 41, 5
    q, k, v = (torch.randn(S, h, n, D).to(dtype) for h, n in ((H, T), (Hkv, L), (Hkv, L)))
    pos = torch.tensor([L - T + t for t in range(T)])
    causal = (torch.arange(L)[None, :] <= pos[:, None]).view(1, 1, T, L)
    out = bi_attention(q, k, v, causal, 1 / math.sqrt(D))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal, enable_gqa=True)
    assert out.dtype == torch.float32 and (out - ref).abs().max().item() < 1e-5
    for t in range(T):
        p = int(pos[t]) + 1
        alone = bi_attention(
            q[:, :, t : t + 1], k[:, :, :p], v[:, :, :p], torch.ones(1, 1, 1, p, dtype=torch.bool), 0.125
        )
        assert torch.equal(alone[:, :, 0], out[:, :, t])
    # a block whose positions see different keys (holes, one position that sees none): each
    # position's output is its own alone, whether the kernel attends position by position or all of
    # a sequence's positions in one task (AMX: the keys any of them sees, the others' weighing 0)
    holes = causal & (torch.rand(S, 1, T, L, generator=torch.Generator().manual_seed(1)) > 0.2)
    holes[1, 0, 2] = False
    sinks = torch.randn(H)
    for sk in (None, sinks):
        block = bi_attention(q, k, v, holes, 0.125, sk)
        for t in range(T):
            alone = bi_attention(q[:, :, t : t + 1], k, v, holes[:, :, t : t + 1], 0.125, sk)
            assert torch.equal(alone[:, :, 0], block[:, :, t])
        assert sk is not None or not block[1, :, 2].any()  # (no key seen, no sink: zeros)
    # in flight: sequence s sees its first lens[s] keys, padded to L with masked keys
    lens = torch.tensor([7, L, 20])
    pad = (torch.arange(L)[None, :] < lens[:, None]).view(S, 1, 1, L)
    batch = bi_attention(q[:, :, :1], k, v, pad, 0.125)
    for s in range(S):
        n = int(lens[s])
        ones = torch.ones(1, 1, 1, n, dtype=torch.bool)
        alone = bi_attention(q[s : s + 1, :, :1], k[s : s + 1, :, :n], v[s : s + 1, :, :n], ones, 0.125)
        assert torch.equal(alone[0], batch[s])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bi_paged_attention_equals_gathered_keys(dtype):
    """The paged kernel reads each sequence's keys from the pools through its slot table: the
    same bits as bi_attention over the gathered keys, with sinks too; padding slots under a false
    mask are never read (they point past the pool here: reading one would fault or differ)."""
    S, H, Hkv, D, L, T, slots = 3, 9, 3, 64, 40, 4, 200
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, H, T, D, generator=g).to(dtype)
    k_pool, v_pool = (torch.randn(slots, Hkv, D, generator=g).to(dtype) for _ in range(2))
    table = torch.stack([torch.randperm(slots, generator=g)[:L] for _ in range(S)])  # [S, L] scattered slots
    lens = torch.tensor([L, 17, 29])
    pos = lens[:, None] - T + torch.arange(T)[None, :]  # [S, T]: the block's positions
    mask = (torch.arange(L)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [S, 1, T, L], causal block
    sinks = torch.randn(H, generator=g)
    gathered = (k_pool[table].transpose(1, 2), v_pool[table].transpose(1, 2))
    for sk in (None, sinks):
        ref = bi_attention(q, *gathered, mask, 0.125, sk)
        padded = torch.where(mask[:, 0].any(1), table, 10**9)  # slots under no visible query: out of range
        got = bi_paged_attention(q, k_pool, v_pool, padded, mask, 0.125, sk)
        assert got.dtype == torch.float32 and torch.equal(got, ref)
    with pytest.raises(RuntimeError, match="int64"):
        bi_paged_attention(q, k_pool, v_pool, table.int(), mask, 0.125)


@pytest.mark.parametrize(
    "dtype, weights",
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int4"), (torch.float32, "int8")],
    ids=["fp32", "bf16", "int4", "int8-fp32"],
)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_dense_layer_op_equals_the_python_layers(family, dtype, weights, head_dim, monkeypatch):
    """``dflash_cpu::dense_layer`` (``models/fused_layer.py``, each dense layer in one C++ call
    on paged steps in one attention group) against the Python layers on the same forward: the
    same logits, features and KV pools bit for bit, for decode steps (1 query a sequence), verify
    blocks (4) and a ragged step (a decode step beside verify blocks, an adaptive-draft probe:
    the op gathers the queries as the Python layer does), on tiny random targets of each dense
    family (Qwen2's q/k/v biases, Qwen3's q/k norms), with batch-invariant fp32 / bf16 linears
    and packed int4 / int8 ones, heads of 16 and 64 dimensions (64: the vectorised RoPE and, in
    bf16 on an AMX CPU, the attention scores on tiles), and a step of two attention groups (a
    prompt chunk beside decode steps: each group's queries gathered, attended and put back in
    its rows)."""
    from dflash_trt.models import fused_layer
    from dflash_trt.models import target as target_module
    from dflash_trt.models.config import TargetConfig
    from dflash_trt.models.layers import set_cpu_norm_kernel
    from dflash_trt.models.target import TargetModel
    from dflash_trt.quantization.packed import quantize_linears
    from dflash_trt.runtime.attention_meta import plan_packed
    from dflash_trt.runtime.kv_cache import PagedKVCache

    cfg = TargetConfig(
        family, 97, 64, 96, 3, 4, 2, head_dim, attention_bias=family == "qwen2", qk_norm=family == "qwen3"
    )
    torch.manual_seed(0)
    model = TargetModel(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    if weights is not None:
        assert quantize_linears(model, weights, 32, None, dtype)["dense"] == 0
    set_batch_invariant(model, True)
    set_cpu_norm_kernel(model, True)
    model.dense_layers = fused_layer.plan_dense_layers(model)
    assert model.dense_layers is not None and all(a is not None for a in model.dense_layers)
    tpb, blocks = 16, 12
    cache = PagedKVCache(cfg.num_layers, blocks, tpb, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
    g = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))  # earlier context of every sequence
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    tables, starts = [[0, 1], [2, 3, 4], [5, 6]], [20, 35, 9]
    spare = blocks * tpb
    for n in (1, 4, [1, 4, 2], [1, 1, 20]):
        lengths = n if isinstance(n, list) else [n] * 3
        offsets = [sum(lengths[:i]) for i in range(3)]
        meta = plan_packed(starts, lengths, offsets, lengths, tables, tpb, spare).build()
        ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=g)
        x = model.embed(ids)
        assert (not meta.groups) is (n != [1, 1, 20]) and (meta.uniform or not isinstance(n, int))
        assert fused_layer.fused_forward_wanted(x, meta, cache.layers)
        got = {}
        for fused in (True, False):
            monkeypatch.setattr(target_module, "fused_forward_wanted", lambda *a, on=fused: on)
            pools = (cache.k.clone(), cache.v.clone())
            kv = [(pools[0][i], pools[1][i]) for i in range(cfg.num_layers)]
            out = model(ids, meta, kv, capture=(0, 2))
            got[fused] = (out.logits, out.features, *pools)
        assert all(torch.equal(a, b) for a, b in zip(got[True], got[False])), n
        assert not torch.equal(got[True][2], cache.k)  # the step wrote its K/V


@pytest.fixture(scope="module")
def bf16_pair():
    """The real target in bf16 with the shipped drafter, and real prompts."""
    target, drafter = load_pair(None, None, torch.bfloat16)
    return target, drafter, [chat_prompt_ids(target.tokenizer, t) for t in mixed_prompts(3)]


@pytest.fixture(scope="module")
def int4_pair(bf16_pair):
    target, drafter = load_pair(None, None, torch.bfloat16, weights="int4")
    return target, drafter, bf16_pair[2]


def _plain_alone(target, prompts: list[list[int]]) -> list[list[int]]:
    return [generate(target, None, [Request(p, MAX_NEW)], 1, batch_invariant=True)[0].output_ids for p in prompts]


def _in_flight(target, drafter, prompts: list[list[int]], block_size: int) -> list[list[int]]:
    """DFlash through the in-flight engine, requests arriving while others decode (their prompt
    chunks packed with decode and verify rows of the others)."""
    cfg = engine_config(
        block_size=block_size, max_batch_size=8, max_num_tokens=96, batch_invariant=True, kv_capacity=8192
    )
    engine = LLMEngine(target.model, drafter, target.stop_token_ids, cfg)
    ids = [engine.add_request(Request(prompts[0], MAX_NEW))]
    for p in prompts[1:]:
        for _ in range(3):
            engine.step()
        ids.append(engine.add_request(Request(p, MAX_NEW)))
    engine.run()
    return [engine.result(i).output_ids for i in ids]


@pytest.mark.parametrize("pair", ["bf16_pair", "int4_pair"])
def test_dflash_equals_plain_token_for_token(pair, request):
    target, drafter, prompts = request.getfixturevalue(pair)
    plain = _plain_alone(target, prompts)
    for block_size in (4, 8):
        stats = LoopStats(block_size)
        outs = [
            generate(target, drafter, [Request(p, MAX_NEW)], block_size, stats, batch_invariant=True)[0].output_ids
            for p in prompts
        ]
        print(f"{pair} block {block_size}: tau {stats.tau:.2f}")
        assert outs == plain, block_size
    assert stats.tau > 1.2  # the drafts were accepted: the comparison covered verify blocks
    reqs = [Request(p, MAX_NEW) for p in prompts]
    batched = [o.output_ids for o in generate(target, drafter, reqs, 4, batch_invariant=True)]
    assert batched == plain
    assert _in_flight(target, drafter, prompts, 4) == plain


def test_model_ops_rows_independent(bf16_pair, int4_pair):
    """The target's own linears (bf16 batch-invariant, packed int4 kept as torch's kernel), on
    its own activations, and the whole forward: K rows vs each row alone, bit for bit."""
    target, _, prompts = bf16_pair
    model = target.model
    set_batch_invariant(model, True)
    assert isinstance(model.layers[0].attn.qkv, BatchInvariantLinear) and model.layers[0].attn.batch_invariant
    x = model.embed(torch.tensor(prompts[0][:40]))
    packed = int4_pair[0].model.layers[0].mlp.gate_up
    assert isinstance(packed, PackedLinear) and packed.fmt == "int4"
    for k in (3, 8, 17):
        assert row_diff(model.layers[0].attn.qkv, x, k) == 0
        assert row_diff(model.lm_head, x, k) == 0
        assert row_diff(packed, x, k) == 0
    assert forward_rows(model, prompts[0][:60], 4, starts=2) == 0
    set_batch_invariant(int4_pair[0].model, True)  # (its attention; the packed linears stay as they are)
    assert forward_rows(int4_pair[0].model, prompts[0][:60], 8, starts=2) == 0


def test_mode_round_trip_is_exact(bf16_pair):
    """On and off again: the same weights (shared, not copied; the same state_dict in the mode),
    the head still tied to the embedding."""
    model = bf16_pair[0].model
    set_batch_invariant(model, False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert set_batch_invariant(model, True) == 4 * model.cfg.num_layers + 1
    assert model.lm_head.weight is model.embed.weight
    inside = model.state_dict()
    assert before.keys() == inside.keys() and all(torch.equal(before[k], inside[k]) for k in before)
    set_batch_invariant(model, False)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.lm_head.weight is model.embed.weight and not model.layers[0].attn.batch_invariant


def test_impossible_settings(bf16_pair):
    half = torch.nn.Linear(4, 4).half()
    with pytest.raises(DFlashError, match="covers fp32 and bf16"):
        check_batch_invariant(half)
    with pytest.raises(DFlashError, match="cuda_graphs runs without the batch-invariant mode"):
        engine_config(batch_invariant=True, cuda_graphs=True)


def test_without_a_compiler(tmp_path):
    """No C++ compiler: the default (auto) runs without the mode after one warning line; asking
    for the mode is a one-line error that names what failed (and nothing is left half-built to
    load later)."""
    from helpers import CLI, error_line

    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), DFLASH_TRT_EXT_DIR=str(tmp_path / "ext"))
    args = ["generate", "--prompt", "Hi", "--max-new-tokens", "3", "--block-size", "1"]
    proc = subprocess.run(CLI + args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("warning: batch-invariant mode off: the batch-invariant CPU kernels could not") == 1
    bad = subprocess.run(CLI + args + ["--batch-invariant"], env=env, capture_output=True, text=True, timeout=300)
    line = error_line(bad)
    assert "could not be built (needs a C++ compiler, g++)" in line
    assert "no-such-compiler: not found" in line  # the shell's error, not ninja's command line
    assert not list((tmp_path / "ext").rglob("*.so"))


def test_runner_puts_the_drafter_linears_on_the_kernel(smollm2, monkeypatch):
    """On the CPU in fp32 the runner runs the drafter's dense linears through the packed kernel
    (``model_runner.drafter_kernel_linears``: for speed, drafts never change the output): each
    becomes a :class:`BatchInvariantLinear` over the same weight (the state dict unchanged), and
    the drafts and final hidden states of draft calls on a real answer's context are those of
    the same drafter (the shipped one) through ``nn.Linear`` (hidden states within fp32 summation-order
    differences). The compiled path gets ``nn.Linear`` back."""
    from helpers import full_features, plain_outputs, shipped_drafter

    from dflash_trt.runtime import model_runner
    from dflash_trt.runtime.model_runner import ModelRunner, StepItem, cpu_weight_layout

    model = smollm2.model
    ids = chat_prompt_ids(smollm2.tokenizer, mixed_prompts(1)[0])
    ids = ids + plain_outputs(smollm2, [ids], 24)[0]
    nb = -(-(len(ids) + 8) // 16)
    runs = {}
    for kernel in (True, False):
        drafter = shipped_drafter(model)
        before = {k: v.clone() for k, v in drafter.state_dict().items()}
        monkeypatch.setattr(model_runner, "drafter_kernel_linears", lambda d, on=kernel: on)
        runner = ModelRunner(model, drafter, engine_config(block_size=4, kv_capacity=nb * 16).with_defaults(4))
        linears = [m for m in drafter.modules() if isinstance(m, nn.Linear)]
        assert linears and all(isinstance(m, BatchInvariantLinear) == kernel for m in linears)
        assert drafter.state_dict().keys() == before.keys()
        assert all(torch.equal(drafter.state_dict()[k], v) for k, v in before.items())
        proposer, hidden, drafts = runner.proposer, [], []
        proposer._fused = False  # the modules' forward (the fused layers: tests/test_fused_drafter.py)
        forward = proposer.forward
        proposer.forward = lambda *a, f=forward, h=hidden: h.append(f(*a).clone()) or h[-1]
        feats = full_features(model, ids, drafter.cfg.target_layer_ids)
        for anchor in range(len(ids) - 12, len(ids) - 4):  # a first call ingests the context so far
            proposer.store_features(0, anchor - 1 if drafts else 0, feats[(anchor - 1 if drafts else 0) : anchor])
            item = StepItem(0, [ids[anchor]], anchor, list(range(nb)), num_draft=3)
            with runner.grad_mode():
                drafts.append(proposer.propose([item], 4)[0].tolist())
        runs[kernel] = hidden, drafts
    (hk, dk), (hd, dd) = runs[True], runs[False]
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(hk, hd))
    print(f"drafter through the kernel vs nn.Linear: max relative difference {diff:.2g}; drafts {dk}")
    assert dk == dd
    assert diff < 1e-5
    monkeypatch.undo()
    drafter = shipped_drafter(model)
    cpu_weight_layout(model, drafter, False, False, True)
    assert model_runner.drafter_kernel_linears(drafter)
    assert all(isinstance(m, BatchInvariantLinear) for m in drafter.modules() if isinstance(m, nn.Linear))
    # the target's norms on the one-call kernel, the drafter's on torch's (bit-equal to z-lab's)
    norms = {
        name: [m.cpu_kernel for m in mod.modules() if isinstance(m, RMSNorm)]
        for name, mod in (("target", model), ("drafter", drafter))
    }
    assert norms["target"] and all(norms["target"]) and norms["drafter"] and not any(norms["drafter"])
    cpu_weight_layout(model, drafter, False, True, True)  # compiled: inductor lowers plain linears
    assert all(type(m) is nn.Linear for m in drafter.modules() if isinstance(m, nn.Linear))
    # the norms stay on the kernel: one opaque call in the compiled graph, the eager path's bits
    assert all(m.cpu_kernel for m in model.modules() if isinstance(m, RMSNorm))
