"""Read an engine directory written by ``dflash-trt build`` into runtime models.

The TensorRT-LLM rank files are mapped back onto our modules (:mod:`.trtllm` names). Quantized
weights are read by their format's module (:mod:`dflash_trt.quantization`): dequantized to the
compute dtype (plain torch, no ModelOpt), or kept as stored under that format's run-time linear
(FP8 GEMMs with ``fp8_gemm``, packed int4 / int8 CPU GEMMs with ``packed``). A process reads only
the rank file of its own TP rank.

A Qwen3-MoE target's stacked experts (``mlp.fc`` = ``[up; gate]`` per expert, ``mlp.proj``, the
fp32 ``mlp.router``; :mod:`.trtllm`) become the ``MoEBlock``'s ``gate_up`` (``[gate; up]``),
``down`` and router in the compute dtype, quantized experts dequantized one expert at a time
(they have no run-time linear here). A rank of a tp_size N engine holds the experts and the
intermediate slice that the engine's ``mapping`` (``moe_tp_size`` x ``moe_ep_size`` in
``target/config.json``) gives it, as TensorRT-LLM's ``Mapping`` does. A gpt-oss engine has no
TensorRT-LLM rank files (only ``hf/target``) and is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DFlashError
from ..models.config import TargetConfig
from ..models.drafter import DFlashDrafter
from ..models.target import TargetModel
from ..models.uninitialized import skip_random_init
from ..quantization import DRAFTER_WEIGHTS, INT_WEIGHT_FORMATS
from ..quantization.common import replace_module, stored_format
from . import trtllm
from .loader import LoadedTarget, parse_dtype, with_tokenizer
from .sources import load_safetensors_file, read_json, sha256_file
from .zlab import check_d2t, drafter_config_from_json

#: ``engine.json`` ``format`` / ``version`` (written by :mod:`..build.builder`)
ENGINE_FORMAT = "dflash-trt-engine"
ENGINE_VERSION = 1


#: KV positions an engine gets when nothing says otherwise (bench, serve)
DEFAULT_KV_CAPACITY = 65536


def kv_capacity(engine_dir: str | Path | None, requested: int | None) -> tuple[int, str]:
    """``(KV capacity in tokens, where it came from)``: ``requested`` when given, else the
    engine directory's memory-plan capacity capped at :data:`DEFAULT_KV_CAPACITY`, else that
    default.

    Raises:
        DFlashError: an unreadable engine manifest.
    """
    if requested is not None:
        return requested, "--kv-capacity"
    if engine_dir:
        plan = read_manifest(engine_dir).get("memory_plan") or {}
        cap = plan.get("kv_token_capacity")
        if isinstance(cap, int) and cap > 0:
            if cap > DEFAULT_KV_CAPACITY:
                return DEFAULT_KV_CAPACITY, f"engine memory plan: {cap:,} tokens, capped at {DEFAULT_KV_CAPACITY:,}"
            return cap, "engine memory plan"
        return DEFAULT_KV_CAPACITY, "default (engine.json has no memory plan KV capacity)"
    return DEFAULT_KV_CAPACITY, "default"


def read_manifest(engine_dir: str | Path) -> dict:
    """``engine.json`` of an engine directory.

    Raises:
        DFlashError: not a directory, no or corrupt manifest, another format.
    """
    d = Path(engine_dir).expanduser()
    if not d.is_dir():
        raise DFlashError(f"engine directory not found: {d}")
    m = read_json(d / "engine.json", "engine")
    if m.get("format") != ENGINE_FORMAT:
        raise DFlashError(f"{d}/engine.json is not a dflash-trt engine manifest")
    return m


def dequantized(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``name`` of a rank file in ``dtype``, dequantized by its weight format when it has
    scales (:func:`~dflash_trt.quantization.common.stored_format`)."""
    fmt = stored_format(tensors, name)
    if fmt is None:
        return tensors[name].to(dtype)
    return fmt.dequantize(tensors, name[: -len(".weight")] if name.endswith(".weight") else name, dtype)


def dequantized_experts(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """Stacked expert tensor ``name`` (``[E, out, in]`` stored: ``mlp.fc`` / ``mlp.proj``) in
    ``dtype``; a quantized one is dequantized one expert at a time, its per-expert tensors
    (``[E, ...]``: weights, block scales, ``weights_scaling_factor(_2)`` ``[E, 1]``) indexed by the
    expert and its ``[1]`` activation scale shared (:mod:`.trtllm`, quantized experts)."""
    fmt = stored_format(tensors, name)
    if fmt is None:
        return tensors[name].to(dtype)
    base = name[: -len(".weight")]
    own = {k: v for k, v in tensors.items() if k.startswith(base + ".")}
    return torch.stack(
        [
            fmt.dequantize({k: v[e] if v.dim() >= 2 else v for k, v in own.items()}, base, dtype)
            for e in range(tensors[name].shape[0])
        ]
    )


def state_dict_from_rank(
    specs: list[trtllm.TensorSpec], tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Our state dict (keys and shapes of ``own``) from one rank's tensors: a full rank (tp_size 1),
    or a rank's own (local) shapes when ``own`` has them. Stacked experts go back from
    TensorRT-LLM's ``[up; gate]`` rows to our ``[gate; up]`` (:func:`.trtllm.swap_halves`).

    Raises:
        DFlashError: a tensor missing from the rank file, or of another shape than ``own``'s.
    """
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for s in specs:
        if s.name not in tensors:
            raise DFlashError(f"engine rank file lacks {s.name}")
        if s.split in (trtllm.EXPERT_FC, trtllm.EXPERT_PROJ):
            t = dequantized_experts(tensors, s.name, dtype)
            if s.swap_halves:
                t = trtllm.swap_halves(t)
        else:
            t = dequantized(tensors, s.name, dtype)
        if s.split == trtllm.VOCAB:
            t = t[: own[s.source].shape[0]]
        pieces.setdefault(s.source, []).append((s.rows[0] if s.rows else 0, t))
    out = {}
    for src, parts in pieces.items():
        full = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
        keys = src.split("|")
        sizes = [own[k].shape[0] for k in keys]
        for k, t in zip(keys, torch.split(full, sizes)):
            if tuple(t.shape) != tuple(own[k].shape):
                raise DFlashError(f"engine tensor for {k} has shape {tuple(t.shape)}, expected {tuple(own[k].shape)}")
            out[k] = t.contiguous()
    return out


def quantized_modules(
    model: torch.nn.Module, specs: list[trtllm.TensorSpec], tensors: dict[str, torch.Tensor], formats: tuple[str, ...]
) -> int:
    """Swap every linear whose engine weight is stored in one of ``formats`` for that format's
    run-time linear over the engine's own bytes (:attr:`WeightFormat.runtime_linears`: FP8 GEMMs,
    packed int4 / int8 CPU GEMMs), instead of the dequantized copy. Fused tensors (q/k/v, fc/gate)
    are joined by rows and split onto our modules; a module the format cannot run stays dense,
    and so do a mixture-of-experts target's stacked experts.

    Returns:
        how many modules were swapped.

    Raises:
        DFlashError: what the format raises on tensors the builder would not write.
    """
    groups: dict[str, list[tuple[int, str]]] = {}
    for sp in specs:
        if not sp.name.endswith(".weight") or sp.split in (trtllm.EXPERT_FC, trtllm.EXPERT_PROJ):
            continue  # stacked experts stay dequantized (MoEBlock has no quantized GEMMs)
        fmt = stored_format(tensors, sp.name)
        if fmt is not None and fmt.name in formats and fmt.runtime_linears is not None:
            module = sp.module or sp.source[: -len(".weight")]
            groups.setdefault(module, []).append((sp.rows[0] if sp.rows else 0, sp.name[: -len(".weight")]))
    swapped = 0
    for module, members in groups.items():
        bases = [b for _, b in sorted(members)]
        targets = module.split("|")
        news = stored_format(tensors, bases[0] + ".weight").runtime_linears(
            tensors, bases, [model.get_submodule(t) for t in targets]
        )
        for t, new in zip(targets, news):
            if new is not None:
                replace_module(model, t, new)
                swapped += 1
    return swapped


def unshard_rank_files(
    specs: list[trtllm.TensorSpec], ranks: list[dict[str, torch.Tensor]], qkv: tuple[int, int, int]
) -> dict[str, torch.Tensor]:
    """One tp_size-1 tensor dict from every rank's tensors (inverse of the builder's sharding):
    weights, biases and NVFP4 block scales are reassembled by their spec's split, per-tensor
    scales are the same on every rank."""
    by_name = {sp.name: sp for sp in specs}
    by_base = {sp.name[: -len(".weight")]: sp for sp in specs if sp.name.endswith(".weight")}
    out: dict[str, torch.Tensor] = {}
    for name in ranks[0]:
        parts = [r[name] for r in ranks]
        sp = by_name.get(name)
        if sp is None and parts[0].dim() != 2:  # per-tensor scales (weights, KV cache): the same on every rank
            out[name] = parts[0]
            continue
        if sp is None:  # a per-row scale tensor: "<base>.<suffix>"
            sp = by_base[name.rsplit(".", 1)[0]]
        out[name] = trtllm.unshard(parts, sp.split, qkv)
    return out


@dataclass
class EngineShard:
    """What a rank of a tp_size > 1 engine holds besides its layers: its rank, the group size,
    its own rows of the (padded, vocab-parallel) embedding and, for a mixture-of-experts target,
    the engine's ``(moe_tp_size, moe_ep_size)`` (None for a dense one). The
    runtime (``runtime/distributed.attach_engine_shard``) gathers the embedding over the group
    and wires the all-reduces; before that the model cannot run."""

    rank: int
    tp_size: int
    embed_rows: torch.Tensor
    moe: tuple[int, int] | None = None


def load_engine(
    engine_dir: str | Path,
    dtype: torch.dtype | None = None,
    rank: int = 0,
    fp8_gemm: bool = False,
    world_size: int = 1,
    packed: bool = True,
) -> tuple[LoadedTarget, DFlashDrafter, dict]:
    """Load the target and drafter of an engine directory for TP rank ``rank``.

    A tp_size 1 engine gives complete models. A tp_size N > 1 engine must run as N ranks
    (``world_size``): rank r reads only ``target/rank{r}.safetensors`` and gets its target
    shard (local heads, intermediate and LM-head rows, a mixture-of-experts target's experts and
    expert slice of the engine's ``moe_tp_size`` x ``moe_ep_size``; ``model.engine_shard`` holds
    its embedding rows, see :class:`EngineShard`). The drafter is replicated by the runtime, so every
    rank reassembles it from the drafter's rank files (a few MB).

    Args:
        engine_dir: output of ``dflash-trt build``.
        dtype: compute dtype (default: the build's ``dtype``).
        rank: TP rank whose file is read.
        fp8_gemm: run FP8 linears as FP8 GEMMs (``torch._scaled_mm``,
            :class:`~dflash_trt.quantization.fp8.Fp8Linear`) instead of dequantizing them to ``dtype``.
        world_size: ranks in this job.
        packed: int4 / int8 linears (``target_quant`` / ``drafter_quant`` / ``weight_quant``
            in the manifest) run as packed CPU GEMMs (:class:`~dflash_trt.quantization.packed.PackedLinear`,
            see :func:`quantized_modules`); False (a GPU run)
            dequantizes them to ``dtype``.

    Returns:
        ``(target, drafter, manifest)``.

    Raises:
        DFlashError: bad directory or manifest, a missing or corrupt rank file, an engine whose
            tp_size differs from ``world_size``, a mixture-of-experts engine whose expert split
            (``moe_tp_size`` x ``moe_ep_size`` of ``target/config.json``) is not its tp_size or
            not its manifest's ``moe_split``, a gpt-oss engine (no TensorRT-LLM rank files: it
            runs from its HF checkpoint).
    """
    d = Path(engine_dir).expanduser()
    m = read_manifest(d)
    if m.get("target_checkpoint") == "hf/target":
        family = (m.get("target") or {}).get("family", "mixture-of-experts")
        raise DFlashError(
            f"engine {d}: running an engine of a {family} (mixture-of-experts) target is not supported: it has no "
            f"TensorRT-LLM rank files; serve {d / 'hf' / 'target'} with TensorRT-LLM (trtllm/llm_api.yaml) or run "
            f"the original checkpoint with --target"
        )
    tp = int(m.get("tp_size", 1))
    if tp != world_size and not (tp == 1 and world_size > 1):
        raise DFlashError(
            f"engine {d} has tp_size {tp}: run it as {tp} ranks (mpiexec -n {tp}); this job has {world_size}"
        )
    cdt = dtype or parse_dtype(m.get("dtype", "fp32"))
    formats = (("fp8",) if fp8_gemm else ()) + (("int4", "int8") if packed else ())
    target = with_tokenizer(_load_target(d, tp, rank, cdt, formats, m), d / "hf" / "target")
    return target, _load_drafter(d, tp, cdt, formats), m


def _hf_config(d: Path, model: str) -> dict:
    """``hf/<model>/config.json`` of an engine without its ``quantization_config``."""
    cfg = read_json(d / "hf" / model / "config.json", f"engine {model}")
    cfg.pop("quantization_config", None)
    return cfg


def engine_moe_split(d: Path, tcfg: TargetConfig, tp: int, manifest: dict) -> tuple[int, int] | None:
    """``(moe_tp_size, moe_ep_size)`` of a mixture-of-experts engine from its target's
    TensorRT-LLM ``config.json`` ``mapping`` (what the builder writes, TensorRT-LLM's ``Mapping``
    keys); None for a dense target.

    Raises:
        DFlashError: no or unreadable ``target/config.json``, sizes missing or whose product is not
            ``tp``, sizes other than the manifest's ``moe_split``, or that do not divide the
            experts / the expert intermediate size.
    """
    if not tcfg.num_experts:
        return None
    mapping = read_json(d / "target" / "config.json", "engine target TensorRT-LLM").get("mapping") or {}
    mtp, mep = mapping.get("moe_tp_size"), mapping.get("moe_ep_size")
    if not isinstance(mtp, int) or not isinstance(mep, int) or mtp < 1 or mep < 1 or mtp * mep != tp:
        raise DFlashError(
            f"engine {d}: target/config.json mapping moe_tp_size {mtp} x moe_ep_size {mep} does not give its "
            f"tp_size {tp} ranks; rebuild the engine"
        )
    split = manifest.get("moe_split") or {}
    if (split.get("moe_tp_size"), split.get("moe_ep_size")) != (mtp, mep):
        raise DFlashError(
            f"engine {d}: engine.json moe_split {split} differs from target/config.json's moe_tp_size {mtp} x "
            f"moe_ep_size {mep}; rebuild the engine"
        )
    if tcfg.num_experts % mep or tcfg.moe_intermediate_size % mtp:
        raise DFlashError(
            f"engine {d}: moe_ep_size {mep} / moe_tp_size {mtp} do not divide the target's {tcfg.num_experts} "
            f"experts / expert intermediate size {tcfg.moe_intermediate_size}; rebuild the engine"
        )
    return mtp, mep


def _local_experts(model: TargetModel, tcfg: TargetConfig, rank: int, moe: tuple[int, int]) -> None:
    """Give every sparse layer of ``model`` (built with the local ``moe_intermediate_size``) rank
    ``rank``'s experts: ``gate_up`` / ``down`` of ``E / moe_ep_size`` experts starting at
    ``expert_offset`` (TensorRT-LLM ``Mapping.ep_experts``; filled in by the rank file), the router
    over all ``E`` experts (replicated)."""
    mtp, mep = moe
    _, ep_rank = trtllm.moe_ranks(rank, mep)
    ne = tcfg.num_experts // mep
    for i, layer in enumerate(model.layers):
        if tcfg.is_moe_layer(i):
            m = layer.mlp
            m.gate_up = torch.nn.Parameter(m.gate_up.new_empty(ne, *m.gate_up.shape[1:]))
            m.down = torch.nn.Parameter(m.down.new_empty(ne, *m.down.shape[1:]))
            m.expert_offset = ep_rank * ne


def _load_target(
    d: Path, tp: int, rank: int, dtype: torch.dtype, formats: tuple[str, ...], manifest: dict
) -> TargetModel:
    """The target (tp 1) or its rank-``rank`` shard, in ``dtype``, linears of ``formats`` run
    as their format's run-time linears (see :func:`load_engine`)."""
    tcfg = TargetConfig.from_hf(_hf_config(d, "target"))
    moe = engine_moe_split(d, tcfg, tp, manifest)
    tt = load_safetensors_file(d / "target" / f"rank{rank if tp > 1 else 0}.safetensors", "engine target")
    specs = trtllm.target_specs(tcfg)
    if tp == 1:
        with skip_random_init():  # every weight is loaded below
            model = TargetModel(tcfg)
        sd = state_dict_from_rank(specs, tt, model.state_dict(), dtype)
        if tcfg.tie_word_embeddings:
            sd["lm_head.weight"] = sd["embed.weight"]
    else:
        local = dataclasses.replace(
            tcfg,
            num_heads=tcfg.num_heads // tp,
            num_kv_heads=tcfg.num_kv_heads // tp,
            intermediate_size=tcfg.intermediate_size // tp,
            **({"moe_intermediate_size": tcfg.moe_intermediate_size // moe[0]} if moe else {}),
        )
        head = dequantized(tt, "lm_head.weight", dtype)
        with skip_random_init():  # every weight is loaded below
            model = TargetModel(local)
            model.lm_head = torch.nn.Linear(tcfg.hidden_size, head.shape[0], bias=False)  # unties a tied head
            if moe:
                _local_experts(model, tcfg, rank, moe)
        sd = state_dict_from_rank([sp for sp in specs if sp.split != trtllm.VOCAB], tt, model.state_dict(), dtype)
        sd["lm_head.weight"] = head
        sd["embed.weight"] = torch.zeros_like(model.embed.weight, dtype=dtype)  # gathered by the runtime
        model.engine_shard = EngineShard(rank, tp, dequantized(tt, "transformer.vocab_embedding.weight", dtype), moe)
    model.load_state_dict(sd, strict=True)
    model = model.to(dtype).eval()
    quantized_modules(model, specs, tt, formats)
    return model


def _load_drafter(d: Path, tp: int, dtype: torch.dtype, formats: tuple[str, ...]) -> DFlashDrafter:
    """The drafter, reassembled from every rank file (it runs replicated), in ``dtype``, linears
    of ``formats`` run as their format's run-time linears."""
    dcfg = drafter_config_from_json(_hf_config(d, "drafter"))
    dspecs = trtllm.drafter_specs(dcfg)
    dt = [load_safetensors_file(d / "drafter" / f"rank{r}.safetensors", "engine drafter") for r in range(tp)]
    d2t = dt[0].get("d2t")  # replicated in every rank file, not sharded: set apart
    dt = [{k: v for k, v in r.items() if k != "d2t"} for r in dt]
    dt = (
        dt[0]
        if tp == 1
        else unshard_rank_files(dspecs, dt, trtllm.qkv_sizes(dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim))
    )
    with skip_random_init():
        drafter = DFlashDrafter(dcfg)
    dsd = state_dict_from_rank(dspecs, dt, drafter.state_dict(), dtype)
    if dcfg.draft_vocab_size is not None:  # the draft vocabulary, int64, beside the weights
        if d2t is None:
            raise DFlashError(f"engine drafter declares draft_vocab_size {dcfg.draft_vocab_size} but has no d2t")
        check_d2t(d2t, dcfg.vocab_size, f"engine drafter {d}")
        dsd["d2t"] = d2t
    drafter.load_state_dict(dsd, strict=True)
    drafter = drafter.to(dtype).eval()
    quantized_modules(drafter, dspecs, dt, formats)
    return drafter


def engine_files_ok(engine_dir: str | Path) -> list[str]:
    """Files whose size or sha256 differ from ``engine.json`` (empty when the engine is intact)."""
    d = Path(engine_dir)
    bad = []
    for rel, info in read_manifest(d)["files"].items():
        p = d / rel
        if not p.is_file() or p.stat().st_size != info["bytes"] or sha256_file(p) != info["sha256"]:
            bad.append(rel)
    return bad


def drafter_format(drafter_weights: str, weights: str | None, device: torch.device | str, world_size: int) -> str:
    """The format a checkpoint pair's drafter is loaded in (:func:`.loader.load_pair`'s
    ``drafter_weights``) for ``--drafter-weights``: ``auto`` is ``--weights``' packed format
    when it has one, else ``int8`` on one CPU rank (the drafting step streams the drafter's
    weights and the draft vocabulary's head rows from memory: bf16 batch 1 0.16x -> 0.13x a
    decode step, fp32 0.13x -> 0.07x, the drafts' acceptance the same; docs/peers.md), else
    ``none`` (a GPU's drafter runs its own kernels; tensor-parallel ranks shard it);
    ``none`` / ``int8`` / ``int4`` as named.

    Raises:
        DFlashError: an unknown name, or a packed format off the CPU or over several ranks.
    """
    if drafter_weights not in DRAFTER_WEIGHTS:
        raise DFlashError(f"unknown --drafter-weights {drafter_weights!r}; choose from {', '.join(DRAFTER_WEIGHTS)}")
    cpu_rank = torch.device(device).type == "cpu" and world_size == 1
    if drafter_weights == "auto":
        return weights if weights in INT_WEIGHT_FORMATS else ("int8" if cpu_rank else "none")
    if drafter_weights != "none" and not cpu_rank:
        raise DFlashError(f"--drafter-weights {drafter_weights} runs packed CPU GEMMs on one rank; use none")
    return drafter_weights


def load_models(
    target_spec: str | None,
    drafter_spec: str | None,
    engine_dir: str | None,
    dtype: torch.dtype,
    need_drafter: bool = True,
    fp8_gemm: bool = False,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    weights: str | None = None,
    drafter_weights: str = "auto",
) -> tuple[LoadedTarget, DFlashDrafter | None]:
    """What ``generate`` / ``bench`` run: an engine directory (``--engine``) or a checkpoint pair,
    on ``device`` (tensor-parallel ranks move to their own GPU afterwards).

    Args:
        weights: ``--weights`` (``int4`` / ``int8``: packed CPU linears, see
            :func:`.loader.load_target`) for a checkpoint pair. An engine's manifest decides its
            own (``weight_quant``), so with ``--engine`` it must be None or the engine's.
        drafter_weights: ``--drafter-weights`` (:func:`drafter_format`).

    Raises:
        DFlashError: ``--engine`` together with ``--target`` / ``--drafter``, ``fp8_gemm``
            without an engine, ``weights`` or ``drafter_weights`` that contradict the engine's or
            with more than one rank, or anything the loaders raise.
    """
    from .loader import check_weights, load_pair

    check_weights(weights, device)
    if weights in INT_WEIGHT_FORMATS and world_size > 1:
        raise DFlashError(f"--weights {weights} runs on one rank (packed CPU GEMMs are not sharded); drop mpiexec")
    if fp8_gemm and engine_dir is None:
        raise DFlashError("--fp8-gemm needs --engine (an FP8 engine from dflash-trt build)")
    if engine_dir is None:
        dfmt = drafter_format(drafter_weights, weights, device, world_size)
        return load_pair(target_spec, drafter_spec, dtype, need_drafter, device, weights=weights, drafter_weights=dfmt)
    if drafter_weights != "auto":
        raise DFlashError(f"--drafter-weights {drafter_weights}: an engine's drafter runs as it was built; drop it")
    if target_spec or drafter_spec:
        raise DFlashError("--engine holds the target and the drafter; drop --target / --drafter")
    if weights is not None and weights != read_manifest(engine_dir).get("target_quant"):
        raise DFlashError(f"--weights {weights}: engine {engine_dir} was not built with int weights of that format")
    target, drafter, _ = load_engine(
        engine_dir,
        dtype,
        rank=rank,
        fp8_gemm=fp8_gemm,
        world_size=world_size,
        packed=torch.device(device).type == "cpu",
    )
    target.model.to(device)
    return target, drafter.to(device) if drafter is not None else None
