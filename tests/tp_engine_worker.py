"""One rank of ``test_tp.py::test_tp3_engine_rank_files`` and ``test_moe_engine.py``:
``mpiexec -n N python -m mpi4py tests/tp_engine_worker.py ENGINE_DIR OUT.json [BLOCK_SIZES]``.
Each rank loads only its own target rank file of a tp_size N engine (``load_engine(..., rank=r,
world_size=N)``), the TP engine gathers the vocab-parallel embedding and wires the all-reduces,
and real prompts are decoded greedily with the block sizes ``BLOCK_SIZES`` (comma-separated,
default ``1,8``); rank 0 writes the outputs, every rank's heads and, for a mixture-of-experts
target, every rank's experts of the first sparse layer (``gate_up`` / ``down`` shapes and
``expert_offset``)."""

from __future__ import annotations

import json
import sys

import torch
from tp_worker import MAX_NEW, engine_config, prompts_for, tp_engine

from dflash_trt.checkpoints.engine_dir import load_engine
from dflash_trt.models.moe import MoEBlock
from dflash_trt.runtime.distributed import init_tp
from dflash_trt.runtime.request import Request


def main(engine_dir: str, out_path: str, block_sizes: str = "1,8") -> None:
    torch.set_num_threads(1)
    tp = init_tp()
    target, drafter, _ = load_engine(engine_dir, torch.float32, rank=tp.rank, world_size=tp.size)
    shard_heads = target.model.cfg.num_heads
    sparse = [layer.mlp for layer in target.model.layers if isinstance(layer.mlp, MoEBlock)]
    m = sparse[0] if sparse else None
    experts = m and {"gate_up": list(m.gate_up.shape), "down": list(m.down.shape), "offset": m.expert_offset}
    prompts = prompts_for(target.tokenizer)[:3]
    outputs = {}
    for K in map(int, block_sizes.split(",")):
        engine = tp_engine(target.model, drafter, target.stop_token_ids, engine_config(K, False), tp)
        if engine is None:
            continue
        sids = [engine.add_request(Request(p, MAX_NEW)) for p in prompts]
        engine.run()
        outputs[K] = [engine.result(s).output_ids for s in sids]
        tp.stop_workers()
    heads = tp.comm.gather(shard_heads, root=0)
    experts = tp.comm.gather(experts, root=0)
    tp.shutdown()
    if tp.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"outputs": outputs, "heads_per_rank": heads, "experts_per_rank": experts}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
