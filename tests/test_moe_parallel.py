"""Parallelism for a mixture-of-experts target (``runtime/distributed.shard_target``): MoE tensor
parallelism (every rank a slice of every expert) and expert parallelism (each rank E / N whole
experts), TensorRT-LLM's ``moe_tp_size`` x ``moe_ep_size`` = ``tp_size``, on the tiny random
transformers ``Qwen3MoeForCausalLM`` of test_moe.py and ``GptOssForCausalLM`` of test_gpt_oss.py
(attention sinks, q/k/v/o biases, router and expert biases, sliding-window layers).

- Without MPI: the ranks' partial outputs of a sparse layer (the shards ``shard_target`` makes
  for ranks 0..N-1, MoE TP 2, EP 2 and MoE TP 2 x EP 2), summed as the all-reduce sums them,
  equal transformers' ``Qwen3MoeSparseMoeBlock`` / ``GptOssMLP`` (so gpt-oss's down-projection
  bias is added exactly once); each rank's share alone does not.
- Under ``mpiexec -n 2`` (gloo, ``tests/moe_parallel_worker.py``), both families: MoE TP 2 and
  EP 2 give logits
  within rounding of TP=1 and, greedy, plain decoding, DFlash with a random drafter and with an
  oracle proposer (long acceptances, rollbacks) all give TP=1 plain decoding's tokens, token for
  token; a divergence is tolerated only at a numerical tie
  (top-2 margin < 1e-4, as test_tp.py), and ties are counted and printed.
- Sizes that do not fit give one line: a product other than the TP size, experts or an
  intermediate size that the split does not divide, and ``--moe-ep`` on the command line.

Skipped only when no ``mpiexec`` exists (mpich + mpi4py are dependencies of the package).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import check_same, generate, main_error, max_diff
from moe_parallel_worker import engine_settings
from test_gpt_oss import tiny_gpt_oss
from test_models import PROMPTS, save_tiny
from test_moe import tiny_qwen3_moe
from test_tp import _mpiexec

from dflash_trt.checkpoints.loader import load_target
from dflash_trt.checkpoints.zlab import init_drafter
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.runtime.config import ParallelConfig, moe_parallel_sizes
from dflash_trt.runtime.distributed import shard_target
from dflash_trt.runtime.request import Request

transformers = pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("moe_parallel_worker.py")
MAX_NEW = 16
BLOCK = 4
#: (name, moe_tp_size, moe_ep_size) on 2 ranks
MODES = [("moe_tp2", 2, 1), ("ep2", 1, 2)]
FAMILIES = ["qwen3_moe", "gpt_oss"]
#: (family, mode name, moe_tp_size, moe_ep_size)
RUNS = [(f, *m) for f in FAMILIES for m in MODES]


class Rank:
    """Rank ``rank`` of a group of ``size``: all :func:`shard_target` reads of a group before a
    forward (the forward would need the collectives)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _tiny(family: str, vocab: int, **overrides):
    """transformers' tiny random target of ``family`` (``overrides``: config fields)."""
    if family == "gpt_oss":
        return tiny_gpt_oss(vocab, **overrides)
    hf = tiny_qwen3_moe(vocab, True)
    if not overrides:
        return hf
    hf_cfg = copy.deepcopy(hf.config)
    for key, value in overrides.items():
        setattr(hf_cfg, key, value)
    torch.manual_seed(1)
    return transformers.Qwen3MoeForCausalLM(hf_cfg).eval()


@pytest.fixture(scope="module")
def targets(smollm2, tmp_path_factory):
    """{family: (transformers' tiny target, its checkpoint directory, ours loaded from it)}."""
    out = {}
    for family in FAMILIES:
        hf = _tiny(family, smollm2.model.cfg.vocab_size)
        path = save_tiny(hf, smollm2.tokenizer, tmp_path_factory.mktemp(f"{family}_par"))
        out[family] = hf, path, load_target(str(path), torch.float32)
    return out


@pytest.fixture(scope="module")
def moe_target(targets):
    """The Qwen3-MoE entry of :func:`targets`."""
    return targets["qwen3_moe"]


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [smollm2.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def tp2(targets, prompts, tp1, tmp_path_factory):
    """Rank 0's report of the 2-rank runs of :data:`MODES` on each family (one ``mpiexec``)."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich mpi4py)")
    d = tmp_path_factory.mktemp("moe_tp2")
    spec = {
        "prompts": prompts,
        "max_new": MAX_NEW,
        "block_size": BLOCK,
        "targets": {
            f: {"checkpoint": str(targets[f][1]), "reference": tp1[f]["plain"], "modes": MODES} for f in FAMILIES
        },
    }
    (d / "in.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(WORKER), str(d / "in.json"), str(d / "out.json")]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"2-rank run timed out after 600 s:\n{(e.stderr or '')[-3000:]}")
    assert p.returncode == 0 and (d / "out.json").exists(), (
        f"2-rank run failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    )
    return json.loads((d / "out.json").read_text())


@pytest.fixture(scope="module")
def tp1(targets, prompts):
    """Per family, TP=1 greedy outputs, all prompts in one batch with the workers' settings:
    plain decoding and DFlash with the same seeded random drafter."""
    out = {}
    for family in FAMILIES:
        target = targets[family][2]
        drafter = init_drafter(target.model.cfg, 1, BLOCK, 0, seed=0)
        reqs = lambda: [Request(p, MAX_NEW) for p in prompts]  # noqa: E731
        plain = generate(target, None, reqs(), **engine_settings(prompts, MAX_NEW, 1))
        dflash = generate(target, drafter, reqs(), **engine_settings(prompts, MAX_NEW, BLOCK))
        out[family] = {"plain": [o.output_ids for o in plain], "dflash": [o.output_ids for o in dflash]}
    return out


def test_moe_parallel_sizes():
    """TensorRT-LLM's ``Mapping`` defaults: MoE TP over all ranks; one size given, the other
    fills the rest."""
    assert moe_parallel_sizes(4, None, None) == (4, 1)
    assert moe_parallel_sizes(4, None, 2) == (2, 2)
    assert moe_parallel_sizes(4, 1, None) == (1, 4)
    assert moe_parallel_sizes(8, 2, 4) == (2, 4)
    assert ParallelConfig(2, moe_expert_parallel_size=2).moe_sizes(2) == (1, 2)
    with pytest.raises(ConfigError, match="moe_expert_parallel_size must be >= 1, got 0"):
        ParallelConfig(2, moe_expert_parallel_size=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "size,moe_tp,moe_ep",
    [(2, 2, 1), (2, 1, 2), (4, 2, 2)],
    ids=["moe_tp2", "ep2", "moe_tp2_ep2"],
)
def test_rank_shares_sum_to_transformers(targets, smollm2, tmp_path, family, size, moe_tp, moe_ep):
    """Every rank's sparse-layer output for the same hidden states, summed over the ranks,
    equals transformers' sparse MoE block (gpt-oss: ``GptOssMLP``, whose down-projection bias a
    rank must not add twice); one rank's share alone is far off. Also checks what each rank
    holds (TensorRT-LLM's rank order: EP rank ``r % moe_ep``, MoE-TP rank ``r // moe_ep``), and
    for gpt-oss its attention's sinks (its q heads') and o bias (rank 0 only)."""
    hf, _, ours = targets[family]
    if size > ours.model.cfg.num_kv_heads:  # attention splits no further: a target with more KV heads
        hf = _tiny(family, hf.config.vocab_size, num_key_value_heads=size, num_attention_heads=size)
        ours = load_target(str(save_tiny(hf, smollm2.tokenizer, tmp_path / "kv4")), torch.float32)
    cfg = ours.model.cfg
    E, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    torch.manual_seed(2)
    x = torch.randn(11, hidden)
    with torch.no_grad():
        ref = hf.model.layers[1].mlp(x[None])
    ref = (ref[0] if isinstance(ref, tuple) else ref)[0]  # GptOssMLP also returns the router scores
    shares = []
    full = ours.model.layers[1]
    for r in range(size):
        model = shard_target(copy.deepcopy(ours.model), Rank(r, size), moe_tp, moe_ep)
        m, a = model.layers[1].mlp, model.layers[1].attn
        e0, i0, ni = (r % moe_ep) * E // moe_ep, (r // moe_ep) * inter // moe_tp, inter // moe_tp
        assert m.expert_offset == e0
        assert list(m.gate_up.shape) == [E // moe_ep, 2 * ni, hidden]
        assert list(m.down.shape) == [E // moe_ep, hidden, ni]
        assert model.cfg.moe_intermediate_size == ni and model.cfg.num_experts == E
        assert torch.equal(m.gate.weight, full.mlp.gate.weight)  # the router: replicated
        if family == "gpt_oss":
            assert torch.equal(m.gate.bias, full.mlp.gate.bias)
            rows = torch.cat([torch.arange(i0, i0 + ni), inter + torch.arange(i0, i0 + ni)])
            assert torch.equal(m.gate_up_bias, full.mlp.gate_up_bias[e0 : e0 + E // moe_ep, rows])
            if i0 == 0:
                assert torch.equal(m.down_bias, full.mlp.down_bias[e0 : e0 + E // moe_ep])
            else:
                assert m.down_bias is None
            nq = cfg.num_heads // size
            assert torch.equal(a.sinks, full.attn.sinks[r * nq : (r + 1) * nq])
            assert (a.o.bias is not None) == (r == 0)
        with torch.no_grad():
            shares.append(m(x))
    d = max_diff(sum(shares), ref)
    print(f"\n{family} moe_tp {moe_tp} x ep {moe_ep}: sum of {size} rank shares vs transformers max |diff| {d:.2g}")
    assert d < 1e-5 * max(1.0, float(ref.abs().max()))
    assert all(max_diff(s, ref) > 100 * max(d, 1e-7) for s in shares)


@pytest.mark.parametrize("family,name,moe_tp,moe_ep", RUNS, ids=[f"{r[0]}-{r[1]}" for r in RUNS])
def test_two_ranks_equal_tp1(tp2, tp1, targets, prompts, family, name, moe_tp, moe_ep):
    """Under ``mpiexec -n 2``: each rank holds its experts' share (shapes and offsets; gpt-oss:
    the down bias on MoE-TP rank 0 or with its experts' owner, the o bias on rank 0, its q heads'
    sinks), the gathered logits are within rounding of TP=1 (far off without the sparse layers'
    all-reduces), and plain decoding, DFlash with the random drafter and with the oracle
    (several tokens committed per step) give TP=1 plain decoding's tokens."""
    model = targets[family][2].model
    cfg = model.cfg
    run, one = tp2[family][name], tp1[family]
    E, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for r, s in enumerate(run["shards"]):
        assert s["rank"] == r and s["num_heads"] == cfg.num_heads // 2
        assert s["gate_up"] == [E // moe_ep, 2 * inter // moe_tp, hidden]
        assert s["down"] == [E // moe_ep, hidden, inter // moe_tp]
        assert s["expert_offset"] == r * E // 2 * (moe_ep == 2)
        assert s["moe_intermediate_size"] == inter // moe_tp
        if family == "gpt_oss":
            assert s["gate_up_bias"] == [E // moe_ep, 2 * inter // moe_tp]
            assert s["down_bias"] == ([E // moe_ep, hidden] if r // moe_ep == 0 else None)
            assert s["o_bias"] == (r == 0) and s["sinks"] == cfg.num_heads // 2
    d = run["logits_max_abs_diff"]
    ties = {
        kind: sum(check_same(model, p, ref, got) for p, ref, got in zip(prompts, one["plain"], run[kind]["outputs"]))
        for kind in ("plain", "dflash", "oracle")
    }
    n = len(prompts)
    print(
        f"\n{family} {name} (moe_tp {moe_tp} x ep {moe_ep}) vs TP=1: logits max |diff| {d:.2g} (max |logit| "
        f"{run['logits_max_abs']:.2g}; without the sparse all-reduces {run['no_allreduce_max_abs_diff']:.2g}); "
        f"identical to TP=1 plain decoding: plain {n - ties['plain']}/{n}, DFlash random drafter "
        f"(tau {run['dflash']['tau']:.2f}) {n - ties['dflash']}/{n}, oracle (tau {run['oracle']['tau']:.2f}) "
        f"{n - ties['oracle']}/{n}; ties {ties}; TP=1 DFlash equal to TP=1 plain: {one['dflash'] == one['plain']}"
    )
    assert d < 1e-4 and run["argmax_equal"]
    assert run["no_allreduce_max_abs_diff"] > 100 * max(d, 1e-6)
    assert all(len(o) == MAX_NEW for kind in ties for o in run[kind]["outputs"])
    assert run["oracle"]["tau"] > 1.5 and max(max(c) for c in run["oracle"]["commit_lengths"]) > 2


def test_sizes_that_do_not_fit_give_one_line(moe_target, capsys):
    """Checked before the target is touched; the command line shows the flag."""
    model = moe_target[2].model
    cfg = model.cfg
    cases = [
        ((2, 1, 3), "moe_expert_parallel_size 3 x moe_tensor_parallel_size 1 = 3, not the 2 tensor-parallel rank(s)"),
        ((3, 1, 3), "moe_expert_parallel_size 3 does not divide the qwen3_moe target's 8 experts"),
        ((3, 3, 1), "moe_tensor_parallel_size 3 does not divide the qwen3_moe target's expert intermediate size 32"),
    ]
    for (size, moe_tp, moe_ep), line in cases:
        with pytest.raises(ConfigError) as e:
            shard_target(model, Rank(0, size), moe_tp, moe_ep)
        assert str(e.value) == line and "\n" not in str(e.value)
    assert model.tp is None and model.cfg is cfg and model.layers[1].mlp.gate_up.shape[0] == cfg.num_experts
    # an expert parameter the split does not know: refused (neither sliced nor summed twice)
    odd = copy.deepcopy(model)
    odd.layers[5].mlp.register_parameter("expert_scale", torch.nn.Parameter(torch.ones(cfg.num_experts)))
    with pytest.raises(DFlashError, match="^tensor parallelism over the experts' expert_scale of a qwen3_moe target"):
        shard_target(odd, Rank(0, 2))
    # one process, TP size 1: EP 2 cannot be
    err = main_error(capsys, "generate", "--target", str(moe_target[1]), "--moe-ep", "2", "--prompt", "hi")
    assert err.endswith("--moe-ep 2 x moe_tensor_parallel_size 1 = 2, not the 1 tensor-parallel rank(s)"), err
