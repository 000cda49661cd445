"""Memory plan and parameter counts of a mixture-of-experts target (Qwen3-MoE, gpt-oss) from its
``config.json`` alone.

The shape (:class:`MoEShape`) comes from the HF config dict through ``TargetConfig.from_hf``;
no weights and no torch model are needed. Every tensor of the target is listed with its full shape, its role and how
TensorRT-LLM splits it over the ``tp_size`` ranks (``tensorrt_llm/mapping.py``: rank ``r`` has
``moe_tp_rank = r // moe_ep_size``, ``moe_ep_rank = r % moe_ep_size``; ``ep_experts`` gives each
EP rank ``E / moe_ep_size`` contiguous experts):

==================  ================================================  ============================
role                tensors                                           per rank
==================  ================================================  ============================
embedding, lm_head  ``[V, H]``                                        vocab rows padded / tp
attention           q, k, v ``[heads x d, H]`` (fused qkv), o         whole heads: / tp
attention_bias      q, k, v biases (/ tp), o bias ``[H]`` (gpt-oss)   o bias on every rank
sinks               gpt-oss ``[heads]``, fp32 (TRT-LLM keeps them so)  / tp
norms               RMSNorm weights, q/k norms                        replicated
router              ``[E, H]`` (+ gpt-oss bias ``[E]``)               replicated, never quantized
experts             gate_up ``[E, 2 Im, H]``, down ``[E, H, Im]``     ``E / moe_ep`` experts, Im / moe_tp
expert_bias         gpt-oss ``[E, 2 Im]`` / ``[E, H]``                like the experts (down bias whole)
dense_mlp           Qwen3-MoE ``mlp_only_layers``: gate, up, down     / tp
==================  ================================================  ============================

Formats, bytes per element of one rank's tensors (``dtype``: the compute dtype):

* ``experts``: ``expert_quant`` (``auto`` = ``target_quant``): NVFP4 0.5 + 1/16 (e4m3 per 16) +
  an fp32 global scale per expert + one fp32 activation scale; FP8 1 + an fp32 scale per expert +
  one activation scale (TensorRT-LLM ``MOEWeightWrapper``: ``weights_scaling_factor
  [experts_per_node, 1]``, ``activation_scaling_factor [1]``); MXFP4 0.5 + 1/32 (e8m0 per 32,
  OCP MX v1.0); none: ``dtype``.
* ``attention`` and ``dense_mlp`` linears: ``target_quant`` (ModelOpt's NVFP4 / FP8 configs
  quantize q/k/v/o; :func:`dflash_trt.builder.plan._tensor_bytes`).
* ``router``: fp32 for Qwen3-MoE (TensorRT-LLM ``models/qwen/convert.py`` saves ``mlp.router``
  in fp32, "Router should never be quantized"); ``dtype`` for gpt-oss (ModelOpt excludes
  ``model.layers.*.mlp.router``; TensorRT-LLM reads the HF checkpoint's bf16 router).
* ``sinks``: fp32; biases, norms, embedding and the LM head: ``dtype`` (never quantized).

KV cache: a full-attention layer holds ``2 x (kv_heads / tp) x head_dim x kv bytes`` per token of
every sequence; a sliding-window layer (gpt-oss: every even layer, window W = 128) holds at most
``min(max_seq_len, W + block_size)`` tokens per sequence (TensorRT-LLM's per-layer
``max_attention_window``: the window plus one verify block). The plan's target KV per token is
the average over a ``max_seq_len`` sequence, so ``KV token capacity / max_seq_len`` is the number
of whole sequences that fit, and the max concurrency is that, capped by ``max_batch_size``.

Parameter counts (full model, unsharded): total = every tensor; active = what one token's
forward multiplies by (attention, router, ``top_k`` of the ``E`` experts, dense MLPs, norms and
the LM head), without the embedding (a lookup) — OpenAI's convention for gpt-oss (model card:
120b 116.83B / 5.13B, 20b 20.91B / 3.61B). Qwen's "3.3B activated" for Qwen3-30B-A3B counts the
embedding as well (3.35B; 3.04B without it), so the plan prints both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import DFlashError

#: HF ``model_type`` of the mixture-of-experts families the plan reads
MOE_FAMILIES = ("qwen3_moe", "gpt_oss")

REPLICATE, VOCAB, HEADS, ROW, COLUMN, EXPERT_OUT, EXPERT_IN, EXPERT_WHOLE = (
    "replicate",
    "vocab",
    "heads",
    "row",
    "column",
    "expert_out",
    "expert_in",
    "expert_whole",
)


@dataclass(frozen=True)
class MoEShape:
    """What the plan needs of a mixture-of-experts target's ``config.json``.

    Attributes:
        family: ``qwen3_moe`` or ``gpt_oss``.
        vocab_size, hidden_size (H), num_layers, num_heads, num_kv_heads, head_dim (d).
        num_experts (E), top_k: experts per token.
        expert_intermediate (Im): each expert's width (Qwen3-MoE ``moe_intermediate_size``,
            gpt-oss ``intermediate_size``).
        dense_intermediate: width of the dense MLP of the layers that have one (Qwen3-MoE).
        sparse: per layer, whether its MLP is the routed experts.
        windows: per layer, the sliding window in tokens, or None (full attention).
        attention_bias: q/k/v biases; o_bias: an o-projection bias (gpt-oss).
        qk_norm: per-head q/k RMSNorm (Qwen3-MoE); sinks: per-head attention sinks (gpt-oss).
        expert_bias, router_bias: gpt-oss biases.
        tie_word_embeddings: one matrix for the embedding and the LM head.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    dense_intermediate: int
    sparse: tuple[bool, ...]
    windows: tuple[int | None, ...]
    attention_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False
    expert_bias: bool = False
    router_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> MoEShape:
        """From an HF ``config.json`` dict, read by
        :meth:`~dflash_trt.models.config.TargetConfig.from_hf` (transformers 5.24's
        ``Qwen3MoeConfig`` / ``GptOssConfig`` defaults where a key is absent).

        Raises:
            DFlashError: not a mixture-of-experts family, a missing key, or an impossible value.
        """
        from ..models.config import TargetConfig

        family = cfg.get("model_type")
        if family not in MOE_FAMILIES:
            raise DFlashError(f"not a mixture-of-experts model_type: {family!r} (planned: {', '.join(MOE_FAMILIES)})")
        return cls.from_target(TargetConfig.from_hf(cfg))

    @classmethod
    def from_target(cls, tcfg) -> MoEShape:
        """From a Qwen3-MoE or gpt-oss :class:`~dflash_trt.models.config.TargetConfig`.

        Raises:
            DFlashError: a dense target.
        """
        if tcfg.family not in MOE_FAMILIES or not tcfg.num_experts:
            raise DFlashError(f"not a mixture-of-experts target: {tcfg.family}")
        n = tcfg.num_layers
        return cls(
            family=tcfg.family,
            vocab_size=tcfg.vocab_size,
            hidden_size=tcfg.hidden_size,
            num_layers=n,
            num_heads=tcfg.num_heads,
            num_kv_heads=tcfg.num_kv_heads,
            head_dim=tcfg.head_dim,
            num_experts=tcfg.num_experts,
            top_k=tcfg.num_experts_per_tok,
            expert_intermediate=tcfg.moe_intermediate_size,
            dense_intermediate=tcfg.intermediate_size if tcfg.family == "qwen3_moe" else 0,
            sparse=tuple(tcfg.is_moe_layer(i) for i in range(n)),
            windows=tuple(tcfg.sliding_window if tcfg.is_sliding_layer(i) else None for i in range(n)),
            attention_bias=tcfg.attention_bias,
            o_bias=tcfg.o_bias,
            qk_norm=tcfg.qk_norm,
            sinks=tcfg.attn_sinks,
            expert_bias=tcfg.expert_bias,
            router_bias=tcfg.router_bias,
            tie_word_embeddings=tcfg.tie_word_embeddings,
        )


@dataclass(frozen=True)
class PlanTensor:
    """One tensor of the target: full shape, role (module docstring table), TP/EP split, and
    whether it is a GEMM weight (quantizable)."""

    name: str
    shape: tuple[int, ...]
    role: str
    split: str
    linear: bool = False


def plan_tensors(s: MoEShape) -> list[PlanTensor]:
    """Every tensor of the target (full shapes; q/k/v fused as TensorRT-LLM's ``attention.qkv``,
    gate/up of an expert as one ``[2 Im, H]`` ``mlp.fc``)."""
    H, d, E, Im = s.hidden_size, s.head_dim, s.num_experts, s.expert_intermediate
    q, kv = s.num_heads * d, s.num_kv_heads * d
    out = [PlanTensor("embedding", (s.vocab_size, H), "embedding", VOCAB)]
    for i in range(s.num_layers):
        p = f"layers.{i}."
        out += [PlanTensor(p + n, (H,), "norms", REPLICATE) for n in ("input_layernorm", "post_layernorm")]
        out.append(PlanTensor(p + "attention.qkv", (q + 2 * kv, H), "attention", HEADS, True))
        out.append(PlanTensor(p + "attention.dense", (H, q), "attention", ROW, True))
        if s.attention_bias:
            out.append(PlanTensor(p + "attention.qkv.bias", (q + 2 * kv,), "attention_bias", HEADS))
        if s.o_bias:
            out.append(PlanTensor(p + "attention.dense.bias", (H,), "attention_bias", REPLICATE))
        if s.qk_norm:
            out += [PlanTensor(p + f"attention.{n}_layernorm", (d,), "norms", REPLICATE) for n in "qk"]
        if s.sinks:
            out.append(PlanTensor(p + "attention.sinks", (s.num_heads,), "sinks", HEADS))
        if s.sparse[i]:
            out.append(PlanTensor(p + "mlp.router", (E, H), "router", REPLICATE))
            if s.router_bias:
                out.append(PlanTensor(p + "mlp.router.bias", (E,), "router", REPLICATE))
            out.append(PlanTensor(p + "mlp.fc", (E, 2 * Im, H), "experts", EXPERT_OUT, True))
            out.append(PlanTensor(p + "mlp.proj", (E, H, Im), "experts", EXPERT_IN, True))
            if s.expert_bias:
                out.append(PlanTensor(p + "mlp.fc.bias", (E, 2 * Im), "expert_bias", EXPERT_OUT))
                out.append(PlanTensor(p + "mlp.proj.bias", (E, H), "expert_bias", EXPERT_WHOLE))
        else:
            I = s.dense_intermediate  # noqa: E741
            out.append(PlanTensor(p + "mlp.fc", (I, H), "dense_mlp", COLUMN, True))
            out.append(PlanTensor(p + "mlp.gate", (I, H), "dense_mlp", COLUMN, True))
            out.append(PlanTensor(p + "mlp.proj", (H, I), "dense_mlp", ROW, True))
    out.append(PlanTensor("ln_f", (H,), "norms", REPLICATE))
    if not s.tie_word_embeddings:
        out.append(PlanTensor("lm_head", (s.vocab_size, H), "lm_head", VOCAB))
    return out


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the full model (see the module docstring for "active")."""

    total: int
    active: int
    embedding: int
    by_role: dict

    @property
    def active_with_embedding(self) -> int:
        return self.active + self.embedding


def param_counts(s: MoEShape) -> ParamCounts:
    """Total and active parameter counts of ``s`` (exact integers)."""
    by_role: dict[str, int] = {}
    active = 0
    for t in plan_tensors(s):
        n = math.prod(t.shape)
        by_role[t.role] = by_role.get(t.role, 0) + n
        if t.role in ("experts", "expert_bias"):
            active += n * s.top_k // s.num_experts
        elif t.role != "embedding":
            active += n
    emb = by_role["embedding"]
    if s.tie_word_embeddings:  # the one matrix is also the LM head a token multiplies by
        active += emb
        emb = 0
    return ParamCounts(sum(by_role.values()), active, emb, by_role)


#: elements per scale block of the packed expert formats: an expert's width slice must hold whole blocks
EXPERT_BLOCK = {"nvfp4": 16, "mxfp4": 32}


def check_moe_split(s: MoEShape, tp: int, moe_tp: int, moe_ep: int, expert_quant: str = "none") -> None:
    """Raises DFlashError (one line) when the TP / MoE-TP / EP split cannot give every rank equal
    whole parts: heads, experts over EP ranks, expert widths over MoE-TP ranks (in whole NVFP4 /
    MXFP4 blocks: the width is the input dimension of the experts' down projection)."""
    if moe_tp * moe_ep != tp:
        raise DFlashError(f"moe_tp_size {moe_tp} x moe_ep_size {moe_ep} must equal tp_size {tp} (TensorRT-LLM Mapping)")
    if s.num_heads % tp or s.num_kv_heads % tp:
        raise DFlashError(
            f"tp_size {tp} does not divide the target's {s.num_heads} attention heads and {s.num_kv_heads} KV heads "
            "(each rank must hold whole heads); use a tp_size dividing both"
        )
    if s.num_experts % moe_ep:
        raise DFlashError(
            f"moe_ep_size {moe_ep} does not divide the target's {s.num_experts} experts "
            "(each EP rank holds E / moe_ep_size whole experts)"
        )
    if s.expert_intermediate % moe_tp:
        raise DFlashError(
            f"moe_tp_size {moe_tp} does not divide the experts' intermediate size {s.expert_intermediate}"
        )
    block = EXPERT_BLOCK.get(expert_quant, 1)
    if (s.expert_intermediate // moe_tp) % block:
        raise DFlashError(
            f"moe_tp_size {moe_tp} cuts the experts' intermediate size {s.expert_intermediate} into "
            f"{s.expert_intermediate // moe_tp}, not whole {expert_quant} blocks of {block}; use expert parallelism"
        )
    if not all(s.sparse) and s.dense_intermediate % tp:
        raise DFlashError(f"tp_size {tp} does not divide the dense MLP's intermediate size {s.dense_intermediate}")


def rank_shape(t: PlanTensor, vocab_padded: int, tp: int, moe_tp: int, moe_ep: int) -> tuple[int, ...]:
    """Shape of ``t`` on one rank (every rank's is the same)."""
    sh = t.shape
    if t.split == REPLICATE:
        return sh
    if t.split == VOCAB:
        return (vocab_padded // tp, *sh[1:])
    if t.split in (HEADS, COLUMN):
        return (sh[0] // tp, *sh[1:])
    if t.split == ROW:
        return (sh[0], sh[1] // tp)
    e = sh[0] // moe_ep
    if t.split == EXPERT_OUT:
        return (e, sh[1] // moe_tp, *sh[2:])
    if t.split == EXPERT_IN:
        return (e, sh[1], sh[2] // moe_tp)
    return (e, *sh[1:])  # EXPERT_WHOLE


def expert_bytes(shape: tuple[int, ...], fmt: str, dtype_bytes: int) -> float:
    """Bytes of one rank's stacked expert weight ``[E_local, out, in]`` in ``fmt`` (module docstring)."""
    e, n = shape[0], math.prod(shape)
    if fmt == "none":
        return n * dtype_bytes
    if fmt == "fp8":
        return n + 4 * e + 4
    if fmt == "nvfp4":
        return n / 2 + n / 16 + 4 * e + 4
    if fmt == "mxfp4":
        return n / 2 + n / 32
    raise DFlashError(f"expert weights in {fmt} are not planned (experts: none, fp8, nvfp4, mxfp4)")


def rank_weight_bytes(
    s: MoEShape, target_quant: str, expert_quant: str, dtype_bytes: int, tp: int, moe_tp: int, moe_ep: int
) -> dict[str, float]:
    """Bytes of one rank's target tensors by role (module docstring formats)."""
    from ..checkpoints.trtllm import padded_vocab
    from .plan import _tensor_bytes

    vp = padded_vocab(s.vocab_size, tp)
    out: dict[str, float] = {}
    for t in plan_tensors(s):
        sh = rank_shape(t, vp, tp, moe_tp, moe_ep)
        if t.role == "experts":
            b = expert_bytes(sh, expert_quant, dtype_bytes)
        elif t.role == "router":
            b = math.prod(sh) * (4 if s.family == "qwen3_moe" else dtype_bytes)
        elif t.role == "sinks":
            b = math.prod(sh) * 4
        else:
            b = _tensor_bytes(sh, target_quant, dtype_bytes, t.linear)
        out[t.role] = out.get(t.role, 0.0) + b
    return out


def kv_bytes_per_token(s: MoEShape, tp: int, kv_bytes: int, max_seq_len: int, block_size: int) -> float:
    """Target KV bytes per token of one rank, averaged over a ``max_seq_len`` sequence: sliding
    layers count ``min(max_seq_len, W + block_size) / max_seq_len`` of a token (module docstring)."""
    per_layer = 2 * (s.num_kv_heads // tp) * s.head_dim * kv_bytes
    total = 0.0
    for w in s.windows:
        total += per_layer if w is None else per_layer * min(max_seq_len, w + block_size) / max_seq_len
    return total
