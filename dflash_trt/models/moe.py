"""Mixture-of-experts MLP of a Qwen3-MoE target (transformers' ``Qwen3MoeSparseMoeBlock``).

Each token's normalised hidden state goes through a router (a bias-free linear, ``[E, hidden]``)
whose softmax over **all** experts is taken in fp32; the ``top_k`` largest probabilities pick
the experts, renormalised to sum to 1 when ``norm_topk_prob`` is set; each picked expert is a
SwiGLU MLP (``down(silu(gate(x)) * up(x))``, no biases) and the token's output is the
probability-weighted sum of its experts' outputs. The experts live in two stacked parameters in
``nn.Linear`` orientation: ``gate_up [E, 2 * I, hidden]`` ([gate; up] along the rows) and
``down [E, hidden, I]``.

The forward groups the tokens by expert and runs one pair of GEMMs per expert that any token
picked, in increasing expert id, adding into the output in that order (transformers' order, so
fp32 outputs agree with its eager path to rounding). Picking the experts reads the routing on
the host: CUDA graphs and torch.compile do not cover this layer yet. Under tensor or expert
parallelism (``runtime/distributed.shard_target``) a rank holds a slice of each expert, or the
experts ``[expert_offset, expert_offset + len(gate_up))`` only, and skips the others.

Batch-invariant mode (``models/batch_invariant.py``): the router is a linear like any other, and
the expert GEMMs run through ``dflash_cpu::bi_linear_packed`` (each expert's weights packed on
its first use), whose per-row arithmetic does not depend
on the other rows; the routing is row-wise and a token's expert outputs are added in expert-id
order whatever else is in the batch, so a token's output does not depend on the batch either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .batch_invariant import weight_identity


class MoEBlock(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE).

    ``forward(x [..., hidden])`` returns ``[..., hidden]`` in ``x.dtype``.

    Args:
        hidden: model width.
        intermediate: each expert's width (``moe_intermediate_size``).
        num_experts: E.
        top_k: experts per token (``num_experts_per_tok``).
        norm_topk_prob: renormalise the picked probabilities to sum to 1.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.intermediate, self.top_k, self.norm_topk_prob = intermediate, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=0.02)
        self.batch_invariant = False  # set by models/batch_invariant.set_batch_invariant
        self.expert_offset = 0  # id of gate_up[0] / down[0]: > 0 on an expert-parallel rank
        # the experts' packed weights in that mode: expert id -> (gate_up, down), and which
        # parameters (storage, version) they were packed from
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._packed_of: tuple | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of ``h [N, hidden]``: ``(weights [N, top_k] in h.dtype, expert ids [N, top_k]
        int64)``."""
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def expert_linears(self, e: int, invariant: bool) -> tuple[Callable, Callable]:
        """Expert ``e``'s two GEMMs as functions of their input rows: ``F.linear`` over its
        slices of :attr:`gate_up` / :attr:`down`, or (``invariant``) ``dflash_cpu::bi_linear_packed``
        over those slices packed once (``dflash_cpu::bi_pack``) and again when the parameters change."""
        if not invariant:
            return (lambda t: F.linear(t, self.gate_up[e])), (lambda t: F.linear(t, self.down[e]))
        key = (weight_identity(self.gate_up), weight_identity(self.down))
        if self._packed_of != key:
            self._packed, self._packed_of = {}, key
        if e not in self._packed:
            pack = torch.ops.dflash_cpu.bi_pack
            self._packed[e] = (pack(self.gate_up[e].detach()), pack(self.down[e].detach()))
        gu, dn = self._packed[e]
        op = torch.ops.dflash_cpu.bi_linear_packed
        return (lambda t: op(t, gu, 2 * self.intermediate, None)), (lambda t: op(t, dn, self.down.shape[1], None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(h)
        invariant = self.batch_invariant and h.device.type == "cpu"
        out = torch.zeros_like(h)
        first, local = self.expert_offset, self.gate_up.shape[0]
        for e in torch.unique(ids).tolist():
            if not first <= e < first + local:
                continue  # another rank's expert (expert parallelism)
            rows, slot = (ids == e).nonzero(as_tuple=True)
            gate_up, down = self.expert_linears(e - first, invariant)
            gate, up = gate_up(h[rows]).split(self.intermediate, dim=-1)
            y = down(F.silu(gate) * up) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return out.view(x.shape)
