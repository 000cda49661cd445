"""A tensor-parallel worker rank of a served model, started by rank 0 itself (no MPI):
``EngineService`` with ``tp_size N`` runs ``python -m dflash_trt.serving.tp_worker CONFIG_JSON
--threads T --tp-rank r --tp-size N --tp-port P`` for r = 1..N-1 (:func:`dflash_trt.runtime.distributed.spawn_tp`).
The worker loads its shard of the same models, mirrors every engine iteration of rank 0 and
exits when rank 0 closes the service (or dies)."""

from __future__ import annotations

import argparse
import json

import torch


def main(argv: list[str] | None = None) -> None:
    from ..runtime.distributed import join_tp
    from .service import EngineService, ServeConfig

    p = argparse.ArgumentParser(prog="dflash_trt.serving.tp_worker")
    p.add_argument("config", help="the ServeConfig as JSON")
    p.add_argument("--tp-rank", type=int, required=True)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--tp-port", type=int, required=True)
    p.add_argument("--threads", type=int, required=True, help="torch threads (rank 0's share of the cores)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tp = join_tp(a.tp_rank, a.tp_size, a.tp_port)
    EngineService(ServeConfig(**json.loads(a.config)), tp=tp)  # returns once rank 0 stops


if __name__ == "__main__":
    main()
