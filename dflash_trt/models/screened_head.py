"""Greedy token choice over a CPU LM head that reads a quarter of an fp32 head's bytes (half a
bf16 head's) and gives the full head's argmax exactly.

A decode step of a small target spends a large share of its weight traffic in the LM head: the
default target's 49,152 x 576 head is 113 MB of the 538 MB an fp32 token reads (57 of 270 in
bf16). Greedy decoding and verification need only each row's argmax, so the head runs in two
passes (:class:`ScreenedHead`):

1. **Screen**: int8 codes of the head (symmetric per vocabulary row, ``dflash_cpu::int8_linear``,
   Q8_0 x Q8_0 arithmetic, 28 MB) give approximate logits ``A`` for every token.
2. **Bound**: for hidden row ``h`` and vocabulary row ``w_i`` (``ŵ_i`` its int8 value, ``ĥ`` the
   activations as the kernel rounds them), the logit the full head computes, ``L_i``, is within
   ``E_i`` of ``A_i``:
   ``|L_i - A_i| <= ||h|| ||w_i - ŵ_i|| + ||h - ĥ|| ||ŵ_i|| + (rounding of both fp32 sums) +
   (rounding of the outputs to the activation dtype)``: the first two terms by Cauchy-Schwarz on
   ``h·w - ĥ·ŵ = h·(w - ŵ) + (h - ĥ)·ŵ``; ``||w_i - ŵ_i||`` and ``||ŵ_i||`` computed once in
   float64 from the stored weight, codes and scales; ``||h - ĥ|| <= 0.5 * sqrt(32 * sum_b d_b^2)``
   from each 32-input block's activation scale ``d_b`` (round to nearest); the sums' rounding
   ``<= 2K * 2^-23 * (||h|| ||w_i|| + ||ĥ|| ||ŵ_i||)`` in any summation order (twice the unit
   roundoff, for truncating accumulators too); bf16 outputs add ``2^-8`` of each logit's
   magnitude (bounded by the row's largest screened magnitude). ``E_i`` is thus ``||h||`` and
   ``||h - ĥ||`` times two per-token coefficients (:attr:`ScreenedHead.coef_h`, ``coef_err``)
   plus the rounding term.
3. **Exact pass**: with ``T = max_j (A_j - E_j)`` (no more than the row's largest full-head
   logit), every token with ``A_i + E_i >= T`` (``dflash_cpu::screen_candidates``: all tokens
   that can reach that logit) is computed by the full head's own kernel on just those weight
   rows (:meth:`BatchInvariantLinear.select_rows`: every output column is the same chain of
   instructions in any panel, so the same bits), for every row of the call (the union of the
   rows' candidates, in vocabulary order), and the first maximum among them is the token (a
   token outside a row's candidates is strictly below that row's maximum, so ties resolve as
   ``argmax`` resolves them over the whole vocabulary).

On the default target the candidates number ~10 a row by the median (GSM8K decode rows, fp32
and bf16; a few hundred at most). A row with a non-finite hidden value, or screened logits that
are not all finite, makes the call return None and the caller runs the full head (where
``argmax``'s NaN rule applies). Sampled rows and banned tokens (``min_tokens``) need full
logits: the runner does not screen those steps.
"""

from __future__ import annotations

import torch

from ..kernels import cpu_ops
from ..kernels.cpu_ops import argmax_rows
from ..quantization.int8 import pack_int8, quantize_int8
from ..quantization.packed import Q8_BLOCK
from .batch_invariant import BatchInvariantLinear


class ScreenedHead:
    """Exact greedy choice over ``head`` (a CPU :class:`BatchInvariantLinear`, fp32 or bf16
    weight ``[V, K]``, ``K`` divisible by 32) through an int8 screen (module docstring).

    Memory: the int8 codes and scales (``V * K`` bytes and ``V`` scales) and two fp32 ``[V]``
    bound coefficients beside the head's own packed weight.

    Raises:
        ValueError: ``head`` is not such a linear (see :meth:`supports`).
    """

    def __init__(self, head: BatchInvariantLinear):
        if not self.supports(head):
            raise ValueError("ScreenedHead takes a CPU BatchInvariantLinear head, fp32 or bf16, in_features % 32 == 0")
        cpu_ops.load()
        self.head = head
        w = head.weight.detach()
        self.vocab, k = w.shape
        self.dtype = w.dtype
        q, scale = quantize_int8(w)
        self.codes, self.scales = pack_int8(q, scale, w.dtype)
        stored = self.scales.double().reshape(-1)[: self.vocab]  # (the scales as the kernel reads them)
        w_hat = q.double() * stored.unsqueeze(1)
        err, norm, hat = (w.double() - w_hat).norm(dim=1), w.double().norm(dim=1), w_hat.norm(dim=1)
        gamma = 2 * k * 2.0**-23  # either fp32 sum's rounding, relative to the sum of |terms|
        up = 1 + 1e-6  # (rounded to fp32 no lower than the float64 values)
        #: E_i's coefficient of ||h||: ||w_i - ŵ_i|| and the sums' rounding
        self.coef_h = (up * (err + gamma * (norm + hat))).float()
        #: E_i's coefficient of ||h - ĥ||: ||ŵ_i|| and the screen sum's rounding
        self.coef_err = (up * hat * (1 + gamma)).float()
        u = 2.0**-8 if w.dtype == torch.bfloat16 else 0.0  # the outputs' rounding to the activation dtype
        self.rel, self.scale = 2 * u, (1 + 4 * u) * (1 + 1e-5)

    def pays(self, rows: int) -> bool:
        """Whether the screen is expected to beat the full head for ``rows`` logits rows: always
        for an fp32 head, for a single row in bf16. (Plain decoding of the load bench's GSM8K
        lanes, the screened head against the full one interleaved in one process, 2-core AMX
        Xeon, medians of 3-5 runs: fp32 1.100x at 1 sequence, 1.055x at 16; bf16 1.028x at 1,
        0.989x at 4, 1.000x at 16: the bf16 head's AMX kernel reads its 57 MB about as fast as
        the int8 kernel reads its 28 from 4 rows on.)"""
        return self.dtype == torch.float32 or rows <= 1

    @staticmethod
    def supports(head) -> bool:
        """Whether ``head`` can be screened: a CPU :class:`BatchInvariantLinear` without bias,
        fp32 or bf16, whose inputs come in whole 32-input blocks."""
        return (
            isinstance(head, BatchInvariantLinear)
            and head.bias is None
            and head.weight.device.type == "cpu"
            and head.weight.dtype in (torch.float32, torch.bfloat16)
            and head.in_features % Q8_BLOCK == 0
        )

    def candidates(self, x: torch.Tensor) -> torch.Tensor | None:
        """The tokens, ascending, among which every row of ``x`` (``[R, K]``, contiguous) has
        its full-head argmax (int64 ``[N]``): the union of each row's tokens within the bound
        of its best screened token (module docstring). None when a value is not finite."""
        approx = torch.ops.dflash_cpu.int8_linear(x, self.codes, self.scales, self.vocab, None)
        xd = x.double()
        scales = xd.view(x.shape[0], -1, Q8_BLOCK).abs().amax(-1) / 127  # each block's d_b
        h = (xd.norm(dim=1) * (1 + 1e-6)).float()
        h_err = (0.5 * torch.sqrt(Q8_BLOCK * (scales * scales).sum(1)) * (1 + 1e-5)).float()  # >= ||h - ĥ||
        if not torch.isfinite(h).all():
            return None
        cand = torch.ops.dflash_cpu.screen_candidates(
            approx, self.coef_h, self.coef_err, h, h_err, self.rel, self.scale
        )
        return cand if len(cand) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The full head's ``argmax`` of each row of ``x`` (``[R, K]`` in the head's dtype): int64
        ``[R]``, the first maximum on ties, as ``argmax_rows(head(x))``; None when a value is not
        finite (the caller runs the full head, where ``argmax``'s NaN rule applies)."""
        x = x.contiguous()
        if not len(x):
            return torch.empty(0, dtype=torch.long)
        cand = self.candidates(x)
        if cand is None:
            return None
        # the full head's kernel over the candidates' weight rows: each column the same bits
        return cand[argmax_rows(self.head.select_rows(cand)(x))]
