"""TensorRT-LLM checkpoint layout: tensor names, quantized tensors and tensor-parallel splits.

Names follow TensorRT-LLM's LLaMA / Qwen checkpoint converters (``tensorrt_llm/models/llama/
convert.py``, ``models/qwen/convert.py``; the loader ``models/modeling_utils.py``), which ModelOpt's
``export_tensorrt_llm_checkpoint`` also writes:

=========================================  ======================  ==========================
TRT-LLM name                               ours (``TargetModel``)  TP split
=========================================  ======================  ==========================
``transformer.vocab_embedding.weight``     ``embed.weight``        vocab rows (padded)
``transformer.layers.N.input_layernorm``   ``attn_norm``           replicated
``transformer.layers.N.attention.qkv``     ``attn.qkv``            q, k, v rows each split
``transformer.layers.N.attention.dense``   ``attn.o``              columns (row-parallel)
``...attention.q_layernorm/k_layernorm``   ``attn.q_norm/k_norm``  replicated (Qwen3)
``transformer.layers.N.post_layernorm``    ``mlp_norm``            replicated
``transformer.layers.N.mlp.fc``            gate half of gate_up    rows (column-parallel)
``transformer.layers.N.mlp.gate``          up half of gate_up      rows (column-parallel)
``transformer.layers.N.mlp.proj``          ``mlp.down``            columns (row-parallel)
``transformer.ln_f.weight``                ``norm.weight``         replicated
``lm_head.weight``                         ``lm_head.weight``      vocab rows (padded)
=========================================  ======================  ==========================

``mlp.fc`` is the SiLU-gated projection (HF ``gate_proj``) and ``mlp.gate`` the up projection
(TensorRT-LLM ``GatedMLP``: ``proj(silu(fc(x)) * gate(x))``). The drafter uses the same names
for its decoder layers plus ``transformer.fc.weight`` (replicated: its output is normalised over
the whole hidden size) and ``transformer.hidden_norm.weight``.

Quantized linears (``quantization.quant_algo``) carry, next to ``weight``:
FP8 ``weights_scaling_factor`` and ``activation_scaling_factor`` (fp32 ``[1]``); NVFP4 ``weight``
uint8 ``[out, in/2]``, ``weights_scaling_factor`` float8_e4m3fn ``[out, in/16]``,
``weights_scaling_factor_2`` and ``activation_scaling_factor`` (fp32 ``[1]``); weight-only int4
(``W4A16_GPTQ``, tp 1) ``weight`` uint8 ``[out, in/2]`` codes 0..15, ``weights_scaling_factor`` and
``zero`` fp32 ``[out, in/group_size]`` (``w = q * scale + zero``); int8 (``W8A16``, tp 1) ``weight``
int8 ``[out, in]``, ``weights_scaling_factor`` fp32 ``[out, 1]`` (see ``docs/engine-format.md``).
Each rank holds whole attention and KV heads; the vocabulary is padded with zero rows to a
multiple of ``tp_size`` (TensorRT-LLM ``pad_vocab_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DFlashError
from ..models.config import DrafterConfig, TargetConfig

REPLICATE, COLUMN, ROW, QKV, VOCAB = "replicate", "column", "row", "qkv", "vocab"


@dataclass(frozen=True)
class TensorSpec:
    """One TensorRT-LLM tensor: where it comes from in our state dict and how it is split.

    Attributes:
        name: TensorRT-LLM name (``...weight`` / ``...bias``).
        source: our state-dict key.
        rows: row range ``(start, stop)`` of ``source`` (the fc / gate halves of gate_up), or None.
        split: ``replicate | column | row | qkv | vocab``.
        linear: a GEMM weight (quantizable); its activation-scale key is ``module``.
        module: our module name whose input amax calibrates this linear.
    """

    name: str
    source: str
    rows: tuple[int, int] | None = None
    split: str = REPLICATE
    linear: bool = False
    module: str = ""


def target_specs(cfg: TargetConfig) -> list[TensorSpec]:
    """The TensorRT-LLM tensors of a Llama / Qwen2 / Qwen3 target, in file order."""
    inter = cfg.intermediate_size
    out = [TensorSpec("transformer.vocab_embedding.weight", "embed.weight", split=VOCAB)]
    for i in range(cfg.num_layers):
        t, o = f"transformer.layers.{i}.", f"layers.{i}."
        out.append(TensorSpec(t + "input_layernorm.weight", o + "attn_norm.weight"))
        out.append(
            TensorSpec(t + "attention.qkv.weight", o + "attn.qkv.weight", split=QKV, linear=True, module=o + "attn.qkv")
        )
        if cfg.attention_bias:
            out.append(TensorSpec(t + "attention.qkv.bias", o + "attn.qkv.bias", split=QKV))
        out.append(
            TensorSpec(t + "attention.dense.weight", o + "attn.o.weight", split=ROW, linear=True, module=o + "attn.o")
        )
        if cfg.qk_norm:
            out.append(TensorSpec(t + "attention.q_layernorm.weight", o + "attn.q_norm.weight"))
            out.append(TensorSpec(t + "attention.k_layernorm.weight", o + "attn.k_norm.weight"))
        out.append(TensorSpec(t + "post_layernorm.weight", o + "mlp_norm.weight"))
        gu, gu_mod = o + "mlp.gate_up.weight", o + "mlp.gate_up"
        out.append(TensorSpec(t + "mlp.fc.weight", gu, rows=(0, inter), split=COLUMN, linear=True, module=gu_mod))
        out.append(
            TensorSpec(t + "mlp.gate.weight", gu, rows=(inter, 2 * inter), split=COLUMN, linear=True, module=gu_mod)
        )
        out.append(
            TensorSpec(t + "mlp.proj.weight", o + "mlp.down.weight", split=ROW, linear=True, module=o + "mlp.down")
        )
    out.append(TensorSpec("transformer.ln_f.weight", "norm.weight"))
    # the LM head is never quantized (it decides every draft and verify argmax): not a ``linear`` here
    out.append(TensorSpec("lm_head.weight", "lm_head.weight", split=VOCAB))
    return out


def drafter_specs(cfg: DrafterConfig) -> list[TensorSpec]:
    """The TensorRT-LLM-style tensors of a DFlash drafter (z-lab names on the right).

    q/k/v are fused into ``attention.qkv`` like the target's (their sources are concatenated by
    :func:`gather`); the source key of a fused tensor is ``"a|b|c"``.
    """
    out = [
        TensorSpec("transformer.fc.weight", "fc.weight", linear=True, module="fc"),
        TensorSpec("transformer.hidden_norm.weight", "hidden_norm.weight"),
    ]
    for i in range(cfg.num_layers):
        t, o = f"transformer.layers.{i}.", f"layers.{i}."
        a = o + "self_attn."
        out.append(TensorSpec(t + "input_layernorm.weight", o + "input_layernorm.weight"))
        out.append(
            TensorSpec(
                t + "attention.qkv.weight",
                "|".join(a + n + ".weight" for n in ("q_proj", "k_proj", "v_proj")),
                split=QKV,
                linear=True,
                module=a + "q_proj|" + a + "k_proj|" + a + "v_proj",
            )
        )
        if cfg.attention_bias:
            out.append(
                TensorSpec(
                    t + "attention.qkv.bias",
                    "|".join(a + n + ".bias" for n in ("q_proj", "k_proj", "v_proj")),
                    split=QKV,
                )
            )
        out.append(
            TensorSpec(t + "attention.dense.weight", a + "o_proj.weight", split=ROW, linear=True, module=a + "o_proj")
        )
        out.append(TensorSpec(t + "attention.q_layernorm.weight", a + "q_norm.weight"))
        out.append(TensorSpec(t + "attention.k_layernorm.weight", a + "k_norm.weight"))
        out.append(TensorSpec(t + "post_layernorm.weight", o + "post_attention_layernorm.weight"))
        m = o + "mlp."
        out.append(
            TensorSpec(t + "mlp.fc.weight", m + "gate_proj.weight", split=COLUMN, linear=True, module=m + "gate_proj")
        )
        out.append(
            TensorSpec(t + "mlp.gate.weight", m + "up_proj.weight", split=COLUMN, linear=True, module=m + "up_proj")
        )
        out.append(
            TensorSpec(t + "mlp.proj.weight", m + "down_proj.weight", split=ROW, linear=True, module=m + "down_proj")
        )
    out.append(TensorSpec("transformer.ln_f.weight", "norm.weight"))
    return out


def hf_target_specs(cfg: TargetConfig) -> list[TensorSpec]:
    """HF names of the target (ModelOpt unified export keeps them) with their sources: q/k/v and
    gate/up are row ranges of our fused weights."""
    inter = cfg.intermediate_size
    out = [TensorSpec("model.embed_tokens.weight", "embed.weight")]
    for i in range(cfg.num_layers):
        h, o = f"model.layers.{i}.", f"layers.{i}."
        out.append(TensorSpec(h + "input_layernorm.weight", o + "attn_norm.weight"))
        for name, rows in qkv_rows(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            out.append(TensorSpec(h + f"self_attn.{name}.weight", o + "attn.qkv.weight", rows=rows, linear=True))
            if cfg.attention_bias:
                out.append(TensorSpec(h + f"self_attn.{name}.bias", o + "attn.qkv.bias", rows=rows))
        out.append(TensorSpec(h + "self_attn.o_proj.weight", o + "attn.o.weight", linear=True))
        if cfg.qk_norm:
            out.append(TensorSpec(h + "self_attn.q_norm.weight", o + "attn.q_norm.weight"))
            out.append(TensorSpec(h + "self_attn.k_norm.weight", o + "attn.k_norm.weight"))
        out.append(TensorSpec(h + "post_attention_layernorm.weight", o + "mlp_norm.weight"))
        out.append(TensorSpec(h + "mlp.gate_proj.weight", o + "mlp.gate_up.weight", rows=(0, inter), linear=True))
        out.append(TensorSpec(h + "mlp.up_proj.weight", o + "mlp.gate_up.weight", rows=(inter, 2 * inter), linear=True))
        out.append(TensorSpec(h + "mlp.down_proj.weight", o + "mlp.down.weight", linear=True))
    out.append(TensorSpec("model.norm.weight", "norm.weight"))
    if not cfg.tie_word_embeddings:
        out.append(TensorSpec("lm_head.weight", "lm_head.weight"))
    return out


def hf_drafter_specs(cfg: DrafterConfig) -> list[TensorSpec]:
    """z-lab names of the drafter; q/k/v are row ranges of the fused (quantized-together) qkv
    source that :func:`drafter_specs` uses."""
    out = [
        TensorSpec("fc.weight", "fc.weight", linear=True),
        TensorSpec("hidden_norm.weight", "hidden_norm.weight"),
        TensorSpec("norm.weight", "norm.weight"),
    ]
    for i in range(cfg.num_layers):
        o = f"layers.{i}."
        a = o + "self_attn."
        fused = "|".join(a + n + ".weight" for n in ("q_proj", "k_proj", "v_proj"))
        for name, rows in qkv_rows(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            out.append(TensorSpec(a + name + ".weight", fused, rows=rows, linear=True))
            if cfg.attention_bias:
                out.append(TensorSpec(a + name + ".bias", fused.replace(".weight", ".bias"), rows=rows))
        out.append(TensorSpec(a + "o_proj.weight", a + "o_proj.weight", linear=True))
        names = [a + "q_norm", a + "k_norm", o + "input_layernorm", o + "post_attention_layernorm"]
        out += [TensorSpec(n + ".weight", n + ".weight") for n in names]
        out += [
            TensorSpec(o + f"mlp.{n}.weight", o + f"mlp.{n}.weight", linear=True)
            for n in ("gate_proj", "up_proj", "down_proj")
        ]
    return out


def gather_source(sd: dict[str, torch.Tensor], source: str) -> torch.Tensor:
    """Our tensor ``source``, or the row-wise concatenation of ``"a|b|c"`` (a fused q/k/v)."""
    return torch.cat([sd[k] for k in source.split("|")]) if "|" in source else sd[source]


def gather(sd: dict[str, torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    """The full (unsharded) tensor of ``spec`` from our state dict."""
    t = gather_source(sd, spec.source)
    return t[spec.rows[0] : spec.rows[1]] if spec.rows else t


def check_tp(cfg: TargetConfig | DrafterConfig, tp: int, what: str) -> None:
    """Raises DFlashError when ``tp`` cannot give every rank whole heads and equal splits."""
    heads, kv_heads, intermediate = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if tp < 1:
        raise DFlashError(f"tp_size must be >= 1, got {tp}")
    if heads % tp or kv_heads % tp:
        raise DFlashError(
            f"tp_size {tp} does not divide the {what}'s {heads} attention heads and {kv_heads} KV heads "
            f"(each rank must hold whole heads); use a tp_size dividing both"
        )
    if intermediate % tp:
        raise DFlashError(f"tp_size {tp} does not divide the {what}'s intermediate size {intermediate}")


def qkv_sizes(heads: int, kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """Rows of q, k and v in a fused qkv weight."""
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


def qkv_rows(heads: int, kv_heads: int, head_dim: int) -> list[tuple[str, tuple[int, int]]]:
    """``[("q_proj", (0, q)), ("k_proj", (q, q + k)), ("v_proj", (q + k, q + k + v))]``."""
    q, k, v = qkv_sizes(heads, kv_heads, head_dim)
    return [("q_proj", (0, q)), ("k_proj", (q, q + k)), ("v_proj", (q + k, q + k + v))]


def padded_vocab(vocab: int, tp: int) -> int:
    """TensorRT-LLM ``pad_vocab_size``: the next multiple of ``tp``."""
    return -(-vocab // tp) * tp


def shard(
    t: torch.Tensor, split: str, tp: int, rank: int, qkv: tuple[int, int, int] | None = None, col_unit: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` (a weight, a packed NVFP4 weight or a block-scale tensor).

    Args:
        t: ``[rows, cols]`` or ``[rows]``.
        split: see :class:`TensorSpec`. ``qkv`` needs ``qkv`` = row counts of q, k, v in ``t``
            (already divided by ``col_unit`` packing for rows: rows are never packed).
        col_unit: logical input elements per stored column (2 for packed NVFP4, 16 for its
            block scales); only used in error messages.

    Raises:
        DFlashError: a dimension that does not divide by ``tp``.
    """
    if split == REPLICATE or tp == 1 and split != VOCAB:
        return t.contiguous()
    if split == VOCAB:
        pad = padded_vocab(t.shape[0], tp) - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
        return t.chunk(tp, 0)[rank].contiguous()
    if split == COLUMN:
        if t.shape[0] % tp:
            raise DFlashError(f"cannot split {t.shape[0]} rows over tp_size {tp}")
        return t.chunk(tp, 0)[rank].contiguous()
    if split == ROW:
        if t.shape[1] % tp:
            raise DFlashError(
                f"cannot split {t.shape[1] * col_unit} input columns over tp_size {tp}"
                + (" in whole NVFP4 16-element blocks" if col_unit > 1 else "")
            )
        return t.chunk(tp, 1)[rank].contiguous()
    if split == QKV:
        parts = torch.split(t, list(qkv), 0)
        return torch.cat([p.chunk(tp, 0)[rank] for p in parts]).contiguous()
    raise ValueError(f"unknown split {split!r}")


def unshard(
    parts: list[torch.Tensor], split: str, qkv: tuple[int, int, int] | None = None, rows: int | None = None
) -> torch.Tensor:
    """Inverse of :func:`shard` over all ranks' parts (``rows``: the unpadded vocabulary)."""
    tp = len(parts)
    if split == REPLICATE or tp == 1 and split != VOCAB:
        return parts[0]
    if split == VOCAB:
        return torch.cat(parts)[:rows]
    if split == COLUMN:
        return torch.cat(parts)
    if split == ROW:
        return torch.cat(parts, 1)
    if split == QKV:
        per = [s // tp for s in qkv]
        pieces = [torch.split(p, per, 0) for p in parts]
        return torch.cat([torch.cat([pc[j] for pc in pieces]) for j in range(3)])
    raise ValueError(f"unknown split {split!r}")
