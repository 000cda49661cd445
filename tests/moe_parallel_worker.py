"""One rank of ``tests/test_moe_parallel.py``, run as ``mpiexec -n 2 python -m mpi4py
tests/moe_parallel_worker.py IN.json OUT.json`` (``-m mpi4py``: an exception on one rank aborts
the whole job).

``IN.json`` gives the prompts' token ids, the tokens to generate, the DFlash block size and, per
target family (``targets``), a tiny checkpoint saved by transformers (Qwen3-MoE, gpt-oss), its
TP=1 plain-decoding outputs (``reference``) and the modes ``[name, moe_tp_size, moe_ep_size]``.
For each target and mode every rank loads the full target (fp32) and the seeded random drafter, and:
  1. takes the TP=1 logits of one plain forward of the longest prompt;
  2. decodes all prompts greedily as one batch through the TP engine at block size 1, the
     target sharded by ``tp_runner`` from the engine settings' MoE sizes (``EngineArgs``);
  3. takes the sharded forward's gathered logits, and once more with the sparse layers'
     all-reduces switched off (must be far off: shows the comparison can fail);
  4. decodes the prompts again with DFlash (the random drafter, ``block_size``), and with an
     oracle proposer that drafts the reference with every 5th token corrupted (long
     acceptances, rejected tails rolled back on every rank's KV shard).
Rank 0 writes ``{family: {mode: ...}}``: outputs, logit differences and every rank's expert
shapes (and which biases it adds) to OUT.json.
The test starts it with OMP_NUM_THREADS=1; each rank also uses one torch thread.
"""

from __future__ import annotations

import json
import sys

import torch
from helpers import OracleProposer, engine_config
from tp_worker import forward_logits, tp_engine

from dflash_trt.checkpoints.loader import load_target
from dflash_trt.checkpoints.zlab import init_drafter
from dflash_trt.models.moe import MoEBlock
from dflash_trt.runtime.distributed import init_tp
from dflash_trt.runtime.request import Request


def engine_settings(prompts: list[list[int]], max_new: int, block_size: int) -> dict:
    """``EngineArgs`` fields of a batch of ``prompts`` admitted at once: the settings
    ``helpers.make_engine`` picks for the same requests (the TP=1 side passes them too, so both
    run the same iterations)."""
    tpb = 16
    need = sum(-(-(len(p) + max_new + block_size) // tpb) for p in prompts)
    return dict(
        block_size=block_size,
        max_batch_size=len(prompts),
        max_num_tokens=max(sum(len(p) for p in prompts), block_size * len(prompts)),
        tokens_per_block=tpb,
        kv_capacity=need * tpb,
    )


def decode(model, drafter, stops, settings: dict, tp, prompts, max_new, proposer_cls=None) -> dict | None:
    """Rank 0: the outputs, commit lengths and tau of ``prompts`` batched through a TP engine;
    other ranks: None."""
    extra = {} if proposer_cls is None else {"proposer_cls": proposer_cls}
    engine = tp_engine(model, drafter, stops, engine_config(**settings), tp, **extra)
    if engine is None:
        return None
    outs = engine.generate([Request(p, max_new) for p in prompts])
    tp.stop_workers()
    return {
        "outputs": [o.output_ids for o in outs],
        "commit_lengths": [o.commit_lengths for o in outs],
        "tau": engine.stats.tau,
    }


def run_mode(spec: dict, target: dict, moe_tp: int, moe_ep: int, tp) -> dict:
    loaded = load_target(target["checkpoint"], torch.float32)
    model, stops = loaded.model, loaded.stop_token_ids
    drafter = init_drafter(model.cfg, 1, spec["block_size"], 0, seed=0)
    prompts, new = spec["prompts"], spec["max_new"]
    ids = max(prompts, key=len)
    ref = forward_logits(model, ids)  # TP=1
    sizes = dict(tensor_parallel_size=tp.size, moe_tensor_parallel_size=moe_tp, moe_expert_parallel_size=moe_ep)
    plain = decode(model, None, stops, engine_settings(prompts, new, 1) | sizes, tp, prompts, new)
    got = forward_logits(model, ids)
    sparse = [layer for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    groups = [layer.tp for layer in sparse]
    for layer in sparse:
        layer.tp = None  # what a forgotten all-reduce would give
    broken = forward_logits(model, ids)
    for layer, g in zip(sparse, groups):
        layer.tp = g
    dflash_settings = engine_settings(prompts, new, spec["block_size"]) | sizes
    dflash = decode(model, drafter, stops, dflash_settings, tp, prompts, new)
    OracleProposer.continuations = [p + r for p, r in zip(prompts, target["reference"])]
    oracle = decode(model, drafter, stops, dflash_settings, tp, prompts, new, OracleProposer)
    m = sparse[0].mlp
    shard = {
        "rank": tp.rank,
        "gate_up": list(m.gate_up.shape),
        "down": list(m.down.shape),
        "expert_offset": m.expert_offset,
        "moe_intermediate_size": model.cfg.moe_intermediate_size,
        "num_heads": model.cfg.num_heads,
        # gpt-oss: which rank adds the biases that must be added once, the sinks it holds
        "o_bias": model.layers[0].attn.o.bias is not None,
        "down_bias": None if m.down_bias is None else list(m.down_bias.shape),
        "gate_up_bias": None if m.gate_up_bias is None else list(m.gate_up_bias.shape),
        "sinks": None if model.layers[0].attn.sinks is None else len(model.layers[0].attn.sinks),
    }
    return {
        "shards": tp.comm.gather(shard, root=0),
        "logits_max_abs_diff": float((got - ref).abs().max()),
        "logits_max_abs": float(ref.abs().max()),
        "argmax_equal": bool(torch.equal(got.argmax(-1), ref.argmax(-1))),
        "no_allreduce_max_abs_diff": float((broken - ref).abs().max()),
        "plain": plain,
        "dflash": dflash,
        "oracle": oracle,
    }


def main(in_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    tp = init_tp("gloo")
    assert tp is not None and tp.size == 2, "run under mpiexec -n 2"
    with open(in_path) as f:
        spec = json.load(f)
    results = {
        family: {name: run_mode(spec, target, moe_tp, moe_ep, tp) for name, moe_tp, moe_ep in target["modes"]}
        for family, target in spec["targets"].items()
    }
    tp.shutdown()
    if tp.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
