"""Target LLM in our own torch code: Llama / SmolLM2, Qwen2 (q/k/v bias), Qwen3 (per-head
q_norm / k_norm), Qwen3-MoE (Qwen3 attention, routed experts in the sparse layers,
``models/moe.py``) and gpt-oss (q/k/v/o biases, attention sinks, sliding-window layers
alternating with full ones, YaRN RoPE, routed experts in every layer). Fused q|k|v and gate|up
GEMMs; the KV cache is owned by the runtime (full length for sliding-window layers too: the
window is a mask).

The forward returns logits for the requested rows and the target features: the outputs of
the layers listed in ``capture`` (HF ``hidden_states[i + 1]``), concatenated on the last axis,
which the DFlash drafter reads (paper §3.1, "KV injection").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import TargetConfig
from .fused_layer import dense_layer_attention, fused_forward_wanted, run_dense_layer
from .layers import AttentionMetadata, GatedMLP, RMSNorm, RotaryEmbedding, apply_rope, cached_attention
from .moe import MoEBlock


class TargetAttention(nn.Module):
    """Self-attention of layer ``index`` over the KV cache (see ``layers.cached_attention``):
    ``sinks`` ``[H]`` when the target has attention sinks, ``window`` the sliding window of a
    ``sliding_attention`` layer (else None)."""

    def __init__(self, cfg: TargetConfig, index: int = 0):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.zeros(self.h)) if cfg.attn_sinks else None
        self.window = cfg.sliding_window if cfg.is_sliding_layer(index) else None
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # each query attended alone (models/batch_invariant.set_batch_invariant)
        self.batch_invariant = False

    def forward(self, x, cos, sin, kv, meta: AttentionMetadata) -> torch.Tensor:
        b, t, _ = x.shape
        h, hkv, d = self.h, self.hkv, self.d
        qkv = self.qkv(x)
        v = qkv[..., (h + hkv) * d :].view(b, t, hkv, d)
        if self.q_norm is None:  # q and k rotated together: one RoPE over h + hkv heads
            qk = apply_rope(qkv[..., : (h + hkv) * d].view(b, t, h + hkv, d).transpose(1, 2), cos, sin)
            q, k = qk[:, :h], qk[:, h:].transpose(1, 2)
        else:
            q, k = qkv[..., : (h + hkv) * d].split([h * d, hkv * d], dim=-1)
            q, k = self.q_norm(q.view(b, t, h, d)), self.k_norm(k.view(b, t, hkv, d))
            q = apply_rope(q.transpose(1, 2), cos, sin)
            k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
        return self.o(cached_attention(q, k, v, kv, meta, self.batch_invariant, self.sinks, self.window))


class TargetLayer(nn.Module):
    """Pre-norm decoder layer ``index``: attention then the gated MLP (the routed experts in a
    mixture-of-experts target's sparse layers), each with a residual."""

    def __init__(self, cfg: TargetConfig, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = TargetAttention(cfg, index)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(index):
            self.mlp = MoEBlock.from_config(cfg)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        # tensor parallelism (runtime/distributed.shard_target): a group whose ``all_reduce``
        # sums the row-parallel outputs of ``attn.o`` and ``mlp.down`` over the ranks
        self.tp = None

    def forward(self, x, cos, sin, kv, meta):
        a = self.attn(self.attn_norm(x), cos, sin, kv, meta)
        x = x + (a if self.tp is None else self.tp.all_reduce(a))
        m = self.mlp(self.mlp_norm(x))
        return x + (m if self.tp is None else self.tp.all_reduce(m))


@dataclass
class TargetOutput:
    """Result of :meth:`TargetModel.forward`.

    Attributes:
        logits: ``[B, n, vocab]`` in the model dtype, for the rows picked by ``logits_index``
            (all ``T`` positions when it is None); None for a ``features_only`` or ``hidden_only``
            forward.
        features: ``[B, T, len(capture) * hidden]`` target features, or None when nothing was
            captured.
        hidden: with ``hidden_only``: ``[B, T, hidden]`` final-norm hidden states, the LM head's
            input (model dtype); else None.
    """

    logits: torch.Tensor | None
    features: torch.Tensor | None
    hidden: torch.Tensor | None = None


class TargetModel(nn.Module):
    """Decoder-only target LLM.

    Parameter names are ours (fused ``qkv`` / ``gate_up``); :meth:`load_hf_state_dict` maps HF
    Llama/Qwen names onto them.

    Tensor parallelism: ``runtime/distributed.shard_target`` makes this rank's shard in place
    (Megatron-LM column/row-parallel linears, vocab-parallel LM head with a forward hook that
    all-gathers the logits); ``tp`` is then the group and ``cfg`` holds the local head counts.
    With ``tp`` None (the default) nothing here communicates.
    """

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.tp = None  # set by runtime/distributed.shard_target
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        #: per layer, the arguments of its one-call C++ form, or None (``models/fused_layer.plan_dense_layers``)
        self.dense_layers: list[tuple | None] | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        capture: tuple[int, ...] = (),
        logits_index: torch.Tensor | None = None,
        features_only: bool = False,
        hidden_only: bool = False,
    ) -> TargetOutput:
        """Run ``input_ids`` (int64 ``[B, T]``) through the model, writing their K/V into ``kv_cache``.

        Args:
            meta: positions, cache slots and mask for these tokens.
            kv_cache: one ``(k, v)`` buffer pair per layer, ``[B, Hkv, slots, D]``.
            capture: target layer ids whose outputs make the features (HF ``hidden_states[i+1]``;
                the last layer's output is taken after the final norm, as HF does).
            logits_index: optional int64 ``[B, n]`` positions in ``T`` to compute logits for.
            features_only: stop after the last captured layer and return no logits (``kv_cache``
                then needs only ``max(capture) + 1`` layers).
            hidden_only: stop before the LM head and return the final-norm hidden states of all
                ``T`` positions instead of logits (a CUDA graph keeps ``[T, hidden]`` in its
                memory instead of ``[T, vocab]``; ``runtime/cuda_graphs.py``).
        """
        x = self.embed(input_ids)
        cos, sin = self.rope(meta.positions, x.dtype, meta.max_position)
        captured = {}
        wanted = set(capture)
        last = len(self.layers) - 1
        upto = max(capture) + 1 if features_only else len(self.layers)
        # uniform paged steps on the CPU: each planned layer in one C++ call (models/fused_layer.py)
        dense = self.dense_layers if self.dense_layers is not None and fused_forward_wanted(x, meta, kv_cache) else None
        layers, attention = list(self.layers), {}  # (a list: ModuleList indexing costs ~20 us a layer)
        for i in range(upto):
            layer = layers[i]
            args = dense[i] if dense is not None else None
            if args is not None:
                w = layer.attn.window
                if w not in attention:  # (once per forward and window)
                    attention[w] = dense_layer_attention(meta, w)
                x = run_dense_layer(args, x, cos, sin, kv_cache[i], attention[w])
            else:
                x = layer(x, cos, sin, kv_cache[i], meta)
            if i in wanted:
                captured[i] = self.norm(x) if i == last else x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        if features_only:
            return TargetOutput(logits=None, features=features)
        x = self.norm(x)
        if hidden_only:
            return TargetOutput(logits=None, features=features, hidden=x)
        if logits_index is not None:
            x = x.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return TargetOutput(logits=self.lm_head(x), features=features)

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load HF Llama/Qwen2/Qwen3/Qwen3-MoE/gpt-oss weights (``model.layers.N.self_attn.q_proj.weight``
        ...; gpt-oss experts dense, as transformers keeps them in memory and saves them:
        ``checkpoints/mxfp4.py`` decodes an MXFP4 checkpoint's to that first; or, into a model
        whose experts are :class:`~dflash_trt.quantization.mxfp4.MXFP4Experts`, their
        ``*_blocks`` / ``*_scales`` as they are).

        Raises:
            KeyError: a required tensor is missing.
            ValueError: a tensor has the wrong shape.
        """
        own = self.state_dict()
        out: dict[str, torch.Tensor] = {
            "embed.weight": sd["model.embed_tokens.weight"],
            "norm.weight": sd["model.norm.weight"],
        }
        if not self.cfg.tie_word_embeddings:
            out["lm_head.weight"] = sd["lm_head.weight"]
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            out[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
            out[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
            out[f"layers.{i}.attn.qkv.weight"] = torch.cat(
                [sd[a + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]
            )
            if self.cfg.attention_bias:
                out[f"layers.{i}.attn.qkv.bias"] = torch.cat(
                    [sd[a + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")]
                )
            out[f"layers.{i}.attn.o.weight"] = sd[a + "o_proj.weight"]
            if self.cfg.o_bias:
                out[f"layers.{i}.attn.o.bias"] = sd[a + "o_proj.bias"]
            if self.cfg.attn_sinks:
                out[f"layers.{i}.attn.sinks"] = sd[a + "sinks"]
            if self.cfg.qk_norm:
                out[f"layers.{i}.attn.q_norm.weight"] = sd[a + "q_norm.weight"]
                out[f"layers.{i}.attn.k_norm.weight"] = sd[a + "k_norm.weight"]
            m = p + "mlp."
            if self.cfg.is_moe_layer(i):
                experts = _hf_gpt_oss_experts if self.cfg.family == "gpt_oss" else _hf_experts
                out.update(experts(sd, m, f"layers.{i}.mlp.", self.cfg.num_experts))
                continue
            out[f"layers.{i}.mlp.gate_up.weight"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
            out[f"layers.{i}.mlp.down.weight"] = sd[m + "down_proj.weight"]
        for name, t in out.items():
            if own[name].shape != t.shape:
                raise ValueError(f"{name}: expected shape {tuple(own[name].shape)}, got {tuple(t.shape)}")
        if self.cfg.tie_word_embeddings:
            out["lm_head.weight"] = out["embed.weight"]
        # copied into the parameters, not assigned: assigned, the parameters kept the checkpoint's
        # tensors (and q|k|v, gate|up concatenated beside them) and the peak resident memory of
        # `generate` grew 1.61 -> 1.89 GiB (the default target, fp32), for ~0.4 s less loading
        self.load_state_dict(out, strict=True)


def _hf_experts(sd: dict[str, torch.Tensor], hf: str, ours: str, num_experts: int) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE sparse MLP's weights under our names: the router ``{hf}gate.weight``, and the
    experts stacked, either from the checkpoint's per-expert tensors
    (``{hf}experts.{e}.{gate,up,down}_proj.weight``, what the official checkpoints and
    transformers' ``save_pretrained`` write) or from transformers' fused in-memory ones
    (``{hf}experts.gate_up_proj [E, 2I, H]``, ``{hf}experts.down_proj [E, H, I]``).

    Raises:
        KeyError: a missing tensor (its HF name).
    """
    out = {ours + "gate.weight": sd[hf + "gate.weight"]}
    x = hf + "experts."
    if x + "gate_up_proj" in sd:
        out[ours + "gate_up"], out[ours + "down"] = sd[x + "gate_up_proj"], sd[x + "down_proj"]
        return out
    experts = range(num_experts)
    out[ours + "gate_up"] = torch.stack(
        [torch.cat([sd[f"{x}{e}.gate_proj.weight"], sd[f"{x}{e}.up_proj.weight"]]) for e in experts]
    )
    out[ours + "down"] = torch.stack([sd[f"{x}{e}.down_proj.weight"] for e in experts])
    return out


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's interleaved gate/up along dim 1 (even: gate, odd: up) as [gate; up]."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _hf_gpt_oss_experts(sd: dict[str, torch.Tensor], hf: str, ours: str, num_experts: int) -> dict[str, torch.Tensor]:
    """A gpt-oss MLP's weights under our names (transformers' ``GptOssMLP``): the router
    ``{hf}router.{weight,bias}``, and the fused experts stored ``[E, in, out]``
    (``{hf}experts.gate_up_proj [E, H, 2I]`` with gate and up interleaved along the last axis,
    ``gate_up_proj_bias [E, 2I]`` likewise, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``),
    turned into our ``nn.Linear`` orientation with [gate; up] rows (``gate_up [E, 2I, H]``,
    ``down [E, H, I]``). ``num_experts`` is read from the shapes (checked by the caller).

    Raises:
        KeyError: a missing tensor (its HF name).
    """
    x = hf + "experts."
    out = {
        ours + "gate.weight": sd[hf + "router.weight"],
        ours + "gate.bias": sd[hf + "router.bias"],
        ours + "gate_up_bias": _deinterleave(sd[x + "gate_up_proj_bias"]),
        ours + "down_bias": sd[x + "down_proj_bias"],
    }
    if x + "gate_up_proj_blocks" in sd:  # MXFP4 kept packed: [E, out, in / 32, 16] codes, out interleaved
        for part in ("blocks", "scales"):
            out[f"{ours}gate_up.{part}"] = _deinterleave(sd[f"{x}gate_up_proj_{part}"])
            out[f"{ours}down.{part}"] = sd[f"{x}down_proj_{part}"]
        return out
    out[ours + "gate_up"] = _deinterleave(sd[x + "gate_up_proj"].transpose(1, 2))
    out[ours + "down"] = sd[x + "down_proj"].transpose(1, 2)
    return out
