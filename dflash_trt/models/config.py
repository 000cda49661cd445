"""Model shape descriptions shared by the target and the drafter.

These are plain dataclasses with no I/O: ``checkpoints/`` builds them from ``config.json``
files; ``models/`` builds modules from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DFlashError

#: target families with our own torch implementation, keyed by HF ``model_type``
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss")
#: RoPE scaling types ``layers.rope_inv_freq`` implements
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
#: per-layer attention kinds (HF ``layer_types``)
LAYER_TYPES = ("full_attention", "sliding_attention")
#: expert routing rules: softmax over all experts then top-k (Qwen3-MoE), or top-k of the logits
#: then softmax over the k picked (gpt-oss)
MOE_ROUTINGS = ("softmax_topk", "topk_softmax")
#: expert activations: ``silu(gate) * up`` (Qwen3-MoE), or gpt-oss's clamped SwiGLU
#: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``
MOE_ACTIVATIONS = ("swiglu", "clamped_swiglu")


def rope_scaling_from_hf(rope: dict | None, max_positions: int) -> dict | None:
    """The RoPE scaling dict of an HF ``rope_scaling`` / ``rope_parameters`` entry (None for the
    default RoPE; ``rope_theta`` left out). YaRN gets transformers' defaults filled in
    (``standardize_rope_params``, ``_compute_yarn_parameters``): ``original_max_position_embeddings``
    = ``max_position_embeddings`` when absent, and ``factor`` = their ratio when absent."""
    if not rope or rope.get("rope_type", rope.get("type", "default")) == "default":
        return None
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        scaling.setdefault("original_max_position_embeddings", max_positions)
        if scaling.get("factor") is None:
            scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return scaling


def _check_rope_scaling(scaling: dict | None, what: str, supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> None:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in supported:
        raise DFlashError(f"{what}: unsupported rope_type {kind!r}; supported: {', '.join(supported)}")


@dataclass(frozen=True)
class TargetConfig:
    """Shape of a decoder-only target LLM (Llama / SmolLM2, Qwen2, Qwen3, Qwen3-MoE, gpt-oss).

    Attributes follow the HF ``config.json`` keys of those families. ``attention_bias`` is
    true for Qwen2 and gpt-oss (bias on q/k/v); ``qk_norm`` is true for Qwen3 and Qwen3-MoE
    (per-head RMSNorm of q and k before RoPE). ``rope_scaling`` is the HF ``rope_scaling`` /
    ``rope_parameters`` dict when it is not the default RoPE (Llama-3.1 uses ``rope_type:
    llama3``; gpt-oss ``yarn``, whose ``original_max_position_embeddings`` is always filled in).

    Attention extras (gpt-oss, transformers' ``GptOssAttention``): ``o_bias`` (the output
    projection has a bias), ``attn_sinks`` (one learned logit per query head joins each softmax
    row and takes weight but adds no value), ``layer_types`` (None: every layer full attention;
    else one of :data:`LAYER_TYPES` per layer) and ``sliding_window`` W: a
    ``sliding_attention`` layer's query at position p sees keys p - W + 1 .. p.

    Mixture of experts (Qwen3-MoE; ``num_experts`` 0 for a dense target): ``num_experts``,
    ``num_experts_per_tok`` (top-k), ``moe_intermediate_size`` (each expert's width),
    ``norm_topk_prob``, and which layers are sparse: layer ``i`` is, unless listed in
    ``mlp_only_layers``, when ``(i + 1) % decoder_sparse_step == 0``; the others have a dense MLP
    of ``intermediate_size`` (transformers' ``Qwen3MoeDecoderLayer``). ``moe_routing`` is one of
    :data:`MOE_ROUTINGS`, ``moe_activation`` one of :data:`MOE_ACTIVATIONS` (with
    ``swiglu_limit`` / ``swiglu_alpha`` for the clamped one); ``router_bias`` / ``expert_bias``:
    the router and each expert's two GEMMs have biases. gpt-oss: every layer sparse,
    ``topk_softmax``, ``clamped_swiglu`` (limit 7.0, alpha 1.702), both biases
    (transformers' ``GptOssMLP``).
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
    moe_routing: str = "softmax_topk"
    moe_activation: str = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    router_bias: bool = False
    expert_bias: bool = False
    o_bias: bool = False
    attn_sinks: bool = False
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    def is_sliding_layer(self, i: int) -> bool:
        """Whether layer ``i`` attends over a sliding window of :attr:`sliding_window` keys."""
        return self.layer_types is not None and self.layer_types[i] == "sliding_attention"

    @property
    def has_sliding_layers(self) -> bool:
        """Whether any layer is a ``sliding_attention`` layer."""
        return self.layer_types is not None and "sliding_attention" in self.layer_types

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
        if self.moe_routing not in MOE_ROUTINGS:
            raise DFlashError(f"unsupported moe_routing {self.moe_routing!r}; supported: {', '.join(MOE_ROUTINGS)}")
        if self.moe_activation not in MOE_ACTIVATIONS:
            raise DFlashError(
                f"unsupported moe_activation {self.moe_activation!r}; supported: {', '.join(MOE_ACTIVATIONS)}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise DFlashError(
                    f"target layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise DFlashError(f"target layer_types: unsupported {bad}; supported: {', '.join(LAYER_TYPES)}")
            if self.has_sliding_layers and not (self.sliding_window or 0) > 0:
                raise DFlashError(f"target has sliding_attention layers but sliding_window is {self.sliding_window!r}")

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
            gpt_oss = family == "gpt_oss"  # transformers' GptOssConfig defaults where a key is absent
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            if gpt_oss and not rope:
                rope = dict(GPT_OSS_ROPE)
            default_theta = GPT_OSS_ROPE_THETA if gpt_oss else 10000.0
            rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", default_theta)))
            max_pos = int(cfg.get("max_position_embeddings", 131072 if gpt_oss else 4096))
            scaling = rope_scaling_from_hf(rope, max_pos)
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
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if gpt_oss else 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family in ("qwen2", "gpt_oss"))),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                max_position_embeddings=max_pos,
                eos_token_ids=eos_ids,
                **_moe_fields(cfg),
                **_gpt_oss_fields(cfg),
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


#: transformers' ``GptOssConfig`` RoPE when a gpt-oss ``config.json`` names none (configuration_gpt_oss.py)
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
GPT_OSS_ROPE_THETA = 150000.0


def gpt_oss_config_defaults(cfg: dict) -> dict:
    """``cfg`` (a ``model_type: gpt_oss`` ``config.json`` dict) with the keys transformers'
    ``GptOssConfig`` fills in when absent, as every HF-config-based engine sees such a file:
    ``rope_parameters`` YaRN (factor 32 over 4096 positions, theta 150000), ``layer_types``
    sliding on the even layers, ``sliding_window`` 128, ``attention_bias`` true,
    ``rms_norm_eps`` 1e-5, ``max_position_embeddings`` 131072."""
    out = dict(cfg)
    if not (out.get("rope_parameters") or out.get("rope_scaling")):
        out["rope_parameters"] = dict(GPT_OSS_ROPE)
    out.setdefault("rope_theta", GPT_OSS_ROPE_THETA)
    layers = int(out.get("num_hidden_layers", 36))
    if out.get("layer_types") is None:
        out["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    for key, value in (
        ("sliding_window", 128),
        ("attention_bias", True),
        ("rms_norm_eps", 1e-5),
        ("max_position_embeddings", 131072),
    ):
        out.setdefault(key, value)
    return out


def _gpt_oss_fields(cfg: dict) -> dict:
    """The gpt-oss fields of a ``config.json`` (transformers' ``GptOssConfig`` defaults where a
    key is absent: 128 experts, top 4, sliding window 128 on the even layers, SwiGLU limit 7.0,
    alpha 1.702); {} for another family."""
    if cfg.get("model_type") != "gpt_oss":
        return {}
    experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 128)))
    top_k = int(cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4)))
    if not 0 < top_k <= experts:
        raise DFlashError(f"target config.json: num_experts_per_tok {top_k} is not in 1..num_local_experts ({experts})")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    window = cfg.get("sliding_window", 128)
    attention_bias = bool(cfg.get("attention_bias", True))
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        moe_routing="topk_softmax",
        moe_activation="clamped_swiglu",
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        router_bias=True,
        expert_bias=True,
        o_bias=attention_bias,
        attn_sinks=True,
        layer_types=tuple(str(t) for t in types),
        sliding_window=None if window is None else int(window),
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
        num_target_layers: layer count of the target the drafter was made for (None: its
            config does not say, as z-lab's gpt-oss drafter configs; ``target_layer_ids`` are
            then only range-checked against the target).
        sliding_window: None (no sliding layers: every layer sees the whole context), or W:
            the window of the z-lab ``sliding_attention`` layers (every layer, unless
            ``layer_types`` says which) — the slot at position ``q`` sees context positions
            ``p`` with ``q - p < W`` (so slot ``k`` of a block anchored at ``a`` sees the last
            ``W - 1 - k`` context positions) and its block.
        layer_types: z-lab's ``layer_types``, one ``"full_attention"`` / ``"sliding_attention"``
            per layer, when they differ (gpt-oss drafters alternate them); empty when every
            layer is the same kind (normalised so: equal configs compare equal).
        causal_layers: per layer, whether its block attends causally (slot ``k`` sees the
            block's slots ``<= k``; z-lab's ``is_causal``, which defaults to true on sliding
            layers); empty when no layer is causal.
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
    num_target_layers: int | None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    sliding_window: int | None = None
    draft_vocab_size: int | None = None
    layer_types: tuple[str, ...] = ()
    causal_layers: tuple[bool, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check_rope_scaling(self.rope_scaling, "drafter")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DFlashError(f"drafter draft_vocab_size {self.draft_vocab_size} outside 1..{self.vocab_size}")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise DFlashError(
                f"drafter sliding_window {self.sliding_window} is smaller than its block size {self.block_size}"
            )
        types, causal = tuple(self.layer_types), tuple(bool(c) for c in self.causal_layers)
        for name, per_layer in (("layer_types", types), ("causal_layers", causal)):
            if per_layer and len(per_layer) != self.num_layers:
                raise DFlashError(f"drafter {name} lists {len(per_layer)} layers for its {self.num_layers}")
        if set(types) - {"full_attention", "sliding_attention"}:
            raise DFlashError(f"drafter layer_types {sorted(set(types))} are not supported")
        if "sliding_attention" in types and self.sliding_window is None:
            raise DFlashError("drafter has sliding_attention layers but no sliding_window")
        if types and len(set(types)) == 1:  # one kind: sliding_window alone says it
            if types[0] == "full_attention" and self.sliding_window is not None:
                raise DFlashError("drafter sets sliding_window but every layer is full_attention")
            types = ()
        object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "causal_layers", causal if any(causal) else ())

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None: it sees the whole context)."""
        if self.layer_types and self.layer_types[i] == "full_attention":
            return None
        return self.sliding_window

    def layer_causal(self, i: int) -> bool:
        """Whether layer ``i``'s block attends causally (z-lab ``is_causal``)."""
        return bool(self.causal_layers) and self.causal_layers[i]

    @property
    def layer_kinds(self) -> tuple[tuple[bool, int | None], ...]:
        """``(causal, window)`` of every layer: the attention masks a draft needs."""
        return tuple((self.layer_causal(i), self.layer_window(i)) for i in range(self.num_layers))

    @property
    def layer_type_names(self) -> list[str]:
        """z-lab's ``layer_types`` written out for every layer (``"full_attention"`` /
        ``"sliding_attention"``), also where every layer is the same kind."""
        return [("full_attention", "sliding_attention")[w is not None] for _, w in self.layer_kinds]

    @property
    def context_window(self) -> int | None:
        """W when every layer slides with window W (no draft ever reads context older than
        ``W - 1`` positions before its anchor), else None (some layer reads all of it)."""
        return None if self.layer_types else self.sliding_window
