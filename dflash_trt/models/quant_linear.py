"""Weight-only packed-integer linears for the CPU: int4 (group-wise, asymmetric) and int8 (per
output channel, symmetric), activations in the module's scale dtype (bf16 by default), through
torch's own packed CPU GEMMs:

* int4: ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` packs the 4-bit codes once,
  ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)``
  multiplies. The kernel's convention (torch 2.13, ``aten/src/ATen/native/cpu/int4mm_kernel.cpp``)
  is ``w = (q - 8) * scale + zero`` with ``q`` in 0..15, one ``(scale, zero)`` pair per
  ``group_size`` consecutive input elements of a row, ``scales_and_zeros`` ``[in / g, out, 2]``
  in the activation dtype. Group sizes 32, 64, 128, 256; ``out`` a multiple of 16.
* int8: ``torch.ops.aten._weight_int8pack_mm(x, q, scales)``: ``w = q * scale[row]``, ``q``
  int8 ``[out, in]``, ``scales`` ``[out]`` in the activation dtype.

This module's own int4 convention is GGUF Q4_1's (``ggml-quants.c``, ``block_q4_1``: 32 weights,
fp16 ``d`` and ``m``, ``w = d * q + m``): :meth:`PackedLinear.from_int4` takes
``(q, scale, zero)`` with ``w = q * scale + zero`` and stores ``zero + 8 * scale`` as the
kernel's zero, so a Q4_1 block maps onto one int4 group exactly up to the rounding of ``d`` and
``m + 8 d`` to the scale dtype.

Packed modules hold no ``weight`` parameter: code that needs the values calls
:meth:`PackedLinear.int_weight` / :meth:`PackedLinear.dequantize`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DFlashError
from .layers import as_dtype

#: weight formats a packed linear runs
INT_FORMATS = ("int4", "int8")
#: group sizes torch's int4 CPU GEMM accepts
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: the int4 kernel packs output rows in tiles of this many
INT4_ROW_MULTIPLE = 16


def check_int4_shape(out_features: int, in_features: int, group_size: int, what: str = "linear") -> None:
    """Raise a one-line :class:`DFlashError` when ``[out, in]`` cannot be packed as int4 with
    ``group_size`` (torch's CPU kernel: group 32/64/128/256 dividing ``in``, ``out`` % 16 == 0)."""
    if group_size not in INT4_GROUP_SIZES:
        raise DFlashError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise DFlashError(f"{what}: input size {in_features} is not divisible by the int4 group size {group_size}")
    if out_features % INT4_ROW_MULTIPLE:
        raise DFlashError(f"{what}: output size {out_features} is not a multiple of {INT4_ROW_MULTIPLE} (int4 packing)")


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether :func:`check_int4_shape` passes."""
    try:
        check_int4_shape(out_features, in_features, group_size)
    except DFlashError:
        return False
    return True


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4, one ``(scale, zero)`` per ``group_size`` inputs of a row
    (the min/max rule of GGUF Q4_1's ``quantize_row_q4_1_ref``: ``scale = (max - min) / 15``,
    ``zero = min``).

    Args:
        w: float ``[out, in]``; ``in`` divisible by ``group_size``.

    Returns:
        ``(q uint8 [out, in] in 0..15, scale fp32 [out, in / g], zero fp32 [out, in / g])`` with
        ``w ~= q * scale + zero``.

    Raises:
        DFlashError: ``in`` not divisible by ``group_size`` or a group size the kernel lacks.
    """
    n, k = w.shape
    if group_size not in INT4_GROUP_SIZES:
        raise DFlashError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise DFlashError(f"input size {k} is not divisible by the int4 group size {group_size}")
    g = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = ((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 per output row (``scale = max |w| / 127``).

    Args:
        w: float ``[out, in]``.

    Returns:
        ``(q int8 [out, in] in -127..127, scale fp32 [out])`` with ``w ~= q * scale``.
    """
    w = w.detach().float()
    scale = w.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (w * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8), scale


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2n]`` codes 0..15 -> uint8 ``[..., n]``, the even element in the low nibble
    (the on-disk layout of engine int4 weights, as for NVFP4)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., n]`` -> uint8 ``[..., 2n]``."""
    return torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


class PackedLinear(nn.Module):
    """``nn.Linear`` over a packed int4 / int8 weight (weight-only quantization, CPU).

    Build with :meth:`from_int4`, :meth:`from_int8` or :meth:`quantize`, not the constructor.
    ``forward(x [..., in])`` returns ``[..., out]`` in ``x.dtype``; the GEMM runs in the scale
    dtype (``x`` is cast to it and back), which ``module.to(dtype)`` changes like any buffer.

    Attributes:
        fmt: ``"int4"`` or ``"int8"``.
        group_size: int4 inputs per (scale, zero) pair; ``in_features`` for int8.
        packed: int4: uint8 ``[out, in / 2]`` in the kernel's packed layout (opaque: read it back
            with :meth:`int_weight`); int8: int8 ``[out, in]``.
        scales: int4: ``[in / g, out, 2]`` (scale, kernel zero) pairs; int8: ``[out]``.
        bias: optional ``[out]``.
    """

    def __init__(
        self,
        fmt: str,
        packed: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        group_size: int,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        if fmt not in INT_FORMATS:
            raise DFlashError(f"unknown packed weight format {fmt!r}; choose from {', '.join(INT_FORMATS)}")
        self.fmt = fmt
        self.out_features = packed.shape[0]
        self.in_features = in_features
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_int4(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> PackedLinear:
        """Pack int4 codes with GGUF Q4_1's convention ``w = q * scale + zero``.

        Args:
            q: uint8 (or any integer) ``[out, in]``, values 0..15.
            scale, zero: float ``[out, in / group_size]`` (fp16 Q4_1 ``d`` / ``m``, or fp32).
            group_size: 32, 64, 128 or 256.
            dtype: scale and activation dtype of the GEMM.

        Raises:
            DFlashError: a shape the kernel cannot pack (see :func:`check_int4_shape`).
        """
        n, k = q.shape
        check_int4_shape(n, k, group_size)
        if tuple(scale.shape) != (n, k // group_size) or tuple(zero.shape) != (n, k // group_size):
            raise DFlashError(f"int4 scales must be [{n}, {k // group_size}], got {tuple(scale.shape)}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        s, z = scale.float(), zero.float() + 8 * scale.float()  # kernel: (q - 8) * s + z
        sz = torch.stack([s.t(), z.t()], dim=-1).to(dtype).contiguous()
        return cls("int4", packed, sz, k, group_size, bias)

    @classmethod
    def from_int8(
        cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> PackedLinear:
        """Wrap int8 codes ``q [out, in]`` with per-row ``scale [out]`` (``w = q * scale``)."""
        n, k = q.shape
        if scale.numel() != n:
            raise DFlashError(f"int8 scales must have {n} values (one per output row), got {scale.numel()}")
        return cls("int8", q.to(torch.int8).contiguous(), scale.reshape(n).to(dtype).contiguous(), k, k, bias)

    @classmethod
    def quantize(
        cls,
        w: torch.Tensor,
        fmt: str,
        group_size: int = 32,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> PackedLinear:
        """Round-to-nearest weight-only quantization of a float ``w [out, in]`` (see
        :func:`quantize_int4` / :func:`quantize_int8`).

        Raises:
            DFlashError: unknown ``fmt`` or a shape int4 cannot pack.
        """
        if fmt == "int4":
            check_int4_shape(*w.shape, group_size)
            return cls.from_int4(*quantize_int4(w, group_size), group_size, bias, dtype)
        if fmt == "int8":
            return cls.from_int8(*quantize_int8(w), bias, dtype)
        raise DFlashError(f"unknown packed weight format {fmt!r}; choose from {', '.join(INT_FORMATS)}")

    @property
    def dtype(self) -> torch.dtype:
        """Activation / scale dtype of the GEMM."""
        return self.scales.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_dtype(x.reshape(-1, self.in_features), self.scales.dtype)
        if self.fmt == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.packed, self.scales)
        if self.bias is not None:
            y = y + as_dtype(self.bias, y.dtype)
        return as_dtype(y, x.dtype).view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def int_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stored integer codes and scales, exactly.

        Returns:
            int4: ``(q uint8 [out, in] 0..15, scale fp32 [out, in / g], zero fp32 [out, in / g])``
            with ``w = q * scale + zero`` (the Q4_1 convention; ``zero`` is the kernel zero minus
            ``8 * scale``, computed in fp32). int8: ``(q int8 [out, in], scale fp32 [out], None)``.

        The int4 codes are read back through the kernel itself (an identity GEMM with unit
        scales and zero 8 gives ``q`` exactly: integers 0..15, one nonzero product per output,
        exact in bf16, the kernel's fast dtype), so nothing depends on the packed layout.
        """
        if self.fmt == "int8":
            return self.packed, self.scales.float(), None
        k, n, g = self.in_features, self.out_features, self.group_size
        unit = torch.stack([torch.ones(k // g, n), torch.full((k // g, n), 8.0)], dim=-1).to(torch.bfloat16)
        eye = torch.eye(k, dtype=torch.bfloat16, device=self.packed.device)
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, g, unit.to(eye.device))
        s = self.scales[..., 0].float().t().contiguous()
        z = self.scales[..., 1].float().t() - 8 * s
        return q.t().round().to(torch.uint8).contiguous(), s, z.contiguous()

    @torch.no_grad()
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the GEMM multiplies by, ``[out, in]`` in ``dtype``."""
        q, s, z = self.int_weight()
        if self.fmt == "int8":
            return (q.float() * s.unsqueeze(-1)).to(dtype)
        g = self.group_size
        return (q.float() * s.repeat_interleave(g, -1) + z.repeat_interleave(g, -1)).to(dtype)

    @torch.no_grad()
    def select_rows(self, index: torch.Tensor) -> PackedLinear:
        """A packed linear over output rows ``index`` (int64 ``[n]``) only, the same codes and
        scales (e.g. the draft vocabulary's rows of a packed LM head).

        Raises:
            DFlashError: int4 with ``n`` not a multiple of 16.
        """
        q, s, z = self.int_weight()
        bias = None if self.bias is None else self.bias[index]
        if self.fmt == "int8":
            return PackedLinear.from_int8(q[index], s[index], bias, self.dtype)
        return PackedLinear.from_int4(q[index], s[index], z[index], self.group_size, bias, self.dtype)

    def weight_bytes(self) -> int:
        """Bytes read per GEMM: packed codes plus scales (and bias)."""
        n = self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.fmt == "int4" else ""
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}{g}, dtype={self.dtype}"


def packed_rows(mod: PackedLinear, index: torch.Tensor) -> PackedLinear | torch.Tensor:
    """Rows ``index`` of a packed linear: :meth:`PackedLinear.select_rows` when they can be
    packed, else the dequantized rows as a dense ``[n, in]`` weight in the module's dtype."""
    if mod.fmt == "int8" or index.numel() % INT4_ROW_MULTIPLE == 0:
        return mod.select_rows(index)
    return mod.dequantize(mod.dtype)[index].contiguous()


def packed_stack(mods: list[PackedLinear]) -> PackedLinear:
    """One packed linear whose output rows are those of ``mods`` in order (same format, group
    size, input size and dtype), e.g. every drafter layer's k/v projections for one GEMM.

    Raises:
        DFlashError: mixed formats / group sizes / input sizes.
    """
    first = mods[0]
    if any((m.fmt, m.group_size, m.in_features) != (first.fmt, first.group_size, first.in_features) for m in mods):
        raise DFlashError("cannot stack packed linears of different formats, group sizes or input sizes")
    parts = [m.int_weight() for m in mods]
    biases = [m.bias for m in mods]
    bias = torch.cat(biases) if biases[0] is not None else None
    q = torch.cat([p[0] for p in parts])
    s = torch.cat([p[1] for p in parts])
    if first.fmt == "int8":
        return PackedLinear.from_int8(q, s, bias, first.dtype)
    return PackedLinear.from_int4(q, s, torch.cat([p[2] for p in parts]), first.group_size, bias, first.dtype)


def quantize_linears(
    model: nn.Module,
    fmt: str,
    group_size: int = 32,
    head: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, int]:
    """Swap every ``nn.Linear`` of ``model`` (target or drafter) for a :class:`PackedLinear`,
    quantized round-to-nearest from its current weight.

    Args:
        fmt: ``int4`` or ``int8``.
        group_size: int4 group size.
        head: format of a module named ``lm_head`` (``int4`` / ``int8``; None or ``"none"``
            keeps it dense). A head tied to the embedding is untied: the embedding stays dense.
        dtype: scale / activation dtype.

    Returns:
        ``{"packed": n, "dense": m}``: linears swapped and linears left dense because int4
        cannot pack their shape (they keep their dtype; listed on stderr by the caller).

    Raises:
        DFlashError: unknown format or group size.
    """
    if fmt not in INT_FORMATS:
        raise DFlashError(f"unknown weight format {fmt!r}; choose from {', '.join(INT_FORMATS)}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        raise DFlashError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    counts = {"packed": 0, "dense": 0}
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        this = fmt
        if name.rsplit(".", 1)[-1] == "lm_head":
            if head in (None, "none"):
                continue
            this = head
        n, k = mod.weight.shape
        if this == "int4" and not int4_fits(n, k, group_size):
            counts["dense"] += 1
            continue
        new = PackedLinear.quantize(mod.weight, this, group_size, mod.bias, dtype)
        replace_module(model, name, new)
        counts["packed"] += 1
    return counts


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Swap the submodule at dotted path ``name`` for ``new``; its forward hooks move to ``new``
    (e.g. the all-gather of a vocab-parallel LM head under tensor parallelism)."""
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    new._forward_hooks.update(getattr(owner, leaf)._forward_hooks)
    setattr(owner, leaf, new)


def packed_summary(model: nn.Module) -> dict:
    """``{"int4": n, "int8": m, "dense": k, "weight_bytes": b}``: packed linears by format, dense
    ``nn.Linear`` modules left, and the bytes of every linear weight (packed codes + scales,
    dense weights at their dtype; a head tied to the embedding counts once)."""
    out = {"int4": 0, "int8": 0, "dense": 0, "weight_bytes": 0}
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, PackedLinear):
            out[mod.fmt] += 1
            out["weight_bytes"] += mod.weight_bytes()
        elif isinstance(mod, nn.Linear):
            out["dense"] += 1
            if mod.weight.data_ptr() not in seen:
                seen.add(mod.weight.data_ptr())
                out["weight_bytes"] += mod.weight.numel() * mod.weight.element_size()
    return out
