"""Tensor parallelism across MPI ranks: rank set-up, the target's shards, the worker loop.

One process per rank, started by ``mpiexec -n N`` (MPICH from the ``mpich`` wheel, or any MPI
that mpi4py was built against). MPI gives the ranks and the rendezvous; the tensors move over
``torch.distributed`` (gloo on CPU: CPU torch has no MPI backend; NCCL on CUDA):

- :func:`init_tp` -> :class:`TPGroup` (None on a single rank);
- :func:`shard_target` turns a full target into this rank's Megatron-LM shard, in place;
- rank 0 runs the :class:`~.engine.LLMEngine` (scheduler, drafting decisions, acceptance,
  sampling) and sends every :class:`~.model_runner.StepPlan` to the others with
  :meth:`TPGroup.send_plan`; every rank executes it with its own
  :class:`~.model_runner.ModelRunner` (:func:`run_worker` on ranks > 0);
- :func:`tp_runner` wires the three together into a rank's runner.

Sharding (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053 §3: ``ColumnParallelLinear`` /
``RowParallelLinear`` in ``megatron/core/tensor_parallel/layers.py``; vLLM and TensorRT-LLM use
the same split):

==============  ===================================================  =========================
module          this rank holds                                      after it
==============  ===================================================  =========================
``attn.qkv``    rows of its q heads, of its KV heads' k and v        (column-parallel, local)
                (bias rows too: Qwen2, gpt-oss)
``attn.o``      input columns of its q heads; the bias (gpt-oss)     all-reduce (row-parallel)
                on rank 0 only, so the all-reduce adds it once
``attn.sinks``  its q heads' sinks (gpt-oss; TensorRT-LLM            (local)
                ``AttentionBlock.load_weights``)
``mlp.gate_up`` its rows of gate AND its rows of up                  (column-parallel, local)
``mlp.down``    its input columns                                    all-reduce (row-parallel)
MoE ``mlp``     router replicated; its experts' slices (see below)   all-reduce (as ``down``)
``lm_head``     its vocabulary rows                                  all-gather of the logits
``embed``       everything (replicated)                              --
norms           everything (replicated; q_norm / k_norm are per-head
                vectors shared by all heads)                         --
==============  ===================================================  =========================

Attention is split by whole KV heads, as evenly as possible, earlier ranks taking the extra
ones (SmolLM2-135M: 9 query / 3 KV heads; TP=2 gives rank 0 KV heads 0-1 = query heads 0-5 and
rank 1 KV head 2 = query heads 6-8). Each query head stays with its KV group, so attention
needs no communication, and each rank's paged KV pool holds only its own KV heads (the
:class:`~.model_runner.ModelRunner` sizes its pools from ``model.cfg``, which becomes the local
shape). The MLP's intermediate dimension and the vocabulary are split the same way.

The drafter is REPLICATED on every rank: it is 1-5 small layers and latency-bound, so sharding
it would put two all-reduces per layer on the drafting critical path for little GEMM saving;
its input (the target features: full hidden states, identical on every rank after the
all-reduces) is already present everywhere. Rank 0's draft tokens are broadcast
(``ModelRunner.draft``) so every rank verifies exactly the same tokens.

Mixture-of-experts layers (``models/moe.py``; TensorRT-LLM's ``moe_tp_size`` x ``moe_ep_size``
= ``tp_size``, rank r being MoE-TP rank ``r // moe_ep_size`` and EP rank ``r % moe_ep_size`` as in
its ``Mapping``). After attention's all-reduce every rank holds every token's hidden state, so
neither mode exchanges tokens: each rank runs the (replicated) router on all tokens, computes
its part of the routed experts' outputs, and the all-reduce after the MLP sums the parts.

- MoE TP: every expert, but only its intermediate slice ``[i0, i0 + I/moe_tp)``: those rows
  of the gate half and of the up half of ``gate_up`` (the ``[gate; up]`` layout, as the dense
  ``mlp_rows``) and those input columns of ``down`` (Megatron-LM's split of each expert).
  gpt-oss's expert biases: ``gate_up_bias`` sliced as ``gate_up``'s rows; ``down_bias`` kept
  by MoE-TP rank 0 only (added once). The router's bias is replicated with the router.
- EP: experts ``[p * E/moe_ep, (p + 1) * E/moe_ep)`` whole (TensorRT-LLM
  ``Mapping.ep_experts``); a rank evaluates only the (token, slot) pairs routed to its own
  experts (``MoEBlock.expert_offset``), a token routed to none of them contributes zeros;
  an expert's biases go with it, so only its owner adds them.

Weights: from a tp 1 checkpoint or engine each rank loads everything and slices it
(:func:`shard_target`; uneven splits allowed). An engine directory built with
``dflash-trt build --tp N`` (TensorRT-LLM layout, even splits, vocab padded) runs as N ranks,
rank r reading only ``target/rank{r}.safetensors`` (``checkpoints.engine_dir.load_engine``; a
mixture-of-experts engine's rank holds the experts and the intermediate slice of the engine's
``moe_tp_size`` x ``moe_ep_size``, the same split as above);
:func:`attach_engine_shard` gathers its vocab-split embedding once into the replicated one.

Numerics: the row-parallel outputs are summed over ranks in another order than one GEMM sums
them, so logits match the tp 1 model only to rounding (SmolLM2 fp32, TP=2: max |diff| 7e-5 on
logits of magnitude ~20); greedy outputs can differ only where the target's top-2 logits tie.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoints.trtllm import moe_ranks
from ..errors import ConfigError, DFlashError
from ..models.drafter import DFlashDrafter
from ..models.target import TargetModel
from ..quantization.mxfp4 import MXFP4Experts
from .config import EngineConfig, moe_parallel_sizes
from .engine import LLMEngine, check_block_size
from .model_runner import ModelRunner, StepPlan
from .spec_decode.dflash import DFlashProposer

__all__ = [
    "TPEngines",
    "TPGroup",
    "attach_engine_shard",
    "init_tp",
    "join_tp",
    "run_worker",
    "shard_target",
    "spawn_tp",
    "split_sizes",
    "tp_runner",
]


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` contiguous pieces as even as possible, earlier pieces taking
    the extra ones (``split_sizes(3, 2) == [2, 1]``)."""
    return [n // parts + (r < n % parts) for r in range(parts)]


class TPGroup:
    """This rank's view of the tensor-parallel group.

    Collectives go through the default ``torch.distributed`` process group (gloo / NCCL);
    plans go through MPI (``comm.bcast``, pickled). Every method except :meth:`send_plan`,
    :meth:`recv_plan` and :meth:`shutdown` is a collective that every rank must call in the
    same order with tensors of the same shape and dtype.

    Attributes:
        rank, size: this rank and the group size.
        device: where this rank's tensors live (``cpu``, or ``cuda:<local rank>``).
        comm: the mpi4py communicator.
    """

    def __init__(self, comm, rank: int, size: int, device: torch.device, procs: list | None = None):
        self.comm, self.rank, self.size, self.device = comm, rank, size, device
        self._workers_looping = False  # rank 0: the other ranks are in run_worker
        self.procs = procs or []  # rank 0 of a spawned group: the worker processes it started

    # ---- tensor collectives ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (in ``x``'s dtype, as Megatron-LM / vLLM do);
        returns ``x``."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """Concatenate every rank's ``x`` on the last dimension, in rank order.

        Args:
            x: ``[..., n_r]``; all other dimensions equal on every rank; any dtype gloo / NCCL
                take (fp32, bf16, fp16, int64).
            sizes: every rank's ``n_r`` when known (from the sharding); otherwise they are
                gathered first (one more small collective). Uneven sizes are fine: the shards
                are zero-padded to the largest for the gather (gloo's all_gather needs equal
                shapes) and trimmed after.

        Returns:
            ``[..., sum(sizes)]`` on every rank.
        """
        if sizes is None:
            n = torch.tensor([x.shape[-1]], dtype=torch.long, device=x.device)
            ns = [torch.zeros_like(n) for _ in range(self.size)]
            dist.all_gather(ns, n)
            sizes = [int(t) for t in ns]
        m = max(sizes)
        x = x.contiguous()
        if x.shape[-1] < m:
            x = torch.cat([x, x.new_zeros((*x.shape[:-1], m - x.shape[-1]))], dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank (``t`` must have the same shape and dtype everywhere);
        returns the received tensor (``t`` itself, overwritten in place)."""
        dist.broadcast(t, src=0)
        return t

    # ---- plans (rank 0 -> the others, over MPI) ----
    def send_plan(self, plan: StepPlan | None) -> None:
        """Rank 0: hand ``plan`` to every other rank (None ends their :func:`run_worker`)."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends plans")
        self.comm.bcast(plan, root=0)

    def recv_plan(self) -> StepPlan | None:
        """Ranks > 0: the next plan from rank 0 (blocks until it comes); None = stop."""
        if self.rank == 0:
            raise RuntimeError("rank 0 does not receive plans")
        return self.comm.bcast(None, root=0)

    def stop_workers(self) -> None:
        """Rank 0: end the other ranks' :func:`run_worker` loops (no-op when they are not
        looping, and on the other ranks)."""
        if self.rank == 0 and self._workers_looping:
            self._workers_looping = False
            self.send_plan(None)

    def shutdown(self) -> None:
        """Every rank calls it last: rank 0 first stops the workers' loops; then the process
        group is destroyed (MPI itself is finalized by mpi4py at exit)."""
        self.stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in self.procs:  # spawned workers leave by themselves once stopped
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def abort(self) -> None:
        """Rank 0 of a spawned group after an error: kill the workers (they may be waiting in
        a collective that will never come)."""
        for p in self.procs:
            p.kill()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: set by MPI launchers in every rank's environment (MPICH / Hydra: PMI_*; Open MPI; PMIx)
MPI_LAUNCHER_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def init_tp(backend: str | None = None) -> TPGroup | None:
    """Join the tensor-parallel group of this ``mpiexec`` job (single node).

    Rank and size come from ``MPI.COMM_WORLD``; rank 0 picks a free TCP port on 127.0.0.1 and
    broadcasts it over MPI, then every rank joins ``torch.distributed`` there. With NCCL each
    rank takes GPU ``local rank`` (from an MPI shared-memory split); with gloo the tensors stay
    on the CPU. ``GLOO_SOCKET_IFNAME`` defaults to ``lo``.

    Args:
        backend: ``gloo`` / ``nccl``; default NCCL when CUDA is available, else gloo.

    Returns:
        the :class:`TPGroup`, or None when the job has one rank (also when started without
        mpiexec).

    Raises:
        DFlashError: mpi4py (or an MPI library) is not installed; NCCL with more ranks on a
            node than GPUs.
    """
    if not any(v in os.environ for v in MPI_LAUNCHER_VARS):
        return None  # not started by mpiexec: no MPI initialisation at all (e.g. a Triton model)
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise DFlashError(
            f"tensor parallelism needs mpi4py and an MPI library (pip install mpich mpi4py): {e}"
        ) from None
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)  # the ranks on this node
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    port = comm.bcast(_free_port() if rank == 0 else None, root=0)
    device = _init_group(rank, size, port, backend, local_rank, local_size)
    return TPGroup(comm, rank, size, device)


def _init_group(rank: int, size: int, port: int, backend: str | None, local_rank: int, local_size: int):
    """Join ``torch.distributed`` at ``tcp://127.0.0.1:port``; returns this rank's device
    (``cuda:<local rank>`` with NCCL, the default when CUDA is available; else the CPU)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if local_size > gpus:  # NCCL refuses two ranks on one GPU
            raise DFlashError(f"{local_size} ranks on this node but {gpus} GPU(s): start at most one rank per GPU")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    return device


class ObjectComm:
    """``bcast`` of picklable objects over a torch.distributed gloo group: the stand-in for the
    MPI communicator in a group whose ranks rank 0 started itself (:func:`spawn_tp`)."""

    def __init__(self):
        # a worker waits in bcast for the next plan for as long as the server is idle (gloo's
        # default 30-minute timeout would end it); a dead rank 0 takes it down (PR_SET_PDEATHSIG)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))

    def bcast(self, obj, root: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=root, group=self.group)
        return box[0]


def _join(rank: int, size: int, port: int, backend: str | None, procs: list | None = None) -> TPGroup:
    device = _init_group(rank, size, port, backend, rank, size)  # spawned groups live on one node
    return TPGroup(ObjectComm(), rank, size, device, procs)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn_tp(size: int, worker_args: list[str], backend: str | None = None) -> TPGroup:
    """Rank 0 of a TP group of ``size`` ranks whose other ranks this process starts itself,
    without MPI (e.g. inside a Triton Inference Server python-backend model): rank ``r``
    runs ``python WORKER_ARGS --tp-rank r --tp-size N --tp-port P`` and calls
    :func:`join_tp`; plans travel by ``torch.distributed`` object broadcast instead of MPI.
    The workers are killed if this process dies (``PR_SET_PDEATHSIG``).

    Raises:
        DFlashError: ``size < 2``; NCCL with fewer GPUs than ranks.
    """
    if size < 2:
        raise DFlashError(f"a spawned TP group needs tp >= 2, got {size}")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *worker_args, "--tp-rank", str(r), "--tp-size", str(size), "--tp-port", str(port)],
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        for r in range(1, size)
    ]
    try:
        return _join(0, size, port, backend, procs)
    except BaseException:
        for p in procs:
            p.kill()
        raise


def join_tp(rank: int, size: int, port: int, backend: str | None = None) -> TPGroup:
    """Ranks > 0 of a group started by :func:`spawn_tp`."""
    return _join(rank, size, port, backend)


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=like.requires_grad)


@torch.no_grad()
def shard_target(
    model: TargetModel, tp: TPGroup, moe_tp_size: int | None = None, moe_ep_size: int | None = None
) -> TargetModel:
    """Turn a full (tp 1) target into rank ``tp.rank``'s shard, in place (see the module
    docstring for the split). Returns ``model``.

    Afterwards ``model.cfg`` is a copy with the LOCAL ``num_heads``, ``num_kv_heads`` and
    ``intermediate_size`` (``vocab_size`` and ``hidden_size`` stay global: the embedding is
    replicated and the logits are gathered to the full vocabulary), every decoder layer has
    ``layer.tp = tp`` (all-reduce after ``o`` and after ``down``), and ``lm_head`` carries a
    forward hook that all-gathers its vocab-parallel logits, so ``model.lm_head(x)`` returns
    full ``[..., vocab]`` logits on every rank — also when the runner calls it for drafting.
    The forward becomes a collective: every rank must run the same forwards.

    The embedding stays replicated although SmolLM2 ties it to the LM head: a vocab-parallel
    embedding would need one more all-reduce per forward (masked lookup, then a sum) to save
    ``1 - 1/N`` of the embedding per rank (SmolLM2 fp32, TP=2: 57 MB).
    A tied head becomes a separate parameter (the local rows of the embedding).

    A mixture-of-experts target's sparse layers are split by ``moe_tp_size`` x ``moe_ep_size``
    (None: filled in as :func:`~.config.moe_parallel_sizes` does; default MoE TP over all
    ranks); ``model.cfg.moe_intermediate_size`` becomes the local slice, ``num_experts`` stays
    global (the router scores all experts). Dense layers, dense targets: as above (the MoE
    sizes are ignored).

    Raises:
        ConfigError: MoE sizes whose product is not ``tp.size``, a ``moe_ep_size`` that does not
            divide the number of experts, a ``moe_tp_size`` that does not divide each expert's
            intermediate size (one line each, raised before anything is changed).
        DFlashError: ``tp.size`` exceeds the target's KV heads ("tp_size 4 exceeds the
            target's 3 KV heads"), or the model is already sharded.
    """
    cfg = model.cfg
    n, r = tp.size, tp.rank
    if getattr(model, "tp", None) is not None:
        raise DFlashError("the target is already sharded")
    moe = _moe_shard(model, n, r, moe_tp_size, moe_ep_size) if cfg.num_experts else None
    if n > cfg.num_kv_heads:
        raise DFlashError(
            f"tp_size {n} exceeds the target's {cfg.num_kv_heads} KV heads "
            f"(each rank must hold at least one whole KV head)"
        )
    d, H, Hkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    group = H // Hkv
    kv_sizes = split_sizes(Hkv, n)
    k0, nkv = sum(kv_sizes[:r]), kv_sizes[r]
    q0, nq = k0 * group, nkv * group
    i_sizes = split_sizes(inter, n)
    i0, ni = sum(i_sizes[:r]), i_sizes[r]
    v_sizes = split_sizes(cfg.vocab_size, n)
    v0, nv = sum(v_sizes[:r]), v_sizes[r]
    qkv_rows = torch.cat(
        [
            torch.arange(q0 * d, (q0 + nq) * d),
            H * d + torch.arange(k0 * d, (k0 + nkv) * d),
            (H + Hkv) * d + torch.arange(k0 * d, (k0 + nkv) * d),
        ]
    )
    mlp_rows = torch.cat([torch.arange(i0, i0 + ni), inter + torch.arange(i0, i0 + ni)])
    for i, layer in enumerate(model.layers):
        a, m = layer.attn, layer.mlp
        rows = qkv_rows.to(a.qkv.weight.device)
        a.qkv.weight = _param(a.qkv.weight[rows], a.qkv.weight)
        if a.qkv.bias is not None:
            a.qkv.bias = _param(a.qkv.bias[rows], a.qkv.bias)
        a.qkv.out_features = len(rows)
        a.o.weight = _param(a.o.weight[:, q0 * d : (q0 + nq) * d], a.o.weight)
        a.o.in_features = nq * d
        if a.o.bias is not None and r:
            a.o.bias = None  # added once: rank 0's partial sum carries it into the all-reduce
        if a.sinks is not None:
            a.sinks = _param(a.sinks[q0 : q0 + nq], a.sinks)
        a.h, a.hkv = nq, nkv
        if cfg.is_moe_layer(i):
            _shard_experts(m, *moe)
            continue
        m.gate_up.weight = _param(m.gate_up.weight[mlp_rows.to(m.gate_up.weight.device)], m.gate_up.weight)
        m.gate_up.out_features = 2 * ni
        m.down.weight = _param(m.down.weight[:, i0 : i0 + ni], m.down.weight)
        m.down.in_features = ni
        m.intermediate = ni
    head = model.lm_head
    head.weight = _param(head.weight[v0 : v0 + nv], head.weight)  # unties a tied head
    head.out_features = nv
    local = dict(num_heads=nq, num_kv_heads=nkv, intermediate_size=ni)
    if cfg.num_experts:
        local["moe_intermediate_size"] = moe[3]
    model.cfg = dataclasses.replace(cfg, **local)
    return _wire(model, tp, v_sizes)


#: what :func:`_shard_experts` knows how to split (or keep whole: the router) in a MoE block
_EXPERT_PARAMS = {"gate.weight", "gate.bias", "gate_up", "down", "gate_up_bias", "down_bias"}


def _moe_shard(model: TargetModel, n: int, r: int, moe_tp: int | None, moe_ep: int | None) -> tuple[int, int, int, int]:
    """Rank ``r``'s part of every sparse layer of ``model`` on ``n`` ranks: ``(first expert,
    experts, first intermediate column, intermediate columns)`` (module docstring).

    Raises:
        ConfigError: see :func:`shard_target`.
        DFlashError: a MoE block with parameters this split does not know (it would not know
            whether to slice them or add them once).
    """
    cfg = model.cfg
    moe_tp, moe_ep = moe_parallel_sizes(n, moe_tp, moe_ep)
    for i, layer in enumerate(model.layers):
        extra = {name for name, _ in layer.mlp.named_parameters()} - _EXPERT_PARAMS if cfg.is_moe_layer(i) else ()
        if extra:
            raise DFlashError(
                f"tensor parallelism over the experts' {', '.join(sorted(extra))} of a {cfg.family} target "
                f"is not supported yet"
            )
    E, inter = cfg.num_experts, cfg.moe_intermediate_size
    if E % moe_ep:
        raise ConfigError("moe_expert_parallel_size", f"{moe_ep} does not divide the {cfg.family} target's {E} experts")
    if inter % moe_tp:
        raise ConfigError(
            "moe_tensor_parallel_size",
            f"{moe_tp} does not divide the {cfg.family} target's expert intermediate size {inter}",
        )
    ne, ni = E // moe_ep, inter // moe_tp
    tp_rank, ep_rank = moe_ranks(r, moe_ep)
    return ep_rank * ne, ne, tp_rank * ni, ni


def _shard_experts(m, e0: int, ne: int, i0: int, ni: int) -> None:
    """Keep experts ``[e0, e0 + ne)`` of the MoE block ``m`` (a ``models.moe.MoEBlock``), and of
    each its intermediate slice ``[i0, i0 + ni)``: rows of the gate and the up half of
    ``gate_up [E, 2 * I, hidden]`` (and of ``gate_up_bias [E, 2 * I]``), input columns of
    ``down [E, hidden, I]``. ``down_bias [E, hidden]`` (gpt-oss) is a whole-output term: only
    the first MoE-TP rank (``i0 == 0``) keeps its experts' rows, the others drop it, so the
    all-reduce adds it once (OpenAI's reference ``gpt_oss/torch/model.py`` MLPBlock; vLLM loads
    ``down_proj_bias`` on one rank)."""
    inter = m.intermediate
    rows = torch.cat([torch.arange(i0, i0 + ni), inter + torch.arange(i0, i0 + ni)]).to(m.gate_up.device)
    if isinstance(m.gate_up, MXFP4Experts):  # kept packed: the same slices of the codes and scales
        m.gate_up = m.gate_up.select(slice(e0, e0 + ne), rows=rows)
        m.down = m.down.select(slice(e0, e0 + ne), cols=slice(i0, i0 + ni))
    else:
        m.gate_up = _param(m.gate_up[e0 : e0 + ne, rows], m.gate_up)
        m.down = _param(m.down[e0 : e0 + ne, :, i0 : i0 + ni], m.down)
    if m.gate_up_bias is not None:
        m.gate_up_bias = _param(m.gate_up_bias[e0 : e0 + ne, rows], m.gate_up_bias)
    if m.down_bias is not None:
        m.down_bias = _param(m.down_bias[e0 : e0 + ne], m.down_bias) if i0 == 0 else None
    m.intermediate, m.expert_offset = ni, e0


def _wire(model: TargetModel, tp: TPGroup, vocab_sizes: list[int]) -> TargetModel:
    """Make a shard's forward collective: every layer all-reduces after ``o`` and ``down``, and
    the LM head's rows (``vocab_sizes[r]`` on rank r) are all-gathered to the full vocabulary
    (``model.cfg.vocab_size``; padding rows past it are dropped)."""
    vocab = model.cfg.vocab_size
    for layer in model.layers:
        layer.tp = tp
    model.lm_head.register_forward_hook(lambda _mod, _inp, out: tp.all_gather_last(out, vocab_sizes)[..., :vocab])
    model.tp = tp
    return model


def run_worker(runner: ModelRunner, tp: TPGroup) -> None:
    """Ranks > 0: execute rank 0's plans until it sends None (:meth:`TPGroup.stop_workers`)."""
    while (plan := tp.recv_plan()) is not None:
        runner.step(plan)


def tp_runner(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    config: EngineConfig,
    tp: TPGroup,
    proposer_cls: type[DFlashProposer] = DFlashProposer,
) -> ModelRunner | None:
    """Shard ``target`` (in place) and build this rank's :class:`ModelRunner` on ``tp``.

    Every rank calls it with the same arguments (the full target, the same drafter, the same
    config). Rank 0 gets its runner back, for the :class:`LLMEngine` that
    :func:`~.engine_factory.create_engine` builds around it; every iteration of that engine is
    mirrored by the other ranks, which loop in :func:`run_worker` here and return None once
    rank 0 calls ``tp.stop_workers()`` (or ``tp.shutdown()``). Call ``tp.shutdown()`` on every
    rank at the end.

    Order: the workers enter their loop right after building their runner, so they are waiting
    in the plan broadcast when rank 0's engine constructor sends its first plans
    (:meth:`LLMEngine.calibrate` in adaptive mode); MPI's bcast blocks both sides until they
    meet. Rank 0 must stop the workers (``tp.stop_workers()``) when its engine's constructor
    raises.

    Args:
        target: the full target (sharded here unless ``target.tp`` is already set); it is moved
            to ``tp.device``, as is the drafter.
        config: the engine's settings (block size defaults to the drafter's; a
            mixture-of-experts target is split by its ``parallel`` MoE sizes).
        proposer_cls: the draft proposer (a test may substitute its own; it must propose the
            same drafts on every rank).

    Raises:
        ConfigError: MoE sizes that do not fit the target or the group (:func:`shard_target`).
        DFlashError: a bad block size (on every rank), tp_size above the KV heads. An error on
            one rank in the middle of a step leaves the others waiting in a collective: run
            under ``python -m mpi4py`` so that an uncaught exception aborts the whole job.
    """
    config = config.with_defaults(drafter.cfg.block_size if drafter else None)
    K = config.speculative.block_size
    check_block_size(drafter, K)
    if getattr(target, "engine_shard", None) is not None:
        par = config.parallel  # a tp_size N engine: this rank read its own file
        attach_engine_shard(target, tp, par.moe_tensor_parallel_size, par.moe_expert_parallel_size)
    elif getattr(target, "tp", None) is None:  # a tp_size 1 checkpoint: split it here
        par = config.parallel
        shard_target(target, tp, par.moe_tensor_parallel_size, par.moe_expert_parallel_size)
    if drafter is not None:
        drafter.to(tp.device)
    target.to(tp.device)
    runner = ModelRunner(target, drafter if K > 1 else None, config, tp=tp, proposer_cls=proposer_cls)
    if tp.rank != 0:
        run_worker(runner, tp)
        return None
    tp._workers_looping = True
    return runner


class TPEngines:
    """Engines built one after another on the same TP group, driven by rank 0 (e.g. the load
    benchmark's DFlash and plain-decoding engines under ``mpiexec -n N dflash-trt bench``).

    Rank 0 calls :meth:`make` for each engine (the previous one's workers are stopped first)
    and :meth:`close` at the end; the other ranks call :meth:`serve`, which mirrors every
    :meth:`make` with :func:`~.engine_factory.create_engine` and returns after :meth:`close`.
    Commands travel by MPI bcast in the same order as the plans, so both sides always agree on
    what comes next.

    Args:
        models: this rank's loaded models (:func:`~.engine_factory.load_models`; the full
            target is sharded in place by the first engine).
        tp: the TP group.
    """

    def __init__(self, models, tp: TPGroup):
        self.models, self.tp = models, tp

    def make(self, args) -> LLMEngine:
        """Rank 0: a new engine from ``args`` (``EngineArgs``) mirrored on every rank (the
        previous one stops serving)."""
        from .engine_factory import create_engine

        self.tp.stop_workers()
        self.tp.comm.bcast(("engine", args), root=0)
        return create_engine(args, self.models, self.tp)

    def serve(self) -> None:
        """Ranks != 0: build and serve each engine rank 0 makes, until :meth:`close`."""
        from .engine_factory import create_engine

        while (cmd := self.tp.comm.bcast(None, root=0)) is not None:
            create_engine(cmd[1], self.models, self.tp)

    def close(self) -> None:
        """Rank 0: stop the last engine's workers and end :meth:`serve` on the other ranks."""
        self.tp.stop_workers()
        self.tp.comm.bcast(None, root=0)


@torch.no_grad()
def attach_engine_shard(
    model: TargetModel, tp: TPGroup, moe_tp_size: int | None = None, moe_ep_size: int | None = None
) -> TargetModel:
    """Make a target shard read from a tp_size N engine (``load_engine(..., rank=r,
    world_size=N)``: rank r's own file only) runnable on the group: the vocab-parallel
    embedding rows are gathered into a full, replicated embedding (as :func:`shard_target`
    keeps it), every layer all-reduces after ``o`` and ``down`` (a sparse layer after its
    experts, whose split the engine fixed), and the LM head's local rows are gathered to full
    logits (the vocabulary padding trimmed). Returns ``model``.

    Args:
        moe_tp_size, moe_ep_size: the run's MoE sizes (``ParallelConfig``), None when not set; a
            mixture-of-experts engine's rank files fix its split, so set ones must be the engine's.

    Raises:
        DFlashError: the shard was written for another rank or group size.
        ConfigError: MoE sizes set for the run that are not the engine's.
    """
    sh = model.engine_shard
    if (sh.rank, sh.tp_size) != (tp.rank, tp.size):
        raise DFlashError(f"engine shard of rank {sh.rank}/{sh.tp_size} loaded on rank {tp.rank}/{tp.size}")
    if sh.moe is not None and (moe_tp_size, moe_ep_size) != (None, None):
        want = moe_parallel_sizes(tp.size, moe_tp_size, moe_ep_size)
        if want != sh.moe:
            raise ConfigError(
                "moe_expert_parallel_size",
                f"{want[1]} x moe_tensor_parallel_size {want[0]} differs from the engine's moe_ep_size {sh.moe[1]} "
                f"x moe_tp_size {sh.moe[0]} (its rank files fix the split): leave both unset or rebuild the engine",
            )
    rows = sh.embed_rows.to(tp.device)
    full = tp.all_gather_last(rows.t().contiguous()).t()[: model.cfg.vocab_size]
    model.embed.weight.copy_(full)
    del model.engine_shard
    return _wire(model, tp, [model.lm_head.out_features] * tp.size)
