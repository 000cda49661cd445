"""Read an engine directory written by ``dflash-trt build`` into runtime models.

The TensorRT-LLM rank files are mapped back onto our modules (:mod:`.trtllm` names);
FP8 / NVFP4 weights are dequantized to the compute dtype on load (plain torch, no ModelOpt). A
process reads only the rank file of its own TP rank.
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
from ..quantization.formats import dequantize_fp8, dequantize_nvfp4
from . import trtllm as L
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
    """Tensor ``name`` of a rank file, dequantized when it has FP8 / NVFP4 / int4 / int8 scales."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    w = tensors[name]
    s = tensors.get(base + ".weights_scaling_factor")
    if s is None:
        return w.to(dtype)
    if base + ".zero" in tensors:  # int4: q * scale + zero per group
        from ..models.quant_linear import unpack_nibbles

        q = unpack_nibbles(w).float()
        g = q.shape[1] // s.shape[1]
        return (q * s.float().repeat_interleave(g, -1) + tensors[base + ".zero"].float().repeat_interleave(g, -1)).to(
            dtype
        )
    if w.dtype == torch.int8:  # int8: q * scale per row
        return (w.float() * s.float().reshape(-1, 1)).to(dtype)
    if w.dtype == torch.uint8:
        return dequantize_nvfp4(w, s, tensors[base + ".weights_scaling_factor_2"], dtype)
    return dequantize_fp8(w, s, dtype)


def state_dict_from_rank(
    specs: list[L.TensorSpec], tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Our state dict (keys and shapes of ``own``) from one full rank's tensors (tp_size 1)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for s in specs:
        if s.name not in tensors:
            raise DFlashError(f"engine rank file lacks {s.name}")
        t = dequantized(tensors, s.name, dtype)
        if s.split == L.VOCAB:
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


def fp8_modules(model: torch.nn.Module, specs: list[L.TensorSpec], tensors: dict[str, torch.Tensor]) -> int:
    """Swap every linear whose engine weight is FP8 for an :class:`Fp8Linear` over the engine's
    own e4m3 bytes (``torch._scaled_mm``), instead of the dequantized copy. Fused tensors (q/k/v,
    fc/gate) are split or joined onto our modules; the builder quantizes each fused source as one
    tensor, so its members share the per-tensor scales (ModelOpt's fused export) and the FP8
    GEMM is exact to the stored format. Returns how many modules were swapped.

    Raises:
        DFlashError: members of one module with different scales (not a file we wrote).
    """
    from ..quantization.fp8_linear import Fp8Linear, replace_linear

    parts: dict[str, list[tuple[int, str]]] = {}
    for sp in specs:
        if sp.linear and tensors[sp.name].dtype == torch.float8_e4m3fn:
            parts.setdefault(sp.module, []).append((sp.rows[0] if sp.rows else 0, sp.name))
    swapped = 0
    for module, names in parts.items():
        names = [n for _, n in sorted(names)]
        bases = [n[: -len(".weight")] for n in names]
        ws = {tensors[b + ".weights_scaling_factor"].item() for b in bases}
        acts = {tensors[b + ".activation_scaling_factor"].item() for b in bases}
        if len(ws) != 1 or len(acts) != 1:
            raise DFlashError(f"engine tensors of {module} have different FP8 scales; rebuild the engine")
        w = torch.cat([tensors[n] for n in names])
        w_scale = tensors[bases[0] + ".weights_scaling_factor"]
        a_scale = tensors[bases[0] + ".activation_scaling_factor"]
        targets = module.split("|")
        sizes = [model.get_submodule(t).weight.shape[0] for t in targets]
        for t, piece in zip(targets, torch.split(w, sizes)):
            old = model.get_submodule(t)
            replace_linear(model, t, Fp8Linear(piece, w_scale, a_scale, old.bias))
            swapped += 1
    return swapped


def int_modules(model: torch.nn.Module, specs: list[L.TensorSpec], tensors: dict[str, torch.Tensor]) -> int:
    """Swap every linear whose engine weight is int4 / int8 (and a packed ``lm_head``) for a
    :class:`~dflash_trt.models.quant_linear.PackedLinear` over the engine's own codes and scales
    (torch's packed CPU GEMMs; activations and scales in the model's dtype). Fused tensors
    (fc / gate) are joined onto our modules by rows. An int4 module whose shape the kernel cannot
    pack stays dense (its weights are already the dequantized codes). Returns how many modules
    were swapped.
    """
    from ..models.quant_linear import PackedLinear, int4_fits, replace_module, unpack_nibbles

    parts: dict[str, list[tuple[int, str]]] = {}
    for sp in specs:
        base = sp.name[: -len(".weight")]
        if not sp.name.endswith(".weight") or base + ".weights_scaling_factor" not in tensors:
            continue
        if base + ".zero" in tensors or tensors[sp.name].dtype == torch.int8:
            module = sp.module or sp.source[: -len(".weight")]
            parts.setdefault(module, []).append((sp.rows[0] if sp.rows else 0, sp.name))
    swapped = 0
    for module, names in parts.items():
        names = [n for _, n in sorted(names)]
        bases = [n[: -len(".weight")] for n in names]
        int4 = bases[0] + ".zero" in tensors
        q = torch.cat([unpack_nibbles(tensors[n]) if int4 else tensors[n] for n in names])
        scale = torch.cat([tensors[b + ".weights_scaling_factor"] for b in bases])
        targets = module.split("|")
        mods = [model.get_submodule(t) for t in targets]
        sizes = [m.weight.shape[0] for m in mods]
        dtype = mods[0].weight.dtype
        zero = torch.cat([tensors[b + ".zero"] for b in bases]) if int4 else None
        group = q.shape[1] // scale.shape[1] if int4 else 0
        row = 0
        for t, old, n in zip(targets, mods, sizes):
            r = slice(row, row + n)
            row += n
            if int4 and not int4_fits(n, q.shape[1], group):
                continue
            new = (
                PackedLinear.from_int4(q[r], scale[r], zero[r], group, old.bias, dtype)
                if int4
                else PackedLinear.from_int8(q[r], scale[r].reshape(-1), old.bias, dtype)
            )
            replace_module(model, t, new)
            swapped += 1
    return swapped


def unshard_rank_files(
    specs: list[L.TensorSpec], ranks: list[dict[str, torch.Tensor]], qkv: tuple[int, int, int]
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
        if sp is None:  # a scale tensor: "<base>.<suffix>"
            sp = by_base[name.rsplit(".", 1)[0]]
            if parts[0].dim() != 2:  # per-tensor scales: the same on every rank
                out[name] = parts[0]
                continue
        out[name] = L.unshard(parts, sp.split, qkv)
    return out


@dataclass
class EngineShard:
    """What a rank of a tp_size > 1 engine holds besides its layers: its rank, the group size
    and its own rows of the (padded, vocab-parallel) embedding. The
    runtime (``runtime/distributed.attach_engine_shard``) gathers the embedding over the group
    and wires the all-reduces; before that the model cannot run."""

    rank: int
    tp_size: int
    embed_rows: torch.Tensor


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
    shard (local heads, intermediate and LM-head rows; ``model.engine_shard`` holds its
    embedding rows, see :class:`EngineShard`). The drafter is replicated by the runtime, so every
    rank reassembles it from the drafter's rank files (a few MB).

    Args:
        engine_dir: output of ``dflash-trt build``.
        dtype: compute dtype (default: the build's ``dtype``).
        rank: TP rank whose file is read.
        fp8_gemm: run FP8 linears as FP8 GEMMs (``torch._scaled_mm``, see :func:`fp8_modules`)
            instead of dequantizing them to ``dtype``.
        world_size: ranks in this job.
        packed: int4 / int8 linears (``target_quant`` / ``drafter_quant`` / ``weight_quant``
            in the manifest) run as packed CPU GEMMs (:func:`int_modules`); False (a GPU run)
            dequantizes them to ``dtype``.

    Returns:
        ``(target, drafter, manifest)``.

    Raises:
        DFlashError: bad directory or manifest, a missing or corrupt rank file, an engine whose
            tp_size differs from ``world_size``.
    """
    d = Path(engine_dir).expanduser()
    m = read_manifest(d)
    tp = int(m.get("tp_size", 1))
    if tp != world_size and not (tp == 1 and world_size > 1):
        raise DFlashError(
            f"engine {d} has tp_size {tp}: run it as {tp} ranks (mpiexec -n {tp}); this job has {world_size}"
        )
    cdt = dtype or parse_dtype(m.get("dtype", "fp32"))
    hf = read_json(d / "hf" / "target" / "config.json", "engine target")
    hf.pop("quantization_config", None)
    tcfg = TargetConfig.from_hf(hf)
    tt = load_safetensors_file(d / "target" / f"rank{rank if tp > 1 else 0}.safetensors", "engine target")
    specs = L.target_specs(tcfg)
    if tp == 1:
        model = TargetModel(tcfg)
        sd = state_dict_from_rank(specs, tt, model.state_dict(), cdt)
        if tcfg.tie_word_embeddings:
            sd["lm_head.weight"] = sd["embed.weight"]
    else:
        local = dataclasses.replace(
            tcfg,
            num_heads=tcfg.num_heads // tp,
            num_kv_heads=tcfg.num_kv_heads // tp,
            intermediate_size=tcfg.intermediate_size // tp,
        )
        model = TargetModel(local)
        head = dequantized(tt, "lm_head.weight", cdt)
        model.lm_head = torch.nn.Linear(tcfg.hidden_size, head.shape[0], bias=False)  # unties a tied head
        sd = state_dict_from_rank([sp for sp in specs if sp.split != L.VOCAB], tt, model.state_dict(), cdt)
        sd["lm_head.weight"] = head
        sd["embed.weight"] = torch.zeros_like(model.embed.weight, dtype=cdt)  # gathered by the runtime
        model.engine_shard = EngineShard(rank, tp, dequantized(tt, "transformer.vocab_embedding.weight", cdt))
    model.load_state_dict(sd, strict=True)
    model = model.to(cdt).eval()
    if fp8_gemm:
        fp8_modules(model, specs, tt)
    if packed:
        int_modules(model, specs, tt)
    target = with_tokenizer(model, d / "hf" / "target")

    dj = read_json(d / "hf" / "drafter" / "config.json", "engine drafter")
    dj.pop("quantization_config", None)
    dcfg = drafter_config_from_json(dj)
    dspecs = L.drafter_specs(dcfg)
    dt = [load_safetensors_file(d / "drafter" / f"rank{r}.safetensors", "engine drafter") for r in range(tp)]
    d2t = dt[0].get("d2t")  # replicated in every rank file, not sharded: set apart
    dt = [{k: v for k, v in r.items() if k != "d2t"} for r in dt]
    dt = (
        dt[0]
        if tp == 1
        else unshard_rank_files(dspecs, dt, L.qkv_sizes(dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim))
    )
    drafter = DFlashDrafter(dcfg)
    dsd = state_dict_from_rank(dspecs, dt, drafter.state_dict(), cdt)
    if dcfg.draft_vocab_size is not None:  # the draft vocabulary, int64, beside the weights
        if d2t is None:
            raise DFlashError(f"engine drafter declares draft_vocab_size {dcfg.draft_vocab_size} but has no d2t")
        check_d2t(d2t, dcfg.vocab_size, f"engine drafter {d}")
        dsd["d2t"] = d2t
    drafter.load_state_dict(dsd, strict=True)
    drafter = drafter.to(cdt).eval()
    if fp8_gemm:
        fp8_modules(drafter, dspecs, dt)
    if packed:
        int_modules(drafter, dspecs, dt)
    return target, drafter, m


def engine_files_ok(engine_dir: str | Path) -> list[str]:
    """Files whose size or sha256 differ from ``engine.json`` (empty when the engine is intact)."""
    d = Path(engine_dir)
    bad = []
    for rel, info in read_manifest(d)["files"].items():
        p = d / rel
        if not p.is_file() or p.stat().st_size != info["bytes"] or sha256_file(p) != info["sha256"]:
            bad.append(rel)
    return bad


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
) -> tuple[LoadedTarget, DFlashDrafter | None]:
    """What ``generate`` / ``bench`` run: an engine directory (``--engine``) or a checkpoint pair,
    on ``device`` (tensor-parallel ranks move to their own GPU afterwards).

    Args:
        weights: ``--weights`` (``int4`` / ``int8``: packed CPU linears, see
            :func:`.loader.load_target`) for a checkpoint pair. An engine's manifest decides its
            own (``weight_quant``), so with ``--engine`` it must be None or the engine's.

    Raises:
        DFlashError: ``--engine`` together with ``--target`` / ``--drafter``, ``fp8_gemm``
            without an engine, ``weights`` that contradict the engine's or with more than one
            rank, or anything the loaders raise.
    """
    from .loader import check_weights, load_pair

    check_weights(weights, device)
    if weights and world_size > 1:
        raise DFlashError(f"--weights {weights} runs on one rank (packed CPU GEMMs are not sharded); drop mpiexec")
    if fp8_gemm and engine_dir is None:
        raise DFlashError("--fp8-gemm needs --engine (an FP8 engine from dflash-trt build)")
    if engine_dir is None:
        return load_pair(target_spec, drafter_spec, dtype, need_drafter=need_drafter, device=device, weights=weights)
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
