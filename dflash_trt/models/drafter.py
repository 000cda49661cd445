"""DFlash drafter (paper arXiv:2602.06036 §3; z-lab ``DFlashDraftModel``). Torch only, no I/O.

Parameter names equal the z-lab checkpoint's (``fc.weight``, ``hidden_norm.weight``,
``norm.weight``, ``layers.N.self_attn.q_proj.weight`` ...), so a z-lab ``model.safetensors``
loads with ``load_state_dict`` as it is.

One forward drafts a whole block: the block ``[anchor, MASK x (B-1)]`` is embedded with the
target's embedding; every layer's queries come from the block only, while its keys and values
come from ``[context features ; block]`` (KV injection), attended non-causally. The context
K/V of each layer is cached by the runtime and only grows by the positions the target accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from ..quantization.packed import Q8_BLOCK, PackedLinear, packed_class, packed_rows, packed_stack
from .batch_invariant import BatchInvariantLinear
from .config import DrafterConfig
from .cpu_linear import OneDNNLinear
from .layers import (
    AttentionMetadata,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    argmax_last,
    as_dtype,
    cached_attention,
)


def sliding_visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """z-lab non-causal ``sliding_attention`` rule (``dflash.model._attention_mask``): a query at
    position ``q`` sees key position ``p`` iff ``q - p < window`` (keys after ``q`` are block
    slots, always within the window because ``window >= block_size``). Broadcasts."""
    return query_pos - key_pos < window


@dataclass
class PagedBlocks:
    """Where ``S`` sequences' draft blocks sit in the paged drafter pools (the drafter kernels'
    metadata, :mod:`dflash_trt.kernels.block_attention`).

    Attributes:
        slots: int64 ``[S * B]`` pool slot of every block token, sequence after sequence.
        tables: int32 ``[S, max_blocks]`` block tables; kv_lens: int32 ``[S]`` keys per sequence
            (each block's last position + 1).
        block: B; tokens_per_block: the KV block size.
    """

    slots: torch.Tensor
    tables: torch.Tensor
    kv_lens: torch.Tensor
    block: int
    tokens_per_block: int


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, block, ctx, cos, sin, kv, meta: AttentionMetadata) -> torch.Tensor:
        b, t, _ = block.shape
        q = self.q_norm(self.q_proj(block).view(b, t, self.h, self.d)).transpose(1, 2)
        kv_in = torch.cat([ctx, block], dim=1)
        n = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(b, n, self.hkv, self.d)).transpose(1, 2)
        q = apply_rope(q, cos[:, :, -t:], sin[:, :, -t:])
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, n, self.hkv, self.d)
        return self.o_proj(cached_attention(q, k, v, kv, meta))

    def forward_paged(self, block, cos, sin, k_pool, v_pool, paged: PagedBlocks, window: int) -> torch.Tensor:
        """:meth:`forward` over paged pools with the drafter kernels: ``block`` ``[M, hidden]``
        (M = S * B), its K/V written at ``paged.slots``; the context K/V is already in the pools."""
        from ..kernels import ops

        m = block.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(block).view(1, m, self.h, self.d)).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(block).view(1, m, self.hkv, self.d)).transpose(1, 2), cos, sin)
        k_pool[paged.slots] = k[0].transpose(0, 1).to(k_pool.dtype)
        v_pool[paged.slots] = self.v_proj(block).view(m, self.hkv, self.d).to(v_pool.dtype)
        q = q[0].transpose(0, 1).contiguous()  # [M, H, D]
        o = ops.block_attention(
            q, k_pool, v_pool, paged.tables, paged.kv_lens, paged.block, paged.tokens_per_block, window, self.d**-0.5
        )
        return self.o_proj(o)


class DrafterMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, ctx, cos, sin, kv, meta):
        return self._residual(x, lambda h: self.self_attn(h, ctx, cos, sin, kv, meta))

    def forward_paged(self, x, cos, sin, k_pool, v_pool, paged: PagedBlocks, window: int):
        return self._residual(x, lambda h: self.self_attn.forward_paged(h, cos, sin, k_pool, v_pool, paged, window))

    def _residual(self, x, attend):
        x = x + attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The DFlash draft model.

    ``forward`` takes the embedded block and the new context features and returns the final
    normed hidden states of the block; the runtime applies the target's LM head to slots
    ``1..B-1`` to get the draft tokens.

    Attributes:
        head_format: the packed format (``int8``) of the draft vocabulary's rows of a dense
            target head (:meth:`propose`), set where the drafter's linears are packed
            (``checkpoints/loader.load_pair``); None: they multiply in the head's own kind.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        if cfg.draft_vocab_size is not None:  # draft id i is target id i + d2t[i] (EAGLE-3 / speculators)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.head_format: str | None = None
        self._head_cache: tuple | None = None  # (weight key, the head over the draft vocabulary)
        self._kv_stack: tuple | None = None  # (weights key, stacked k/v weights, biases, k_norms)

    def forward_paged(
        self,
        block_embeds: torch.Tensor,
        ctx_features: torch.Tensor,
        ctx_positions: torch.Tensor,
        ctx_slots: torch.Tensor,
        block_positions: torch.Tensor,
        max_position: int,
        paged: PagedBlocks,
        k_pools: torch.Tensor,
        v_pools: torch.Tensor,
    ) -> torch.Tensor:
        """Draft the blocks of ``S`` sequences over paged pools with the drafter kernels
        (:mod:`dflash_trt.kernels`): the same result as :meth:`forward` with paged metadata.

        Args:
            block_embeds: ``[S * B, hidden]`` embeddings of every block, sequence after sequence.
            ctx_features: ``[N, len(target_layer_ids) * hidden]`` features of the context positions
                not yet in the pools (any sequences), at ``ctx_positions`` / ``ctx_slots`` (int64 ``[N]``).
            block_positions: int64 ``[S * B]`` the block tokens' positions; ``max_position`` the
                largest (known on the host: no device read for RoPE).
            paged: where the blocks sit in the pools.
            k_pools, v_pools: ``[L, P, Hkv, D]`` every drafter layer's pool (written in place).

        Returns:
            ``[S * B, hidden]`` final normed hidden states.

        Raises:
            DFlashError: a drafter with causal layers (the kernels attend non-causally; nothing
                is written then).
        """
        if self.cfg.causal_layers:
            raise DFlashError("the drafter kernels attend non-causally; a drafter with causal layers drafts in torch")
        # first: it moves RoPE's tables and inv_freq to the device once (no copy per draft)
        cos, sin = self.rope(block_positions.view(1, -1), block_embeds.dtype, max_position)
        if ctx_features.shape[0]:
            self.write_context_kv(ctx_features, ctx_positions, ctx_slots, k_pools, v_pools)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer.forward_paged(x, cos, sin, k_pools[i], v_pools[i], paged, self.cfg.layer_window(i) or 0)
        return self.norm(x)

    def write_context_kv(
        self,
        ctx_features: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_pools: torch.Tensor,
        v_pools: torch.Tensor,
        linears: tuple[nn.Module, nn.Module] | None = None,
    ) -> None:
        """KV injection alone: the context K/V of every layer from target features, written into
        the pools (one GEMM for all layers, then ``dflash::context_kv``: k_norm, RoPE, the writes;
        the Triton kernel on CUDA, its torch reference on the CPU).

        Args:
            ctx_features: ``[N, len(target_layer_ids) * hidden]`` target features (N >= 1).
            positions, slots: int64 ``[N]`` their positions and pool slots.
            k_pools, v_pools: ``[L, P, Hkv, D]`` every drafter layer's pool (written in place).
            linears: ``(fc, stacked k/v)`` modules computing what ``fc`` and the layers' stacked
                ``[k_proj; v_proj]`` compute, used instead of them (the fused CPU path's
                batch-invariant copies, ``models/fused_layer.py``).
        """
        from ..kernels import cpu_ops, ops

        w, b, knorm = self._stacked_kv()
        fc = self.fc
        if linears is not None:
            fc, w = linears
        h = self.hidden_norm(fc(ctx_features))
        kv = w(h) if isinstance(w, nn.Module) else F.linear(h, w, b)
        inv_freq = self.rope.inv_freq.to(h.device)  # fp32 [D / 2]
        if self.rope.attention_factor != 1.0:
            # YaRN multiplies cos and sin by a factor; RoPE is linear in k, so that is the same
            # factor on k, applied through the k_norm weight (the kernel's RoPE takes inv_freq alone)
            knorm = knorm * self.rope.attention_factor
        # on the eager CPU path not the custom op (its dispatch, autograd and in-place bookkeeping,
        # cost ~0.2 ms of a ~0.5 ms KV injection at draft sizes): the C++ kernel where the CPU
        # kernels are loaded (~0.5 ms less a drafting step than the torch reference's ~20 ops)
        eager_cpu = kv.device.type == "cpu" and not torch.compiler.is_compiling()
        write = cpu_ops.context_kv if eager_cpu else ops.context_kv
        write(kv, knorm, self.cfg.rms_norm_eps, inv_freq, positions, slots, k_pools, v_pools)

    def _stacked_kv(self) -> tuple[torch.Tensor | PackedLinear, torch.Tensor | None, torch.Tensor]:
        """Every layer's ``[k_proj; v_proj]`` weights stacked (one GEMM for all layers' context
        K/V), their biases when the drafter has them, and the layers' k_norm weights ``[L, D]``;
        built once per weight version. Packed (int4 / int8) projections stack into one
        :class:`PackedLinear` (the same codes and scales), returned in place of the weight."""
        attns = [layer.self_attn for layer in self.layers]
        if isinstance(attns[0].k_proj, PackedLinear):
            mods = [p for a in attns for p in (a.k_proj, a.v_proj)]
            key = tuple((m.packed.data_ptr(), m.scales.data_ptr(), m.scales.dtype) for m in mods)
            if self._kv_stack is None or self._kv_stack[0] != key:
                knorm = torch.stack([a.k_norm.weight for a in attns])
                self._kv_stack = (key, packed_stack(mods), None, knorm)
            return self._kv_stack[1:]
        ws = [p for a in attns for p in (a.k_proj.weight, a.v_proj.weight)]
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in ws)
        if self._kv_stack is None or self._kv_stack[0] != key:
            bs = [p for a in attns for p in (a.k_proj.bias, a.v_proj.bias)]
            bias = torch.cat(bs) if bs[0] is not None else None
            self._kv_stack = (key, torch.cat(ws), bias, torch.stack([a.k_norm.weight for a in attns]))
        return self._kv_stack[1:]

    def draft_token_ids(self) -> torch.Tensor | None:
        """int64 ``[N]`` sorted target ids of the draft vocabulary (``arange(N) + d2t``), or None
        when the drafter drafts over the whole target vocabulary."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def propose(self, hidden: torch.Tensor, lm_head: nn.Module, sharded_head: bool = False) -> torch.Tensor:
        """Greedy draft tokens from final hidden states.

        Args:
            hidden: ``[..., hidden]`` (the block's slots 1..B-1).
            lm_head: the target's LM head (``nn.Linear``, ``[V, hidden]`` weight, also oneDNN-
                prepacked :class:`OneDNNLinear`, or a packed int4 / int8 :class:`PackedLinear`:
                the draft vocabulary's rows are sliced and packed the same way once).
            sharded_head: the head is vocab-parallel under tensor parallelism (its forward returns
                gathered full logits, its weight is a shard): the draft vocabulary's columns are
                picked from the full logits instead of slicing the weight.

        Returns:
            int64 ``[...]`` target token ids: the argmax over the draft vocabulary (the whole
            vocabulary without ``d2t``). With a draft vocabulary only its rows of the head are
            multiplied, so tokens never trained as negatives cannot win the argmax.
        """
        # 2-D rows: a 3-D strided slice would make linear a bmm over an expanded (copied) head
        lead, rows = hidden.shape[:-1], hidden.reshape(-1, hidden.shape[-1])
        if self.d2t is None:
            return argmax_last(lm_head(rows)).view(lead)
        if sharded_head:
            return self.draft_token_ids()[argmax_last(lm_head(rows)[..., self.draft_token_ids()])].view(lead)
        ids = argmax_last(self._draft_head(lm_head)(rows))
        return (ids + self.d2t[ids]).view(lead)

    def _draft_head(self, lm_head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """``rows [n, hidden] -> logits [n, N]`` over the draft vocabulary's rows of ``lm_head``
        only, built once per head weight in the head's own kind: packed int4 / int8 rows
        (:func:`packed_rows`; dense when int4 cannot pack them), oneDNN-prepacked bf16 rows,
        batch-invariant rows (the target in that mode), or dense rows (``rows`` cast to the head's
        dtype); with :attr:`head_format` set, a dense head's rows packed in it (its dtype the
        scales'; int8: half the bytes of bf16 rows, a quarter of fp32's, for a drafting step that
        reads them all)."""
        if isinstance(lm_head, PackedLinear):
            key = (lm_head.packed.data_ptr(), lm_head.scales.data_ptr(), lm_head.scales.dtype)
        else:
            w = lm_head.weight
            key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._head_cache is None or self._head_cache[0] != key:
            ids = self.draft_token_ids()
            if isinstance(lm_head, PackedLinear):
                head = packed_rows(lm_head, ids)
            elif self.head_format is not None:
                w = lm_head.weight
                head = packed_class(self.head_format).from_weight(w[ids].float(), Q8_BLOCK, None, w.dtype)
            elif isinstance(lm_head, BatchInvariantLinear):
                head = lm_head.select_rows(ids)
            else:
                head = lm_head.weight[ids].contiguous()
                if isinstance(lm_head, OneDNNLinear) and lm_head.packed is not None:
                    head = OneDNNLinear.from_weight(head)
            self._head_cache = (key, head if isinstance(head, nn.Module) else partial(_dense_head, head))
        return self._head_cache[1]

    def forward(
        self,
        block_embeds: torch.Tensor,
        ctx_features: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Draft one block.

        Args:
            block_embeds: ``[B, K, hidden]`` target embeddings of ``[anchor, MASK x (K-1)]``.
            ctx_features: ``[B, N, len(target_layer_ids) * hidden]`` target features of the
                positions not yet in the drafter's context cache (N may be 0; padded rows
                write to the trash slot).
            meta: ``positions`` / ``write_slots`` cover the ``N + K`` context-then-block tokens;
                ``mask`` is ``[B, 1, K, kv_len]`` (non-causal: a block sees all committed
                context and the whole block). A drafter whose layers differ in window or
                causality (``cfg.layer_kinds``) takes one metadata per layer, each with that
                layer's mask (the same positions and slots).
            kv_cache: one ``(k, v)`` buffer pair per drafter layer.

        Returns:
            ``[B, K, hidden]`` final normed hidden states of the block.
        """
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        ctx = self.hidden_norm(self.fc(ctx_features))
        cos, sin = self.rope(metas[0].positions, block_embeds.dtype, metas[0].max_position)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, cos, sin, kv_cache[i], metas[i])
        return self.norm(x)

    def forward_train(
        self,
        block_embeds: torch.Tensor,
        ctx_features: torch.Tensor,
        ctx_positions: torch.Tensor,
        anchors: torch.Tensor,
        ctx_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training forward: many blocks per sequence in ONE pass (paper §4 recipe).

        Every block ``b`` is ``[token at anchor_b, MASK x (B-1)]`` at positions
        ``anchor_b .. anchor_b + B - 1``. Per layer, the context K/V of all ``S`` positions is
        computed once; block ``b`` sees context position ``p`` iff ``p < anchor_b`` (strictly
        before the anchor, exactly what :meth:`forward` sees at inference when the block starts
        at the last committed token) plus its own ``B`` slots (non-causal), never other blocks.
        The result equals :meth:`forward` run block by block with a fresh cache holding the
        context positions ``< anchor_b``.

        Args:
            block_embeds: ``[nb, B, hidden]`` (or ``[N, nb, B, hidden]`` for N sequences)
                target embeddings of the blocks.
            ctx_features: ``[S, F]`` (or ``[N, S, F]``) target features of the sequence.
            ctx_positions: int64 ``[S]`` (or ``[N, S]``) their absolute positions.
            anchors: int64 ``[nb]`` (or ``[N, nb]``) anchor position of each block.
            ctx_valid: optional bool ``[S]`` (or ``[N, S]``); false marks padding, never seen.

        Returns:
            ``[nb, B, hidden]`` (or ``[N, nb, B, hidden]``) final normed hidden states.
        """
        single = block_embeds.dim() == 3
        if single:
            block_embeds, ctx_features = block_embeds.unsqueeze(0), ctx_features.unsqueeze(0)
            ctx_positions, anchors = ctx_positions.unsqueeze(0), anchors.unsqueeze(0)
            ctx_valid = ctx_valid.unsqueeze(0) if ctx_valid is not None else None
        N, nb, B, H = block_embeds.shape
        S = ctx_features.shape[1]
        block_pos = (anchors.unsqueeze(-1) + torch.arange(B, device=anchors.device)).reshape(N, nb * B)
        dtype = block_embeds.dtype
        cos_c, sin_c = self.rope(ctx_positions, dtype) if S else (None, None)
        cos_b, sin_b = self.rope(block_pos, dtype)
        seen = {w: _train_visibility(anchors, ctx_positions, ctx_valid, w, B, S) for _, w in set(self.cfg.layer_kinds)}
        ctx = self.hidden_norm(self.fc(ctx_features))
        x = block_embeds.reshape(N, nb * B, H)
        for layer, (causal, w) in zip(self.layers, self.cfg.layer_kinds):
            h = layer.input_layernorm(x)
            visible, index = seen[w]
            attn = layer.self_attn
            x = x + _train_attention(attn, h, ctx, cos_c, sin_c, cos_b, sin_b, visible, nb, B, index, causal)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.norm(x).view(N, nb, B, H)
        return out[0] if single else out


def _train_visibility(anchors, ctx_positions, ctx_valid, W: int | None, B: int, S: int):
    """Which context keys each block's queries see in :meth:`DFlashDrafter.forward_train`:
    ``(visible, None)`` with ``visible`` bool ``[N, nb, 1, S]`` (no window: the context before
    the anchor), or with a window W ``(visible [N, nb, B, W-1], index [N, nb, W-1])``: a block
    anchored at ``a`` sees context positions ``a - W + 1 .. a - 1`` only, gathered (``index``)
    instead of scoring all S (contexts are positions ``0 .. S - 1`` there)."""
    if W is not None and S:
        dev = anchors.device
        index = anchors.unsqueeze(-1) - (W - 1) + torch.arange(W - 1, device=dev)  # [N, nb, W-1]
        inside = index >= 0
        index = index.clamp(min=0)
        if ctx_valid is not None:
            inside = inside & torch.gather(ctx_valid, 1, index.flatten(1)).view_as(index)
        query = anchors[..., None, None] + torch.arange(B, device=dev)[:, None]  # [N, nb, B, 1]
        return inside.unsqueeze(2) & sliding_visible(query, index.unsqueeze(2), W), index
    visible = ctx_positions.unsqueeze(1) < anchors.unsqueeze(-1)  # [N, nb, S]
    if ctx_valid is not None:
        visible = visible & ctx_valid.unsqueeze(1)
    return visible.unsqueeze(2), None


def _train_attention(
    attn: DrafterAttention, h, ctx, cos_c, sin_c, cos_b, sin_b, visible, nb: int, B: int, index=None, causal=False
):
    """Attention of ``nb`` blocks of ``B`` queries over ``[shared context ; own block]``.

    Scores against the context are one GEMM for all blocks (masked by ``visible``
    ``[N, nb, 1 or B, S]``), scores within each block a batched ``B x B`` GEMM (``causal``:
    slot ``k`` sees the block's slots ``<= k`` only); one softmax over both.
    With ``index`` (int64 ``[N, nb, L]``, a sliding window's context positions per block) each
    block scores only its ``L`` gathered context keys (``visible`` is then ``[N, nb, B, L]``).
    Grouped-query heads are handled by viewing the queries as ``[N, Hkv, group, T, D]``
    (query head ``i`` reads KV head ``i // group``, like SDPA's ``enable_gqa``).
    """
    N, T, _ = h.shape
    S = ctx.shape[1]
    hq, hkv, d = attn.h, attn.hkv, attn.d
    g = hq // hkv
    q = attn.q_norm(attn.q_proj(h).view(N, T, hq, d)).transpose(1, 2)
    q = apply_rope(q, cos_b, sin_b).reshape(N, hkv, g, nb, B, d)
    kb = attn.k_norm(attn.k_proj(h).view(N, T, hkv, d)).transpose(1, 2)
    kb = apply_rope(kb, cos_b, sin_b).reshape(N, hkv, 1, nb, B, d)
    vb = attn.v_proj(h).view(N, T, hkv, d).transpose(1, 2).reshape(N, hkv, 1, nb, B, d)
    scale = d**-0.5
    s_blk = (q @ kb.transpose(-1, -2)) * scale  # [N, hkv, g, nb, B, B]
    if causal:
        s_blk = s_blk.masked_fill(torch.ones(B, B, dtype=torch.bool, device=h.device).triu(1), float("-inf"))
    if S:
        kc = attn.k_norm(attn.k_proj(ctx).view(N, S, hkv, d)).transpose(1, 2)
        kc = apply_rope(kc, cos_c, sin_c).unsqueeze(2)  # [N, hkv, 1, S, d]
        vc = attn.v_proj(ctx).view(N, S, hkv, d).transpose(1, 2).unsqueeze(2)
        if index is not None:
            L = index.shape[-1]
            rows = torch.arange(N, device=index.device).view(N, 1, 1)
            kw = kc[:, :, 0].transpose(1, 2)[rows, index].permute(0, 3, 1, 2, 4).unsqueeze(2)  # [N, hkv, 1, nb, L, d]
            vw = vc[:, :, 0].transpose(1, 2)[rows, index].permute(0, 3, 1, 2, 4).unsqueeze(2)
            s_ctx = (q @ kw.transpose(-1, -2)) * scale  # [N, hkv, g, nb, B, L]
            s_ctx = s_ctx.masked_fill(~visible.view(N, 1, 1, nb, B, L), float("-inf"))
            p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(vb.dtype)
            out = p[..., :L] @ vw + p[..., L:] @ vb
            out = out.reshape(N, hq, T, d).transpose(1, 2).reshape(N, T, hq * d)
            return attn.o_proj(out)
        s_ctx = (q.reshape(N, hkv, g, T, d) @ kc.transpose(-1, -2)).view(N, hkv, g, nb, B, S) * scale
        s_ctx = s_ctx.masked_fill(~visible.view(N, 1, 1, nb, visible.shape[2], S), float("-inf"))
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(vb.dtype)
        out = (p[..., :S].reshape(N, hkv, g, T, S) @ vc).view(N, hkv, g, nb, B, d) + p[..., S:] @ vb
    else:
        out = torch.softmax(s_blk.float(), dim=-1).to(vb.dtype) @ vb
    out = out.reshape(N, hq, T, d).transpose(1, 2).reshape(N, T, hq * d)
    return attn.o_proj(out)


def _dense_head(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows @ weight.T`` with ``rows`` cast to the weight's dtype (a dense draft-vocabulary head)."""
    return F.linear(as_dtype(rows, weight.dtype), weight)
