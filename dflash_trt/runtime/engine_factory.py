"""From settings to a running engine: the one place that loads the target and drafter, joins or
starts the tensor-parallel ranks, shards the target, sizes the KV cache and builds the runner
(:meth:`LLMEngine.from_engine_args <dflash_trt.runtime.engine.LLMEngine.from_engine_args>`
calls :func:`create_engine`).

Resolution of what a setting leaves open (``runtime/config.py``): ``dtype`` ``auto`` becomes an
engine directory's build dtype, else the checkpoint's (bf16 for fp32 / bf16 checkpoints);
``kv_capacity`` None the engine's memory plan, else :data:`~.config.DEFAULT_KV_CAPACITY`;
``block_size`` None the drafter's; ``batch_invariant`` None on for fp32 / bf16 CPU targets.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from ..checkpoints.loader import LoadedTarget, parse_dtype
from ..errors import ConfigError, DFlashError
from ..models.drafter import DFlashDrafter
from .config import CacheConfig, EngineConfig, SpeculativeConfig


@dataclass
class LoadedModels:
    """A target (with its tokenizer and stop ids) and its drafter (None for plain decoding),
    loaded once and shared by the engines built on them (e.g. the benchmark's plain-decoding and
    DFlash engines).

    Attributes:
        target: the target and its tokenizer, in the compute dtype, on the engine's device.
        drafter: the DFlash drafter, or None.
        dtype: the compute dtype's name (``fp32`` / ``bf16`` / ``fp16``).
        device: where the models run.
    """

    target: LoadedTarget
    drafter: DFlashDrafter | None
    dtype: str
    device: torch.device

    @classmethod
    def of(cls, target: LoadedTarget, drafter: DFlashDrafter | None = None) -> LoadedModels:
        """Models loaded elsewhere (their dtype and device are the target's)."""
        w = target.model.embed.weight
        name = next(n for n in ("fp32", "bf16", "fp16") if parse_dtype(n) == w.dtype)
        return cls(target, drafter, name, w.device)


def resolve_dtype(config: EngineConfig) -> str:
    """The compute dtype's name: the setting, or for ``auto`` an engine's build dtype, else
    the checkpoint's (``checkpoints/loader.auto_dtype``).

    Raises:
        DFlashError: an unreadable engine manifest or target config.
    """
    from ..checkpoints.loader import auto_dtype

    m = config.model
    return m.dtype if m.dtype != "auto" else auto_dtype(m.engine_dir, m.weights, m.target)


def load_models(config: EngineConfig, rank: int = 0, world_size: int = 1) -> LoadedModels:
    """Load what ``config`` names on its device (tensor-parallel ranks load on the CPU and move
    their shard afterwards): the target, and its drafter when speculative decoding is on.

    Raises:
        DFlashError: missing or corrupt checkpoints, a drafter that does not fit the target,
            weights or dtypes the device cannot run.
    """
    from ..checkpoints.engine_dir import load_models as load_checkpoints
    from ..checkpoints.loader import parse_device, parse_dtype
    from .cuda_graphs import check_cuda_graphs

    m, spec = config.model, config.speculative
    dtype = resolve_dtype(config)
    device = parse_device(m.device)
    check_cuda_graphs(m.cuda_graphs, device, world_size)
    target, drafter = load_checkpoints(
        m.target,
        spec.drafter,
        m.engine_dir,
        parse_dtype(dtype),
        need_drafter=spec.enabled,
        fp8_gemm=m.fp8_gemm,
        weights=m.weights,
        drafter_weights=spec.drafter_weights,
        rank=rank,
        world_size=world_size,
        device=device if world_size == 1 else "cpu",
    )
    return LoadedModels(target, drafter if spec.enabled else None, dtype, device)


def resolve(config: EngineConfig, drafter: DFlashDrafter | None) -> EngineConfig:
    """``config`` with what it leaves open decided: the KV capacity
    (:func:`~dflash_trt.checkpoints.engine_dir.kv_capacity`: an engine directory's memory plan,
    capped, else the default) and the block size (the drafter's, or 1 without one).

    Raises:
        ConfigError: a block size the drafter cannot serve.
        DFlashError: an unreadable engine manifest.
    """
    from ..checkpoints.engine_dir import kv_capacity
    from .engine import check_block_size

    cap, _ = kv_capacity(config.model.engine_dir, config.cache.kv_capacity)
    config = dataclasses.replace(config, cache=CacheConfig(config.cache.tokens_per_block, cap))
    config = config.with_defaults(drafter.cfg.block_size if drafter is not None else None)
    check_block_size(drafter if config.speculative.enabled else None, config.speculative.block_size)
    return config


def create_engine(args, models: LoadedModels | None = None, tp=None):
    """Build an :class:`~.engine.LLMEngine` from ``args`` (``EngineArgs`` or
    :class:`~.config.EngineConfig`).

    Args:
        args: the settings.
        models: targets and drafter already loaded (:func:`load_models`; their dtype and device
            win over ``args``'); None loads them here. A drafter is used only when speculative
            decoding is on in ``args``.
        tp: this rank's tensor-parallel group, or None: the ``mpiexec`` job's group when there
            is one (:func:`~.distributed.init_tp`), else, for ``tensor_parallel_size`` N > 1,
            N - 1 worker processes started here (:func:`~.distributed.spawn_tp`, running
            ``python -m dflash_trt.runtime.tp_worker``).

    Returns:
        the engine on rank 0; None on a tensor-parallel worker rank, once rank 0 has closed its
        engine (the workers mirror every iteration meanwhile; a group joined or started here is
        then shut down, one given in ``tp`` is the caller's to end).

    Raises:
        ConfigError: impossible settings (named by field).
        DFlashError: what loading raises.
    """
    from .distributed import init_tp, spawn_tp

    config = args if isinstance(args, EngineConfig) else args.create_engine_config()
    size = config.parallel.tensor_parallel_size
    own = tp is None  # the group is joined or started here, and ended with the engine
    if own:
        tp = init_tp()
        if tp is not None and size not in (1, tp.size):
            raise ConfigError("tensor_parallel_size", f"is {size} but this mpiexec job has {tp.size} ranks")
        config.parallel.moe_sizes(tp.size if tp is not None else size)  # before any worker starts
        if tp is None and size > 1:
            tp = _spawn_workers(args, size, spawn_tp)
    try:
        engine = _create(config, models, tp)
    except BaseException:
        if tp is not None and tp.rank == 0:
            tp.abort()
        raise
    if engine is None and own:  # a worker rank whose engine rank 0 has closed
        tp.shutdown()
    return engine


def _create(config: EngineConfig, models: LoadedModels | None, tp):
    from .distributed import tp_runner
    from .engine import LLMEngine

    if models is None:
        models = load_models(config, tp.rank if tp else 0, tp.size if tp else 1)
    drafter = models.drafter if config.speculative.enabled else None
    config = resolve(config, drafter)
    target = models.target
    runner = None
    if tp is not None:
        runner = tp_runner(target.model, drafter, config, tp)
        if runner is None:  # a worker rank: rank 0 has closed its engine
            return None
    try:
        engine = LLMEngine(
            target.model,
            drafter,
            tuple(target.stop_token_ids),
            config,
            runner=runner,
            tp=tp,
            calibration_ids=calibration_ids(target.tokenizer),
        )
    except BaseException:
        if tp is not None:
            tp.stop_workers()  # they wait for rank 0's first plan
        raise
    engine.models = models
    return engine


def calibration_ids(tokenizer) -> list[int] | None:
    """:data:`~.engine.CALIBRATION_TEXT` in ``tokenizer``'s ids (an HF tokenizer; special tokens as
    its ``encode`` adds them), for ``LLMEngine(calibration_ids=...)``; None without one."""
    from .engine import CALIBRATION_TEXT

    return None if tokenizer is None else list(tokenizer.encode(CALIBRATION_TEXT))


def _spawn_workers(args, size: int, spawn_tp):
    """Start ranks 1..size-1 as child processes (no MPI) and join them as rank 0; the cores are
    shared: each rank takes ``threads // size`` torch threads."""
    from ..engine_args import EngineArgs

    if not isinstance(args, EngineArgs):
        raise DFlashError("a tensor-parallel engine started without mpiexec needs EngineArgs (sent to its workers)")
    threads = max(1, torch.get_num_threads() // size)
    torch.set_num_threads(threads)
    payload = json.dumps(dataclasses.asdict(args))
    return spawn_tp(size, ["-m", "dflash_trt.runtime.tp_worker", payload, "--threads", str(threads)])


def speculative_off(config: EngineConfig) -> EngineConfig:
    """``config`` for plain decoding (no drafter, block size 1), everything else the same."""
    return dataclasses.replace(config, speculative=SpeculativeConfig(method="none", block_size=1))
