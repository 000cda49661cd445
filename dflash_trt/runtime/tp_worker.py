"""A tensor-parallel worker rank started by rank 0 itself, without MPI: an engine built with
``tensor_parallel_size`` N outside ``mpiexec`` runs ``python -m dflash_trt.runtime.tp_worker
ENGINE_ARGS_JSON --threads T --tp-rank r --tp-size N --tp-port P`` for r = 1..N-1
(:func:`~dflash_trt.runtime.engine_factory.create_engine`, :func:`~.distributed.spawn_tp`).
The worker loads its shard of the same models, mirrors every engine iteration of rank 0 and
exits when rank 0 closes its engine (or dies)."""

from __future__ import annotations

import argparse
import json

import torch


def main(argv: list[str] | None = None) -> None:
    from ..engine_args import EngineArgs
    from .distributed import join_tp
    from .engine_factory import create_engine

    p = argparse.ArgumentParser(prog="dflash_trt.runtime.tp_worker")
    p.add_argument("engine_args", help="the EngineArgs as JSON")
    p.add_argument("--tp-rank", type=int, required=True)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--tp-port", type=int, required=True)
    p.add_argument("--threads", type=int, required=True, help="torch threads (rank 0's share of the cores)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tp = join_tp(a.tp_rank, a.tp_size, a.tp_port)
    try:
        create_engine(EngineArgs(**json.loads(a.engine_args)), tp=tp)  # returns once rank 0 stops
    finally:
        tp.shutdown()


if __name__ == "__main__":
    main()
