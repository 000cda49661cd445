"""Tensor parallelism (runtime/distributed.py): TP=2 under mpiexec on the real SmolLM2 target
(fp32, greedy, real prompts) equals the same runs at TP=1 token for token.

``tests/tp_worker.py`` runs on 2 ranks (``mpiexec -n 2``); it checks the shard split on one
forward (and that skipping the all-reduces is far off), then batches requests through the TP
engine with block size 1, 8, 8 adaptive and 8 with an oracle proposer (high acceptance). This
file reruns the same engine settings in-process at TP=1 and compares. As in test_lossless, a
divergence is tolerated only at a numerical tie (top-2 margin < 1e-4: the all-reduce sums the
row-parallel partial products in another order than one GEMM); ties are counted and printed.

Skipped only when no ``mpiexec`` exists (mpich + mpi4py are dependencies of the package).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import check_same
from tp_worker import MAX_NEW, RUNS, engine_config, prompts_for

from dflash_trt.errors import DFlashError
from dflash_trt.runtime.distributed import shard_target, split_sizes
from dflash_trt.runtime.engine import LLMEngine
from dflash_trt.runtime.request import Request

WORKER = Path(__file__).with_name("tp_worker.py")


def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"  # the mpich wheel's, in the venv
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, smollm2):
    """Rank 0's report of the TP=2 run (the smollm2 fixture first makes sure the converted
    checkpoint is in the cache, so the ranks do not both convert it)."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich mpi4py)")
    out = tmp_path_factory.mktemp("tp") / "tp2.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(WORKER), str(out)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"TP=2 run timed out after 900 s:\n{(e.stderr or '')[-3000:]}")
    assert p.returncode == 0 and out.exists(), (
        f"TP=2 run failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def prompts(smollm2):
    return prompts_for(smollm2.tokenizer)


def run_tp1(smollm2, drafter, prompts, block_size, adaptive):
    engine = LLMEngine(smollm2.model, drafter, smollm2.stop_token_ids, engine_config(block_size, adaptive))
    sids = [engine.add_request(Request(p, MAX_NEW)) for p in prompts]
    engine.run()
    return [engine.result(s).output_ids for s in sids], engine.stats.tau


@pytest.fixture(scope="module")
def tp1(smollm2, random_drafter, prompts):
    """The TP=1 outputs of the prompts for an engine setting ``(block_size, adaptive)``, each run
    once for the module: plain decoding (block size 1) is the reference of three tests."""
    runs = {}

    def outputs(block_size: int, adaptive: bool) -> list[list[int]]:
        if (block_size, adaptive) not in runs:
            runs[block_size, adaptive] = run_tp1(smollm2, random_drafter, prompts, block_size, adaptive)[0]
        return runs[block_size, adaptive]

    return outputs


def test_split_sizes():
    assert split_sizes(3, 2) == [2, 1]
    assert split_sizes(9, 4) == [3, 2, 2, 2]
    assert split_sizes(1536, 2) == [768, 768]


def test_tp_above_kv_heads_refused(smollm2):
    class Group:  # shard_target checks the size before it touches anything
        rank, size = 0, 4

    with pytest.raises(DFlashError, match="tp_size 4 exceeds the target's 3 KV heads"):
        shard_target(smollm2.model, Group())
    assert smollm2.model.tp is None and smollm2.model.cfg.num_kv_heads == 3


def test_shard_split(tp2, smollm2):
    """Uneven head split 2+1 KV heads (6+3 query heads); one forward's gathered logits equal
    the TP=1 logits; without the all-reduces they are far off (the check can fail)."""
    cfg = smollm2.model.cfg
    d = cfg.head_dim
    s0, s1 = tp2["shards"]
    for s, kv in ((s0, 2), (s1, 1)):
        print(
            f"rank {s['rank']}: {s['num_heads']} q heads / {s['num_kv_heads']} KV heads, intermediate "
            f"{s['intermediate']}, vocab rows {s['lm_head_rows']}; logits max |diff| {s['max_abs_diff']:.2e}, "
            f"without all-reduce {s['no_allreduce_max_abs_diff']:.1f}"
        )
        assert (s["num_kv_heads"], s["num_heads"]) == (kv, 3 * kv)
        assert s["qkv_rows"] == (3 * kv + 2 * kv) * d and s["o_cols"] == 3 * kv * d
        assert s["intermediate"] == cfg.intermediate_size // 2
        assert s["lm_head_rows"] == cfg.vocab_size // 2
        assert s["logits_shape"][1] == cfg.vocab_size
        assert s["allclose"] and s["argmax_equal"], s
        assert s["no_allreduce_max_abs_diff"] > 1.0


@pytest.mark.parametrize("name,block_size,adaptive", RUNS)
def test_tp2_equals_tp1(tp2, tp1, smollm2, prompts, name, block_size, adaptive):
    ref = tp1(block_size, adaptive)
    got = tp2["runs"][name]["outputs"]
    ties = sum(check_same(smollm2.model, p, r, o) for p, r, o in zip(prompts, ref, got))
    print(f"TP=2 {name}: {len(prompts) - ties}/{len(prompts)} identical to TP=1, {ties} at ties")
    assert all(len(o) >= 1 for o in got)


def test_tp2_high_acceptance(tp2, tp1, smollm2, prompts):
    """The oracle proposer (block 8) commits several tokens per step and rolls back rejected
    ones on both ranks' KV shards; the output still equals TP=1 plain decoding."""
    ref = tp1(1, False)
    run = tp2["runs"]["oracle8"]
    ties = sum(check_same(smollm2.model, p, r, o) for p, r, o in zip(prompts, ref, run["outputs"]))
    print(
        f"TP=2 oracle block 8: tau {run['tau']:.2f}, {len(prompts) - ties}/{len(prompts)} identical to TP=1, "
        f"{ties} at ties"
    )
    assert run["tau"] > 2.0
    assert max(max(c) for c in run["commit_lengths"]) > 2


def test_tp3_engine_rank_files(tmp_path, smollm2, prompts, tp1):
    """A tp_size 3 engine from ``dflash-trt build`` (fp32, no quantization: the rank files hold
    the original weights, split) runs as 3 ranks, each reading only its own target rank file;
    greedy outputs at block size 1 and 8 equal plain decoding at TP=1 (ties excepted)."""
    from dflash_trt.builder.builder import build_engine
    from dflash_trt.builder.config import BuildConfig

    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich mpi4py)")
    root = Path(__file__).resolve().parents[1]
    engine_dir = tmp_path / "tp3"
    bc = BuildConfig.load(root / "build_configs" / "cpu-fp32.yaml", {"tp_size": 3})
    build_engine(bc, None, None, engine_dir, progress=False, log=lambda *a: None)
    from dflash_trt.checkpoints.engine_dir import load_engine

    with pytest.raises(DFlashError, match="has tp_size 3: run it as 3 ranks"):
        load_engine(engine_dir)  # one process cannot run a 3-rank engine
    out = tmp_path / "tp3.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [
        mpiexec,
        "-n",
        "3",
        sys.executable,
        "-m",
        "mpi4py",
        str(WORKER.with_name("tp_engine_worker.py")),
        str(engine_dir),
        str(out),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and out.exists(), f"TP=3 run failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    res = json.loads(out.read_text())
    assert res["heads_per_rank"] == [3, 3, 3]
    ref = tp1(1, False)[:3]  # (plain decoding of all the prompts in one batch: the same tokens but at ties)
    ties = 0
    for K in ("1", "8"):
        ties += sum(check_same(smollm2.model, pr, r, o) for pr, r, o in zip(prompts, ref, res["outputs"][K]))
    print(f"\nTP=3 engine (rank files): {2 * len(ref) - ties}/{2 * len(ref)} identical to TP=1, {ties} ties")
