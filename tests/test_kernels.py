"""The drafter kernels (dflash_trt.kernels): the Triton kernels against their torch references
and the references against a direct per-sequence computation, on ragged batches, grouped-query
heads, block sizes 4/8/16, KV blocks of 16/32 tokens, with and without a sliding window; the
runtime drafting through the kernels proposes exactly what the torch modules propose; the AOT
compile produces Hopper and Blackwell cubins.

Without a GPU the Triton kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set
by conftest): the same kernel code and masks, executed with numpy. With
``DFLASH_TRT_TEST_DEVICE=cuda`` the kernels are compiled and their inputs live on the GPU; the
definitions and references stay on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("triton", reason="the kernels extra (triton) is not installed")

from dflash_trt.kernels import ops  # noqa: E402
from dflash_trt.kernels.acceptance import accept_reference, accept_triton  # noqa: E402
from dflash_trt.kernels.block_attention import block_attention_reference, block_attention_triton  # noqa: E402
from dflash_trt.kernels.context_kv import context_kv_reference, context_kv_triton  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
#: where the Triton kernels run: the interpreter on the CPU, compiled on a GPU
DEVICE = torch.device(os.environ.get("DFLASH_TRT_TEST_DEVICE", "cpu"))


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of ``tensors`` on :data:`DEVICE` (the kernels' inputs)."""
    return [t.to(DEVICE) for t in tensors]


def block_attention_on_device(q, k, v, bt, kv_lens, *args) -> torch.Tensor:
    """:func:`block_attention_triton` with its inputs on :data:`DEVICE`; the output on the CPU."""
    return block_attention_triton(*on_device(q, k, v, bt, kv_lens), *args).cpu()


def paged_batch(lens: list[int], tpb: int, hkv: int, d: int, dtype, seed: int):
    """Random pools and shuffled block tables holding ``lens[i]`` keys for sequence ``i``."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / tpb) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    width = max(need)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k = torch.randn(num_blocks * tpb, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks * tpb, hkv, d, generator=g).to(dtype)
    return k, v, bt, tables


def direct_attention(q, k, v, tables, lens, block, tpb, window, scale):
    """One sequence at a time, plain loops over its key positions: the definition."""
    S, hq, d = len(lens), q.shape[1], q.shape[2]
    hkv = k.shape[1]
    out = torch.zeros(S * block, hq, d)
    for i, n in enumerate(lens):
        slots = [tables[i][p // tpb] * tpb + p % tpb for p in range(n)]
        keys, vals = k[slots].float(), v[slots].float()  # [n, Hkv, D]
        for j in range(block):
            qpos = n - block + j
            vis = torch.tensor([window == 0 or qpos - p < window for p in range(n)])
            for h in range(hq):
                kh = h // (hq // hkv)
                s = keys[:, kh] @ q[i * block + j, h].float() * scale
                s = s.masked_fill(~vis, float("-inf"))
                out[i * block + j, h] = torch.softmax(s, 0) @ vals[:, kh]
    return out.view(S * block, hq * d)


CASES = [
    # (lens, Hq, Hkv, D, block, tpb, window)
    ([4, 37, 300, 129], 9, 3, 64, 4, 16, 0),
    ([8, 8, 71, 256], 9, 3, 64, 8, 32, 12),
    ([16, 45, 300], 8, 2, 32, 16, 16, 0),
    ([33, 16, 190, 17], 8, 2, 32, 16, 32, 24),
    ([5, 304], 12, 3, 64, 4, 32, 5),  # context 1 and 300 (kv length = context + B)
    ([9, 150, 8, 61], 9, 3, 64, 8, 16, 12),  # window on with 16-token KV blocks
    ([4, 77, 250], 8, 2, 32, 4, 32, 0),  # window off with 32-token KV blocks
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[4]}-g{c[1] // c[2]}-tpb{c[5]}-w{c[6]}")
def test_block_attention_matches_definition(case, record_property):
    lens, hq, hkv, d, block, tpb, window = case
    k, v, bt, tables = paged_batch(lens, tpb, hkv, d, torch.float32, seed=len(lens) + block)
    q = torch.randn(len(lens) * block, hq, d, generator=torch.Generator().manual_seed(block))
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d**-0.5
    want = direct_attention(q, k, v, tables, lens, block, tpb, window, scale)
    ref = block_attention_reference(q, k, v, bt, kv_lens, block, tpb, window, scale)
    tri = block_attention_on_device(q, k, v, bt, kv_lens, block, tpb, window, scale)
    assert (ref - want).abs().max() < TOL[torch.float32]
    assert (tri - want).abs().max() < TOL[torch.float32]
    # bf16 pools and queries: fp32 accumulation in both, bf16 rounding of the output
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    refb = block_attention_reference(qb, kb, vb, bt, kv_lens, block, tpb, window, scale)
    trib = block_attention_on_device(qb, kb, vb, bt, kv_lens, block, tpb, window, scale)
    assert trib.dtype == torch.bfloat16 and (trib.float() - refb.float()).abs().max() < TOL[torch.bfloat16]
    diffs = f"fp32 |triton - definition| {(tri - want).abs().max():.2e}, bf16 |triton - reference| "
    record_property("max_abs_diff", diffs + f"{(trib.float() - refb.float()).abs().max():.2e}")


def test_window_changes_the_result():
    """The window must matter (else the windowed cases above test nothing)."""
    lens, hq, hkv, d, block, tpb = [60, 90], 8, 2, 32, 4, 16
    k, v, bt, _ = paged_batch(lens, tpb, hkv, d, torch.float32, seed=3)
    q = torch.randn(len(lens) * block, hq, d)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    full = block_attention_on_device(q, k, v, bt, kv_lens, block, tpb, 0, d**-0.5)
    win = block_attention_on_device(q, k, v, bt, kv_lens, block, tpb, 8, d**-0.5)
    assert (full - win).abs().max() > 1e-2


def rope_direct(x: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of one head vector at one position."""
    ang = pos * inv_freq
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    half = x.shape[-1] // 2
    rot = torch.cat([-x[half:], x[:half]])
    return x * cos + rot * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_kv_matches_definition(dtype, record_property):
    L, hkv, d, T, P = 3, 2, 32, 19, 64
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(T, L * 2 * hkv * d, generator=g).to(dtype)
    knorm = (1 + 0.1 * torch.randn(L, d, generator=g)).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.randint(0, 500, (T,), generator=g)
    slots = torch.randperm(P, generator=g)[:T]
    pools = [torch.zeros(L, P + 1, hkv, d, dtype=dtype) for _ in range(4)]
    context_kv_reference(kv, knorm, 1e-6, inv_freq, positions, slots, pools[0], pools[1])
    dev_pools = on_device(pools[2], pools[3])
    kv_d, knorm_d, inv_freq_d, positions_d, slots_d = on_device(kv, knorm, inv_freq, positions, slots)
    context_kv_triton(kv_d, knorm_d, 1e-6, inv_freq_d, positions_d, slots_d, *dev_pools)
    pools[2], pools[3] = (p.cpu() for p in dev_pools)
    x = kv.float().view(T, L, 2, hkv, d)
    worst = 0.0
    for t in range(T):
        for layer in range(L):
            for h in range(hkv):
                k = x[t, layer, 0, h]
                k = k * torch.rsqrt(k.pow(2).mean() + 1e-6) * knorm[layer].float()
                want_k = rope_direct(k, int(positions[t]), inv_freq)
                s = int(slots[t])
                for kp, vp in ((pools[0], pools[1]), (pools[2], pools[3])):
                    worst = max(worst, (kp[layer, s, h].float() - want_k).abs().max().item())
                    assert (kp[layer, s, h].float() - want_k).abs().max() < 4 * TOL[dtype]
                    assert torch.equal(vp[layer, s, h].float(), x[t, layer, 1, h])
    untouched = torch.ones(P + 1, dtype=torch.bool)
    untouched[slots] = False
    assert all(p[:, untouched].abs().sum() == 0 for p in pools)  # nothing written elsewhere
    record_property("max_abs_diff", f"{dtype}: K vs definition {worst:.2e}, V exact")


def test_accept_kernel():
    rng = random.Random(0)
    S, K = 37, 15
    gen = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 5, (S, K), generator=gen)
    target = torch.randint(0, 5, (S, K + 1), generator=gen)
    for i in range(S):  # long matching prefixes as well as early misses
        m = rng.randrange(0, K + 1)
        target[i, :m] = drafts[i, :m]
    target[0, 0] = (drafts[0, 0] + 1) % 5  # at least one miss at the first draft token
    n = torch.tensor([rng.randrange(0, K + 1) for _ in range(S)], dtype=torch.int32)
    n[0] = K
    want = []
    for i in range(S):
        a = 0
        while a < int(n[i]) and drafts[i, a] == target[i, a]:
            a += 1
        want.append(a)
    assert accept_reference(drafts, target, n).tolist() == want
    assert accept_triton(*on_device(drafts, target, n)).tolist() == want
    assert ops.accept(*on_device(drafts, target, n)).tolist() == want
    assert max(want) > 3 and min(want) == 0


# ---------------------------------------------------------------- the runtime through the kernels
def recorded_drafts(smollm2, drafter, reqs, mode: str, monkeypatch) -> tuple[list, list, list]:
    """Run the engine with ``DFLASH_TRT_KERNELS=mode``: every draft call's proposals, the
    drafter's final hidden states of every call (``[S, B - 1, hidden]``), the outputs."""
    from helpers import engine_config

    from dflash_trt.runtime.engine import LLMEngine
    from dflash_trt.runtime.model_runner import ModelRunner
    from dflash_trt.runtime.spec_decode.dflash import DFlashProposer

    calls: list = []
    hidden: list = []

    class Recording(DFlashProposer):
        def propose(self, items, block):
            out = super().propose(items, block)
            calls.append([row[: it.num_draft] for row, it in zip(out.tolist(), items)])
            return out

    propose = type(drafter).propose
    monkeypatch.setattr(drafter, "propose", lambda h, *a: hidden.append(h.clone()) or propose(drafter, h, *a))
    monkeypatch.setenv("DFLASH_TRT_KERNELS", mode)
    cfg = engine_config(block_size=8, max_batch_size=4, max_num_tokens=64, tokens_per_block=16, kv_capacity=64 * 16)
    runner = ModelRunner(smollm2.model, drafter, cfg.with_defaults(8), proposer_cls=Recording)
    assert runner.proposer.kernels == (mode == "triton")
    engine = LLMEngine(smollm2.model, drafter, smollm2.stop_token_ids, cfg, runner=runner)
    ids = [engine.add_request(r) for r in reqs]
    engine.run()
    return calls, hidden, [engine.result(i).output_ids for i in ids]


@pytest.mark.parametrize("window,layout", [(None, None), (12, None), (12, "alternating")])
def test_runtime_drafts_through_kernels_equal_torch_modules(smollm2, window, layout, monkeypatch):
    """Same drafts, same drafter hidden states (fp32, to 1e-4) and same outputs through
    :meth:`DFlashDrafter.forward_paged` and the kernels as through the torch modules; chunked
    prefill, requests joining and leaving, a sliding window (on every layer, or on every other
    one) and a draft vocabulary included."""
    from test_zlab import with_layout

    from dflash_trt.checkpoints.loader import default_mask_token_id
    from dflash_trt.checkpoints.zlab import init_drafter
    from dflash_trt.prompts import chat_prompt_ids, mixed_prompts
    from dflash_trt.runtime.request import Request

    mask = default_mask_token_id(smollm2.tokenizer, smollm2.model.cfg.vocab_size)
    d2t = torch.arange(0, 4096) * 3 if window else None  # a draft vocabulary on one of the two
    drafter = init_drafter(smollm2.model.cfg, 2, 8, mask, seed=5, sliding_window=window, draft_token_ids=d2t)
    drafter = with_layout(drafter, layout).to(smollm2.model.embed.weight.device)  # the target's device
    reqs = [Request(chat_prompt_ids(smollm2.tokenizer, t), 10) for t in mixed_prompts(3)]
    torch_calls, torch_hidden, torch_out = recorded_drafts(smollm2, drafter, reqs, "torch", monkeypatch)
    kern_calls, kern_hidden, kern_out = recorded_drafts(smollm2, drafter, reqs, "triton", monkeypatch)
    assert len(torch_calls) > 3 and kern_calls == torch_calls and kern_out == torch_out
    assert len(kern_hidden) == len(torch_hidden)
    for a, b in zip(kern_hidden, torch_hidden):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
    # the hidden states depend on the context (else equal hidden states would prove little)
    assert (torch_hidden[0][0] - torch_hidden[-1][0]).abs().max() > 1e-2


def test_kernels_aot_writes_cubins_and_ptx(tmp_path, monkeypatch):
    out = tmp_path / "cubins"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "dflash_trt.cli", "kernels-aot", "--out", str(out)]  # sm_90a, sm_100a, sm_103a
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads((out / "manifest.json").read_text())
    assert {e["arch"] for e in m["cubins"]} == {"sm_90a", "sm_100a", "sm_103a"}
    print("\n" + "\n".join(f"{e['arch']} {e['variant']}: {e['bytes']} bytes" for e in m["cubins"]))
    for e in m["cubins"]:
        blob = (out / e["file"]).read_bytes()
        assert blob[:4] == b"\x7fELF" and len(blob) == e["bytes"] > 1000
        ptx = (out / e["ptx"]).read_text()
        assert f".target {e['arch']}" in ptx and f".entry {e['entry']}" in ptx
    for kernel in ("block_attention", "context_kv", "accept"):
        assert sum(e["variant"].startswith(kernel) for e in m["cubins"]) >= 2  # >= one per arch
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "already exists" in again.stderr and len(again.stderr.splitlines()) == 1
    plugins_launch_what_was_compiled(out, m, monkeypatch)


class _Dim(int):
    """A TensorRT shape expression of a known size (``constant_value``; arithmetic as an int)."""

    @property
    def constant_value(self) -> int:
        return int(self)


def _stand_in_tensorrt() -> tuple[types.ModuleType, types.ModuleType]:
    """``tensorrt`` / ``tensorrt.plugin`` stand-ins with the parts of the quickly deployable
    plugin API that ``plugins/dflash_plugins.py`` touches (TensorRT does not install here):
    the decorators register the functions by name, the launch objects record what is set."""
    trt, trtp = types.ModuleType("tensorrt"), types.ModuleType("tensorrt.plugin")
    trt.int32, trt.plugin = "int32", trtp
    trtp.registered = {}

    def decorator(kind):
        return lambda name: lambda fn: trtp.registered.setdefault((kind, name), fn)

    trtp.register, trtp.autotune, trtp.aot_impl = decorator("register"), decorator("autotune"), decorator("aot")
    trtp.TensorDesc = object
    trtp.KernelLaunchParams = types.SimpleNamespace
    trtp.SymIntExprs = lambda n: [None] * n
    trtp.SymInt32 = int
    return trt, trtp


def plugins_launch_what_was_compiled(out, manifest, monkeypatch):
    """The TensorRT plugins' AOT implementations, called as TensorRT would for SmolLM2's drafter
    shapes, pick a kernel that ``kernels-aot`` compiled (the variant of the drafter's k_norm
    eps included) and pass exactly as many int32 extras as that kernel declares."""
    import importlib.util

    from dflash_trt.kernels import plugin_abi

    trt, trtp = _stand_in_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setenv("DFLASH_TRT_KERNELS_DIR", str(out))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 3))
    path = os.path.join(os.path.dirname(__file__), os.pardir, "plugins", "dflash_plugins.py")
    spec = importlib.util.spec_from_file_location("dflash_plugins_under_test", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert {n for _, n in trtp.registered} == {"dflash::context_kv", "dflash::block_attention", "dflash::accept"}

    def desc(*dims):
        return types.SimpleNamespace(shape_expr=[_Dim(x) for x in dims], dtype="bf16")

    extras = {s.name: len(s.extras) for s in plugin_abi.specs()}
    entries = {e["variant"]: e for e in manifest["cubins"] if e["arch"] == "sm_103a"}
    aot = {n: fn for (kind, n), fn in trtp.registered.items() if kind == "aot"}
    s_, t, L, hkv, d, pages, k = 5, 40, 2, 3, 64, 64, 4
    ctx_kv = [desc(t, L * 2 * hkv * d), desc(L, d), desc(d // 2), desc(t), desc(t)]
    ctx_kv += [desc(L, pages * 32, hkv, d)] * 2  # K and V pools
    calls = {
        "context_kv_d64_h3_eps1e-05": aot["dflash::context_kv"](*ctx_kv, 9.999999747378752e-06, None, 0),
        "context_kv_d64_h3_eps1e-06": aot["dflash::context_kv"](*ctx_kv, 1e-6, None, 0),
        "block_attention_d64_g3_b4": aot["dflash::block_attention"](
            desc(s_ * k, 3 * hkv, d),
            desc(pages * 32, hkv, d),
            desc(pages * 32, hkv, d),
            desc(s_, 8),
            desc(s_),
            k,
            32,
            0,
            None,
            0,
        ),
        "accept_k16": aot["dflash::accept"](desc(s_, k), desc(s_, k + 1), desc(s_), None, 0),
    }
    for variant, (entry, ptx, launch, extra) in calls.items():
        assert entry == entries[variant]["entry"] and ptx == (out / entries[variant]["ptx"]).read_text(), variant
        assert len(extra) == extras[variant] and None not in extra, variant
        assert launch.block_x == 32 * entries[variant]["num_warps"]
    with pytest.raises(RuntimeError, match="32 tokens per KV block"):
        aot["dflash::block_attention"](
            desc(s_ * k, 9, d), desc(512, hkv, d), desc(512, hkv, d), desc(s_, 8), desc(s_), k, 16, 0, None, 0
        )
