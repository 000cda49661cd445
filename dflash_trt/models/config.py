"""Model shape descriptions shared by the target and the drafter.

These are plain dataclasses with no I/O: ``checkpoints/`` builds them from ``config.json``
files; ``models/`` builds modules from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DFlashError

#: target families with our own torch implementation, keyed by HF ``model_type``
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
#: RoPE scaling types ``layers.rope_inv_freq`` implements
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _check_rope_scaling(scaling: dict | None, what: str) -> None:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise DFlashError(f"{what}: unsupported rope_type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


@dataclass(frozen=True)
class TargetConfig:
    """Shape of a decoder-only target LLM (Llama / SmolLM2, Qwen2, Qwen3, Qwen3-MoE).

    Attributes follow the HF ``config.json`` keys of those families. ``attention_bias`` is
    true for Qwen2 (bias on q/k/v); ``qk_norm`` is true for Qwen3 and Qwen3-MoE (per-head RMSNorm
    of q and k before RoPE). ``rope_scaling`` is the HF ``rope_scaling`` / ``rope_parameters``
    dict when it is not the default RoPE (Llama-3.1 uses ``rope_type: llama3``).

    Mixture of experts (Qwen3-MoE; ``num_experts`` 0 for a dense target): ``num_experts``,
    ``num_experts_per_tok`` (top-k), ``moe_intermediate_size`` (each expert's width),
    ``norm_topk_prob``, and which layers are sparse: layer ``i`` is, unless listed in
    ``mlp_only_layers``, when ``(i + 1) % decoder_sparse_step == 0``; the others have a dense MLP
    of ``intermediate_size`` (transformers' ``Qwen3MoeDecoderLayer``).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the routed experts (else a dense gated MLP)."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise DFlashError(f"unsupported target family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise DFlashError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        _check_rope_scaling(self.rope_scaling, "target")

    @classmethod
    def from_hf(cls, cfg: dict) -> TargetConfig:
        """Build from an HF ``config.json`` dict.

        Raises:
            DFlashError: unknown ``model_type`` or missing keys.
        """
        family = cfg.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise DFlashError(f"unsupported target model_type {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
            scaling = None
            if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
                scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                eos_token_ids=eos_ids,
                **_moe_fields(cfg),
            )
        except KeyError as e:
            raise DFlashError(f"target config.json lacks required key {e.args[0]!r}") from None


def _moe_fields(cfg: dict) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE ``config.json`` (transformers'
    ``Qwen3MoeConfig`` defaults where a key is absent); {} for a dense family."""
    if cfg.get("model_type") != "qwen3_moe":
        return {}
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
    top_k = int(cfg.get("num_experts_per_tok", 8))
    if not 0 < top_k <= experts:
        raise DFlashError(f"target config.json: num_experts_per_tok {top_k} is not in 1..num_experts ({experts})")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=max(1, int(cfg.get("decoder_sparse_step", 1))),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter, spread evenly from layer 1 to L-3.

    Same rule as the z-lab reference (``build_target_layer_ids``): one draft layer takes the
    middle layer; otherwise ``round(1 + i * (L - 4) / (N - 1))`` for i in 0..N-1.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of a DFlash drafter (paper arXiv:2602.06036 §3; z-lab ``DFlashDraftModel``).

    A stack of Qwen3-style decoder layers whose attention also reads K/V projected from the
    target features (KV injection). It has no embedding or LM head of its own.

    Attributes:
        target_layer_ids: target layers whose outputs (HF ``hidden_states[i + 1]``) are
            concatenated into the context features, ``len(target_layer_ids) * hidden_size`` wide.
        block_size: tokens per drafted block, the anchor (last committed token) included, so one
            drafter forward proposes ``block_size - 1`` draft tokens.
        mask_token_id: token id embedded (with the target's embedding) at the masked slots.
        num_target_layers: layer count of the target the drafter was made for.
        sliding_window: None (every layer sees the whole context), or W: every layer is a
            z-lab ``sliding_attention`` layer with ``is_causal: false`` — the slot at position
            ``q`` sees context positions ``p`` with ``q - p < W`` (so slot ``k`` of a block
            anchored at ``a`` sees the last ``W - 1 - k`` context positions) and its whole block.
        draft_vocab_size: None (drafts over the target's whole vocabulary), or N: the drafter
            drafts over N target tokens only (EAGLE-3 / vLLM speculators convention: its
            weights hold ``d2t`` int64 ``[N]``, draft id ``i`` is target id ``i + d2t[i]``), the
            rows of the target's LM head it reads.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    sliding_window: int | None = None
    draft_vocab_size: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check_rope_scaling(self.rope_scaling, "drafter")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DFlashError(f"drafter draft_vocab_size {self.draft_vocab_size} outside 1..{self.vocab_size}")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise DFlashError(
                f"drafter sliding_window {self.sliding_window} is smaller than its block size {self.block_size}"
            )
