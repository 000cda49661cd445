"""Batch-invariant mode: every row of a target forward gets the same bits whatever else is in
the forward (how many rows, which sequences, prompt chunk or decode step or verify block).

Why it is needed: speculative decoding is lossless only if the target's logits at a position
are the same when that position is verified inside a block of ``B`` tokens as when plain
decoding computes it alone. In fp32 the two differ in the last bits (a GEMM or an attention
that blocks its sums by the number of rows); in bf16 each op rounds those bits to bf16, the
differences grow over the layers (up to ~1.3 logits on SmolLM2-135M) and a greedy choice at a
near tie flips. ``bench/batch_invariance.py`` measures, per op, how far a row's output moves
between a 1-row and a K-row call; the ops that move are replaced here:

- every ``nn.Linear`` / oneDNN-prepacked :class:`~.cpu_linear.OneDNNLinear` of the target by
  :class:`BatchInvariantLinear` over the same weight (``dflash_cpu::bi_linear``: fp32
  accumulation in a fixed order per output, whatever the rows);
- attention by ``dflash_cpu::bi_attention`` (each query alone over its visible keys in key
  order), switched on per attention module (:attr:`TargetAttention.batch_invariant`).

Packed int4 / int8 linears (:class:`~dflash_trt.quantization.packed.PackedLinear`, torch's ``tinygemm``-style CPU
kernels) compute each row with one FMA chain per output in tiles of 4 rows, so they are kept:
the per-op measurement and the tests check that they are invariant on the machine they run on.
RMSNorm, RoPE, SiLU, residual adds and the embedding are row-wise or elementwise ops: invariant
as they are (measured too). The drafter is left alone: its drafts only decide what the target
verifies, never what it outputs.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DFlashError
from ..quantization.common import replace_module
from .cpu_linear import OneDNNLinear, dense_linear

#: activation and weight dtypes the kernels take
INVARIANT_DTYPES = (torch.float32, torch.bfloat16)


def weight_identity(w: torch.Tensor) -> tuple[int, int]:
    """A weight's storage address and in-place version (inference tensors keep no version: 0)."""
    return w.data_ptr(), 0 if w.is_inference() else w._version


class BatchInvariantLinear(nn.Linear):
    """``nn.Linear`` (CPU, fp32 or bf16) whose output rows do not depend on the other rows.

    ``forward(x [..., in])`` returns ``[..., out]`` in ``x.dtype``, computed by
    ``dflash_cpu::bi_linear_packed`` (:func:`~dflash_trt.kernels.cpu_ops.bi_linear`'s
    arithmetic) over :attr:`packed`, the weight laid out in panels of output columns
    (``dflash_cpu::bi_pack``: ``[ceil(out / lanes), in, lanes]``, the weight's dtype), made here
    and again whenever the weight changes (its storage or version). The module shares the
    ``weight`` and ``bias`` parameters of the linear it was made from (the same ``state_dict``;
    the packed copy is a non-persistent buffer: one more copy of the weight's bytes in memory
    while the mode is on). Off the CPU it is ``F.linear`` over ``weight``.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.register_buffer("packed", None, persistent=False)
        self._packed_from: tuple[int, int] | None = None
        if weight.device.type == "cpu":
            self._pack()

    def _pack(self) -> None:
        """Lay :attr:`weight` out for the kernel (:attr:`packed`) and remember which weight it was."""
        self.packed = torch.ops.dflash_cpu.bi_pack(self.weight.detach())
        self._packed_from = weight_identity(self.weight)

    @classmethod
    def from_module(cls, mod: nn.Module) -> BatchInvariantLinear:
        """From an ``nn.Linear`` (its parameters shared) or a :class:`~.cpu_linear.OneDNNLinear`
        (its exact dense weight).

        Raises:
            DFlashError: a weight that is not fp32 or bf16 on the CPU.
        """
        w = mod.dense_weight() if isinstance(mod, OneDNNLinear) else mod.weight
        if w.device.type != "cpu" or w.dtype not in INVARIANT_DTYPES:
            raise DFlashError(f"batch-invariant linears take fp32 or bf16 CPU weights, got {w.dtype} on {w.device}")
        return cls(w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False), mod.bias)

    def dense_weight(self) -> torch.Tensor:
        """The ``[out, in]`` weight (the shared parameter)."""
        return self.weight

    def select_rows(self, index: torch.Tensor) -> BatchInvariantLinear:
        """A batch-invariant linear over output rows ``index`` (int64 ``[n]``) only (copies them)."""
        bias = None if self.bias is None else nn.Parameter(self.bias[index], requires_grad=False)
        return BatchInvariantLinear(nn.Parameter(self.weight[index].contiguous(), requires_grad=False), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        if not torch.compiler.is_compiling() and self._packed_from != weight_identity(self.weight):
            self._pack()  # the weight was loaded, moved or changed since
        # the op itself (loaded by set_batch_invariant), so that torch.compile sees one opaque call
        x2 = x.reshape(-1, self.in_features)
        y = torch.ops.dflash_cpu.bi_linear_packed(x2, self.packed, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, batch-invariant"


def check_batch_invariant(model: nn.Module) -> None:
    """Raise a one-line :class:`DFlashError` when the batch-invariant mode cannot run ``model``:
    off the CPU, or a compute dtype the kernels lack (fp32 and bf16 are covered)."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        raise DFlashError(f"the batch-invariant mode runs on the CPU only (the target is on {p.device})")
    dtype = model.embed.weight.dtype if hasattr(model, "embed") else p.dtype
    if dtype not in INVARIANT_DTYPES:
        raise DFlashError(f"the batch-invariant mode covers fp32 and bf16, not {dtype}")


def set_batch_invariant(model: nn.Module, on: bool) -> int:
    """Put ``model`` (a target) in or out of the batch-invariant mode, in place (idempotent).

    On: every dense linear (``nn.Linear`` / :class:`~.cpu_linear.OneDNNLinear`) becomes a
    :class:`BatchInvariantLinear` over the same weight, and every module with a
    ``batch_invariant`` attribute (the attention layers) has it set. Off: the linears go back to
    ``nn.Linear`` over the same weight; the caller then lays them out as it wants
    (``runtime/model_runner.cpu_weight_layout``). Forward hooks move with a swapped module (the
    vocab-parallel head's all-gather).

    Returns:
        how many linears were swapped.

    Raises:
        DFlashError: on, for a model :func:`check_batch_invariant` refuses.
    """
    if on:
        from ..kernels.cpu_ops import load

        check_batch_invariant(model)
        load()  # the kernels built (first use on this machine) before any forward
    if hasattr(model, "dense_layers"):  # planned for the layers as they were (models/fused_layer.py)
        model.dense_layers = None
    n = 0
    for name, mod in list(model.named_modules()):
        if hasattr(mod, "batch_invariant"):
            mod.batch_invariant = on
        if on and (type(mod) is nn.Linear or isinstance(mod, OneDNNLinear)):
            replace_module(model, name, BatchInvariantLinear.from_module(mod))
            n += 1
        elif not on and isinstance(mod, BatchInvariantLinear):
            replace_module(model, name, dense_linear(mod))
            n += 1
    return n


def is_batch_invariant(model: nn.Module) -> bool:
    """Whether :func:`set_batch_invariant` put ``model`` in the mode."""
    return any(getattr(m, "batch_invariant", False) for m in model.modules())


#: compute dtypes in which the mode is on unless asked otherwise (on the CPU)
AUTO_DTYPES = INVARIANT_DTYPES


def resolve_batch_invariant(requested: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """The mode for a target on ``device`` in ``dtype``: ``requested`` when given (True or
    False), else on for CPU targets in :data:`AUTO_DTYPES` whose kernels build here (without
    a C++ compiler: off, with one warning on stderr)."""
    if requested is not None:
        return requested
    if device.type != "cpu" or dtype not in AUTO_DTYPES:
        return False
    from ..kernels.cpu_ops import load

    try:
        load()
    except DFlashError as e:
        global _warned
        if not _warned:
            print(f"dflash-trt: warning: batch-invariant mode off: {e}", file=sys.stderr)
            _warned = True
        return False
    return True


_warned = False
