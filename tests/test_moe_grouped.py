"""The MoE layer's grouped-GEMM expert computation (dflash_trt.kernels.moe_grouped): the Triton
grouped GEMM and ``torch.nn.functional.grouped_mm`` against a per-row definition on ragged
groups (empty experts first, in the middle and last, a group of one row, groups crossing the
16-row tile, widths not multiples of the 64-wide tiles); the whole layer against ``MoEBlock``
(models/moe.py, routed by its own router) and a direct per-token loop, and with gpt-oss's
clamped SwiGLU and biases against transformers' ``GptOssExperts``; the routing helpers; the
dispatcher; bad input gives one-line errors.

Without a GPU the Triton kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``, set
by conftest before Triton is imported). ``DFLASH_TRT_TEST_DEVICE=cuda`` (scripts/gpu_validate.sh,
stage ``moe``) runs the same tests on the GPU: the kernel compiled, ``grouped_mm`` on CUDA.

Tolerances: fp32 inputs, 2e-5 absolute on outputs of size ~1 (``ieee`` fp32 products, fp32
accumulation in another order than the definition's); bf16 / fp16 inputs, the definition
computed in fp64 from the same 16-bit values: 1.6e-2 relative + 1e-2 absolute (one bf16 rounding
of the result and of the intermediate activation; fp16 is finer).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the kernels extra (triton) is not installed")

from dflash_trt.errors import DFlashError  # noqa: E402
from dflash_trt.kernels import moe_grouped as mg  # noqa: E402
from dflash_trt.models.moe import MoEBlock  # noqa: E402

DEVICE = torch.device(os.environ.get("DFLASH_TRT_TEST_DEVICE", "cpu"))
CUDA = DEVICE.type == "cuda"
TOL = {torch.float32: dict(rtol=0, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
TOL[torch.float16] = TOL[torch.bfloat16]
ALPHA, LIMIT = 1.702, 7.0


def grouped_mm_dtypes() -> tuple:
    """``grouped_mm``'s documented dtype on CUDA is bf16; torch's CPU implementation takes fp32 too."""
    return (torch.bfloat16,) if CUDA else (torch.float32, torch.bfloat16)


def definition_rows(x, ends, w, bias, act):
    """Row by row in fp64: each row's expert from ``ends``, ``w[e] @ x (+ b)``, the activation."""
    x64, w64 = x.double().cpu(), w.double().cpu()
    ends_l = ends.tolist()
    n_out = w.shape[1] // 2 if act != "none" else w.shape[1]
    out = torch.zeros(x.shape[0], n_out, dtype=torch.float64)
    for r in range(ends_l[-1]):
        e = next(i for i, end in enumerate(ends_l) if r < end)
        y = w64[e] @ x64[r] + (0 if bias is None else bias[e].double().cpu())
        if act == "none":
            out[r] = y
        elif act == "swiglu":
            out[r] = torch.nn.functional.silu(y[:n_out]) * y[n_out:]
        else:
            g, u = y[:n_out].clamp(max=LIMIT), y[n_out:].clamp(-LIMIT, LIMIT)
            out[r] = (u + 1) * g * torch.sigmoid(g * ALPHA)
    return out


def ragged(sizes, k_in, out, dtype, seed, bias=False):
    """Rows sorted by expert with group ``sizes`` (+ 3 trailing rows in no group), weights, ends."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes) + 3
    x = torch.randn(n, k_in, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(len(sizes), out, k_in, generator=g) * k_in**-0.5).to(dtype).to(DEVICE)
    b = (torch.randn(len(sizes), out, generator=g) * 0.5).to(dtype).to(DEVICE) if bias else None
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    return x, ends, w, b


# groups: empty first / middle / last experts, one row, 17 rows (two 16-row tiles), a big group
SIZES = [0, 3, 0, 1, 17, 5, 0]
SIZES_FULL_ENDS = [2, 0, 0, 9, 4]  # the first and the last expert non-empty, E not a power of 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ["none", "swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("sizes", [SIZES, SIZES_FULL_ENDS], ids=["empty-ends", "full-ends"])
def test_triton_grouped_gemm_matches_definition(sizes, dtype, act, record_property):
    bias = act == "clamped_swiglu"
    x, ends, w, b = ragged(sizes, 72, 80, dtype, seed=len(act), bias=bias)  # K: 2 tiles of 64, out: 2 of 64
    want = definition_rows(x, ends, w, b, act)
    tri = mg.grouped_gemm_triton(x, ends, w, b, act, ALPHA, LIMIT)
    ref = mg.grouped_gemm_reference(x, ends, w, b, act, ALPHA, LIMIT)
    assert tri.dtype == dtype and tri.shape == want.shape
    torch.testing.assert_close(tri.double().cpu(), want, **TOL[dtype])
    torch.testing.assert_close(ref.double().cpu(), want, **TOL[dtype])
    assert (tri[int(ends[-1]) :] == 0).all(), "rows in no group stay zero"
    record_property("max_abs_diff", f"{(tri.double().cpu() - want).abs().max():.2e}")


@pytest.mark.parametrize("dtype", grouped_mm_dtypes(), ids=str)
@pytest.mark.parametrize("act", ["swiglu", "clamped_swiglu"])
def test_grouped_mm_expert_mlp_matches_definition(dtype, act):
    bias = act == "clamped_swiglu"
    x, ends, gate_up, gb = ragged(SIZES, 64, 2 * 48, dtype, seed=7, bias=bias)
    g = torch.Generator().manual_seed(8)
    down = (torch.randn(len(SIZES), 64, 48, generator=g) * 48**-0.5).to(dtype).to(DEVICE)
    db = (torch.randn(len(SIZES), 64, generator=g) * 0.5).to(dtype).to(DEVICE) if bias else None
    mid = definition_rows(x, ends, gate_up, gb, act).to(dtype)  # the 16-bit intermediate, as both paths
    want = definition_rows(mid, ends, down, db, "none")
    for impl in ("grouped_mm", "triton", "torch"):
        got = mg.expert_mlp(x, ends, gate_up, down, gb, db, act, ALPHA, LIMIT, impl)
        torch.testing.assert_close(got.double().cpu(), want, **TOL[dtype], msg=impl)
        assert (got[int(ends[-1]) :] == 0).all(), impl


def test_single_token_and_all_tokens_on_one_expert():
    """T = 1 (a decode step: one group per slot, the rest empty) and every slot on one expert."""
    for ids, t in (([[4, 1]], 1), ([[2, 2]] * 5, 5)):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, 32, generator=g).to(DEVICE)
        gate_up = (torch.randn(6, 2 * 24, 32, generator=g) * 0.2).to(DEVICE)
        down = (torch.randn(6, 32, 24, generator=g) * 0.2).to(DEVICE)
        ids_t = torch.tensor(ids, device=DEVICE)
        w = torch.rand(t, 2, generator=g).to(DEVICE)
        want = direct_tokens(x, ids_t, w, gate_up, down)
        for impl in ("triton", "torch") + (("grouped_mm",) if not CUDA else ()):
            got = mg.grouped_experts(x, ids_t, w, gate_up, down, impl=impl)
            torch.testing.assert_close(got.double().cpu(), want, **TOL[torch.float32], msg=impl)


def direct_tokens(x, ids, weights, gate_up, down, gb=None, db=None, act="swiglu"):
    """The definition, token by token and slot by slot in fp64."""
    i = down.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            y = gate_up[e].double().cpu() @ x[t].double().cpu()
            if gb is not None:
                y = y + gb[e].double().cpu()
            mid = mg.activation(y[:i], y[i:], act, ALPHA, LIMIT)
            z = down[e].double().cpu() @ mid + (0 if db is None else db[e].double().cpu())
            out[t] += float(weights[t, s]) * z
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_experts_equal_moe_block(dtype, record_property):
    """``MoEBlock``'s own routing and weights: every implementation equals the block's forward
    and the direct per-token loop (13 tokens, 6 experts, top-2: some experts get no token)."""
    torch.manual_seed(0)
    block = MoEBlock(hidden=48, intermediate=40, num_experts=6, top_k=2, norm_topk_prob=True)
    block = block.to(DEVICE, dtype)
    x = torch.randn(13, 48, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        weights, ids = block.route(x)
        assert weights.dtype == dtype and ids.dtype == torch.int64
        want = direct_tokens(x, ids, weights.float(), block.gate_up, block.down)
        ours_block = block(x)
        impls = ["torch", "triton", "auto"] + (["grouped_mm"] if dtype in grouped_mm_dtypes() else [])
        diffs = {}
        for impl in impls:
            got = mg.grouped_experts(x, ids, weights, block.gate_up, block.down, impl=impl)
            assert got.dtype == dtype and got.shape == x.shape
            torch.testing.assert_close(got.double().cpu(), want, **TOL[dtype], msg=impl)
            torch.testing.assert_close(got.double().cpu(), ours_block.double().cpu(), **TOL[dtype], msg=impl)
            diffs[impl] = f"{(got.double().cpu() - want).abs().max():.1e}"
    touched = len(torch.unique(ids))
    assert touched > 2, "the routing must spread over several experts"
    record_property("max_abs_diff", ", ".join(f"{k} {v}" for k, v in diffs.items()))


def test_clamped_swiglu_with_biases_equals_transformers_gpt_oss_experts():
    """gpt-oss's experts: transformers' ``GptOssExperts`` (interleaved [E, H, 2I] weights,
    biases, clamped SwiGLU) against ours on the de-interleaved [gate; up] layout, fp32."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=40, intermediate_size=24, num_local_experts=5, num_experts_per_tok=3)
    cfg._experts_implementation = "eager"
    hf = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.6)  # some gate/up values past the clamp at 7
    x = torch.randn(11, 40, generator=g) * 2
    ids = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(11)])
    weights = torch.softmax(torch.randn(11, 3, generator=g), -1)
    with torch.no_grad():
        want = hf(x, ids, weights)
        gu = hf.gate_up_proj.detach()  # [E, H, 2I], gate and up interleaved along 2I
        gate_up = torch.cat([gu[..., ::2], gu[..., 1::2]], -1).transpose(1, 2).contiguous()  # [E, 2I, H]
        gb = hf.gate_up_proj_bias.detach()
        gate_up_bias = torch.cat([gb[..., ::2], gb[..., 1::2]], -1)
        down = hf.down_proj.detach().transpose(1, 2).contiguous()  # [E, H, I]
        db = hf.down_proj_bias.detach()
        args = dict(gate_up_bias=gate_up_bias, down_bias=db, act="clamped_swiglu", alpha=ALPHA, limit=LIMIT)
        h = x @ gu[0]
        assert (h.abs() > LIMIT).any(), "the clamp must bite somewhere"
        for impl in ("torch", "triton") + (("grouped_mm",) if not CUDA else ()):
            d = lambda t: t.to(DEVICE)  # noqa: E731
            got = mg.grouped_experts(
                d(x),
                d(ids),
                d(weights),
                d(gate_up),
                d(down),
                **{k: d(v) if torch.is_tensor(v) else v for k, v in args.items()},
                impl=impl,
            )
            rel = ((got.cpu() - want).abs().max() / want.abs().max()).item()
            assert rel < 1e-5, (impl, rel)


def test_sort_by_expert_and_combine_slots():
    ids = torch.tensor([[3, 0], [0, 3], [1, 3], [9, -1]])  # the last token's ids are out of range
    order, ends = mg.sort_by_expert(ids, 5)
    assert order[:6].tolist() == [1, 2, 4, 0, 3, 5] and ends.tolist() == [2, 3, 3, 6, 6]
    assert ends.dtype == torch.int32 and set(order[6:].tolist()) == {6, 7}
    y = torch.arange(8.0).view(8, 1).repeat(1, 2)  # sorted row r holds r
    w = torch.tensor([[1.0, 10.0], [100.0, 1000.0], [1e4, 1e5], [0.0, 0.0]])
    out = mg.combine_slots(y, order, w)
    # pair p sits at sorted row order.index(p)
    pos = {p: r for r, p in enumerate(order.tolist())}
    want = [[w[t, 0] * pos[2 * t] + w[t, 1] * pos[2 * t + 1]] * 2 for t in range(4)]
    assert out.dtype == torch.float32 and out.tolist() == want


def test_dispatch(monkeypatch):
    monkeypatch.delenv("DFLASH_TRT_KERNELS", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert mg.pick_impl(cpu, torch.bfloat16, 2880, 2880) == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert mg.pick_impl(cuda, torch.bfloat16, 2880, 2880) == "grouped_mm"
    assert mg.pick_impl(cuda, torch.float16, 2880, 2880) == "triton"
    assert mg.pick_impl(cuda, torch.float32, 2880, 2880) == "triton"
    assert mg.pick_impl(cuda, torch.bfloat16, 2880, 2881) == "triton"  # rows not 16-byte aligned
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert mg.pick_impl(cuda, torch.bfloat16, 2880, 2880) == "triton"
    monkeypatch.setenv("DFLASH_TRT_KERNELS", "triton")
    assert mg.pick_impl(cpu, torch.float32, 64, 64) == "triton"
    monkeypatch.setenv("DFLASH_TRT_KERNELS", "torch")
    assert mg.pick_impl(cuda, torch.bfloat16, 2880, 2880) == "torch"


def test_bad_input_one_line_errors():
    x = torch.randn(4, 16)
    gate_up, down = torch.randn(3, 20, 16), torch.randn(3, 16, 10)
    ids, w = torch.tensor([[0, 1]] * 4), torch.rand(4, 2)
    cases = [
        ((x, ids, w, torch.randn(3, 20, 12), down), {}, "do not fit hidden 16"),
        ((x, ids, w, torch.randn(3, 21, 16), down), {}, "do not fit hidden 16"),
        ((x, ids, w, gate_up, torch.randn(3, 16, 9)), {}, "do not fit hidden 16"),
        ((x, ids, w, gate_up[0], down), {}, "must be 3-D"),
        ((x.view(2, 2, 16), ids, w, gate_up, down), {}, "[tokens, hidden]"),
        ((x, ids[:3], w, gate_up, down), {}, "shape [4, k]"),
        ((x, ids, w[:, :1], gate_up, down), {}, "shape [4, k]"),
        ((x, ids.float(), w, gate_up, down), {}, "integer"),
        ((x, ids + 2, w, gate_up, down), {}, "expert id 3 out of range for 3 experts"),
        ((x, ids - 1, w, gate_up, down), {}, "expert id -1 out of range"),
        ((x, ids, w, gate_up.double(), down), {}, "must match"),
        ((x.half(), ids, w, gate_up.half(), down), {}, "down is torch.float32"),
        ((x.long(), ids, w, gate_up, down), {}, "not supported"),
        ((x, ids, w, gate_up, down), {"act": "gelu"}, "unknown MoE activation 'gelu'"),
        ((x, ids, w, gate_up, down), {"impl": "cutlass"}, "unknown MoE implementation"),
        ((x, ids, w, gate_up, down), {"down_bias": torch.randn(3, 10)}, "down_bias must be [3, 16]"),
    ]
    for args, kwargs, msg in cases:
        with pytest.raises(DFlashError) as err:
            mg.grouped_experts(*args, **kwargs)
        assert msg in str(err.value) and "\n" not in str(err.value), (msg, str(err.value))
