"""int8 weights (weight-only, symmetric per output row): quantize, read an engine's int8 codes,
and run them as our batch-invariant int8 CPU GEMM.

Convention: ``w = q * scale[row]``, ``q`` int8 in -127..127, ``scale = max |w[row]| / 127``
(round to nearest). Engine tensors (``quant_algo`` ``W8A16``): ``weight`` int8 ``[out, in]``,
``weights_scaling_factor`` fp32 ``[out, 1]``. Run time: ``dflash_cpu::int8_linear``
(``kernels/cpu/batch_invariant.cpp``): codes in blocks of 64 output rows (:func:`pack_int8`, 8
panels of 8 rows, one 8-byte word per panel and input, so that a decode step streams the weight
in order), scales in the activation dtype, fp32 accumulation, every row computed alone
(torch's ``_weight_int8pack_mm``, used before for the default target's int8 LM head: 3.4 ms a
decode step, 5.2 ms for 4 rows).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DFlashError
from ..kernels import cpu_ops
from .common import QuantizedLinear, WeightFormat
from .packed import BLOCK_ROWS, PANEL, PackedLinear, blocks_to_rows, rows_to_blocks, weight_only_hf_config


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


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q`` int8 ``[out, in]``, ``scale`` ``[out]`` or ``[out, 1]`` -> ``q * scale`` ``[out, in]``
    in ``dtype`` (fp32 arithmetic)."""
    return (q.float() * scale.float().reshape(-1, 1)).to(dtype)


def pack_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales in ``dflash_cpu::int8_linear``'s layout.

    Args:
        q: int8 ``[out, in]``; scale: float ``[out]`` (``w = q * scale``).
        dtype: the scales' dtype (the GEMM's activation dtype).

    Returns:
        ``(codes int8 [S, in, 64], scales [S, 8, 8] in dtype)`` with ``S = ceil(out / 64)``:
        ``codes[s, k, 8 c + j]`` is row ``64 s + 8 c + j`` at input ``k`` (rows past ``out`` zero).
    """
    codes = rows_to_blocks(q.to(torch.int8)).permute(0, 3, 1, 2).reshape(-1, q.shape[1], BLOCK_ROWS)
    return codes.contiguous(), rows_to_blocks(scale.reshape(-1).to(dtype)).contiguous()


class Int8Linear(PackedLinear):
    """:class:`~.packed.PackedLinear` over int8 codes (``dflash_cpu::int8_linear``).

    Attributes:
        packed: int8 ``[ceil(out / 64), in, 64]`` (:func:`pack_int8`).
        scales: ``[ceil(out / 64), 8, 8]`` in the activation dtype.
        group_size: ``in_features`` (one scale per row).
    """

    fmt = "int8"

    @classmethod
    def from_codes(
        cls,
        codes: tuple[torch.Tensor, ...],
        group_size: int = 0,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Int8Linear:
        """Wrap ``codes = (q [out, in], scale [out])`` (``w = q * scale``); ``group_size`` is not
        used.

        Raises:
            DFlashError: not one scale per output row.
        """
        q, scale = codes
        n, k = q.shape
        if scale.numel() != n:
            raise DFlashError(f"int8 scales must have {n} values (one per output row), got {scale.numel()}")
        cpu_ops.load()  # the GEMM's op, once here rather than on every forward
        codes, scales = pack_int8(q, scale, dtype)
        return cls(codes, scales, k, k, bias, out_features=n)

    @staticmethod
    def quantize_codes(w: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, ...]:
        """:func:`quantize_int8` (``group_size`` is not used)."""
        return quantize_int8(w)

    @staticmethod
    def gguf_codes(t) -> None:
        """None: no GGUF block type maps onto per-row int8 (every tensor is requantized)."""
        return None

    @staticmethod
    def describe(group_size: int) -> str:
        """How this format quantizes, in words (for notes on stderr)."""
        return "int8 per output row"

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.dflash_cpu.int8_linear(x2, self.packed, self.scales, self.out_features, None)

    @torch.no_grad()
    def int_weight(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The stored codes and scales, exactly: ``(q int8 [out, in], scale fp32 [out], None)``."""
        s, k, _ = self.packed.shape
        q = self.packed.view(s, k, PANEL, PANEL).permute(0, 2, 3, 1)  # [S, c, j, in]
        return blocks_to_rows(q, self.out_features), blocks_to_rows(self.scales.float(), self.out_features), None

    @torch.no_grad()
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the GEMM multiplies by, ``[out, in]`` in ``dtype``."""
        q, s, _ = self.int_weight()
        return dequantize_int8(q, s, dtype)


#: the packed linear of this format (:func:`~.packed.packed_class`)
LINEAR = Int8Linear


def quantize_linear(w: torch.Tensor, act_amax: float | None = None, group_size: int = 0) -> QuantizedLinear:
    """Engine tensors of one linear ``w [out, in]`` (weight-only: ``act_amax`` and
    ``group_size`` are not used): ``weight`` int8 ``[out, in]``, ``weights_scaling_factor``
    fp32 ``[out, 1]``."""
    q, scale = quantize_int8(w)
    return {"weight": q, "weights_scaling_factor": scale.unsqueeze(-1)}


def is_stored(tensors: dict[str, torch.Tensor], base: str) -> bool:
    """Whether ``base.weight`` is an int8 weight."""
    w = tensors.get(base + ".weight")
    return w is not None and w.dtype == torch.int8


def dequantize_stored(tensors: dict[str, torch.Tensor], base: str, dtype: torch.dtype) -> torch.Tensor:
    """``base.weight`` of a rank file as ``[out, in]`` in ``dtype``."""
    return dequantize_int8(tensors[base + ".weight"], tensors[base + ".weights_scaling_factor"], dtype)


def runtime_linears(
    tensors: dict[str, torch.Tensor], bases: list[str], modules: list[nn.Module]
) -> list[PackedLinear | None]:
    """:class:`Int8Linear` modules over the engine's codes of one fused linear (members ``bases``
    in row order), split by rows onto ``modules``."""
    q = torch.cat([tensors[b + ".weight"] for b in bases])
    scale = torch.cat([tensors[b + ".weights_scaling_factor"] for b in bases])
    return Int8Linear.for_modules((q, scale), modules, q.shape[1])


FORMAT = WeightFormat(
    name="int8",
    quant_algo="W8A16",
    weight_only=True,
    gemm_plugin="auto",
    quantize=quantize_linear,
    is_stored=is_stored,
    dequantize=dequantize_stored,
    runtime_linears=runtime_linears,
    trtllm_keys=lambda group_size: {"group_size": None, "has_zero_point": False},
    hf_config=lambda group_size, kv, ignore, producer: weight_only_hf_config("W8A16", 8, None, True, ignore, producer),
)
