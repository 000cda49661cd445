"""The MoE-layer bench and the speedup model (issue 39, item 6), at tiny shapes.

The timed layer is checked against transformers' eager experts (``GptOssExperts``,
``Qwen3MoeExperts``) on the same weights and routing; the experts it reports touched against a
direct count of the routing; the touched formula against an exact enumeration and a Monte Carlo
draw; bytes per expert against the formats' sizes computed here; the command's JSON for every
block size; the model's parameter counts against OpenAI's model card and its known limits.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from dflash_trt.bench.moe_layer import MoELayer, draw_routing, expert_weights, run_layer_bench
from dflash_trt.bench.moe_speedup import (
    GPUS,
    PRESETS,
    expected_experts_touched,
    measured_speedup,
    model_speedup,
    speedup,
    step_time,
)
from dflash_trt.errors import ConfigError
from dflash_trt.quantization.int4 import Int4Linear

TINY = PRESETS["tiny"]
TINY_QWEN = replace(TINY, name="tiny-qwen", expert_bias=False, activation="swiglu")
ROOT = Path(__file__).resolve().parents[1]


def _reference(target, seed: int, dequant_int4: bool = False) -> torch.nn.Module:
    """transformers' eager experts (fp32) holding the bench layer's weights (seed ``seed``), or
    their int4 round trip (the codes ``Int4Linear`` multiplies by, dequantized)."""

    def w(t):
        if not dequant_int4:
            return t
        return Int4Linear.from_weight(t, 32).dequantize(torch.float32)

    E, H, inter = target.num_experts, target.hidden, target.intermediate
    if target.activation == "gpt_oss":
        cfg = GptOssConfig(
            hidden_size=H, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=target.top_k,
            experts_implementation="eager",
        )  # fmt: skip
        ref = GptOssExperts(cfg)
        for e in range(E):
            p = expert_weights(target, e, seed)
            ref.gate_up_proj.data[e] = w(p["gate_up"]).t()  # transformers: [E, in, out]
            ref.down_proj.data[e] = w(p["down"]).t()
            ref.gate_up_proj_bias.data[e] = (
                p["gate_up_bias"].to(torch.bfloat16).float() if dequant_int4 else p["gate_up_bias"]
            )
            ref.down_proj_bias.data[e] = p["down_bias"].to(torch.bfloat16).float() if dequant_int4 else p["down_bias"]
        return ref
    cfg = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=target.top_k,
        experts_implementation="eager",
    )  # fmt: skip
    ref = Qwen3MoeExperts(cfg)
    for e in range(E):
        p = expert_weights(target, e, seed)
        ref.gate_up_proj.data[e] = w(p["gate_up"])  # transformers: [E, out, in], [gate; up] rows
        ref.down_proj.data[e] = w(p["down"])
    return ref


@torch.no_grad()
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("target", [TINY, TINY_QWEN], ids=["gpt_oss", "qwen3_moe"])
def test_layer_equals_transformers_experts_and_counts_touched(target):
    """fp32: the bench layer equals transformers' eager experts; int4: equals them on the int4
    codes' dequantized weights up to bf16 rounding; the experts it ran are those the routing picked."""
    seed, gen = 3, torch.Generator().manual_seed(0)
    ref = _reference(target, seed)
    layer = MoELayer(target, "fp32", seed)
    for tokens in (1, 4, 16):
        ids, wts = draw_routing(target.num_experts, target.top_k, 1, tokens, gen)
        x = torch.randn(tokens, target.hidden, generator=gen)
        got = layer(x, ids, wts)
        want = ref(x, ids, wts)
        rel = _rel(got, want)
        print(f"{target.name} fp32 tokens={tokens}: max rel diff {rel:.2e}")
        assert rel < 1e-5
        assert layer.last_touched == sorted(set(ids.flatten().tolist()))
    ref4 = _reference(target, seed, dequant_int4=True)
    layer4 = MoELayer(target, "int4", seed)
    ids, wts = draw_routing(target.num_experts, target.top_k, 2, 8, gen)
    x = torch.randn(16, target.hidden, generator=gen)
    rel = _rel(layer4(x, ids, wts), ref4(x.to(torch.bfloat16).float(), ids, wts))
    print(f"{target.name} int4 vs dequantized reference: rel {rel:.2e}")
    assert rel < 2e-2
    assert layer4.last_touched == sorted(set(ids.flatten().tolist()))


def test_touched_formula_exact_and_monte_carlo():
    """E(1-(1-k/E)^n) equals the mean over every routing of small cases (exact enumeration) and
    the Monte Carlo mean of :func:`draw_routing` within 4 standard errors."""
    for E, k, n in ((4, 2, 2), (5, 2, 3), (6, 3, 2)):
        subsets = list(itertools.combinations(range(E), k))
        exact = sum(len(set().union(*c)) for c in itertools.product(subsets, repeat=n)) / len(subsets) ** n
        assert math.isclose(expected_experts_touched(E, k, n), exact, rel_tol=1e-12)
    gen = torch.Generator().manual_seed(1)
    for E, k, n in ((32, 4, 8), (128, 8, 16)):
        draws = 2000
        ids, w = draw_routing(E, k, draws, n, gen)
        per_token = ids.view(draws * n, k)
        assert all(len(set(r)) == k for r in per_token.tolist())  # k distinct experts a token
        assert torch.allclose(w.sum(-1), torch.ones(draws * n))
        counts = torch.tensor([len(set(s)) for s in ids.view(draws, n * k).tolist()], dtype=torch.float64)
        se = counts.std() / math.sqrt(draws)
        assert abs(counts.mean() - expected_experts_touched(E, k, n)) < 4 * se


def test_sticky_routing_limits():
    """rho=1 keeps a sequence on its first token's k experts; rho=0 is uniform (the formula)."""
    gen = torch.Generator().manual_seed(2)
    ids, _ = draw_routing(16, 4, 50, 8, gen, "sticky", 1.0)
    assert all(len(set(s)) == 4 for s in ids.view(50, 32).tolist())
    ids, _ = draw_routing(16, 4, 400, 8, gen, "sticky", 0.0)
    counts = torch.tensor([len(set(s)) for s in ids.view(400, 32).tolist()], dtype=torch.float64)
    assert abs(counts.mean() - expected_experts_touched(16, 4, 8)) < 4 * counts.std() / 20
    with pytest.raises(ConfigError):
        draw_routing(16, 4, 1, 1, gen, "zipf")


def test_bench_bytes_and_rows():
    """Each row's bytes = measured touched x bytes per expert, with bytes per expert the format's
    size computed here; touched per repeat never exceeds the experts or tokens x k."""
    H, inter = TINY.hidden, TINY.intermediate
    res = run_layer_bench(TINY, ["bf16", "int4"], [4, 8], [1, 2], repeats=2)
    w, b = 3 * H * inter, 2 * inter + H
    size = {"bf16": 2 * (w + b), "int4": w // 2 + 2 * 2 * (w // 32) + 2 * b}  # codes, bf16 (scale, zero), bf16 bias
    for fmt, f in res["formats"].items():
        assert f["bytes_per_expert"] == size[fmt]
        assert {(r["batch"], r["tokens_per_block"]) for r in f["rows"]} == {(x, y) for x in (1, 2) for y in (1, 4, 8)}
        for r in f["rows"]:
            assert r["expert_bytes_read_mean"] == pytest.approx(r["experts_touched_mean"] * size[fmt])
            assert all(
                1 <= t <= min(TINY.num_experts, r["tokens"] * TINY.top_k) for t in r["experts_touched_per_repeat"]
            )
            if r["tokens"] == 1:
                assert r["experts_touched_per_repeat"] == [TINY.top_k] * 2
                assert r["verify_cost_ratio"] == 1.0


def _bench_cli():
    spec = importlib.util.spec_from_file_location("moe_layer_cli", ROOT / "bench" / "moe_layer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_json_png_and_bad_input(tmp_path, capsys):
    """The command writes a JSON with every block size per format (and the model's tables) and
    a PNG; a bad block list is one line and exit status 2."""
    cli = _bench_cli()
    js, png = tmp_path / "moe.json", tmp_path / "moe.png"
    argv = ["--preset", "tiny", "--formats", "bf16,int4", "--blocks", "4,8,16", "--repeats", "1"]
    threads = torch.get_num_threads()
    try:
        assert cli.main([*argv, "--json", str(js), "--png", str(png)]) == 0
    finally:
        torch.set_num_threads(threads)  # the command's default is 1 thread
    res = json.loads(js.read_text())
    for f in res["formats"].values():
        assert sorted(r["tokens_per_block"] for r in f["rows"]) == [1, 4, 8, 16]
    assert [r["tokens_per_block"] for r in res["speedup_model"]["h100"]["batch_1"]] == [1, 4, 8, 16]
    assert "uniform" in res["routing"] and res["machine"]["cpu"] and res["machine"]["torch_threads"] == 1
    assert res["command"] == " ".join(["bench/moe_layer.py", *argv, "--json", str(js), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert cli.main(["--preset", "tiny", "--blocks", "0,4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_speedup_model_limits_and_published_counts():
    """tau=1, no draft, verify = decode -> 1; E = k (every expert always read) memory-bound -> tau;
    the gpt-oss parameter counts equal OpenAI's model card (116.83B / 5.13B, 20.91B / 3.61B)."""
    assert speedup(1.0, 2.5, 2.5, 0.0) == 1.0
    assert measured_speedup(3.0, 1.0) == 3.0
    h100 = GPUS["h100"]
    assert model_speedup(PRESETS["gpt-oss-20b"], 1, 1, h100, include_draft=False) == pytest.approx(1.0)
    dense_like = replace(PRESETS["gpt-oss-20b"], num_experts=4)  # top_k 4 of 4
    for k in (4, 8, 16):
        assert model_speedup(dense_like, k / 2, k, h100, include_draft=False) == pytest.approx(k / 2)
    # more tokens per block never reads fewer bytes, and K=16 on gpt-oss-20b reads >2x decode's
    t = PRESETS["gpt-oss-20b"]
    costs = [step_time(t, n, h100).bytes for n in (1, 4, 8, 16)]
    assert costs == sorted(costs) and costs[-1] > 2 * costs[0]
    for name, total, active in (("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)):
        assert PRESETS[name].total_params() == pytest.approx(total, rel=1e-3)
        assert PRESETS[name].active_params_per_token() == pytest.approx(active, rel=2e-3)
    for bad in (lambda: speedup(0.5, 1, 1), lambda: speedup(2, 1, 0), lambda: step_time(t, 1, h100, 1, "fp2")):
        with pytest.raises(ConfigError):
            bad()
    with pytest.raises(ConfigError):
        model_speedup(t, 9, 8, h100)
