"""Weight-only packed-integer linears for the CPU: what the int4 and int8 formats share.

:class:`PackedLinear` is the run-time module: the weight stays in a packed integer layout and
our batch-invariant packed CPU GEMMs multiply, activations in the module's scale dtype (bf16 by
default). Its subclasses, :class:`~.int4.Int4Linear` (group-wise asymmetric,
``dflash_cpu::int4_linear``) and :class:`~.int8.Int8Linear` (per output row, symmetric,
``dflash_cpu::int8_linear``), each in its format's module, hold the packing and the GEMM; this
module holds the format-free rest: forward, row selection and stacking, whole-model
quantization and a summary.

Packed modules hold no ``weight`` parameter: code that needs the values calls
:meth:`PackedLinear.int_weight` / :meth:`PackedLinear.dequantize`.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ..errors import DFlashError
from ..models.layers import as_dtype
from .common import replace_module

#: weight formats a packed linear runs
INT_FORMATS = ("int4", "int8")


#: output rows of one block of the packed integer kernels (``dflash_cpu::int4_linear`` /
#: ``int8_linear``): 8 panels of 8 rows
PANEL = 8
BLOCK_ROWS = PANEL * PANEL


#: inputs per activation scale of ``dflash_cpu::int4_linear`` / ``int8_linear`` (GGUF Q8's block)
Q8_BLOCK = 32


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations as ``dflash_cpu::int4_linear`` and ``int8_linear`` multiply them: per row
    and block of :data:`Q8_BLOCK` inputs, ``d = amax / 127`` and ``q = round(x * (1 / d))`` (to
    nearest even; 0 where ``amax`` is 0), all in fp32 (GGUF ``quantize_row_q8_1``'s rule).

    Args:
        x: float ``[M, K]``, ``K`` divisible by 32.

    Returns:
        ``(q int8 [M, K] in -127..127, d fp32 [M, K / 32])`` with ``x ~= q * d``.
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // Q8_BLOCK, Q8_BLOCK)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (xb * inv.unsqueeze(-1)).round().to(torch.int8).reshape(m, k), d


def rows_to_blocks(t: torch.Tensor) -> torch.Tensor:
    """``[out, ...]`` -> ``[S, 8, 8, ...]`` (block, panel, row of the panel), the rows padded with
    zeros to ``S = ceil(out / 64)`` blocks."""
    pad = -t.shape[0] % BLOCK_ROWS
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    return t.view(-1, PANEL, PANEL, *t.shape[1:])


def blocks_to_rows(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of :func:`rows_to_blocks`: ``[S, 8, 8, ...]`` -> ``[out, ...]``."""
    return t.reshape(-1, *t.shape[3:])[:out_features].contiguous()


def packed_class(fmt: str) -> type[PackedLinear]:
    """The :class:`PackedLinear` subclass of ``fmt`` (``int4`` / ``int8``).

    Raises:
        DFlashError: another format.
    """
    if fmt not in INT_FORMATS:
        raise DFlashError(f"unknown packed weight format {fmt!r}; choose from {', '.join(INT_FORMATS)}")
    return importlib.import_module(f"{__package__}.{fmt}").LINEAR


class PackedLinear(nn.Module):
    """``nn.Linear`` over a packed int4 / int8 weight (weight-only quantization, CPU).

    Build with :meth:`quantize` or a subclass's ``from_codes``, not the constructor.
    ``forward(x [..., in])`` returns ``[..., out]`` in ``x.dtype``; the GEMM runs in the scale
    dtype (``x`` is cast to it and back), which ``module.to(dtype)`` changes like any buffer.

    Attributes:
        fmt: ``"int4"`` or ``"int8"`` (the subclass's).
        group_size: int4 inputs per (scale, zero) pair; ``in_features`` for int8.
        packed: the codes in the kernel's layout (see the subclass).
        scales: the scales in the kernel's layout (see the subclass).
        bias: optional ``[out]``.
    """

    fmt = ""

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        group_size: int,
        bias: torch.Tensor | None = None,
        out_features: int | None = None,
    ):
        super().__init__()
        self.out_features = packed.shape[0] if out_features is None else out_features
        self.in_features = in_features
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    # -- what a format defines ------------------------------------------------------------

    @classmethod
    def from_codes(
        cls,
        codes: tuple[torch.Tensor, ...],
        group_size: int,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> PackedLinear:
        """Pack integer codes (the tuple :meth:`quantize_codes` returns) with scale dtype ``dtype``."""
        raise NotImplementedError

    @staticmethod
    def quantize_codes(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
        """Round-to-nearest integer codes and scales of a float ``w [out, in]``."""
        raise NotImplementedError

    @staticmethod
    def fits(out_features: int, in_features: int, group_size: int) -> bool:
        """Whether the kernel can pack a ``[out, in]`` weight (every shape, unless overridden)."""
        return True

    @staticmethod
    def check_group_size(group_size: int) -> None:
        """Raise a one-line :class:`DFlashError` for a group size the format cannot use."""

    @staticmethod
    def gguf_codes(t) -> tuple[torch.Tensor, ...] | None:
        """Codes of a ``gguf.ReaderTensor`` as stored, None when its block type does not map
        onto this format (the caller requantizes the dequantized tensor)."""
        raise NotImplementedError

    @staticmethod
    def describe(group_size: int) -> str:
        """How this format quantizes, in words (for notes on stderr)."""
        raise NotImplementedError

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [rows, in]`` in the scale dtype times the weight -> ``[rows, out]``."""
        raise NotImplementedError

    def int_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stored integer codes and scales, exactly: ``(q, scale, zero or None)``."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the GEMM multiplies by, ``[out, in]`` in ``dtype``."""
        raise NotImplementedError

    # -- format-free ----------------------------------------------------------------------

    @classmethod
    def quantize(
        cls,
        w: torch.Tensor,
        fmt: str,
        group_size: int = 32,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> PackedLinear:
        """Round-to-nearest weight-only quantization of a float ``w [out, in]`` into the
        ``fmt`` subclass (see :func:`~.int4.quantize_int4` / :func:`~.int8.quantize_int8`).

        Raises:
            DFlashError: unknown ``fmt`` or a shape int4 cannot pack.
        """
        return packed_class(fmt).from_weight(w, group_size, bias, dtype)

    @classmethod
    def from_weight(
        cls, w: torch.Tensor, group_size: int, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> PackedLinear:
        """This format's round-to-nearest codes of a float ``w [out, in]``, packed.

        Raises:
            DFlashError: a shape or group size the format cannot pack.
        """
        return cls.from_codes(cls.quantize_codes(w, group_size), group_size, bias, dtype)

    @classmethod
    def for_modules(
        cls, codes: tuple[torch.Tensor, ...], modules: list[nn.Module], group_size: int
    ) -> list[PackedLinear | None]:
        """Split the codes of a fused linear (rows of ``modules`` one after another) into packed
        linears for ``modules`` (their biases kept, scales in the first one's weight dtype); None
        where the kernel cannot pack that module's shape (it stays dense)."""
        dtype = modules[0].weight.dtype
        out: list[PackedLinear | None] = []
        row = 0
        for m in modules:
            n = m.weight.shape[0]
            r = slice(row, row + n)
            row += n
            fits = cls.fits(n, codes[0].shape[1], group_size)
            out.append(cls.from_codes(tuple(c[r] for c in codes), group_size, m.bias, dtype) if fits else None)
        return out

    @property
    def dtype(self) -> torch.dtype:
        """Activation / scale dtype of the GEMM."""
        return self.scales.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(as_dtype(x.reshape(-1, self.in_features), self.scales.dtype))
        if self.bias is not None:
            y = y + as_dtype(self.bias, y.dtype)
        return as_dtype(y, x.dtype).view(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def select_rows(self, index: torch.Tensor) -> PackedLinear:
        """A packed linear over output rows ``index`` (int64 ``[n]``) only, the same codes and
        scales (e.g. the draft vocabulary's rows of a packed LM head).

        Raises:
            DFlashError: a row count the kernel cannot pack (int4: not a multiple of 16).
        """
        codes = tuple(c[index] for c in self.int_weight() if c is not None)
        bias = None if self.bias is None else self.bias[index]
        return type(self).from_codes(codes, self.group_size, bias, self.dtype)

    def weight_bytes(self) -> int:
        """Bytes read per GEMM: packed codes plus scales (and bias)."""
        n = self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}"


def packed_rows(mod: PackedLinear, index: torch.Tensor) -> PackedLinear | torch.Tensor:
    """Rows ``index`` of a packed linear: :meth:`PackedLinear.select_rows` when they can be
    packed, else the dequantized rows as a dense ``[n, in]`` weight in the module's dtype."""
    if mod.fits(index.numel(), mod.in_features, mod.group_size):
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
    codes = tuple(torch.cat([p[i] for p in parts]) for i in range(3) if parts[0][i] is not None)
    biases = [m.bias for m in mods]
    bias = torch.cat(biases) if biases[0] is not None else None
    return type(first).from_codes(codes, first.group_size, bias, first.dtype)


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
        ``{"packed": n, "dense": m}``: linears swapped and linears left dense because the kernel
        cannot pack their shape (they keep their dtype; listed on stderr by the caller).

    Raises:
        DFlashError: unknown format or group size.
    """
    packed_class(fmt).check_group_size(group_size)
    counts = {"packed": 0, "dense": 0}
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        this = fmt
        if name.rsplit(".", 1)[-1] == "lm_head":
            if head in (None, "none"):
                continue
            this = head
        cls = packed_class(this)
        if not cls.fits(*mod.weight.shape, group_size):
            counts["dense"] += 1
            continue
        replace_module(model, name, cls.from_weight(mod.weight, group_size, mod.bias, dtype))
        counts["packed"] += 1
    return counts


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every :class:`PackedLinear`'s codes and scales replaced by the
    weight its GEMM multiplies by (``<name>.weight`` ``[out, in]`` fp32, :meth:`PackedLinear.dequantize`;
    its bias kept): the keys of the dense model it was packed from, so the weights a packed model
    runs can be written to, or loaded into, a dense checkpoint (a z-lab drafter directory, the
    z-lab reference loop). Dense modules' tensors are returned as they are."""
    sd = model.state_dict()
    for name, mod in model.named_modules():
        if isinstance(mod, PackedLinear):
            pre = f"{name}." if name else ""
            for key in [k for k in sd if k.startswith(pre) and "." not in k[len(pre) :]]:
                if key != f"{pre}bias":
                    del sd[key]
            sd[f"{pre}weight"] = mod.dequantize(torch.float32)
    return sd


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


def weight_only_hf_config(
    quant_algo: str, bits: int, group_size: int | None, sym: bool, ignore: list[str], producer: dict
) -> dict:
    """``quantization_config`` of an int4 / int8 checkpoint: this project's own layout
    (``quant_method: dflash-trt``; tensors as in ``docs/engine-format.md``)."""
    return {
        "quant_method": "dflash-trt",
        "quant_algo": quant_algo,
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "ignore": ignore,
        "producer": producer,
    }
