"""Memory plan of an engine: bytes per TP rank and the KV-cache token capacity left.

Per rank (weights sharded as :mod:`..checkpoints.trtllm` lays them out, so the plan is what ``build`` writes):

* target weights and drafter weights, at their stored size (NVFP4: half a byte per element +
  one e4m3 scale per 16 elements; FP8: one byte; int4: half a byte + a (scale, zero) pair in the
  compute dtype per 32 elements, as the packed CPU path holds them; int8: one byte + a scale per
  output row; unquantized: the compute dtype; the LM head counts dense);
* target KV per token: ``2 x layers x (kv_heads / tp) x head_dim x kv bytes``;
* drafter context KV per token: the same for the drafter's layers (every committed position is
  also a drafter context position);
* workspace: activations of one ``max_num_tokens`` forward (qkv, attention output, gate/up and
  the residual stream, twice for in/out buffers) + fp32 logits of ``max_batch_size x block_size``
  rows over the rank's vocabulary shard — an estimate, stated as one;
* KV token capacity = (usable memory - weights - workspace) / (target + drafter KV per token);
  max concurrency = whole ``max_seq_len`` sequences in that, capped by ``max_batch_size``.

A mixture-of-experts target (Qwen3-MoE, gpt-oss) is planned from its ``config.json`` alone by
:func:`moe_memory_plan` (formats, MoE-TP / EP splits, sliding-window KV and parameter counts:
``builder/moe_plan.py``).

Raises :class:`DFlashError` (via :meth:`MemoryPlan.check`) when the weights do not fit or the cache
cannot hold one ``max_seq_len`` sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..checkpoints import trtllm
from ..checkpoints.loader import dtype_bytes
from ..errors import DFlashError
from ..models.config import DrafterConfig, TargetConfig
from .config import BuildConfig


def _tensor_bytes(shape: tuple[int, ...], fmt: str, dtype_bytes: int, linear: bool) -> float:
    n = 1
    for d in shape:
        n *= d
    if not linear or fmt == "none":
        return n * dtype_bytes
    if fmt == "fp8":
        return n + 8  # e4m3 weight + weight and activation scales
    if fmt == "int4":
        return n / 2 + n / 32 * 2 * dtype_bytes  # packed codes + a (scale, zero) pair per group of 32
    if fmt == "int8":
        return n + shape[0] * dtype_bytes  # int8 codes + one scale per output row
    return n / 2 + n / 16 + 8  # packed e2m1 + e4m3 block scales + global scales


def _rank_shape(spec: trtllm.TensorSpec, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if spec.split == trtllm.REPLICATE:
        return shape
    if spec.split == trtllm.VOCAB:
        return (trtllm.padded_vocab(shape[0], tp) // tp, *shape[1:])
    if spec.split == trtllm.ROW:
        return (shape[0], shape[1] // tp)
    return (shape[0] // tp, *shape[1:])  # column, qkv


def weight_bytes(
    specs: list[trtllm.TensorSpec], shapes: dict[str, tuple[int, ...]], fmt: str, dtype_bytes: int, tp: int
) -> float:
    """Bytes of one rank's tensors (``shapes``: full shape per spec name)."""
    total = 0.0
    for s in specs:
        total += _tensor_bytes(_rank_shape(s, shapes[s.name], tp), fmt, dtype_bytes, s.linear)
    return total


def spec_shapes(specs: list[trtllm.TensorSpec], model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Full shapes of ``specs`` from a model built on the meta device (no weights needed)."""
    sd = model.state_dict()
    out = {}
    for s in specs:
        parts = [tuple(sd[k].shape) for k in s.source.split("|")]
        rows = sum(p[0] for p in parts)
        if s.rows:
            rows = s.rows[1] - s.rows[0]
        out[s.name] = (rows, *parts[0][1:])
    return out


@dataclass
class MemoryPlan:
    """The plan, bytes per rank (see the module docstring)."""

    gpu: str
    tp_size: int
    usable_bytes: float
    target_weight_bytes: float
    drafter_weight_bytes: float
    workspace_bytes: float
    target_kv_bytes_per_token: float
    drafter_kv_bytes_per_token: float
    kv_token_capacity: int
    max_seq_len: int
    max_batch_size: int
    #: mixture-of-experts targets: ``"moe_tp_size N x moe_ep_size M: ..."``, per-rank target bytes
    #: by role, parameter counts ``{total, active, active_with_embedding}``, how KV is counted
    moe_split: str | None = None
    target_weights_by_role: dict | None = None
    params: dict | None = None
    kv_note: str | None = None

    @property
    def full_sequences(self) -> float:
        return self.kv_token_capacity / self.max_seq_len

    @property
    def max_concurrency(self) -> int:
        """Sequences of ``max_seq_len`` tokens the KV cache holds at once, at most ``max_batch_size``."""
        return min(self.max_batch_size, int(self.full_sequences))

    def to_dict(self) -> dict:
        return asdict(self) | {"full_sequences": self.full_sequences, "max_concurrency": self.max_concurrency}

    def check(self) -> None:
        """Raises DFlashError when the engine does not fit (with the numbers)."""
        weights = self.target_weight_bytes + self.drafter_weight_bytes
        if weights + self.workspace_bytes > self.usable_bytes:
            raise DFlashError(
                f"does not fit on {self.gpu} x{self.tp_size}: weights {_gb(weights)} + "
                f"workspace {_gb(self.workspace_bytes)} per rank exceed the usable {_gb(self.usable_bytes)}; "
                "raise tp_size, quantize, or lower max_num_tokens"
            )
        if self.kv_token_capacity < self.max_seq_len:
            raise DFlashError(
                f"KV cache too small on {self.gpu} x{self.tp_size}: room for {self.kv_token_capacity} tokens per rank, "
                f"one sequence needs max_seq_len {self.max_seq_len}; lower max_seq_len, use an fp8 KV cache "
                "or raise tp_size"
            )

    def table(self) -> str:
        kv = self.target_kv_bytes_per_token + self.drafter_kv_bytes_per_token
        rows = [("usable memory", _gb(self.usable_bytes)), ("target weights", _gb(self.target_weight_bytes))]
        for role, b in (self.target_weights_by_role or {}).items():
            rows.append((f"  {role}", _gb(b)))
        rows += [
            ("drafter weights", _gb(self.drafter_weight_bytes)),
            ("workspace (estimate)", _gb(self.workspace_bytes)),
            ("target KV per token", f"{self.target_kv_bytes_per_token / 1024:.1f} KiB"),
            ("drafter context KV per token", f"{self.drafter_kv_bytes_per_token / 1024:.1f} KiB"),
            ("KV token capacity", f"{self.kv_token_capacity:,} tokens ({kv / 1024:.1f} KiB each)"),
            (
                "sequences at max_seq_len",
                f"{self.full_sequences:,.1f} x {self.max_seq_len} tokens (max_batch_size {self.max_batch_size})",
            ),
            ("max concurrency", f"{self.max_concurrency:,} sequences"),
        ]
        head = [f"memory plan per rank: {self.gpu}, tp_size {self.tp_size}"]
        if self.moe_split:
            head.append(self.moe_split)
        if self.params:
            p = self.params
            head.append(
                f"parameters: {p['total'] / 1e9:.2f}B total, {p['active'] / 1e9:.2f}B active per token "
                f"(LM head counted, embedding not; {p['active_with_embedding'] / 1e9:.2f}B with it)"
            )
        lines = head + ["-" * 60] + [f"{k:<30} {v:>28}" for k, v in rows]
        return "\n".join(lines + ([self.kv_note] if self.kv_note else []))


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def memory_plan(bc: BuildConfig, tcfg: TargetConfig, dcfg: DrafterConfig | None) -> MemoryPlan:
    """The plan of ``bc`` for a target (and drafter) shape; shapes only, no weights read.

    A mixture-of-experts target goes to :func:`moe_memory_plan`.

    Raises:
        DFlashError: tp_size does not divide the heads.
    """
    from ..models.target import TargetModel

    if tcfg.num_experts:
        from .moe_plan import MoEShape

        return moe_memory_plan(bc, MoEShape.from_target(tcfg), dcfg)
    tp = bc.tp_size
    trtllm.check_tp(tcfg, tp, "target")
    act = dtype_bytes(bc.dtype)
    kvb = dtype_bytes(bc.kv_dtype)
    with torch.device("meta"):
        tmodel = TargetModel(tcfg)
        tspecs = trtllm.target_specs(tcfg)
        tw = weight_bytes(tspecs, spec_shapes(tspecs, tmodel), bc.target_quant, act, tp)
    dw, dkv = drafter_plan_bytes(bc, dcfg)
    tkv = 2 * tcfg.num_layers * (tcfg.num_kv_heads // tp) * tcfg.head_dim * kvb
    mlp_act = 2 * tcfg.intermediate_size // tp
    return _assemble(bc, tcfg, tw, dw, tkv, dkv, mlp_act)


def _assemble(
    bc: BuildConfig, shape, tw: float, dw: float, tkv: float, dkv: float, mlp_act: int, **extra
) -> MemoryPlan:
    """The :class:`MemoryPlan` of weights ``tw`` / ``dw`` bytes and KV ``tkv`` / ``dkv`` bytes per
    token: the workspace estimate (one ``max_num_tokens`` forward's qkv, attention output,
    ``mlp_act`` MLP activations and the residual stream, twice, + fp32 logits of
    ``max_batch_size x block_size`` rows over the rank's vocabulary shard) and the KV token
    capacity left. ``shape`` has ``num_heads``, ``num_kv_heads``, ``head_dim``, ``hidden_size``,
    ``vocab_size``; ``extra`` goes to the plan's optional fields."""
    tp, act = bc.tp_size, dtype_bytes(bc.dtype)
    q, k, v = trtllm.qkv_sizes(shape.num_heads, shape.num_kv_heads, shape.head_dim)
    per_token = ((q + k + v) // tp + q // tp + mlp_act + 2 * shape.hidden_size) * act * 2
    logits = bc.max_batch_size * bc.block_size * (trtllm.padded_vocab(shape.vocab_size, tp) // tp) * 4
    work = bc.max_num_tokens * per_token + logits
    free = bc.memory_bytes - tw - dw - work
    cap = max(0, int(free // (tkv + dkv))) if free > 0 else 0
    return MemoryPlan(
        gpu=bc.device.name,
        tp_size=tp,
        usable_bytes=bc.memory_bytes,
        target_weight_bytes=tw,
        drafter_weight_bytes=dw,
        workspace_bytes=work,
        target_kv_bytes_per_token=tkv,
        drafter_kv_bytes_per_token=dkv,
        kv_token_capacity=cap,
        max_seq_len=bc.max_seq_len,
        max_batch_size=bc.max_batch_size,
        **extra,
    )


def drafter_plan_bytes(bc: BuildConfig, dcfg: DrafterConfig | None) -> tuple[float, float]:
    """(drafter weight bytes, drafter context KV bytes per token) of one rank.

    Raises:
        DFlashError: tp_size does not divide the drafter's heads.
    """
    if dcfg is None:
        return 0.0, 0.0
    from ..models.drafter import DFlashDrafter

    tp = bc.tp_size
    trtllm.check_tp(dcfg, tp, "drafter")
    with torch.device("meta"):
        dspecs = trtllm.drafter_specs(dcfg)
        dw = weight_bytes(dspecs, spec_shapes(dspecs, DFlashDrafter(dcfg)), bc.drafter_quant, dtype_bytes(bc.dtype), tp)
    return dw, 2 * dcfg.num_layers * (dcfg.num_kv_heads // tp) * dcfg.head_dim * dtype_bytes(bc.kv_dtype)


def moe_memory_plan(bc: BuildConfig, shape, dcfg: DrafterConfig | None) -> MemoryPlan:
    """The plan of ``bc`` for a mixture-of-experts target ``shape``
    (:class:`~dflash_trt.builder.moe_plan.MoEShape`; see ``builder/moe_plan.py`` for the
    formats, splits and KV counting), with parameter counts.

    Raises:
        DFlashError: a TP / MoE-TP / EP split that does not divide heads, experts or widths, or
            a CPU weight format (int4 / int8) for a mixture-of-experts target.
    """
    from . import moe_plan as mp

    if bc.target_quant in ("int4", "int8"):
        raise DFlashError(f"target_quant {bc.target_quant} is not planned for a mixture-of-experts target")
    tp = bc.tp_size
    mtp, mep = bc.moe_split
    mp.check_moe_split(shape, tp, mtp, mep, bc.expert_format)
    act = dtype_bytes(bc.dtype)
    fmt = bc.expert_format
    by_role = mp.rank_weight_bytes(shape, bc.target_quant, fmt, act, tp, mtp, mep)
    tw = sum(by_role.values())
    dw, dkv = drafter_plan_bytes(bc, dcfg)
    tkv = mp.kv_bytes_per_token(shape, tp, dtype_bytes(bc.kv_dtype), bc.max_seq_len, bc.block_size)
    moe_act = shape.top_k * (2 * shape.expert_intermediate // mtp + shape.hidden_size)
    mlp_act = max(moe_act, 2 * shape.dense_intermediate // tp)
    counts = mp.param_counts(shape)
    dense = "" if all(shape.sparse) else " and dense MLPs"
    n_swa = sum(w is not None for w in shape.windows)
    kv_note = "KV: every layer holds every token of a sequence"
    if n_swa:
        w = next(w for w in shape.windows if w is not None)
        held = min(bc.max_seq_len, w + bc.block_size)
        kv_note = (
            f"KV: {shape.num_layers - n_swa} full-attention layers hold every token; {n_swa} sliding-window layers "
            f"(W {w}) hold min(max_seq_len, W + block_size) = {held} tokens per sequence "
            "(TensorRT-LLM max_attention_window), averaged into the KV per token above"
        )
    return _assemble(
        bc,
        shape,
        tw,
        dw,
        tkv,
        dkv,
        mlp_act,
        moe_split=(
            f"{shape.family}: moe_tp_size {mtp} x moe_ep_size {mep}: {shape.num_experts // mep} of "
            f"{shape.num_experts} experts per rank, {shape.expert_intermediate // mtp} of {shape.expert_intermediate} "
            f"expert width; experts {fmt}, attention{dense} {bc.target_quant}, "
            f"router {'fp32' if shape.family == 'qwen3_moe' else bc.dtype}"
        ),
        target_weights_by_role=by_role,
        params={
            "total": counts.total,
            "active": counts.active,
            "active_with_embedding": counts.active_with_embedding,
        },
        kv_note=kv_note,
    )
