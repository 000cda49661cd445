"""The ``dflash-trt`` command as a user runs it: happy paths on the real model, and bad input
giving one line on stderr, exit status 2 and no traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import error_line, run


@pytest.fixture(scope="module")
def mismatched_drafter(tmp_path_factory, smollm2, random_drafter):
    """A drafter whose config says it was made for a 24-layer target (SmolLM2 has 30)."""
    from dflash_trt.checkpoints.zlab import save_drafter

    good = save_drafter(random_drafter, tmp_path_factory.mktemp("d") / "drafter")
    bad = good.parent / "mismatched"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_target_layers"] = 24
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize(
    "args, expect",
    [
        (["bench", "--dataset", "foo"], "unknown dataset 'foo'"),
        (["generate", "--prompt", "hi", "--target", "/nonexistent/model"], "target not found"),
        (["generate", "--prompt", "hi", "--drafter", "/nonexistent/drafter"], "drafter not found"),
        (["generate", "--prompt", "hi", "--block-size", "32"], "above the drafter's block_size 8"),  # shipped
        (["generate", "--prompt", "hi", "--temperature", "-0.5"], "temperature must be a finite number >= 0"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["bench", "--peers", "vllm"], "unknown peer 'vllm'"),
        (["generate", "--prompt", "hi", "--dtype", "int3"], "unknown dtype"),
        (["generate"], "--prompt"),
        (["generate", "--prompt", "hi", "--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA device"),
        (["bench", "--cuda-graphs", "--device", "cpu", "--concurrency", "2"], "--cuda-graphs needs a CUDA device"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_one_line(args, expect):
    assert expect in error_line(run(*args))


def test_corrupt_target_files(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not a gguf at all")
    assert "not a GGUF file" in error_line(run("generate", "--prompt", "hi", "--target", str(gguf)))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "vocab_size": 10')
    assert "not valid JSON" in error_line(run("generate", "--prompt", "hi", "--target", str(hf)))


def test_corrupt_drafter_weights(tmp_path, mismatched_drafter):
    bad = tmp_path / "corrupt"
    shutil.copytree(mismatched_drafter, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    assert "corrupt" in error_line(run("generate", "--prompt", "hi", "--drafter", str(bad)))


def test_drafter_target_mismatch(mismatched_drafter):
    line = error_line(run("generate", "--prompt", "hi", "--drafter", str(mismatched_drafter)))
    assert "drafter does not match target" in line and "24-layer" in line


def test_generate_streams_and_reports(tmp_path, random_drafter):
    from dflash_trt.checkpoints.zlab import save_drafter

    d = save_drafter(random_drafter, tmp_path / "drafter")
    proc = run(
        "generate", "--prompt-from", "gsm8k:0", "--max-new-tokens", "12", "--block-size", "4", "--drafter", str(d)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "tau" in last and "tok/s" in last and "12 tokens" in last
    assert "Janet" in proc.stdout  # the prompt is echoed


def test_bench_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run(
        "bench",
        "--dataset",
        "humaneval",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--block-size",
        "4",
        "--peers",
        "hf",
        "--prompt-lookup-min",
        "2",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "b.png"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    for key in (
        "dataset",
        "num_prompts",
        "max_new_tokens",
        "block_size",
        "temperature",
        "target",
        "drafter",
        "device",
        "threads",
        "lossless",
        "tau",
        "acceptance_per_position",
        "ar_tokens_per_s",
        "dflash_tokens_per_s",
        "speedup",
        "verify_cost_ratio",
        "draft_cost_ratio",
        "peers",
    ):
        assert key in r, key
    assert r["dataset"] == "humaneval" and r["num_prompts"] == 2 and r["block_size"] == 4
    assert r["lossless"] is True
    assert len(r["acceptance_per_position"]) == 3
    assert 1.0 <= r["tau"] <= 4.0
    assert r["peers"]["hf"]["tokens_per_s"] > 0 and r["peers"]["hf"]["identical_to_ar"] is True
    lk = r["prompt_lookup"]  # the third mode, DFlash with prompt-lookup tokens merged in (fp32: exact)
    assert lk["tokens_per_s"] > 0 and lk["lossless"] is True and len(lk["acceptance_per_position"]) == 3
    assert (lk["min_n"], lk["max_n"]) == (2, 4) and 0 <= lk["lookup_step_share"] <= 1
    assert "plain decoding" in proc.stdout and "peer: hf" in proc.stdout and "DFlash + lookup" in proc.stdout
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_init_drafter_writes_loadable_drafter(tmp_path):
    out = tmp_path / "d"
    proc = run("init-drafter", "--layers", "1", "--block-size", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    from dflash_trt.checkpoints.zlab import load_drafter

    d = load_drafter(out)
    assert d.cfg.num_layers == 1 and d.cfg.block_size == 8 and d.cfg.num_target_layers == 30
    assert "already exists" in error_line(run("init-drafter", "--out", str(out)))


def test_distill_then_train(tmp_path):
    """The training path from the command line: self-distilled data, a few steps, a drafter."""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    proc = run(
        "distill",
        "--out",
        str(data),
        "--word-problems",
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "6",
        "--batch",
        "3",
        "--dtype",
        "fp32",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((data / "manifest.json").read_text())["source"] == "synthetic word problems (seed 0)"
    proc = run(
        "train",
        "--data",
        str(data),
        "--out",
        str(run_dir),
        "--steps",
        "2",
        "--block-size",
        "4",
        "--anchors",
        "4",
        "--batch",
        "2",
        "--save-every",
        "2",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from dflash_trt.checkpoints.zlab import load_drafter

    assert load_drafter(run_dir / "drafter").cfg.block_size == 4
    assert "must be in [0, 1]" in error_line(run("distill", "--out", str(tmp_path / "x"), "--sampled-fraction", "2"))
    both = run("distill", "--out", str(tmp_path / "x"), "--word-problems", "--prompts-file", str(tmp_path / "p.jsonl"))
    assert "not both" in error_line(both)
