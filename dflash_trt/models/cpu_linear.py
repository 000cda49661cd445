"""Dense bf16 linears in oneDNN's prepacked weight layout, for the CPU decode loop.

``F.linear`` on a bf16 CPU tensor hands the row-major ``[out, in]`` weight to oneDNN, which
reorders it into its blocked GEMM layout on every call: the weight is read and written once more
per call than the GEMM needs. At decode sizes that reorder costs as much as the GEMM itself.
Measured on this project's 2-core CI machine (Xeon with AVX512-BF16, no AMX; torch 2.13, 2
threads; mean µs per call):

=====================  ===================  ===================
weight ``[out, in]``   ``F.linear`` 1 / 4 rows  prepacked 1 / 4 rows
=====================  ===================  ===================
gate_up 3072 x 576     131 / 199            67 / 117
down 576 x 1536        74 / 108             41 / 70
LM head 49152 x 576    2,235 / 3,258        1,084 / 1,472
=====================  ===================  ===================

:class:`OneDNNLinear` packs once (``torch.ops.mkldnn._reorder_linear_weight``) and multiplies with
``torch.ops.mkldnn._linear_pointwise`` — the same pair inductor emits for a frozen bf16 linear
(``torch/_inductor/fx_passes/mkldnn_fusion.py``). The GEMM is oneDNN's either way (fp32
accumulation, bf16 output); only the weight's layout differs, so results equal ``F.linear``'s up
to summation order.

Only bf16 weights on the CPU are packed: fp32 ``F.linear`` goes to MKL's sgemm, which does not
reorder per call, and on CUDA cuBLAS reads the weight as it is.
"""

from __future__ import annotations

import torch
from torch import nn

#: dtypes whose CPU linears are packed
PACKED_DTYPES = (torch.bfloat16,)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN (mkldnn) with bf16 support on this CPU."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class OneDNNLinear(nn.Module):
    """``nn.Linear`` (bf16, CPU) over a weight prepacked once in oneDNN's blocked layout.

    ``forward(x [..., in] bf16)`` returns ``[..., out]`` bf16. Build with :meth:`from_linear`.
    The module holds no ``weight`` parameter unless built with ``keep_weight`` (a head tied to
    the embedding, whose rows the drafter slices): the packed copy is opaque (an mkldnn tensor).

    Attributes:
        packed: the weight in oneDNN's layout (``torch._mkldnn`` tensor).
        weight: the dense ``[out, in]`` weight (shared with the original module, not copied)
            when kept, else None.
        bias: optional ``[out]``.

    Raises:
        nothing at call time beyond torch's own errors; :meth:`from_linear` raises ValueError
        for a weight that is not bf16 on the CPU.
    """

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int, bias, weight=None):
        super().__init__()
        self.packed = packed  # an mkldnn tensor: not a buffer (state_dict / .to() cannot carry it)
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.weight = weight

    @classmethod
    @torch.no_grad()
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False) -> OneDNNLinear:
        """Pack a bf16 CPU weight ``w [out, in]`` (``bias [out]`` is used as it is).

        Raises:
            ValueError: the weight is not bf16 or not on the CPU.
        """
        if w.dtype not in PACKED_DTYPES or w.device.type != "cpu":
            raise ValueError(f"OneDNNLinear packs bf16 CPU weights, got {w.dtype} on {w.device}")
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)
        return cls(packed, w.shape[1], w.shape[0], bias, w if keep_weight else None)

    @classmethod
    def from_linear(cls, mod: nn.Linear, keep_weight: bool = False) -> OneDNNLinear:
        """Pack ``mod``'s weight (see :meth:`from_weight`)."""
        return cls.from_weight(mod.weight, mod.bias, keep_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn-prepacked bf16"


def pack_linears(model: nn.Module, keep: tuple[str, ...] = ("lm_head",), skip: tuple[str, ...] = ()) -> int:
    """Swap ``model``'s bf16 CPU ``nn.Linear`` modules for :class:`OneDNNLinear` in place
    (idempotent: packed modules are left as they are).

    Args:
        keep: leaf names whose dense weight stays reachable as ``.weight`` (the LM head: tied to
            the embedding, and the drafter slices its draft-vocabulary rows).
        skip: leaf names left as ``nn.Linear`` (weights other code reads directly).

    Returns:
        the number of linears packed now (0 when oneDNN lacks bf16 here or nothing is bf16 CPU).
    """
    if not onednn_available():
        return 0
    n = 0
    for name, mod in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if type(mod) is not nn.Linear or leaf in skip:
            continue
        if mod.weight.dtype not in PACKED_DTYPES or mod.weight.device.type != "cpu":
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, OneDNNLinear.from_linear(mod, leaf in keep))
        n += 1
    return n
