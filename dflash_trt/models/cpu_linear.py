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
import torch.nn.functional as F
from torch import nn

from ..quantization.common import replace_module
from .layers import as_dtype

#: dtypes whose CPU linears are packed
PACKED_DTYPES = (torch.bfloat16,)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN (mkldnn) with bf16 support on this CPU."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class OneDNNLinear(nn.Module):
    """``nn.Linear`` (bf16, CPU) over a weight prepacked once in oneDNN's blocked layout.

    ``forward(x [..., in])`` returns ``[..., out]`` in ``x.dtype``; the GEMM runs in bf16 (``x``
    is cast to it and back, like :class:`~dflash_trt.quantization.packed.PackedLinear`). Build
    with :meth:`from_linear` or :meth:`from_weight`. The packed copy (an opaque mkldnn tensor,
    not a buffer) replaces the dense weight, so memory does not grow; :meth:`dense_weight` restores it bit for bit
    (``to_dense``), and the module's ``state_dict`` carries it as ``weight`` like ``nn.Linear``'s,
    so saving a drafter or loading its weights into another model works as before.
    ``.to()`` / ``.float()`` move the weight: still bf16 on the CPU it is packed again, otherwise
    the module falls back to ``F.linear`` on the converted dense weight.

    Attributes:
        packed: the weight in oneDNN's layout (``torch._mkldnn`` tensor), or None after a move
            off bf16 CPU.
        weight: the dense ``[out, in]`` weight parameter when kept (``keep_weight``: a head tied
            to the embedding, whose rows the drafter slices; shared, not copied) or after such a
            move, else None.
        bias: optional ``[out]``.
    """

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int, bias, weight=None):
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.weight = weight

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False) -> OneDNNLinear:
        """Pack a bf16 CPU weight ``w [out, in]`` (``bias [out]`` is used as it is).

        Raises:
            ValueError: the weight is not bf16 or not on the CPU.
        """
        if not _packable(w):
            raise ValueError(f"OneDNNLinear packs bf16 CPU weights, got {w.dtype} on {w.device}")
        return cls(_pack(w), w.shape[1], w.shape[0], bias, w if keep_weight else None)

    @classmethod
    def from_linear(cls, mod: nn.Linear, keep_weight: bool = False) -> OneDNNLinear:
        """Pack ``mod``'s weight (see :meth:`from_weight`)."""
        return cls.from_weight(mod.weight, mod.bias, keep_weight)

    def dense_weight(self) -> torch.Tensor:
        """The ``[out, in]`` weight in row-major layout (the kept one, or unpacked: exact)."""
        return self.weight if self.weight is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        x2 = as_dtype(x.reshape(-1, self.in_features), torch.bfloat16).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return as_dtype(y, x.dtype).view(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight is None:
            destination[prefix + "weight"] = self.packed.to_dense()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        key = prefix + "weight"
        if self.weight is None and key in state_dict:  # a new dense weight: packed again
            w = state_dict[key].to(torch.bfloat16)
            if tuple(w.shape) != (self.out_features, self.in_features):
                errors.append(f"size mismatch for {key}: {tuple(w.shape)} vs {(self.out_features, self.in_features)}")
            else:
                self.packed = _pack(w)
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        elif self.weight is None and strict:
            missing.append(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def _apply(self, fn, recurse=True):
        dense = None if self.weight is not None else fn(self.packed.to_dense())
        super()._apply(fn, recurse)  # the kept weight and the bias
        w = self.weight if dense is None else dense
        if _packable(w):
            self.packed = _pack(w)
        else:  # off bf16 CPU: F.linear on the dense weight from now on
            self.packed = None
            if self.weight is None:
                self.weight = nn.Parameter(w, requires_grad=False)
        return self

    def extra_repr(self) -> str:
        how = "onednn-prepacked bf16" if self.packed is not None else "dense"
        return f"in_features={self.in_features}, out_features={self.out_features}, {how}"


def _packable(w: torch.Tensor) -> bool:
    return w.dtype in PACKED_DTYPES and w.device.type == "cpu"


def _pack(w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)


def pack_linears(model: nn.Module, keep: tuple[str, ...] = ("lm_head",), skip: tuple[str, ...] = ()) -> int:
    """Swap ``model``'s bf16 CPU ``nn.Linear`` modules for :class:`OneDNNLinear` in place
    (idempotent: packed modules are left as they are; :func:`unpack_linears` undoes it).

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
        if type(mod) is nn.Linear and leaf not in skip and _packable(mod.weight):
            replace_module(model, name, OneDNNLinear.from_linear(mod, leaf in keep))
            n += 1
    return n


def unpack_linears(model: nn.Module) -> int:
    """Swap every :class:`OneDNNLinear` of ``model`` back for an ``nn.Linear`` with the same
    weight (exact) and bias, in place; returns how many (the compiled path needs plain linears:
    inductor packs only weights it froze itself)."""
    n = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, OneDNNLinear):
            replace_module(model, name, dense_linear(mod))
            n += 1
    return n


def dense_linear(mod: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` over a repacked linear's exact dense weight (``mod.dense_weight()``;
    a kept weight parameter is shared, not copied) and bias."""
    lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
    w = mod.dense_weight()
    lin.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
    lin.bias = mod.bias
    return lin
