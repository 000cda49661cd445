"""Every device this machine has (the CPU, and each visible CUDA GPU's first device): the
runtime and the trainer on a tiny random Llama-shaped target, so the device paths (RoPE tables,
paged KV pools, per-request CPU generators with device logits, batched greedy choice, feature
caches, time-boxed training) run without model weights.

On a machine without a GPU only the ``cpu`` cases exist; on a GPU machine the ``cuda`` cases run
as well (``pytest tests/test_devices.py``). The lossless checks allow a divergence only at a
numerical tie (top-2 logit margin < 1e-4), as everywhere else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import OracleProposer, check_same, engine_config, generate

from dflash_trt.checkpoints.loader import LoadedTarget, parse_device
from dflash_trt.checkpoints.zlab import init_drafter, load_drafter
from dflash_trt.errors import DFlashError
from dflash_trt.models.config import TargetConfig
from dflash_trt.models.target import TargetModel
from dflash_trt.runtime.engine import LLMEngine
from dflash_trt.runtime.model_runner import ModelRunner
from dflash_trt.runtime.request import LoopStats, Request
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.training.config import TrainConfig
from dflash_trt.training.dataset import Sample
from dflash_trt.training.run_dir import read_log
from dflash_trt.training.trainer import train

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 256
MASK = VOCAB - 1


def tiny_target(device: str, num_layers: int = 4) -> TargetModel:
    cfg = TargetConfig(
        family="llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = TargetModel(cfg)
    with torch.no_grad():
        for p in model.parameters():  # large enough weights that logits are far from ties
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    return model.to(device).eval()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB - 1, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_dflash_equals_plain_on_device(device):
    model = tiny_target(device)
    drafter = init_drafter(model.cfg, 1, 4, MASK, seed=0).to(device)
    reqs = [Request(p, 20) for p in prompts(5)]
    ref = [generate(model, None, [r], 1)[0].output_ids for r in reqs]
    outs = [o.output_ids for o in generate(model, drafter, reqs, 4)]
    ties = sum(check_same(model, r.prompt_ids, a, b) for r, a, b in zip(reqs, ref, outs))
    # an oracle drafter (the reference continuation) exercises acceptance and KV rollback
    OracleProposer.continuations = [r.prompt_ids + a for r, a in zip(reqs, ref)]
    stats = LoopStats(4)
    oracle = generate(model, drafter, reqs, 4, stats, proposer_cls=OracleProposer)
    ties += sum(check_same(model, r.prompt_ids, a, o.output_ids) for r, a, o in zip(reqs, ref, oracle))
    print(f"{device}: oracle tau {stats.tau:.2f}, {ties} ties")
    assert stats.tau > 2.0
    assert all(len(o) == 20 for o in outs)


@pytest.mark.parametrize("device", DEVICES)
def test_in_flight_batching_and_sampling_on_device(device):
    model = tiny_target(device)
    drafter = init_drafter(model.cfg, 1, 4, MASK, seed=0).to(device)
    engine = LLMEngine(
        model,
        drafter,
        (),
        engine_config(block_size=4, max_batch_size=3, max_num_tokens=64, tokens_per_block=8, kv_capacity=8 * 40),
    )
    ps = prompts(7, seed=2)
    sids = [
        engine.add_request(Request(p, 12, SamplingParams(0.8, top_p=0.9, seed=i) if i % 2 else SamplingParams()))
        for i, p in enumerate(ps)
    ]
    engine.run()
    outs = [engine.result(s) for s in sids]
    assert all(len(o.output_ids) == 12 and all(0 <= t < VOCAB for t in o.output_ids) for o in outs)
    for i in range(0, 7, 2):  # the greedy ones equal plain decoding
        check_same(model, ps[i], generate(model, None, [Request(ps[i], 12)], 1)[0].output_ids, outs[i].output_ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 4])
def test_sampled_tokens_do_not_depend_on_batching(device, block_size):
    """The runner samples every sampled request's rows in one device pass, each row with its
    request's temperature / top-k / top-p and the uniforms its own generator drew: a request
    gets the same tokens in a mixed in-flight batch (greedy and sampled, prompts beside verify
    blocks) as alone, so no row took another request's settings or uniforms."""
    model = tiny_target(device)
    drafter = init_drafter(model.cfg, 1, 4, MASK, seed=0).to(device) if block_size > 1 else None
    settings = [
        SamplingParams(),
        SamplingParams(0.8, top_p=0.9, seed=1),
        SamplingParams(1.2, seed=2),
        SamplingParams(0.7, top_k=5, seed=3),
        SamplingParams(1.0, top_k=8, top_p=0.8, seed=4),
    ]

    def run(batch: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
        cfg = engine_config(
            block_size=block_size, max_batch_size=3, max_num_tokens=64, tokens_per_block=8, kv_capacity=8 * 60
        )
        engine = LLMEngine(model, drafter, (), cfg)
        sids = [engine.add_request(Request(p, 14, sp)) for p, sp in batch]
        engine.run()
        return [engine.result(s).output_ids for s in sids]

    reqs = list(zip(prompts(5, seed=6), settings))
    together = run(reqs)
    alone = [run([r])[0] for r in reqs]
    assert together[1:] == alone[1:]  # sampled: exactly (a tie would need a uniform on a boundary)
    check_same(model, reqs[0][0], alone[0], together[0])
    assert len({tuple(t) for t in together[1:]}) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_time_boxed_training_on_device(device, tmp_path):
    model = tiny_target(device)
    target = LoadedTarget(model, None, Path("tiny"), ())
    samples = []
    for p in prompts(6, seed=3):
        resp = generate(model, None, [Request(p, 24)], 1)[0].output_ids
        samples.append(Sample(p + resp, [0] * len(p) + [1] * len(resp), len(samples), False, False))
    cfg = TrainConfig(
        steps=10**6,  # more than any machine runs in the time box: only the clock can stop the run
        batch=2,
        anchors_per_seq=8,
        block_size=4,
        num_layers=1,
        mask_token_id=MASK,
        max_minutes=0.05,
        save_every=10**6,
        progress=False,
        autocast="fp32",
        lr=3e-3,
    )
    out = train(target, samples, tmp_path / "run", cfg)
    log = read_log(tmp_path / "run")
    assert 1 <= len(log) < cfg.steps, "the time box stops the run"
    assert log[-1]["elapsed_s"] >= 60 * cfg.max_minutes - 0.05  # (recorded just before the check)
    assert all(r["loss"] == r["loss"] for r in log)  # no NaN
    assert log[-1]["lr"] < cfg.lr, "the schedule followed the clock"
    drafter = load_drafter(out, torch.float32).to(device)
    reqs = [Request(s.input_ids[: s.response_start], 16) for s in samples[:3]]
    ref = [generate(model, None, [r], 1)[0].output_ids for r in reqs]
    got = [o.output_ids for o in generate(model, drafter, reqs, 4)]
    for r, a, b in zip(reqs, ref, got):
        check_same(model, r.prompt_ids, a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("ahead", [False, True], ids=["first-use", "at-start"])
def test_cuda_graphs_give_the_same_tokens(device, block_size, ahead):
    """Decode and verify iterations replayed from graphs per batch and key bucket
    (``runtime/cuda_graphs.py``; on a GPU captured CUDA graphs, on the CPU the same padded
    static-buffer path without capture) give the eager runner's tokens and accepted drafts.
    Prompts of 3-300 tokens finishing at different times: batches of 6 down to 1 (buckets 8,
    4, 2, 1), contexts over and under 256 keys (key buckets 512 and 256), an oracle drafter
    (long accepted prefixes, KV rollback between replays). Graphs captured on first use (with
    the iteration's inputs) or when the runner starts (``cuda_graph_capture_len``: on padding
    only; then no iteration makes a graph)."""
    model = tiny_target(device)
    g = torch.Generator().manual_seed(7)
    lengths, max_new = (3, 40, 120, 230, 260, 300), (60, 50, 40, 30, 20, 10)
    ps = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
    reqs = [Request(p, n) for p, n in zip(ps, max_new)]
    OracleProposer.continuations = [r.prompt_ids + generate(model, None, [r], 1)[0].output_ids for r in reqs]
    drafter = init_drafter(model.cfg, 1, 4, MASK, seed=0).to(device) if block_size > 1 else None
    runs = {}
    for graphs in (False, True):
        cfg = engine_config(
            block_size=block_size,
            max_batch_size=8,
            max_num_tokens=512,
            tokens_per_block=16,
            kv_capacity=16 * 160,
            cuda_graphs=graphs,
            cuda_graph_capture_len=512 if ahead else 0,
        )
        runner = ModelRunner(model, drafter, cfg.with_defaults(block_size), proposer_cls=OracleProposer)
        engine = LLMEngine(model, drafter, (), cfg, runner=runner)
        made = runner.graph_count()
        for i, r in enumerate(reqs):
            engine.add_request(r, seq_id=i)
        engine.run()
        runs[graphs] = engine, [engine.result(i).output_ids for i in range(len(reqs))]
    (eager, want), (graphed, got) = runs[False], runs[True]
    if ahead:  # every bucket made at start: 4 batch x 1 or 4 queries x 2 key buckets, 5 + 6 prompt-chunk
        # buckets (16 .. 256 and 16 .. 512 tokens), and the drafter's 8 context and 4 x 2 drafting graphs
        assert made == graphed.runner.graph_count() == 8 * block_size + 11 + (8 + 8 if block_size > 1 else 0)
    else:
        assert made == 0
    ties = sum(check_same(model, r.prompt_ids, a, b) for r, a, b in zip(reqs, want, got))
    gt = graphed.runner.graphs
    keys = sorted((k.batch, k.queries, k.keys) for k in gt.graphs)
    chunks = sorted((k.queries, k.keys) for k in gt.prompts)
    dg = graphed.runner.proposer.graphs if block_size > 1 else None  # the drafter's (runtime/drafter_graphs.py)
    drafting = sorted((k.batch, k.keys) for k in dg.drafts) if dg else []
    print(
        f"{device}, block size {block_size}: {gt.replays} replays, graphs {keys}, "
        f"{gt.prompt_replays} prompt-chunk replays, graphs {chunks}, "
        f"drafter: {dg.replays if dg else 0} replays, graphs {drafting}, "
        f"context rows {sorted(dg.contexts) if dg else []}, "
        f"tau {graphed.stats.tau:.2f}, {ties} ties"
    )
    assert {k.batch for k in gt.graphs} >= {1, 2, 4, 8} and {k.keys for k in gt.graphs} == {256, 512}
    # every prompt chunk replayed (6 prompts over 512-token budgets: chunked, beside decode steps), none eager
    assert gt.prompt_replays >= 7 and {k for _, k in chunks} == {256, 512}
    assert graphed.stats.replayed_iterations == graphed.stats.iterations
    assert ties == 0 and got == want and graphed.stats.accepted == eager.stats.accepted
    if block_size > 1:
        assert graphed.stats.tau > 2.0
        # every drafting iteration drafted from the drafter's graphs, over several batch and key buckets
        assert dg.replays == graphed.stats.draft_calls > 0
        assert {b for b, _ in drafting} >= {1, 2, 4} and {k for _, k in drafting} == {256, 512}
        assert len(dg.contexts) >= 2
    if device != "cpu":  # captured, not run eagerly
        assert all(graph.graph is not None for graph in [*gt.graphs.values(), *gt.prompts.values()])
        if dg:
            assert all(g.graph is not None for g in [*dg.drafts.values(), *dg.contexts.values()])


@pytest.mark.parametrize("device", DEVICES)
def test_adaptive_costs_under_cuda_graphs_come_from_replayed_steps(device):
    """Under CUDA graphs decode iterations replay while prompts run eagerly (on an H200 a
    12-token prompt cost 3x a replayed 16-sequence decode step), so the adaptive controller's
    target costs, keyed by tokens, must come from replayed steps alone: the start-up calibration
    measures decode steps of 1-8 sequences without and with drafts (no prompt sweep), and later
    prompt chunks are not observed, nor iterations that captured a graph (on the H200 tens of
    milliseconds each: they had made a 16-sequence decode step look 16 ms). Without graphs the
    same sizes, from decode steps too, and decode-only iterations alone are learnt.
    The outputs equal eager decoding's."""
    model = tiny_target(device)
    drafter = init_drafter(model.cfg, 1, 4, MASK, seed=0).to(device)
    reqs = [Request(p, 24) for p in prompts(6)]
    seen = {}
    for graphs in (False, True):
        cfg = engine_config(
            block_size=4,
            adaptive=True,
            max_batch_size=8,
            max_num_tokens=256,
            tokens_per_block=16,
            kv_capacity=16 * 64,
            cuda_graphs=graphs,
            cuda_graph_capture_len=0,  # (graphs captured on first use: such iterations are not learnt)
        )
        engine = LLMEngine(model, drafter, (), cfg)
        sizes = list(engine.controller.target_cost.xs)  # after the calibration
        observed, outs = [], []
        observe, step = engine.controller.target_cost.observe, engine.runner.step
        engine.controller.target_cost.observe = lambda n, s, seen=observed, f=observe: (seen.append(n), f(n, s))
        engine.runner.step = lambda plan, outs=outs, f=step: outs.append(f(plan)) or outs[-1]
        for i, r in enumerate(reqs):
            engine.add_request(r, seq_id=i)
        engine.run()
        seen[graphs] = sizes, observed, outs, [engine.result(i).output_ids for i in range(len(reqs))]
    (eager_sizes, eager_seen, _, want), (sizes, observed, outs, got) = seen[False], seen[True]
    learnt = [o.target_tokens for o in outs if o.replayed and not o.captured]
    print(
        f"{device}: calibrated sizes eager {eager_sizes}, graphs {sizes}; graphs observed {sorted(set(observed))} "
        f"in {len(observed)} of {len(outs)} iterations ({sum(o.captured for o in outs)} captured a graph)"
    )
    for calibrated in (eager_sizes, sizes):  # decode steps of 1-8 sequences without and with drafts
        assert set(calibrated) <= {1, 2, 4, 8, 16, 32} and {1, 4, 8, 32} <= set(calibrated)
    assert eager_seen and max(eager_seen) <= 8 * 4  # no prompt chunk learnt without graphs either
    # replayed decode steps only, none that captured a graph (the prompts are 3-39 tokens)
    assert observed == learnt and max(observed) <= 8 * 4 and any(o.captured for o in outs)
    for r, a, b in zip(reqs, want, got):
        check_same(model, r.prompt_ids, a, b)


def test_parse_device():
    assert parse_device("cpu").type == "cpu"
    assert parse_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DFlashError, match="unknown device"):
        parse_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DFlashError, match="no CUDA GPU"):
            parse_device("cuda")
    else:
        with pytest.raises(DFlashError, match="visible"):
            parse_device(f"cuda:{torch.cuda.device_count()}")


def test_upload_is_one_packed_copy_that_restores_every_tensor():
    """The iteration's host inputs (the attention plan of a verify group beside a prompt-chunk
    group, token ids, int32 counts, fp32 settings) go to the device as one packed int64 buffer,
    and the metadata is built there from the plan; run here with the packing forced on the CPU:
    every tensor comes back with its values, shape and dtype, and the metadata built from the
    copied plan equals the one built from the host plan."""
    from dflash_trt.runtime.attention_meta import plan_packed
    from dflash_trt.runtime.uploads import upload_meta

    tables = [[3, 1], [0, 6], [2, 4]]
    # sequence 1 is a 40-token prompt chunk (its own group), 0 and 2 verify blocks of 5 tokens
    plan = plan_packed([20, 0, 50], [5, 40, 5], [0, 5, 45], [5, 40, 5], tables, 32, 7 * 32)
    meta = plan.build()
    assert meta.groups is not None and len(meta.groups) == 2
    ids = torch.arange(50)
    counts = torch.tensor([4, 0, 2], dtype=torch.int32)
    floats = torch.tensor([0.25, -0.0, 1e-40, -3.5e38, float("inf"), 0.9999999])  # uniforms, settings
    got, got_ids, got_counts, got_floats = upload_meta(torch.device("cpu"), plan, ids, counts, floats, pack=True)
    assert got_floats.dtype == torch.float32 and torch.equal(got_floats.view(torch.int32), floats.view(torch.int32))
    with pytest.raises(TypeError, match="float64"):
        upload_meta(torch.device("cpu"), plan, floats.double(), pack=True)
    for a, b in [(meta, got)] + list(zip(meta.groups, got.groups)) + [(ids, got_ids), (counts, got_counts)]:
        pairs = [(a, b)] if isinstance(a, torch.Tensor) else [(getattr(a, k), getattr(b, k)) for k in vars(a)]
        for x, y in pairs:
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            elif not isinstance(x, list):
                assert x == y


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])  # CUDA only: nothing to see on a CPU
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("graphs", [False, True])
def test_an_iteration_synchronises_once(device, temperature, graphs):
    """A decode iteration with drafts (in-flight batch of 3, greedy or sampled with top-k and
    top-p) waits for the device once: the copy of its results (the target's choices, drafts,
    accepted counts). The metadata and the sampling uniforms go up in one non-blocking copy
    (``upload``); a plain ``.to(device)`` would synchronise each time, and so would sampling
    on the host. With CUDA graphs the same holds for a replayed step."""
    import warnings

    model = tiny_target(device)
    drafter = init_drafter(model.cfg, 1, 4, MASK, seed=0).to(device)
    # (with graphs: the measured step replays a graph captured before it)
    cfg = engine_config(
        block_size=4, max_batch_size=3, max_num_tokens=64, tokens_per_block=8, kv_capacity=320, cuda_graphs=graphs
    )
    engine = LLMEngine(model, drafter, (), cfg)
    for i, p in enumerate(prompts(3, seed=4)):
        engine.add_request(Request(p, 30, SamplingParams(temperature, top_k=20, top_p=0.9, seed=i)))
    for _ in range(4):  # prompts in, first verify blocks (device tables built)
        engine.step()
    while graphs and engine.runner.graphs.replays < 2:  # the batch's graph captured and replayed
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs


def test_graph_buckets_captured_at_start():
    """What the runner captures at start-up (``ModelRunner.capture_graphs``): every query count of
    a block up to 8, beyond that 1, the powers of two and the block; the key buckets of contexts up
    to the capture length, largest first, capped at 8,192; a negative length is refused."""
    from dflash_trt.runtime.cuda_graphs import capture_queries, key_buckets

    assert capture_queries(1) == [1] and capture_queries(4) == [1, 2, 3, 4]
    assert capture_queries(16) == [1, 2, 4, 8, 16] and capture_queries(10) == [1, 2, 4, 8, 10]
    assert key_buckets(0) == [] and key_buckets(100) == [256] and key_buckets(1024) == [1024, 512, 256]
    assert key_buckets(1025)[0] == 2048 and key_buckets(10**6)[0] == 8192
    with pytest.raises(DFlashError, match="cuda_graph_capture_len must be >= 0"):
        engine_config(cuda_graphs=True, cuda_graph_capture_len=-1)
