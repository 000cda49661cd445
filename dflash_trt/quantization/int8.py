"""int8 weights (weight-only, symmetric per output row): quantize, read an engine's int8 codes,
and run them as our batch-invariant int8 CPU GEMM.

Convention: ``w = q * scale[row]``, ``q`` int8 in -127..127, ``scale = max |w[row]| / 127``
(round to nearest). Engine tensors (``quant_algo`` ``W8A16``): ``weight`` int8 ``[out, in]``,
``weights_scaling_factor`` fp32 ``[out, 1]``. Run time: ``dflash_cpu::int8_linear``
(``kernels/cpu/batch_invariant.cpp``): codes in blocks of 64 output rows (:func:`pack_int8`, 8
panels of 8 rows, 32 bytes holding 4 consecutive inputs of a panel's 8 rows), scales in the
activation dtype; the activations rounded to int8 per row in blocks of 32 as int4's are
(:func:`~.packed.quantize_activations`) and each block's dot products exact integers (VNNI
``vpdpbusd``, else AVX2 ``vpmaddubsw``): GGUF Q8_0 x Q8_0's arithmetic (llama.cpp's for the
default target's Q8_0 LM head) with one scale a row, every row computed alone. The default
target's LM head (49,152 x 576) on an AMD EPYC Zen 4 (AVX512-VNNI, 2 threads, min of 15 runs,
three sittings): 0.43-0.72 ms for one row and 0.92-1.38 ms for four, against 1.07-1.59 and
2.26-2.88 with the codes decoded to fp32 against fp32 activations (this kernel until
2026-11-28; torch's ``_weight_int8pack_mm`` before it: 3.4 / 5.2 ms on an AVX2 EPYC).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DFlashError
from ..kernels import cpu_ops
from .common import QuantizedLinear, WeightFormat
from .packed import PANEL, Q8_BLOCK, PackedLinear, blocks_to_rows, rows_to_blocks, weight_only_hf_config


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
        q: int8 ``[out, in]`` (``in`` divisible by 32); scale: float ``[out]`` (``w = q * scale``).
        dtype: the scales' dtype (the GEMM's activation dtype).

    Returns:
        ``(codes uint8 [S, in / 4, 8, 32], scales [S, 8, 8] in dtype)`` with ``S = ceil(out / 64)``
        blocks of 8 panels of 8 rows: byte ``(s, kq, c, 4 j + i)`` holds ``q + 128`` of row ``64 s +
        8 c + j`` at input ``4 kq + i`` (so that one VNNI ``vpdpbusd`` multiplies 4 consecutive
        inputs of 8 rows at once); ``scales[s, c, j]`` that row's scale (rows past ``out`` zero).
    """
    k = q.shape[1]
    qb = (rows_to_blocks(q.to(torch.int8)).to(torch.int16) + 128).to(torch.uint8)  # [S, c, j, in]
    codes = qb.view(qb.shape[0], PANEL, PANEL, k // 4, 4).permute(0, 3, 1, 2, 4)  # [S, kq, c, j, i]
    codes = codes.reshape(qb.shape[0], k // 4, PANEL, 4 * PANEL).contiguous()
    return codes, rows_to_blocks(scale.reshape(-1).to(dtype)).contiguous()


def unpack_int8(codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_int8`'s tensors back as ``(q int8 [out, in], scale fp32 [out])``."""
    nb, kq = codes.shape[:2]
    c = codes.view(nb, kq, PANEL, PANEL, 4).permute(0, 2, 3, 1, 4).reshape(nb, PANEL, PANEL, kq * 4)
    q = (c.to(torch.int16) - 128).to(torch.int8)
    return blocks_to_rows(q, out_features), blocks_to_rows(scales.float(), out_features)


class Int8Linear(PackedLinear):
    """:class:`~.packed.PackedLinear` over int8 codes (``dflash_cpu::int8_linear``).

    Attributes:
        packed: uint8 ``[ceil(out / 64), in / 4, 8, 32]`` (:func:`pack_int8`).
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
        if not cls.fits(n, k, group_size):
            raise DFlashError(f"int8 needs a multiple of {Q8_BLOCK} inputs, got {k}")
        cpu_ops.load()  # the GEMM's op, once here rather than on every forward
        codes, scales = pack_int8(q, scale, dtype)
        return cls(codes, scales, k, k, bias, out_features=n)

    @staticmethod
    def fits(out_features: int, in_features: int, group_size: int) -> bool:
        """Whether the kernel packs ``[out, in]``: ``in`` a multiple of 32 (the activations'
        blocks)."""
        return in_features % Q8_BLOCK == 0

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
        return (*unpack_int8(self.packed, self.scales, self.out_features), None)

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
