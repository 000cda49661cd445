"""Mixture-of-experts MLP of a Qwen3-MoE target (transformers' ``Qwen3MoeSparseMoeBlock``) or a
gpt-oss target (transformers' ``GptOssMLP``).

Each token's normalised hidden state goes through a router (a bias-free linear, ``[E, hidden]``)
whose softmax over **all** experts is taken in fp32; the ``top_k`` largest probabilities pick
the experts, renormalised to sum to 1 when ``norm_topk_prob`` is set; each picked expert is a
SwiGLU MLP (``down(silu(gate(x)) * up(x))``, no biases) and the token's output is the
probability-weighted sum of its experts' outputs. The experts live in two stacked parameters in
``nn.Linear`` orientation: ``gate_up [E, 2 * I, hidden]`` ([gate; up] along the rows) and
``down [E, hidden, I]``.

gpt-oss differs in three places (``TargetConfig`` fields ``moe_routing``, ``moe_activation``,
``router_bias`` / ``expert_bias``): the router has a bias and picks the top-k of its **logits**,
then takes the softmax over those k only (in the activations' dtype); each expert's two GEMMs
have biases (``gate_up_bias [E, 2 * I]``, [gate; up] as the weight, and ``down_bias [E,
hidden]``); and the activation is the clamped SwiGLU of OpenAI's reference: ``g = min(gate,
limit)``, ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)`` (limit 7.0,
alpha 1.702). The checkpoint's interleaved gate/up columns are split into [gate; up] at load
(``models/target._hf_gpt_oss_experts``).

The forward groups the tokens by expert and runs one pair of GEMMs per expert that any token
picked, in increasing expert id, adding into the output in that order (transformers' order, so
fp32 outputs agree with its eager path to rounding). Picking the experts reads the routing on
the host, which neither torch.compile nor a CUDA graph can follow; so while torch.compile traces
the forward (``--compile``), while a CUDA graph captures it, and on the CUDA-graph path's static
buffers (:func:`static_experts`, ``runtime/cuda_graphs.py``; on the CPU too, uncaptured) the
layer takes a static-shape path instead (:meth:`MoEBlock.forward_static`): every expert this
rank holds over every token (``E_local / top_k`` times the routed FLOPs: meant for decode and
verify steps and small targets), then each token's picks weighted and added in increasing expert
id as above; its outputs equal the eager path's to rounding (bit for bit in the batch-invariant
mode, eager: ``tests/test_moe_graphs.py``). On CUDA, a rank that holds every
expert runs them all in one grouped GEMM pair instead, eager, compiled or captured
(``kernels/moe_grouped.py``: no host read; a token's expert outputs added in slot order in fp32;
its torch reference, which reads the host, gives way to the static path when compiling or
capturing). Under tensor or expert
parallelism (``runtime/distributed.shard_target``) a rank holds a slice of each expert, or the
experts ``[expert_offset, expert_offset + len(gate_up))`` only, and skips the others.

Batch-invariant mode (``models/batch_invariant.py``): the router is a linear like any other, and
the expert GEMMs run through ``dflash_cpu::bi_linear_packed`` (each expert's weights packed on
its first use), whose per-row arithmetic does not depend
on the other rows; the routing is row-wise and a token's expert outputs are added in expert-id
order whatever else is in the batch, so a token's output does not depend on the batch either.
The static path keeps that property: its GEMMs are ``dflash_cpu::bi_linear`` over the unpacked
weights (no packing inside a compiled graph).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from ..quantization.mxfp4 import MXFP4Experts
from .batch_invariant import weight_identity

#: set inside :func:`static_experts`
_STATIC = False


@contextmanager
def static_experts() -> Iterator[None]:
    """Within it, MoE layers take their static-shape path (:meth:`MoEBlock.forward_static`) even
    when eager: the CUDA-graph path's forwards (``runtime/cuda_graphs.py``), captured or not."""
    global _STATIC
    before, _STATIC = _STATIC, True
    try:
        yield
    finally:
        _STATIC = before


def expert_activation(gate: torch.Tensor, up: torch.Tensor, kind: str, alpha: float, limit: float) -> torch.Tensor:
    """An expert's gated activation, in the inputs' dtype: ``"swiglu"`` ``silu(gate) * up``
    (Qwen3-MoE), or ``"clamped_swiglu"`` (gpt-oss: OpenAI's reference ``swiglu``, transformers'
    ``GptOssExperts``) ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)`` (alpha 1.702, limit 7.0).

    Raises:
        DFlashError: another ``kind``.
    """
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "clamped_swiglu":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise DFlashError(f"unknown MoE activation {kind!r}; choose from swiglu, clamped_swiglu")


def _static_wanted(h: torch.Tensor) -> bool:
    """torch.compile is tracing, a CUDA graph is capturing, or :func:`static_experts` is on."""
    # is_compiling first: dynamo then reads no global (no guard on _STATIC)
    if torch.compiler.is_compiling() or _STATIC:
        return True
    return h.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class MoEBlock(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE, gpt-oss).

    ``forward(x [..., hidden])`` returns ``[..., hidden]`` in ``x.dtype``.

    Args:
        hidden: model width.
        intermediate: each expert's width (``moe_intermediate_size``).
        num_experts: E.
        top_k: experts per token (``num_experts_per_tok``).
        norm_topk_prob: renormalise the picked probabilities to sum to 1 (``softmax_topk`` only).
        routing: ``"softmax_topk"`` (Qwen3-MoE) or ``"topk_softmax"`` (gpt-oss).
        activation: ``"swiglu"`` or ``"clamped_swiglu"`` (gpt-oss, with ``limit`` and ``alpha``).
        router_bias, expert_bias: the router / the experts' GEMMs have biases.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        routing: str = "softmax_topk",
        activation: str = "swiglu",
        limit: float = 7.0,
        alpha: float = 1.702,
        router_bias: bool = False,
        expert_bias: bool = False,
    ):
        super().__init__()
        self.intermediate, self.top_k, self.norm_topk_prob = intermediate, top_k, norm_topk_prob
        self.routing, self.activation, self.limit, self.alpha = routing, activation, limit, alpha
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)  # the router
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=0.02)
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate)) if expert_bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden)) if expert_bias else None
        self.batch_invariant = False  # set by models/batch_invariant.set_batch_invariant
        self.expert_offset = 0  # id of gate_up[0] / down[0]: > 0 on an expert-parallel rank
        # the experts' packed weights in that mode: expert id -> (gate_up, down), and which
        # parameters (storage, version) they were packed from
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._packed_of: tuple | None = None

    @classmethod
    def from_config(cls, cfg) -> MoEBlock:
        """The sparse MLP of a :class:`~dflash_trt.models.config.TargetConfig`."""
        return cls(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            routing=cfg.moe_routing,
            activation=cfg.moe_activation,
            limit=cfg.swiglu_limit,
            alpha=cfg.swiglu_alpha,
            router_bias=cfg.router_bias,
            expert_bias=cfg.expert_bias,
        )

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of ``h [N, hidden]``: ``(weights [N, top_k] in h.dtype, expert ids [N, top_k]
        int64)``."""
        if self.routing == "topk_softmax":  # gpt-oss: the top-k logits, softmax over those k
            top, ids = torch.topk(self.gate(h), self.top_k, dim=-1)
            return F.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def expert_linears(self, e: int, invariant: bool) -> tuple[Callable, Callable]:
        """Expert ``e``'s two GEMMs as functions of their input rows: ``F.linear`` over its
        slices of :attr:`gate_up` / :attr:`down`, or (``invariant``) ``dflash_cpu::bi_linear_packed``
        over those slices packed once (``dflash_cpu::bi_pack``) and again when the parameters change."""
        gu_bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
        dn_bias = None if self.down_bias is None else self.down_bias[e]
        if not invariant or isinstance(self.gate_up, MXFP4Experts):
            # MXFP4 experts (kept packed): decoded for each call, never cached in a wider form
            op = torch.ops.dflash_cpu.bi_linear if invariant else F.linear
            return (lambda t: op(t, self.gate_up[e], gu_bias)), (lambda t: op(t, self.down[e], dn_bias))
        key = (weight_identity(self.gate_up), weight_identity(self.down))
        if self._packed_of != key:
            self._packed, self._packed_of = {}, key
        if e not in self._packed:
            pack = torch.ops.dflash_cpu.bi_pack
            self._packed[e] = (pack(self.gate_up[e].detach()), pack(self.down[e].detach()))
        gu, dn = self._packed[e]
        op = torch.ops.dflash_cpu.bi_linear_packed
        return (lambda t: op(t, gu, 2 * self.intermediate, gu_bias)), (lambda t: op(t, dn, self.down.shape[1], dn_bias))

    def _grouped(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert in one grouped GEMM pair on CUDA (:func:`~dflash_trt.kernels.moe_grouped.grouped_experts`:
        ``F.grouped_mm`` or the Triton kernel; no host read of the routing); a token's slots are added
        in slot order in fp32."""
        from ..kernels.moe_grouped import grouped_experts

        return grouped_experts(
            h,
            ids,
            weights,
            *self.expert_weights(),
            gate_up_bias=self.gate_up_bias,
            down_bias=self.down_bias,
            act=self.activation,
            alpha=self.alpha,
            limit=self.limit,
        )

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2 * I, hidden], down [E, hidden, I])``: the parameters, or MXFP4
        experts decoded (for this forward only)."""
        if isinstance(self.gate_up, MXFP4Experts):
            return self.gate_up.dense(), self.down.dense()
        return self.gate_up, self.down

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The experts' activation (:func:`expert_activation` with this block's settings)."""
        return expert_activation(gate, up, self.activation, self.alpha, self.limit)

    def forward_static(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts of routed rows with static shapes and no host read (module docstring):
        ``h [N, hidden]``, ``weights [N, top_k]`` in ``h.dtype`` and ``ids`` int64 ``[N, top_k]``
        (:meth:`route`) to ``[N, hidden]`` in ``h.dtype``. Every expert this rank holds runs
        over all ``N`` rows (batched GEMMs, or in batch-invariant mode on the CPU
        ``dflash_cpu::bi_linear``); a token's picks among them are weighted in ``h.dtype`` and
        added to zeros in increasing expert id (the eager loop's ``index_add_`` order); other
        ranks' experts add nothing. Memory: ``[E_local, N, 2 * intermediate]`` activations."""
        n, k = ids.shape
        first, local, inter = self.expert_offset, self.gate_up.shape[0], self.intermediate
        gate_up_w, down_w = self.expert_weights()
        if self.batch_invariant and h.device.type == "cpu":
            op = torch.ops.dflash_cpu.bi_linear  # row-wise: each row's outputs whatever the rows
            gu_bias = None if self.gate_up_bias is None else self.gate_up_bias.reshape(-1)
            gu = op(h, gate_up_w.reshape(-1, h.shape[1]), gu_bias).view(n, local, 2 * inter).transpose(0, 1)
            mid = self.act(gu[..., :inter], gu[..., inter:])
            dn_bias = [None] * local if self.down_bias is None else self.down_bias
            y = torch.stack([op(mid[e].contiguous(), down_w[e], dn_bias[e]) for e in range(local)])
        else:
            hb = h.expand(local, n, h.shape[1])
            if self.gate_up_bias is None:
                gu = torch.bmm(hb, gate_up_w.transpose(1, 2))
            else:
                gu = torch.baddbmm(self.gate_up_bias[:, None], hb, gate_up_w.transpose(1, 2))
            mid = self.act(gu[..., :inter], gu[..., inter:])
            if self.down_bias is None:
                y = torch.bmm(mid, down_w.transpose(1, 2))
            else:
                y = torch.baddbmm(self.down_bias[:, None], mid, down_w.transpose(1, 2))
        # y [E_local, N, hidden]: each expert's output for every row
        lid, perm = torch.sort(ids - first, dim=-1)  # each token's experts in increasing id
        w = weights.gather(1, perm)
        mine = (lid >= 0) & (lid < local)
        rows = torch.arange(n, device=h.device)
        out = torch.zeros_like(h)
        for j in range(k):
            yj = y[lid[:, j].clamp(0, local - 1), rows] * w[:, j, None]
            out = out + torch.where(mine[:, j, None], yj, 0.0)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(h)
        static = _static_wanted(h)
        if h.device.type == "cuda" and self.gate_up.shape[0] == self.gate.out_features:
            from ..kernels.moe_grouped import pick_impl

            # the grouped kernels read no host value; their torch reference does
            if not static or pick_impl(h.device, h.dtype, h.shape[1], self.intermediate) != "torch":
                return self._grouped(h, weights, ids).view(x.shape)
        if static:
            return self.forward_static(h, weights, ids).view(x.shape)
        invariant = self.batch_invariant and h.device.type == "cpu"
        out = torch.zeros_like(h)
        first, local = self.expert_offset, self.gate_up.shape[0]
        for e in torch.unique(ids).tolist():
            if not first <= e < first + local:
                continue  # another rank's expert (expert parallelism)
            rows, slot = (ids == e).nonzero(as_tuple=True)
            gate_up, down = self.expert_linears(e - first, invariant)
            gate, up = gate_up(h[rows]).split(self.intermediate, dim=-1)
            y = down(self.act(gate, up)) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return out.view(x.shape)
