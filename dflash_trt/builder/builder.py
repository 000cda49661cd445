"""``dflash-trt build``: target + drafter -> engine directory (validate, calibrate, quantize, shard, write).

Engine directory (written into a temporary sibling, renamed into place at the end; a failed
build leaves nothing at the output path)::

    engine.json                 manifest: versions, build config, source checksums, memory plan,
                                every file with its sha256
    target/config.json          TensorRT-LLM checkpoint of the target (LlamaForCausalLM /
    target/rank{r}.safetensors  Qwen2ForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM: experts
                                split by moe_tp_size x moe_ep_size), one file per TP rank
    drafter/config.json         the drafter in the same layout (architecture DFlashDraftModel,
    drafter/rank{r}.safetensors z-lab dflash_config keys in config.json)
    hf/target/                  unified HF checkpoint (ModelOpt ``export_hf_checkpoint`` layout:
                                ``hf_quant_config.json``, ``quantization_config``), + tokenizer;
                                for gpt-oss the only target checkpoint (no ``target/``: TensorRT-LLM
                                has no gpt-oss converter and runs it from the HF layout)
    hf/drafter/                 the z-lab drafter, quantized the same way
    trtllm/llm_api.yaml         ``speculative_config: {decoding_type: DFlash, ...}`` for
                                ``trtllm-serve`` / ``LLM(...)`` on TensorRT-LLM releases with DFlash
    trtllm/build.sh             the ``trtllm-build`` command line for the target (1.2.x)
    trtllm/plugins.json         the drafter plugins (``plugins/dflash_plugins.py``) and the AOT
                                kernel variants this drafter launches
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import atomic_dir, write_json
from ..checkpoints import trtllm
from ..checkpoints.engine_dir import ENGINE_FORMAT, ENGINE_VERSION
from ..checkpoints.loader import LoadedTarget, dtype_name
from ..checkpoints.sources import sha256_file
from ..errors import DFlashError
from ..models.config import DrafterConfig, TargetConfig
from ..models.drafter import DFlashDrafter
from ..quantization.common import HF_SUFFIX, QuantizedLinear, linear_rows, needs_calibration, weight_format
from .config import BuildConfig
from .plan import MemoryPlan, memory_plan

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
#: families TensorRT-LLM runs from the HF layout only (no checkpoint converter): the build writes
#: the unified HF checkpoint of the target and no ``target/`` TensorRT-LLM checkpoint
HF_ONLY_ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
#: TensorRT-LLM ``MoeConfig.ExpertScaleNormalizationMode``: NONE (softmax over all experts, top-k
#: as is) and RENORMALIZE (the top-k renormalised to sum to 1: HF ``norm_topk_prob``)
MOE_NORMALIZATION = {False: 0, True: 1}


def quantize_model(
    sd: dict[str, torch.Tensor],
    specs: list[trtllm.TensorSpec],
    fmt: str,
    amax: dict[str, float],
    progress: bool = False,
    desc: str = "quantize",
    group_size: int = 32,
) -> dict[str, QuantizedLinear]:
    """``{spec.source: QuantizedLinear}`` for every linear of ``specs`` in weight format ``fmt``
    (:attr:`~dflash_trt.quantization.common.WeightFormat.quantize`; whole fused sources: the
    gate/up halves are quantized together and sliced later, fused members share per-tensor
    scales as ModelOpt's exports make them). FP8 / NVFP4 take the largest calibrated input range
    ``amax`` of the source's modules; int4 / int8 are weight-only (``group_size`` for int4) and
    read no ``amax``.

    Raises:
        DFlashError: a linear without a calibrated activation range.
    """
    from tqdm import tqdm

    wf = weight_format(fmt)
    out: dict[str, QuantizedLinear] = {}
    todo = [s for s in specs if s.linear]
    for s in tqdm(todo, desc=desc, unit="linear", disable=not progress, file=sys.stderr):
        if s.source in out:
            continue
        act_amax = None
        if not wf.weight_only:
            mods = s.module.split("|")
            missing = [m for m in mods if m not in amax]
            if missing:
                raise DFlashError(f"no calibrated activation range for {missing[0]}")
            act_amax = max(amax[m] for m in mods)
        w = trtllm.gather_source(sd, s.source).float()
        if w.dim() == 3:  # stacked experts
            out[s.source] = quantize_experts(w, wf, act_amax, group_size, shared=s.split == trtllm.HF_EXPERTS)
        else:
            out[s.source] = wf.quantize(w, act_amax, group_size)
    return out


def quantize_experts(
    w: torch.Tensor, wf, act_amax: float | None, group_size: int, shared: bool = False
) -> QuantizedLinear:
    """Stacked experts ``w [E, out, in]`` quantized one expert at a time (each expert's fused
    gate/up rows share its per-tensor scales), stacked on a leading expert axis: per-row tensors
    ``[E, out, ...]``, per-expert scales ``[E, 1]``, and one activation scale ``[1]`` (every
    expert took the same calibrated input range; TensorRT-LLM's MoE keeps one per GEMM).
    ``shared``: all experts as one ``[E * out, in]`` linear instead, so one per-tensor scale
    ``[1]`` covers them all (ModelOpt's export of fused ``[E, in, out]`` experts: gpt-oss).

    Raises:
        DFlashError: a weight-only CPU format (int4 / int8), which has no expert layout.
    """
    if wf.weight_only:
        raise DFlashError(f"{wf.name} expert weights are not supported: use fp8, nvfp4 or none")
    if shared:
        q = wf.quantize(w.reshape(-1, w.shape[-1]), act_amax, group_size)
        return {k: v.reshape(w.shape[0], w.shape[1], -1) if v.dim() == 2 else v for k, v in q.items()}
    per = [wf.quantize(w[e], act_amax, group_size) for e in range(w.shape[0])]
    return {k: per[0][k] if k == "activation_scaling_factor" else torch.stack([q[k] for q in per]) for k in per[0]}


def linear_tensors(
    spec: trtllm.TensorSpec, sd: dict[str, torch.Tensor], qlin: dict[str, QuantizedLinear], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``{suffix: tensor}`` of one spec over its full range: ``{"": weight}`` unquantized, or
    the quantized tensors (``weight``, scales)."""
    if spec.source in qlin:
        q = qlin[spec.source]
        if spec.expert is not None:  # one expert of stacked experts: [E, ...] tensors indexed, [1] shared
            q = {k: v[spec.expert] if v.dim() >= 2 else v for k, v in q.items()}
        if spec.swap_halves:  # per-row tensors of stacked experts [E, rows, ...]
            q = {k: trtllm.swap_halves(v, 1) if v.dim() == 3 else v for k, v in q.items()}
        if spec.interleave:
            q = {k: trtllm.interleave_halves(v, 1) if v.dim() == 3 else v for k, v in q.items()}
        return linear_rows(q, *spec.rows) if spec.rows else q
    return {"": trtllm.gather(sd, spec).to(torch.float32 if spec.dtype == "fp32" else dtype)}


def rank_tensors(
    specs: list[trtllm.TensorSpec],
    sd: dict[str, torch.Tensor],
    qlin: dict[str, QuantizedLinear],
    dtype: torch.dtype,
    tp: int,
    rank: int,
    qkv: tuple[int, int, int],
    moe: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """TRT-LLM tensors of rank ``rank`` (``moe``: ``(moe_tp_size, moe_ep_size)`` for stacked experts;
    default ``(tp, 1)``)."""
    out = {}
    mtp, mep = moe or (tp, 1)
    for s in specs:
        base = s.name[: -len(".weight")] if s.name.endswith(".weight") else s.name
        for suffix, t in linear_tensors(s, sd, qlin, dtype).items():
            if s.split in (trtllm.EXPERT_FC, trtllm.EXPERT_PROJ):
                out[s.name if suffix in ("", "weight") else f"{base}.{suffix}"] = trtllm.shard_experts(
                    t, s.split, mtp, mep, rank
                )
            elif suffix == "":
                out[s.name] = trtllm.shard(t, s.split, tp, rank, qkv)
            elif suffix == "weight":
                out[s.name] = trtllm.shard(t, s.split, tp, rank, qkv, col_unit=2 if t.dtype == torch.uint8 else 1)
            elif t.dim() == 2:  # NVFP4 block scales (int4 / int8 scales: tp 1) follow the weight's rows
                out[f"{base}.{suffix}"] = trtllm.shard(t, s.split, tp, rank, qkv, col_unit=16)
            else:
                out[f"{base}.{suffix}"] = t.clone()
    return out


def _decoder_keys(cfg: TargetConfig | DrafterConfig, bc: BuildConfig, quant: str) -> dict:
    """TRT-LLM ``PretrainedConfig`` keys shared by the target and the drafter (both are RoPE
    decoder stacks with RMSNorm and a SiLU-gated MLP)."""
    return {
        "dtype": dtype_name(bc.dtype),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_size": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": cfg.rope_theta,
        "rotary_scaling": cfg.rope_scaling,
        "attn_bias": cfg.attention_bias,
        "mapping": {"world_size": bc.tp_size, "tp_size": bc.tp_size, "pp_size": 1},
        "quantization": quant_algos(quant, bc.kv_cache_dtype, _exclude(bc, quant, cfg), bc.group_size),
    }


def _moe_keys(cfg: TargetConfig, bc: BuildConfig) -> dict:
    """TensorRT-LLM ``QWenConfig`` keys of a Qwen3-MoE target (``models/qwen/config.py``) and the
    expert split of ``mapping``. ``normalization_mode`` follows HF ``norm_topk_prob``
    (TensorRT-LLM's own converter writes NONE whatever it says)."""
    mtp, mep = bc.moe_split
    return {
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "moe": {
            "num_experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_tok,
            "normalization_mode": MOE_NORMALIZATION[cfg.norm_topk_prob],
            "shared_expert_intermediate_size": 0,
        },
        "mapping": {
            "world_size": bc.tp_size,
            "tp_size": bc.tp_size,
            "pp_size": 1,
            "moe_tp_size": mtp,
            "moe_ep_size": mep,
        },
    }


def _exclude(bc: BuildConfig, quant: str, cfg: TargetConfig | DrafterConfig) -> list[str] | None:
    """``exclude_modules``: the LM head, unless a target's ``head_quant`` packs it; a
    mixture-of-experts target's router (TensorRT-LLM's default list, which an explicit one
    replaces, has ``*router``)."""
    if quant == "none":
        return None
    out = [] if isinstance(cfg, TargetConfig) and bc.head_quant != "none" else ["lm_head"]
    return out + (["*router"] if getattr(cfg, "num_experts", 0) else [])


def target_trtllm_config(cfg: TargetConfig, bc: BuildConfig) -> dict:
    """TRT-LLM ``config.json`` of the target (``PretrainedConfig`` / ``LLaMAConfig`` / ``QWenConfig`` keys)."""
    c = {
        "architecture": ARCHITECTURES[cfg.family],
        "logits_dtype": "float32",
        **_decoder_keys(cfg, bc, bc.target_quant),
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "mlp_bias": False,
        "qk_layernorm": cfg.qk_norm,
    }
    if cfg.family in ("qwen2", "qwen3", "qwen3_moe"):
        c.update(qwen_type=cfg.family, seq_length=bc.max_seq_len)
    if cfg.num_experts:
        c.update(_moe_keys(cfg, bc))
    return c


def drafter_trtllm_config(cfg: DrafterConfig, bc: BuildConfig) -> dict:
    """The drafter's ``config.json`` in the same layout (architecture ``DFlashDraftModel``)."""
    return {
        "architecture": "DFlashDraftModel",
        **_decoder_keys(cfg, bc, bc.drafter_quant),
        "qk_layernorm": True,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "sliding_window": cfg.sliding_window,
        "layer_types": cfg.layer_type_names,
        "causal_layers": [c for c, _ in cfg.layer_kinds],
        "dflash_config": {
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    }


def quant_algos(fmt: str, kv: str, exclude: list[str] | None, group_size: int = 32) -> dict:
    """The quantization block both TensorRT-LLM's ``config.json`` and ModelOpt's
    ``hf_quant_config.json`` carry: ``quant_algo``, ``kv_cache_quant_algo``, ``exclude_modules``,
    and the format's own keys (:attr:`~dflash_trt.quantization.common.WeightFormat.trtllm_keys`:
    ``group_size`` 16 for NVFP4; int4 / int8: ``group_size`` and ``has_zero_point``)."""
    wf = None if fmt == "none" else weight_format(fmt)
    q = {
        "quant_algo": None if wf is None else wf.quant_algo,
        "kv_cache_quant_algo": "FP8" if kv == "fp8" else None,
        "exclude_modules": exclude,
    }
    return q if wf is None else q | wf.trtllm_keys(group_size)


# --------------------------------------------------------------------------------------------
# unified HF checkpoint (ModelOpt export_hf_checkpoint layout)
# --------------------------------------------------------------------------------------------


def hf_tensors(
    specs: list[trtllm.TensorSpec], sd: dict[str, torch.Tensor], qlin: dict[str, QuantizedLinear], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Unified-HF tensors: ``x.weight`` (+ ``x.weight_scale``, ``x.weight_scale_2``, ``x.input_scale``, 0-d)."""
    out = {}
    for s in specs:
        fused = s.split == trtllm.HF_EXPERTS  # transformers' [E, in, out] experts: name_weight_scale ...
        base, sep = (s.name, "_") if fused else (s.name[: -len(".weight")], ".")
        for suffix, t in linear_tensors(s, sd, qlin, dtype).items():
            if fused and t.dim() == 3:
                t = t.transpose(1, 2)
            if suffix in ("", "weight"):
                out[s.name] = t.contiguous()
            else:
                out[f"{base}{sep}{HF_SUFFIX[suffix]}"] = (
                    t.reshape(()) if t.numel() == 1 and t.dim() == 1 else t.contiguous()
                )
    return out


def hf_quant_config(fmt: str, kv: str, exclude: list[str], group_size: int = 32) -> dict | None:
    """``hf_quant_config.json`` content (ModelOpt 0.47 ``get_quant_config``), None when nothing is quantized."""
    q = quant_algos(fmt, kv, sorted(exclude), group_size)
    if q["quant_algo"] is None and q["kv_cache_quant_algo"] is None:
        return None
    return {"producer": {"name": "dflash-trt", "version": _version("dflash-trt")}, "quantization": q}


def hf_quantization_config(fmt: str, kv: str, exclude: list[str], group_size: int = 32) -> dict | None:
    """``config.json`` ``quantization_config``
    (:attr:`~dflash_trt.quantization.common.WeightFormat.hf_config`: ModelOpt's
    ``convert_hf_quant_config_format`` for FP8 / NVFP4, our own layout for int4 / int8), None
    when the weights are not quantized."""
    if fmt == "none":
        return None
    producer = {"name": "dflash-trt", "version": _version("dflash-trt")}
    return weight_format(fmt).hf_config(group_size, kv, sorted(exclude), producer)


# --------------------------------------------------------------------------------------------
# TRT-LLM commands
# --------------------------------------------------------------------------------------------


def trtllm_build_command(bc: BuildConfig) -> str:
    """The ``trtllm-build`` line for ``target/`` (TensorRT-LLM 1.2.x ``commands/build.py`` flags)."""
    gemm = "auto" if bc.target_quant == "none" else weight_format(bc.target_quant).gemm_plugin
    return (
        f"trtllm-build --checkpoint_dir target --output_dir trtllm/engine/target --gemm_plugin {gemm} "
        f"--max_batch_size {bc.max_batch_size} --max_seq_len {bc.max_seq_len} --max_num_tokens {bc.max_num_tokens} "
        f"--kv_cache_type paged --tokens_per_block {bc.tokens_per_block} --use_paged_context_fmha enable "
        f"--workers {bc.tp_size}"
    )


def llm_api_yaml(bc: BuildConfig, dcfg: DrafterConfig, moe: bool = False) -> str:
    """``trtllm-serve hf/target --extra_llm_api_options trtllm/llm_api.yaml`` options
    (``DFlashDecodingConfig``, TensorRT-LLM >= 1.3, PyTorch backend; ``moe``: the target has
    experts, split by ``moe_tensor_parallel_size`` / ``moe_expert_parallel_size``)."""
    import yaml

    options = {
        "tensor_parallel_size": bc.tp_size,
        **({"moe_tensor_parallel_size": bc.moe_split[0], "moe_expert_parallel_size": bc.moe_split[1]} if moe else {}),
        "max_batch_size": bc.max_batch_size,
        "max_seq_len": bc.max_seq_len,
        "max_num_tokens": bc.max_num_tokens,
        "kv_cache_config": {
            "free_gpu_memory_fraction": bc.gpu_memory_fraction,
            "tokens_per_block": bc.tokens_per_block,
            "dtype": "fp8" if bc.kv_cache_dtype == "fp8" else "auto",
        },
        "speculative_config": {
            "decoding_type": "DFlash",
            "max_draft_len": bc.block_size - 1,
            "speculative_model": "hf/drafter",
            "target_layer_ids": list(dcfg.target_layer_ids),
            "mask_token_id": dcfg.mask_token_id,
        },
    }
    head = (
        "# TensorRT-LLM LLM-API options (PyTorch backend, releases with DFlashDecodingConfig, >= 1.3):\n"
        f"#   trtllm-serve hf/target --tp_size {bc.tp_size} --extra_llm_api_options trtllm/llm_api.yaml\n"
    )
    return head + yaml.safe_dump(options, sort_keys=False)


def plugins_json(bc: BuildConfig, dcfg: DrafterConfig) -> dict:
    """``trtllm/plugins.json``: the TensorRT plugins of the drafter, their attributes and the
    kernel variants (:mod:`dflash_trt.kernels.plugin_abi` names) this drafter's shapes launch.
    ``unsupported`` lists, one line each, what ``dflash-trt kernels-aot`` does not compile for
    this build (a variant, or a KV-cache block size other than the kernels'): empty when the
    plugins can run it; the torch runtime is unaffected either way."""
    from ..kernels import plugin_abi as abi

    d, hkv, g = dcfg.head_dim, dcfg.num_kv_heads, dcfg.num_heads // dcfg.num_kv_heads
    kernels = [
        abi.context_kv_variant(d, hkv, dcfg.rms_norm_eps),
        abi.block_attention_variant(d, g, bc.block_size),
        abi.ACCEPT_VARIANT,
    ]
    unsupported = [f"kernel variant {k} is not compiled ahead of time" for k in kernels if k not in abi.variant_names()]
    if dcfg.causal_layers:
        unsupported.append("causal drafter layers: dflash::block_attention attends non-causally")
    if bc.tokens_per_block != abi.AOT_TOKENS_PER_BLOCK:
        unsupported.append(
            f"tokens_per_block {bc.tokens_per_block}: the AOT kernels read {abi.AOT_TOKENS_PER_BLOCK} per KV block"
        )
    return {
        "library": "plugins/dflash_plugins.py",
        "plugins": ["dflash::context_kv", "dflash::block_attention", "dflash::accept"],
        "kernels": kernels,
        "kernels_dir": "DFLASH_TRT_KERNELS_DIR (from: dflash-trt kernels-aot --out DIR)",
        "tokens_per_block": bc.tokens_per_block,
        "sliding_window": dcfg.sliding_window or 0,
        # per layer: the window block_attention gets (0: the whole context)
        "layer_windows": [w or 0 for _, w in dcfg.layer_kinds],
        "rms_norm_eps": dcfg.rms_norm_eps,
        "unsupported": unsupported,
    }


# --------------------------------------------------------------------------------------------
# the build
# --------------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    seen, out = set(), {}
    for k, v in tensors.items():  # tied embedding / LM head: one storage, two names -> copy
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    save_file(out, str(path), metadata={"format": "pt"})


@dataclass
class EngineContents:
    """Everything written into an engine directory (what :func:`build_engine` computed).

    Attributes:
        bc: the build config.
        target, drafter: the loaded fp32 models (the target with its tokenizer and HF path).
        tsd, dsd: their state dicts (detached tensors).
        tspecs, dspecs: their TensorRT-LLM tensor specs.
        tq, dq: quantized linears by state-dict key (empty when a model is not quantized).
        dtype: the compute dtype of unquantized tensors.
        plan: the memory plan.
        target_source: ``--target`` as given (None: the default model).
        drafter_path: the drafter directory used.
    """

    bc: BuildConfig
    target: LoadedTarget
    drafter: DFlashDrafter
    tsd: dict[str, torch.Tensor]
    dsd: dict[str, torch.Tensor]
    tspecs: list[trtllm.TensorSpec]
    dspecs: list[trtllm.TensorSpec]
    tq: dict[str, QuantizedLinear]
    dq: dict[str, QuantizedLinear]
    dtype: torch.dtype
    plan: MemoryPlan
    target_source: str | None
    drafter_path: Path


def build_engine(
    bc: BuildConfig,
    target_spec: str | None,
    drafter_spec: str | None,
    out_dir: str | os.PathLike,
    progress: bool = True,
    log=print,
) -> Path:
    """Build ``out_dir`` from a target and its drafter (see the module docstring).

    Args:
        bc: a validated build config.
        target_spec, drafter_spec: ``--target`` / ``--drafter`` (None: the default model / its drafter).
        out_dir: engine directory to create (must not exist).
        log: one-line progress messages.

    Returns:
        the engine directory.

    Raises:
        DFlashError: ``out_dir`` exists, a bad pair, a block size above the drafter's, a
            tp_size that does not divide the heads, a target family the builder does not write
            (gpt-oss), an expert split that does not divide (moe_tp_size x moe_ep_size), a model that
            does not fit the memory plan,
            corrupt checkpoints, ModelOpt missing for a quantized build. Nothing is left at
            ``out_dir`` on any error.
    """
    from ..checkpoints.loader import default_drafter_path, load_pair, parse_dtype

    out = Path(out_dir).expanduser()
    if out.exists():
        raise DFlashError(f"output {out} already exists; choose a new engine directory")
    dtype = parse_dtype(bc.dtype)
    target, drafter = load_pair(target_spec, drafter_spec, torch.float32)
    drafter_path = Path(drafter_spec) if drafter_spec else default_drafter_path(target, target_spec is None)
    tcfg, dcfg = target.model.cfg, drafter.cfg
    if tcfg.family not in ARCHITECTURES and tcfg.family not in HF_ONLY_ARCHITECTURES:
        supported = ", ".join([*ARCHITECTURES, *HF_ONLY_ARCHITECTURES])
        raise DFlashError(f"building an engine of a {tcfg.family} target is not supported yet (supported: {supported})")
    if tcfg.num_experts and bc.expert_format != bc.target_quant:
        raise DFlashError(
            f"expert_quant {bc.expert_quant} differs from target_quant {bc.target_quant}: the build quantizes "
            "experts and attention alike (other expert formats are planned only)"
        )
    if bc.block_size > dcfg.block_size:
        raise DFlashError(f"block_size {bc.block_size} is above the drafter's block size {dcfg.block_size}")
    plan = memory_plan(bc, tcfg, dcfg)  # also checks tp_size against both models' heads
    log(plan.table())
    plan.check()

    tsd = {k: v.detach() for k, v in target.model.state_dict().items()}
    dsd = {k: v.detach() for k, v in drafter.state_dict().items()}
    hf_only = tcfg.family in HF_ONLY_ARCHITECTURES  # quantized from (and written as) its HF names
    tspecs = trtllm.hf_target_specs(tcfg) if hf_only else trtllm.target_specs(tcfg)
    dspecs = trtllm.drafter_specs(dcfg)
    tq: dict[str, QuantizedLinear] = {}
    dq: dict[str, QuantizedLinear] = {}
    if bc.target_quant != "none" or bc.drafter_quant != "none":
        t_amax: dict[str, float] = {}
        d_amax: dict[str, float] = {}
        if needs_calibration(bc.target_quant, bc.drafter_quant):  # FP8 / NVFP4 activations
            from .calibration import calibrate_pair

            t_amax, d_amax = calibrate_pair(target, drafter, bc, progress)
        g = bc.group_size
        if bc.target_quant != "none":
            tq = quantize_model(tsd, tspecs, bc.target_quant, t_amax, progress, "quantize target", g)
        if bc.drafter_quant != "none":
            dq = quantize_model(dsd, dspecs, bc.drafter_quant, d_amax, progress, "quantize drafter", g)
        if bc.head_quant != "none":  # the LM head (tied or not) as its own packed tensor
            tq["lm_head.weight"] = weight_format(bc.head_quant).quantize(tsd["lm_head.weight"].float(), None, g)

    contents = EngineContents(
        bc, target, drafter, tsd, dsd, tspecs, dspecs, tq, dq, dtype, plan, target_spec, drafter_path
    )
    with atomic_dir(out) as tmp:
        _write_all(tmp, contents, progress)
    log(f"wrote {out}")
    if _version("tensorrt_llm") is None:
        log(
            f"skipped the TensorRT-LLM engine build: tensorrt_llm is not installed "
            f"(the checkpoints are ready; see {out}/trtllm/build.sh)"
        )
    return out


def _write_all(tmp: Path, c: EngineContents, progress: bool) -> None:
    from tqdm import tqdm

    bc, target, drafter, dtype = c.bc, c.target, c.drafter, c.dtype
    tcfg, dcfg = target.model.cfg, drafter.cfg
    t_qkv = trtllm.qkv_sizes(tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim)
    d_qkv = trtllm.qkv_sizes(dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim)
    moe = bc.moe_split if tcfg.num_experts else None
    hf_only = tcfg.family in HF_ONLY_ARCHITECTURES  # no target/ TensorRT-LLM checkpoint: hf/target is it
    if not hf_only:
        write_json(tmp / "target" / "config.json", target_trtllm_config(tcfg, bc))
    write_json(tmp / "drafter" / "config.json", drafter_trtllm_config(dcfg, bc))
    kv_scale = bc.kv_cache_dtype == "fp8"
    # the draft vocabulary (int64 [N], replicated, never quantized) travels as it is
    d2t = {"d2t": c.dsd["d2t"].contiguous()} if "d2t" in c.dsd else {}
    for r in tqdm(range(bc.tp_size), desc="write ranks", unit="rank", disable=not progress, file=sys.stderr):
        tt = {} if hf_only else rank_tensors(c.tspecs, c.tsd, c.tq, dtype, bc.tp_size, r, t_qkv, moe)
        dt = rank_tensors(c.dspecs, c.dsd, c.dq, dtype, bc.tp_size, r, d_qkv)
        if kv_scale:  # TensorRT-LLM / ModelOpt write 1.0 (amax/448 clamped to >= 1)
            for i in range(0 if hf_only else tcfg.num_layers):
                tt[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] = torch.ones(1)
            for i in range(dcfg.num_layers):
                dt[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] = torch.ones(1)
        if not hf_only:
            _save(tt, tmp / "target" / f"rank{r}.safetensors")
        _save(dt | d2t, tmp / "drafter" / f"rank{r}.safetensors")

    # unified HF checkpoints
    from ..checkpoints.sources import read_json
    from ..checkpoints.zlab import drafter_config_to_json

    hf_cfg = read_json(Path(target.path) / "config.json", "target")
    hf_cfg.pop("quantization_config", None)
    hf_cfg["torch_dtype"] = dtype_name(bc.dtype)
    _write_hf(
        tmp / "hf" / "target",
        hf_cfg,
        hf_tensors(trtllm.hf_target_specs(tcfg), c.tsd, c.tq, dtype),
        bc.target_quant,
        bc.kv_cache_dtype,
        ["model.embed_tokens"]
        + ([] if bc.head_quant != "none" else ["lm_head"])
        + ([f"model.layers.*.mlp.{'router' if hf_only else 'gate'}"] if tcfg.num_experts else []),
        bc.group_size,
    )
    target.tokenizer.save_pretrained(str(tmp / "hf" / "target"))
    if (Path(target.path) / "generation_config.json").is_file():
        shutil.copy(Path(target.path) / "generation_config.json", tmp / "hf" / "target")
    _write_hf(
        tmp / "hf" / "drafter",
        drafter_config_to_json(dcfg),
        hf_tensors(trtllm.hf_drafter_specs(dcfg), c.dsd, c.dq, dtype) | d2t,
        bc.drafter_quant,
        bc.kv_cache_dtype,
        [],
        bc.group_size,
    )

    (tmp / "trtllm").mkdir()
    (tmp / "trtllm" / "llm_api.yaml").write_text(llm_api_yaml(bc, dcfg, moe is not None))
    write_json(tmp / "trtllm" / "plugins.json", plugins_json(bc, dcfg))
    build_sh = (
        "#!/bin/sh\n# TensorRT-LLM 1.2.x engine build of the target (run from the engine directory).\n"
        "# DFlash itself runs in TensorRT-LLM's PyTorch backend (>= 1.3): see llm_api.yaml.\nset -e\n"
        + trtllm_build_command(bc)
        + "\n"
    )
    if hf_only:
        build_sh = (
            f"#!/bin/sh\n# {tcfg.family}: TensorRT-LLM has no checkpoint converter for this family, so no\n"
            "# trtllm-build engine; its PyTorch backend reads hf/target (unified HF checkpoint) directly:\n"
            f"#   trtllm-serve hf/target --tp_size {bc.tp_size} --extra_llm_api_options trtllm/llm_api.yaml\n"
            "echo 'no trtllm-build engine for this target: serve hf/target (see the comment above)' >&2\nexit 1\n"
        )
    (tmp / "trtllm" / "build.sh").write_text(build_sh)

    files = {
        str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    manifest = {
        "format": ENGINE_FORMAT,
        "version": ENGINE_VERSION,
        "build_config": bc.to_dict(),
        "target": {
            "source": str(c.target_source or "default"),
            "path": str(target.path),
            "family": tcfg.family,
            "checkpoint_sha256": _dir_digest(Path(target.path)),
        },
        "drafter": {
            "source": str(c.drafter_path),
            "block_size": dcfg.block_size,
            "checkpoint_sha256": _dir_digest(c.drafter_path),
        },
        "tp_size": bc.tp_size,
        "target_checkpoint": "hf/target" if hf_only else "target/",
        "moe_split": {"moe_tp_size": moe[0], "moe_ep_size": moe[1]} if moe else None,
        "dtype": bc.dtype,
        "target_quant": bc.target_quant,
        "drafter_quant": bc.drafter_quant,
        # int4 / int8: how the runtime's packed CPU path reads the rank files
        "weight_quant": {"group_size": bc.group_size, "head_quant": bc.head_quant}
        if any(f != "none" and weight_format(f).weight_only for f in (bc.target_quant, bc.drafter_quant))
        else None,
        "memory_plan": c.plan.to_dict(),
        "packages": {
            p: _version(p)
            for p in ("dflash-trt", "torch", "transformers", "safetensors", "nvidia-modelopt", "tensorrt_llm")
        },
        "python": platform.python_version(),
        "trtllm_build": "skipped: tensorrt_llm is not installed"
        if _version("tensorrt_llm") is None
        else "see trtllm/build.sh",
        "files": files,
    }
    write_json(tmp / "engine.json", manifest)


def _write_hf(
    d: Path, config: dict, tensors: dict[str, torch.Tensor], fmt: str, kv: str, exclude: list[str], group_size: int
) -> None:
    """One unified HF checkpoint: ``config.json`` (+ ``quantization_config``), ``hf_quant_config.json``
    when anything is quantized, ``model.safetensors``."""
    qc = hf_quantization_config(fmt, kv, exclude, group_size)
    write_json(d / "config.json", config | ({"quantization_config": qc} if qc else {}))
    hq = hf_quant_config(fmt, kv, exclude, group_size)
    if hq:
        write_json(d / "hf_quant_config.json", hq)
    _save(tensors, d / "model.safetensors")


def _dir_digest(path: Path) -> str | None:
    """sha256 over the safetensors/json files of a checkpoint directory (names and contents)."""
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.is_file() and p.suffix in (".safetensors", ".json"):
            h.update(p.name.encode())
            h.update(sha256_file(p).encode())
    return h.hexdigest()
