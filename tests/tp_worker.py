"""One rank of the TP=2 test (``tests/test_tp.py``), run as
``mpiexec -n 2 python -m mpi4py tests/tp_worker.py OUT.json`` (``-m mpi4py``: an exception on one
rank aborts the whole job instead of leaving the other rank waiting).

Every rank loads the real default target (fp32) and the seeded random drafter, then:
  1. shard check: the logits of one plain forward of a real prompt, before and after
     ``shard_target``, and once more with the layers' all-reduces switched off (must be far off:
     shows the comparison can fail);
  2. several requests batched through ``tp_engine`` (greedy, real prompts) with block size 1,
     8, and 8 with the adaptive draft length (whose start-up calibration sends plans from inside
     the engine constructor);
  3. block size 8 with an oracle proposer that drafts the block-1 output with every 5th token
     corrupted, so long prefixes are accepted and rejected tails rolled back on every rank's
     KV shard (the random drafter is almost never accepted).
Rank 0 writes everything to OUT.json; test_tp.py compares it with the same runs at TP=1.
The test starts it with OMP_NUM_THREADS=1; each rank also uses one torch thread.
"""

from __future__ import annotations

import json
import sys

import torch
from helpers import OracleProposer

from dflash_trt.checkpoints.loader import default_mask_token_id, load_target
from dflash_trt.checkpoints.zlab import init_drafter
from dflash_trt.engine_args import EngineArgs
from dflash_trt.models.layers import AttentionMetadata
from dflash_trt.models.prefill import KVCache
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts
from dflash_trt.runtime.config import EngineConfig
from dflash_trt.runtime.distributed import init_tp, shard_target, tp_runner
from dflash_trt.runtime.engine import LLMEngine
from dflash_trt.runtime.request import Request
from dflash_trt.runtime.spec_decode.dflash import DFlashProposer

NUM_PROMPTS = 4
MAX_NEW = 16
#: (name, block size, adaptive)
RUNS = [("block1", 1, False), ("block8", 8, False), ("block8_adaptive", 8, True)]


def engine_config(block_size: int, adaptive: bool) -> EngineConfig:
    """Shared with test_tp.py's TP=1 runs. A 192-token budget splits the longer prompts into
    chunks (chunked prefill under TP too)."""
    return EngineArgs(
        block_size=block_size,
        adaptive=adaptive,
        max_batch_size=NUM_PROMPTS,
        max_num_tokens=192,
        tokens_per_block=16,
        kv_capacity=4096,
    ).create_engine_config()


def tp_engine(model, drafter, stop_token_ids, config: EngineConfig, tp, proposer_cls=DFlashProposer):
    """This rank's part of a TP engine built from ``model`` (rank 0: the engine; the other
    ranks mirror it until rank 0 stops them, then None), ``proposer_cls`` drafting (the
    package's factory, ``engine_factory.create_engine``, always uses the DFlash proposer)."""
    runner = tp_runner(model, drafter, config, tp, proposer_cls)
    if runner is None:
        return None
    try:
        return LLMEngine(model, drafter, tuple(stop_token_ids), config, runner=runner, tp=tp)
    except BaseException:
        tp.stop_workers()
        raise


def prompts_for(tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, t) for t in mixed_prompts(NUM_PROMPTS)]


@torch.inference_mode()
def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 ``[T, vocab]`` logits of one plain causal forward over ``ids``."""
    cfg = model.cfg
    T = len(ids)
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, T, torch.float32)
    pos = torch.arange(T).unsqueeze(0)
    return model(torch.tensor([ids]), AttentionMetadata.causal(pos, T), cache.layers).logits[0].float()


def serve(engine, prompts) -> dict:
    """Rank 0: the requests batched through ``engine``; outputs, commit lengths and tau."""
    sids = [engine.add_request(Request(p, MAX_NEW)) for p in prompts]
    engine.run()
    outs = [engine.result(s) for s in sids]
    return {
        "outputs": [o.output_ids for o in outs],
        "commit_lengths": [o.commit_lengths for o in outs],
        "tau": engine.stats.tau,
    }


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    tp = init_tp("gloo")  # CPU on every machine (the TP=1 side of the test runs on the CPU)
    assert tp is not None and tp.size == 2, "run under mpiexec -n 2"
    loaded = load_target(None, torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    full = model.cfg
    drafter = init_drafter(full, 2, 16, default_mask_token_id(tok, full.vocab_size), seed=0)
    prompts = prompts_for(tok)

    # 1. shard check on one forward
    ids = prompts[0]
    ref = forward_logits(model, ids)
    shard_target(model, tp)
    got = forward_logits(model, ids)
    layers_tp = [layer.tp for layer in model.layers]
    for layer in model.layers:
        layer.tp = None  # what a forgotten all-reduce would give
    broken = forward_logits(model, ids)
    for layer, g in zip(model.layers, layers_tp):
        layer.tp = g
    a0 = model.layers[0].attn
    info = {
        "rank": tp.rank,
        "num_heads": model.cfg.num_heads,
        "num_kv_heads": model.cfg.num_kv_heads,
        "intermediate": model.cfg.intermediate_size,
        "qkv_rows": a0.qkv.weight.shape[0],
        "o_cols": a0.o.weight.shape[1],
        "lm_head_rows": model.lm_head.weight.shape[0],
        "logits_shape": list(got.shape),
        "max_abs_diff": float((got - ref).abs().max()),
        "allclose": bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-4)),
        "argmax_equal": bool(torch.equal(got.argmax(-1), ref.argmax(-1))),
        "no_allreduce_max_abs_diff": float((broken - ref).abs().max()),
    }
    shard_info = tp.comm.gather(info, root=0)

    # 2. batched requests through the TP engine
    runs = {}
    for name, K, adaptive in RUNS:
        engine = tp_engine(model, drafter, loaded.stop_token_ids, engine_config(K, adaptive), tp)
        if engine is None:
            continue  # a worker: rank 0 has stopped this engine's loop
        runs[name] = serve(engine, prompts)
        tp.stop_workers()

    # 3. high acceptance: multi-token commits and rollback on every rank
    base = tp.comm.bcast(runs["block1"]["outputs"] if tp.rank == 0 else None, root=0)
    OracleProposer.continuations = [p + r for p, r in zip(prompts, base)]
    engine = tp_engine(model, drafter, loaded.stop_token_ids, engine_config(8, False), tp, proposer_cls=OracleProposer)
    if engine is not None:
        runs["oracle8"] = serve(engine, prompts)
        tp.stop_workers()
    tp.shutdown()
    if tp.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"shards": shard_info, "runs": runs}, f)


if __name__ == "__main__":
    main(sys.argv[1])
