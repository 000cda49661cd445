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

Qwen3-MoE sparse layers (``models/qwen/convert.py``, MoE branch; ``layers/moe.py``
``MOEWeightWrapper`` for the quantized parameters):

==========================================  ===============================  ==============================
TRT-LLM name                                ours (``MoEBlock``)              split over the tp_size ranks
==========================================  ===============================  ==============================
``transformer.layers.N.mlp.router.weight``  ``mlp.gate.weight`` ``[E, H]``   replicated, fp32, never quantized
``transformer.layers.N.mlp.fc.weight``      ``mlp.gate_up`` ``[E, 2Im, H]``  ``[E/ep, 2Im/mtp, H]``: per expert
                                            as ``[up; gate]`` (``w3, w1``)   ``concat([up_r, gate_r])``
``transformer.layers.N.mlp.proj.weight``    ``mlp.down`` ``[E, H, Im]``      ``[E/ep, H, Im/mtp]``
==========================================  ===============================  ==============================

Rank ``r`` is MoE-TP rank ``r // moe_ep_size`` and EP rank ``r % moe_ep_size`` and holds the
contiguous experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` (``mapping.py``: ``moe_tp_rank``,
``moe_ep_rank``, ``ep_experts``). Quantized experts stack the per-expert tensors on a leading
expert axis: FP8 ``weight`` e4m3 ``[E, out, in]``, ``weights_scaling_factor`` fp32 ``[E, 1]``
(gate and up share it, as TensorRT-LLM requires); NVFP4 ``weight`` uint8 ``[E, out, in/2]``,
``weights_scaling_factor`` e4m3 ``[E, out, in/16]``, ``weights_scaling_factor_2`` fp32 ``[E, 1]``
(gate and up share it); both with one ``activation_scaling_factor`` fp32 ``[1]`` per GEMM (the
largest input range over the experts, TensorRT-LLM's "use max input range").

gpt-oss has no TensorRT-LLM checkpoint converter (no ``tensorrt_llm/models/gpt_oss``): TensorRT-LLM
runs it on its PyTorch backend from the HF layout (``_torch/models/modeling_gpt_oss.py``), which the
unified HF checkpoint of a build is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import DFlashError
from ..models.config import DrafterConfig, TargetConfig

REPLICATE, COLUMN, ROW, QKV, VOCAB = "replicate", "column", "row", "qkv", "vocab"
#: stacked experts: ``[E, 2Im, H]`` fc (EP on experts, MoE-TP on each half's rows) and
#: ``[E, H, Im]`` proj (EP on experts, MoE-TP on the input columns)
EXPERT_FC, EXPERT_PROJ = "expert_fc", "expert_proj"
#: stacked experts written in transformers' ``[E, in, out]`` orientation (gpt-oss HF layout),
#: quantized with one per-tensor scale over all experts as ModelOpt's export does
HF_EXPERTS = "hf_experts"


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
        expert: index into a stacked ``[E, ...]`` source (one expert of the HF layout), or None.
        swap_halves: write the source's two row halves in the other order (``[gate; up]`` ->
            TensorRT-LLM's ``[up; gate]`` expert fc).
        dtype: ``fp32`` to store the tensor in fp32 whatever the compute dtype (the MoE router),
            or "" (the compute dtype).
        interleave: write the source's ``[gate; up]`` halves of axis 1 interleaved (gate row 0,
            up row 0, gate row 1, ...: transformers' ``GptOssExperts`` layout).
    """

    name: str
    source: str
    rows: tuple[int, int] | None = None
    split: str = REPLICATE
    linear: bool = False
    module: str = ""
    expert: int | None = None
    swap_halves: bool = False
    dtype: str = ""
    interleave: bool = False


def target_specs(cfg: TargetConfig) -> list[TensorSpec]:
    """The TensorRT-LLM tensors of a Llama / Qwen2 / Qwen3 / Qwen3-MoE target, in file order.

    Raises:
        DFlashError: a gpt-oss target (TensorRT-LLM has no checkpoint converter for it).
    """
    if cfg.family == "gpt_oss":
        raise DFlashError("gpt-oss has no TensorRT-LLM checkpoint layout: TensorRT-LLM reads its HF layout")
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
        if cfg.is_moe_layer(i):
            m = o + "mlp."
            out.append(TensorSpec(t + "mlp.router.weight", m + "gate.weight", dtype="fp32"))
            fc = TensorSpec(t + "mlp.fc.weight", m + "gate_up", split=EXPERT_FC, linear=True, swap_halves=True)
            out.append(dataclasses.replace(fc, module=m + "gate_up"))
            out.append(TensorSpec(t + "mlp.proj.weight", m + "down", split=EXPERT_PROJ, linear=True, module=m + "down"))
            continue
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
    gate/up are row ranges of our fused weights; ``module`` names the linear whose calibrated
    input range quantizes it (a gpt-oss build quantizes from these specs).

    Mixture-of-experts layers: Qwen3-MoE per-expert names (``mlp.experts.{e}.{gate,up,down}_proj``,
    router ``mlp.gate``); gpt-oss transformers' fused ``GptOssExperts`` (``mlp.experts.gate_up_proj
    [E, H, 2I]`` with gate and up interleaved along the last axis, ``down_proj [E, I, H]``, their
    biases, router ``mlp.router`` with a bias), attention ``sinks`` and the ``o_proj`` bias.
    """
    inter = cfg.intermediate_size
    out = [TensorSpec("model.embed_tokens.weight", "embed.weight")]
    for i in range(cfg.num_layers):
        h, o = f"model.layers.{i}.", f"layers.{i}."
        qkv, ow = o + "attn.qkv", o + "attn.o"
        out.append(TensorSpec(h + "input_layernorm.weight", o + "attn_norm.weight"))
        for name, rows in qkv_rows(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            out.append(TensorSpec(h + f"self_attn.{name}.weight", qkv + ".weight", rows=rows, linear=True, module=qkv))
            if cfg.attention_bias:
                out.append(TensorSpec(h + f"self_attn.{name}.bias", qkv + ".bias", rows=rows))
        out.append(TensorSpec(h + "self_attn.o_proj.weight", ow + ".weight", linear=True, module=ow))
        if cfg.o_bias:
            out.append(TensorSpec(h + "self_attn.o_proj.bias", ow + ".bias"))
        if cfg.attn_sinks:
            out.append(TensorSpec(h + "self_attn.sinks", o + "attn.sinks"))
        if cfg.qk_norm:
            out.append(TensorSpec(h + "self_attn.q_norm.weight", o + "attn.q_norm.weight"))
            out.append(TensorSpec(h + "self_attn.k_norm.weight", o + "attn.k_norm.weight"))
        out.append(TensorSpec(h + "post_attention_layernorm.weight", o + "mlp_norm.weight"))
        m, gu, dn = o + "mlp.", o + "mlp.gate_up", o + "mlp.down"
        if cfg.is_moe_layer(i) and cfg.family == "gpt_oss":  # ModelOpt's export keeps the fused experts
            x = h + "mlp.experts."
            out.append(TensorSpec(h + "mlp.router.weight", m + "gate.weight"))
            out.append(TensorSpec(h + "mlp.router.bias", m + "gate.bias"))
            out.append(TensorSpec(x + "gate_up_proj", gu, split=HF_EXPERTS, linear=True, module=gu, interleave=True))
            out.append(TensorSpec(x + "gate_up_proj_bias", m + "gate_up_bias", interleave=True))
            out.append(TensorSpec(x + "down_proj", dn, split=HF_EXPERTS, linear=True, module=dn))
            out.append(TensorSpec(x + "down_proj_bias", m + "down_bias"))
            continue
        if cfg.is_moe_layer(i):  # ModelOpt's export: per-expert HF names, the router (mlp.gate) unquantized
            im = cfg.moe_intermediate_size
            out.append(TensorSpec(h + "mlp.gate.weight", m + "gate.weight"))
            for e in range(cfg.num_experts):
                x = h + f"mlp.experts.{e}."
                out.append(TensorSpec(x + "gate_proj.weight", gu, rows=(0, im), linear=True, module=gu, expert=e))
                out.append(TensorSpec(x + "up_proj.weight", gu, rows=(im, 2 * im), linear=True, module=gu, expert=e))
                out.append(TensorSpec(x + "down_proj.weight", dn, linear=True, module=dn, expert=e))
            continue
        gw, dw = gu + ".weight", dn + ".weight"
        out.append(TensorSpec(h + "mlp.gate_proj.weight", gw, rows=(0, inter), linear=True, module=gu))
        out.append(TensorSpec(h + "mlp.up_proj.weight", gw, rows=(inter, 2 * inter), linear=True, module=gu))
        out.append(TensorSpec(h + "mlp.down_proj.weight", dw, linear=True, module=dn))
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
    """The full (unsharded) tensor of ``spec`` from our state dict (one expert of a stacked
    source, its halves swapped, its row range, as the spec says)."""
    t = gather_source(sd, spec.source)
    if spec.expert is not None:
        t = t[spec.expert]
    if spec.swap_halves:
        t = swap_halves(t)
    if spec.interleave:
        t = interleave_halves(t)
    return t[spec.rows[0] : spec.rows[1]] if spec.rows else t


def interleave_halves(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``[a; b]`` along ``dim`` -> ``a0, b0, a1, b1, ...`` (our ``[gate; up]`` -> gpt-oss's
    interleaved gate/up, transformers' ``GptOssExperts``: gate ``[..., ::2]``, up ``[..., 1::2]``)."""
    dim %= t.dim()
    a, b = t.chunk(2, dim)
    return torch.stack([a, b], dim + 1).flatten(dim, dim + 1)


def swap_halves(t: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """``[a; b]`` -> ``[b; a]`` along ``dim`` (our ``[gate; up]`` expert rows -> TensorRT-LLM's ``[up; gate]``)."""
    a, b = t.chunk(2, dim)
    return torch.cat([b, a], dim)


def moe_ranks(rank: int, moe_ep: int) -> tuple[int, int]:
    """``(moe_tp_rank, moe_ep_rank)`` of TP rank ``rank`` (TensorRT-LLM ``Mapping``)."""
    return rank // moe_ep, rank % moe_ep


def shard_experts(t: torch.Tensor, split: str, moe_tp: int, moe_ep: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of a stacked expert tensor: ``[E, rows, cols]`` (a weight, packed or
    not, or NVFP4 block scales) keeps experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` and the
    MoE-TP slice (``EXPERT_FC``: rank ``moe_tp_rank``'s rows of each half, ``[up_r; gate_r]``;
    ``EXPERT_PROJ``: its input columns); ``[E, 1]`` per-expert scales keep the rank's experts;
    ``[1]`` activation scales are whole.

    Raises:
        DFlashError: experts, rows or columns that do not divide by the EP / MoE-TP size.
    """
    if t.dim() == 1:
        return t.contiguous()
    tp_rank, ep_rank = moe_ranks(rank, moe_ep)
    if t.shape[0] % moe_ep:
        raise DFlashError(f"cannot split {t.shape[0]} experts over moe_ep_size {moe_ep}")
    t = t.chunk(moe_ep, 0)[ep_rank]
    if t.dim() == 2 or moe_tp == 1:
        return t.contiguous()
    if split == EXPERT_FC:
        halves = t.chunk(2, 1)
        if halves[0].shape[1] % moe_tp:
            raise DFlashError(f"cannot split {halves[0].shape[1]} expert rows over moe_tp_size {moe_tp}")
        return torch.cat([h.chunk(moe_tp, 1)[tp_rank] for h in halves], 1).contiguous()
    if t.shape[2] % moe_tp:
        raise DFlashError(f"cannot split {t.shape[2]} stored expert input columns over moe_tp_size {moe_tp}")
    return t.chunk(moe_tp, 2)[tp_rank].contiguous()


def unshard_experts(parts: list[torch.Tensor], split: str, moe_tp: int, moe_ep: int) -> torch.Tensor:
    """Inverse of :func:`shard_experts` over all ``moe_tp * moe_ep`` ranks' parts (rank order)."""
    if parts[0].dim() == 1:
        return parts[0]
    groups = []
    for ep in range(moe_ep):
        mine = [parts[r] for r in range(len(parts)) if moe_ranks(r, moe_ep)[1] == ep]
        if mine[0].dim() == 2 or moe_tp == 1:
            groups.append(mine[0])
        elif split == EXPERT_FC:
            halves = [p.chunk(2, 1) for p in mine]
            groups.append(torch.cat([torch.cat([h[j] for h in halves], 1) for j in range(2)], 1))
        else:
            groups.append(torch.cat(mine, 2))
    return torch.cat(groups, 0)


def check_tp(cfg: TargetConfig | DrafterConfig, tp: int, what: str) -> None:
    """Raises DFlashError when ``tp`` cannot give every rank whole heads and equal splits (a
    mixture-of-experts target is checked by ``builder/moe_plan.check_moe_split`` instead)."""
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
