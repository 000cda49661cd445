"""``dflash-trt bench --concurrency``: the load benchmark on the real default model (SmolLM2 +
the seeded random default drafter, fp32), the arrival / in-flight rules of its driver on the
real engine, the KV-capacity default, and bad input giving one line and exit status 2."""

from __future__ import annotations

import json
import math

import pytest
from helpers import engine_config, main_error, run

from dflash_trt.bench.load import (
    Lane,
    LoadConfig,
    arrival_times,
    drive,
    drive_lanes,
    kv_capacity_for,
)
from dflash_trt.engine_args import EngineArgs
from dflash_trt.models.prefill import first_divergence, top2_margin
from dflash_trt.runtime.config import DEFAULT_KV_CAPACITY
from dflash_trt.runtime.engine import LLMEngine
from dflash_trt.runtime.request import Request
from dflash_trt.runtime.sampling import SamplingParams

TIE = 1e-4  # fp32 top-2 logit margin below which a greedy divergence is a numerical tie (test_lossless.py)

ROW_KEYS = (
    "concurrency",
    "mode",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "iteration_p50_s",
    "iteration_max_s",
    "mean_draft_tokens",
    "tau",
    "requests",
    "output_tokens",
    "per_user_tokens_per_s",
    "wall_s",
    "iterations",
    "eager_iterations",
    "capture_iterations",
    "lossless",
    "divergences",
    "interleaved",
)


def test_load_bench_cli_json_table_plot(tmp_path):
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    proc = run(
        "bench",
        "--dataset",
        "gsm8k",
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "12",
        "--concurrency",
        "1,4",
        "--repeats",
        "2",
        "--threads",
        "1",
        "--dtype",
        "fp32",
        "--max-batch-size",
        "8",
        "--max-num-tokens",
        "512",
        "--kv-capacity",
        "8192",
        "--json",
        str(out),
        "--plot",
        str(png),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KV capacity: 8,192 tokens (--kv-capacity)" in proc.stderr
    r = json.loads(out.read_text())
    assert r["benchmark"] == "load" and r["request_rate"] is None and r["block_size"] == 8 and r["adaptive"] is True
    assert r["engine_config"]["kv_capacity_tokens"] == 8192 and r["engine_config"]["max_batch_size"] == 8
    rows = r["load"]
    assert sorted((x["concurrency"], x["mode"]) for x in rows) == [(1, "ar"), (1, "dflash"), (4, "ar"), (4, "dflash")]
    for x in rows:
        for k in ROW_KEYS:
            assert k in x, (k, x)
        c = x["concurrency"]
        assert x["requests"] == max(2 * c, 3)
        # greedy, 12 new tokens: a request ends at 12 tokens or at EOS
        assert x["requests"] <= x["output_tokens"] <= 12 * x["requests"]
        assert x["output_tokens_per_s"] > 0 and x["per_user_tokens_per_s"] > 0 and x["wall_s"] > 0
        assert x["output_tokens_per_s"] == pytest.approx(x["output_tokens"] / x["wall_s"])
        # two runs of the lanes: the row is the lower of the two (the lower middle of an even count)
        assert len(x["repeats_tok_s"]) == 2 and x["output_tokens_per_s"] == min(x["repeats_tok_s"])
        assert 0 < x["ttft_p50_s"] <= x["ttft_p99_s"] <= x["wall_s"]
        assert 0 < x["tpot_p50_s"] <= x["tpot_p99_s"] <= x["wall_s"]
        assert 0 < x["iteration_p50_s"] <= x["iteration_max_s"] <= x["wall_s"]
        assert x["tau"] >= 1.0 and x["interleaved"] is True
        # every iteration counted, each eager (no CUDA graphs here); one per token at most, fewer with prompts batched
        assert 0 < x["iterations"] == x["eager_iterations"] <= x["output_tokens"] and x["capture_iterations"] == 0
        if x["mode"] == "ar":
            assert x["mean_draft_tokens"] == 0 and x["tau"] == 1.0
        else:
            assert 0 <= x["mean_draft_tokens"] <= 15
        # dflash and ar give the same tokens, or differ only at a numerical tie
        assert x["lossless"] is (not x["divergences"])
        for d in x["divergences"]:
            assert d["top2_margin"] < TIE, d
    table = proc.stdout.splitlines()
    ours = [line for line in table if line.split()[:2] in (["1", "ar"], ["1", "dflash"], ["4", "ar"], ["4", "dflash"])]
    assert len(ours) == 4 and all("2 runs" in line for line in ours)
    for line in ours:  # DFlash's runs against plain decoding's of the same repeat
        paired = line.split("vs ar per run ")[1].split("/") if line.split()[1] == "dflash" else []
        assert len(paired) == (2 if line.split()[1] == "dflash" else 0) and all(float(p) > 0 for p in paired), line
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_arrivals_seeded():
    a = arrival_times(2000, 50.0, seed=3)
    assert a == arrival_times(2000, 50.0, seed=3) and a != arrival_times(2000, 50.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(1 / 50.0, rel=0.1)  # mean gap 1/rate
    assert arrival_times(5, None, 0) == [0.0] * 5 == arrival_times(5, math.inf, 0)


def test_driver_respects_arrivals_and_concurrency(smollm2):
    """Plain decoding on the real engine: no request starts before it arrives, never more than C
    run at once, a request that found C in flight starts when one of them finished, and the
    outputs equal one-at-a-time greedy decoding."""
    from dflash_trt.prompts import chat_prompt_ids, load_prompts

    prompts = [chat_prompt_ids(smollm2.tokenizer, t) for t in load_prompts("gsm8k", 3)]
    eng = LLMEngine(
        smollm2.model,
        None,
        smollm2.stop_token_ids,
        engine_config(block_size=1, max_batch_size=8, max_num_tokens=512, kv_capacity=4096),
    )
    n, C = 7, 2
    reqs = [Request(prompts[i % 3], 5, stop_token_ids=()) for i in range(n)]
    arrivals = arrival_times(n, 20.0, seed=1)
    records = drive(eng, reqs, arrivals, C)
    eps = 1e-9
    for rec, t in zip(records, arrivals):
        assert rec.release_s >= t - eps and rec.release_s <= rec.first_s <= rec.finish_s
        assert len(rec.output) == 5
    assert max_in_flight(records) <= C
    finishes = {r.finish_s for r in records}
    for rec, t in zip(records, arrivals):
        assert rec.release_s == t or rec.release_s in finishes  # waited for a slot
    assert max(r.finish_s for r in records) >= arrivals[-1]
    ref = LLMEngine(smollm2.model, None, smollm2.stop_token_ids, engine_config(block_size=1, kv_capacity=4096))
    for i, p in enumerate(prompts):
        sid = ref.add_request(Request(p, 5, stop_token_ids=()))
        ref.run()
        same_or_tie(smollm2.model, p, ref.result(sid).output_ids, records[i].output)
    first = [r.output for r in records]
    assert not eng.has_unfinished()
    # all arriving at t=0: exactly C in flight from the start
    records = drive(eng, reqs[:4], arrival_times(4, None, 0), 3)
    assert max_in_flight(records) == 3 and sorted(r.release_s for r in records)[:3] == [0.0] * 3
    for i, rec in enumerate(records):
        same_or_tie(smollm2.model, reqs[i].prompt_ids, first[i], rec.output)


def test_lanes_interleave_on_their_own_clocks(smollm2, random_drafter):
    """Plain decoding and DFlash driven together: their iterations alternate through the whole
    run, each lane's clock counts only its own iterations (together they never exceed the wall
    time that passed, where wall clocks would count it twice), and both give plain decoding's
    tokens."""
    import time

    from dflash_trt.prompts import chat_prompt_ids, load_prompts

    prompts = [chat_prompt_ids(smollm2.tokenizer, t) for t in load_prompts("gsm8k", 4)]
    ecfg = dict(max_batch_size=8, max_num_tokens=512, kv_capacity=8192)
    plain = LLMEngine(smollm2.model, None, smollm2.stop_token_ids, engine_config(block_size=1, **ecfg))
    dflash = LLMEngine(smollm2.model, random_drafter, smollm2.stop_token_ids, engine_config(block_size=4, **ecfg))
    # one-time costs untimed, as the bench does (the drafter plans its fused layers at its first draft)
    for e in (plain, dflash):
        e.warm_up(prompts[:1], SamplingParams(), 2)
    n, C = 6, 2
    arrivals = arrival_times(n, None, 0)
    lanes = [
        Lane(e, [Request(prompts[i % 4], 8, stop_token_ids=()) for i in range(n)], arrivals, C) for e in (plain, dflash)
    ]
    start = time.perf_counter()
    drive_lanes(lanes)
    elapsed = time.perf_counter() - start
    a, b = (lane._wall for lane in lanes)
    order = [lane for _, lane in sorted([(t, 0) for t in a] + [(t, 1) for t in b])]
    switches = sum(x != y for x, y in zip(order, order[1:]))
    assert len(a) >= 3 and len(b) >= 3 and switches >= min(len(a), len(b)) // 2  # not one after the other
    assert sum(lane.clock for lane in lanes) <= elapsed
    for lane in lanes:
        assert lane.clock == pytest.approx(max(r.finish_s for r in lane.records), abs=0.05)
        assert max_in_flight(lane.records) <= C
    for i in range(n):
        same_or_tie(smollm2.model, prompts[i % 4], lanes[0].records[i].output, lanes[1].records[i].output)


def same_or_tie(model, prompt: list[int], ref: list[int], got: list[int]) -> None:
    """Greedy outputs are equal, or first differ where the target's top-2 margin is a tie."""
    k = first_divergence(ref, got)
    if k is not None:
        margin = top2_margin(model, prompt + ref[:k])
        assert margin < TIE, f"differ at token {k}, top-2 margin {margin:.3g}: {ref} vs {got}"


def max_in_flight(records) -> int:
    """Most requests between release and finish at any instant (a finish frees its slot before
    a release at the same instant takes it)."""
    events = sorted([(r.release_s, 1) for r in records] + [(r.finish_s, -1) for r in records])
    live = most = 0
    for _, d in events:
        live += d
        most = max(most, live)
    return most


def test_kv_capacity_default(tmp_path):
    def engine_dir(name: str, plan: dict | None):
        d = tmp_path / name
        d.mkdir()
        m = {"format": "dflash-trt-engine", "version": 1}
        if plan is not None:
            m["memory_plan"] = plan
        (d / "engine.json").write_text(json.dumps(m))
        return str(d)

    assert kv_capacity_for(LoadConfig()) == (DEFAULT_KV_CAPACITY, "default")
    assert kv_capacity_for(LoadConfig(EngineArgs(kv_capacity=1000)))[0] == 1000
    assert kv_capacity_for(LoadConfig(EngineArgs(engine=engine_dir("small", {"kv_token_capacity": 5000})))) == (
        5000,
        "engine memory plan",
    )
    cap, src = kv_capacity_for(LoadConfig(EngineArgs(engine=engine_dir("big", {"kv_token_capacity": 10**7}))))
    assert cap == DEFAULT_KV_CAPACITY and "capped" in src
    cap, src = kv_capacity_for(LoadConfig(EngineArgs(engine=engine_dir("none", None))))
    assert cap == DEFAULT_KV_CAPACITY and "no memory plan" in src


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--concurrency", "0"], "--concurrency values must be integers >= 1"),
        (["--concurrency", "a,b"], "--concurrency takes comma-separated integers"),
        (["--concurrency", ","], "--concurrency takes comma-separated integers"),
        (["--concurrency", "1,4", "--request-rate", "-2"], "--request-rate must be > 0"),
        (["--concurrency", "1", "--request-rate", "fast"], "--request-rate takes a number"),
        (["--concurrency", "1", "--peers", "hf"], "only peer is vllm"),
        (["--concurrency", "1", "--peers", "vllm", "--weights", "int4"], "peer vllm runs the dense checkpoint"),
        (["--concurrency", "1", "--max-batch-size", "0"], "--max-batch-size must be >= 1"),
        (["--concurrency", "1", "--num-requests", "0"], "--num-requests must be >= 1"),
        (["--concurrency", "1", "--repeats", "0"], "--repeats must be >= 1"),
        (["--repeats", "3"], "add --concurrency"),
        (["--kv-capacity", "4096"], "add --concurrency"),
    ],
)
def test_load_bench_bad_input_one_line(args, expect, capsys):
    assert expect in main_error(capsys, "bench", *args)


def test_vllm_peer_without_its_environment_one_line(capsys, monkeypatch, tmp_path):
    """``--peers vllm`` names ``make peers`` when vLLM's environment is not there, before any model loads."""
    monkeypatch.setenv("DFLASH_TRT_VLLM_PYTHON", str(tmp_path / "no-python"))
    for argv in (["--peers", "vllm"], ["--concurrency", "1", "--peers", "vllm"]):
        line = main_error(capsys, "bench", *argv)
        assert "make peers" in line and "no-python" in line


def test_engine_settings_rejected_before_running(capsys):
    """A block size above the token budget fails as one line (the engine's own check)."""
    argv = ["--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "2", "--max-num-tokens", "4"]
    line = main_error(capsys, "bench", *argv)
    assert "--max-num-tokens (4) must be >= the block size (8)" in line  # the shipped drafter's block
