"""int4 weights (weight-only, group-wise asymmetric): quantize, read an engine's or a GGUF file's
int4 codes, and run them as our packed int4 CPU GEMM.

Convention: GGUF Q4_1's (llama.cpp ``ggml-quants.c``, ``block_q4_1``: 32 weights, fp16 ``d`` and
``m``, ``w = d * q + m``): codes ``q`` in 0..15, one ``(scale, zero)`` pair per ``group_size``
consecutive inputs of a row, ``w = q * scale + zero``; the quantizer is round to nearest with
Q4_1's min/max rule (``quantize_row_q4_1_ref``: ``scale = (max - min) / 15``, ``zero = min``).

Engine tensors (``quant_algo`` ``W4A16_GPTQ``, ``has_zero_point``; TensorRT-LLM's names, our
layout): ``weight`` uint8 ``[out, in / 2]`` (codes, the even element in the low nibble),
``weights_scaling_factor`` and ``zero`` fp32 ``[out, in / group_size]``.

Run time: ``dflash_cpu::int4_linear`` (``kernels/cpu/batch_invariant.cpp``, built once per
machine): codes packed once by :func:`pack_int4` into blocks of 64 output rows (8 panels of 8;
32 bytes hold 8 consecutive inputs of a panel's 8 rows, so that one AVX2 vpmaddubsw, or one VNNI
vpdpbusd, multiplies 4 inputs of 8 rows by 4 activation bytes), scales and zeros
``[blocks, in / g, 2, 8, 8]`` in the activation dtype. The activations are quantized per row to int8 in blocks
of 32 (:func:`~.packed.quantize_activations`, GGUF Q8_1's rule) and each block's dot products
are exact integers: llama.cpp's Q4_1 x Q8_1 arithmetic (``ggml_vec_dot_q4_1_q8_1``), the zero
term over the quantized activations' group sums (as Q8_1's ``s``); the integer sums and a fixed
order of the fp32 ones make each row's result the same whatever the other rows. The activations'
rounding moves an output by up to ~1 % of the largest against ``x @ w.T`` of the dequantized
weight (random weights and inputs); on the default target the logits move as much as llama.cpp's
do (docs/peers.md). Against decoding every code to fp32 and fp32 activations (this module's
kernel before 1fa9c19, 2026-11-27), measured on a 2-core AMD EPYC (AVX2, 2 threads, bf16
activations, the 120 int4 GEMMs of the default target's 30 layers from memory, three runs
interleaved): one row 8.9-11.8 ms against 10.5-13.7, four rows 12.8-17.8 against 19.4-21.8, 16
rows 33.7-39.8 against 56.0-67.4.

GGUF blocks (``ggml/src/ggml-common.h``; each covers 32 consecutive inputs of one output row):
``Q4_1`` ``{fp16 d; fp16 m; uint8 qs[16]}`` (20 bytes), ``q[j] = qs[j] & 0xF`` and
``q[j + 16] = qs[j] >> 4``; ``Q4_0`` ``{fp16 d; uint8 qs[16]}`` (18 bytes), ``w = d * (q - 8)``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..errors import DFlashError
from ..kernels import cpu_ops
from .common import QuantizedLinear, WeightFormat, pack_nibbles, unpack_nibbles
from .packed import PANEL, PackedLinear, blocks_to_rows, rows_to_blocks, weight_only_hf_config

#: group sizes an int4 weight may use (those of the engine format and GGUF's blocks)
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: output rows an int4 weight must come in multiples of (the engine format's tiles of 16; the
#: kernel pads its blocks of 64)
INT4_ROW_MULTIPLE = 16
#: GGUF block types whose codes load as int4 group 32 as they are
GGUF_DIRECT = ("Q4_1", "Q4_0")


def check_int4_shape(out_features: int, in_features: int, group_size: int, what: str = "linear") -> None:
    """Raise a one-line :class:`DFlashError` when ``[out, in]`` cannot be packed as int4 with
    ``group_size`` (group 32/64/128/256 dividing ``in``, ``out`` % 16 == 0)."""
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
    (the min/max rule of GGUF Q4_1's ``quantize_row_q4_1_ref``).

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


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q [out, in]`` (0..15), ``scale`` / ``zero`` ``[out, in / g]`` -> ``q * scale + zero``
    ``[out, in]`` in ``dtype`` (fp32 arithmetic)."""
    g = q.shape[1] // scale.shape[1]
    return (q.float() * scale.float().repeat_interleave(g, -1) + zero.float().repeat_interleave(g, -1)).to(dtype)


def _gguf_blocks(t, block_bytes: int) -> np.ndarray:
    """Raw bytes of a block-quantized GGUF tensor as ``[out, in / 32, block_bytes]`` uint8."""
    data = np.asarray(t.data)
    n = int(t.shape[1]) if len(t.shape) > 1 else 1
    return data.reshape(n, -1, block_bytes)


def _gguf_nibbles(qs: np.ndarray) -> torch.Tensor:
    """``[out, nb, 16]`` packed bytes -> uint8 ``[out, nb * 32]``: low nibbles are elements
    0..15 of the block, high nibbles 16..31."""
    n, nb, _ = qs.shape
    q = np.empty((n, nb, 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[..., :16])
    np.right_shift(qs, 4, out=q[..., 16:])
    return torch.from_numpy(q.reshape(n, nb * 32))


def _fp16_field(b: np.ndarray, at: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0])


def q4_1_codes(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF ``Q4_1`` tensor as int4 codes.

    Args:
        t: a ``gguf.ReaderTensor`` of type Q4_1, logical shape ``[out, in]`` (GGUF ``ne`` =
            ``[in, out]``).

    Returns:
        ``(q uint8 [out, in] 0..15, d fp16 [out, in / 32], m fp16 [out, in / 32])`` with
        ``w = d * q + m`` per block (ggml ``dequantize_row_q4_1``).
    """
    b = _gguf_blocks(t, 20)
    return _gguf_nibbles(b[..., 4:20]), _fp16_field(b, 0), _fp16_field(b, 2)


def q4_0_codes(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF ``Q4_0`` tensor as int4 codes: ``(q, d, -8 d)`` (``w = d * (q - 8)``; ggml
    ``dequantize_row_q4_0``), shapes as :func:`q4_1_codes`; the zero is fp32."""
    b = _gguf_blocks(t, 18)
    d = _fp16_field(b, 0)
    return _gguf_nibbles(b[..., 2:18]), d, -8 * d.float()


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales in ``dflash_cpu::int4_linear``'s layout.

    Args:
        q: integer ``[out, in]`` in 0..15 (``in`` divisible by 8); scale, zero: float ``[out, in /
            g]`` (``w = q * scale + zero``).
        dtype: the scales' dtype (the GEMM's activation dtype).

    Returns:
        ``(codes uint8 [S, in / 8, 8, 32], scales [S, in / g, 2, 8, 8] in dtype)`` with ``S =
        ceil(out / 64)`` blocks of 8 panels of 8 rows: byte ``(s, kc, c, 4 j + i)`` holds row ``64 s
        + 8 c + j``'s codes at inputs ``8 kc + i`` (low nibble) and ``8 kc + 4 + i`` (high nibble),
        ``i`` = 0..3 (so that a vpmaddubsw multiplies 4 consecutive inputs of 8 rows at once);
        ``scales[s, g, 0, c, j]`` the scale of that row in group ``g``, ``scales[s, g, 1, c, j]``
        its zero (rows past ``out`` zero).
    """
    k = q.shape[1]
    qb = rows_to_blocks(q.to(torch.uint8))  # [S, c, j, in]
    qb = qb.view(qb.shape[0], PANEL, PANEL, k // 8, 2, 4)  # [S, c, j, kc, half, i]
    codes = (qb[..., 0, :] | (qb[..., 1, :] << 4)).permute(0, 3, 1, 2, 4)  # [S, kc, c, j, i]
    sz = torch.stack([rows_to_blocks(t.float()).permute(0, 3, 1, 2) for t in (scale, zero)], dim=2)
    return codes.reshape(qb.shape[0], k // 8, PANEL, 4 * PANEL).contiguous(), sz.to(dtype).contiguous()


def unpack_int4(codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> tuple[torch.Tensor, ...]:
    """:func:`pack_int4`'s tensors back as ``(q uint8 [out, in] 0..15, scale fp32 [out, G],
    zero fp32 [out, G])``."""
    nb, kc = codes.shape[:2]
    c = codes.view(nb, kc, PANEL, PANEL, 4).permute(0, 2, 3, 1, 4)  # [S, c, j, kc, i]
    q = blocks_to_rows(torch.stack([c & 15, c >> 4], dim=-2).reshape(nb, PANEL, PANEL, kc * 8), out_features)
    s, z = (blocks_to_rows(scales[:, :, i].float().permute(0, 2, 3, 1), out_features) for i in (0, 1))
    return q, s, z


class Int4Linear(PackedLinear):
    """:class:`~.packed.PackedLinear` over int4 codes (``dflash_cpu::int4_linear``).

    Attributes:
        packed: uint8 ``[ceil(out / 64), in / 8, 8, 32]``, the codes as :func:`pack_int4` lays them out
            (read them back with :meth:`int_weight`).
        scales: ``[ceil(out / 64), in / g, 2, 8, 8]`` scales and zeros in the activation dtype.
    """

    fmt = "int4"

    @classmethod
    def from_codes(
        cls,
        codes: tuple[torch.Tensor, ...],
        group_size: int,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Int4Linear:
        """Pack ``codes = (q, scale, zero)`` with ``w = q * scale + zero`` (GGUF Q4_1's convention).

        Args:
            codes: ``q`` uint8 (or any integer) ``[out, in]`` in 0..15; ``scale``, ``zero`` float
                ``[out, in / group_size]`` (fp16 Q4_1 ``d`` / ``m``, or fp32).
            group_size: 32, 64, 128 or 256.
            dtype: scale and activation dtype of the GEMM.

        Raises:
            DFlashError: a shape the kernel cannot pack (see :func:`check_int4_shape`).
        """
        q, scale, zero = codes
        n, k = q.shape
        check_int4_shape(n, k, group_size)
        if tuple(scale.shape) != (n, k // group_size) or tuple(zero.shape) != (n, k // group_size):
            raise DFlashError(f"int4 scales must be [{n}, {k // group_size}], got {tuple(scale.shape)}")
        cpu_ops.load()  # the GEMM's op, once here rather than on every forward
        codes, sz = pack_int4(q, scale, zero, dtype)
        return cls(codes, sz, k, group_size, bias, out_features=n)

    @classmethod
    def from_weight(
        cls, w: torch.Tensor, group_size: int, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> Int4Linear:
        """:func:`quantize_int4` of ``w [out, in]``, packed.

        Raises:
            DFlashError: a shape the kernel cannot pack.
        """
        check_int4_shape(*w.shape, group_size)
        return cls.from_codes(quantize_int4(w, group_size), group_size, bias, dtype)

    @staticmethod
    def quantize_codes(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
        """:func:`quantize_int4`."""
        return quantize_int4(w, group_size)

    @staticmethod
    def fits(out_features: int, in_features: int, group_size: int) -> bool:
        """:func:`int4_fits`."""
        return int4_fits(out_features, in_features, group_size)

    @staticmethod
    def check_group_size(group_size: int) -> None:
        """Raise a one-line :class:`DFlashError` unless ``group_size`` is one of :data:`INT4_GROUP_SIZES`."""
        if group_size not in INT4_GROUP_SIZES:
            raise DFlashError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")

    @staticmethod
    def gguf_codes(t) -> tuple[torch.Tensor, ...] | None:
        """``(q, scale fp32, zero fp32)`` of a GGUF Q4_1 / Q4_0 tensor as stored, None for
        another block type (it is requantized)."""
        if t.tensor_type.name not in GGUF_DIRECT:
            return None
        q, s, z = q4_1_codes(t) if t.tensor_type.name == "Q4_1" else q4_0_codes(t)
        return q, s.float(), z.float()

    @staticmethod
    def describe(group_size: int) -> str:
        """How this format quantizes, in words (for notes on stderr)."""
        return f"int4 group {group_size}"

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.dflash_cpu.int4_linear(x2, self.packed, self.scales, self.out_features, self.group_size, None)

    @torch.no_grad()
    def int_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored codes and scales, exactly: ``(q uint8 [out, in] 0..15, scale fp32
        [out, in / g], zero fp32 [out, in / g])`` with ``w = q * scale + zero`` (the Q4_1
        convention)."""
        return unpack_int4(self.packed, self.scales, self.out_features)

    @torch.no_grad()
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the GEMM multiplies by, ``[out, in]`` in ``dtype``."""
        return dequantize_int4(*self.int_weight(), dtype)

    def extra_repr(self) -> str:
        return (
            f"int4, in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, dtype={self.dtype}"
        )


#: the packed linear of this format (:func:`~.packed.packed_class`)
LINEAR = Int4Linear


def quantize_linear(w: torch.Tensor, act_amax: float | None = None, group_size: int = 32) -> QuantizedLinear:
    """Engine tensors of one linear ``w [out, in]`` (weight-only: ``act_amax`` is not used):
    ``weight`` uint8 ``[out, in / 2]`` (nibble-packed codes), ``weights_scaling_factor`` and
    ``zero`` fp32 ``[out, in / group_size]``; all per output row, so fused members slice by rows.

    Raises:
        DFlashError: what :func:`quantize_int4` raises.
    """
    q, scale, zero = quantize_int4(w, group_size)
    return {"weight": pack_nibbles(q), "weights_scaling_factor": scale, "zero": zero}


def is_stored(tensors: dict[str, torch.Tensor], base: str) -> bool:
    """Whether ``base`` is stored as int4 (it has a ``zero`` tensor)."""
    return base + ".zero" in tensors


def dequantize_stored(tensors: dict[str, torch.Tensor], base: str, dtype: torch.dtype) -> torch.Tensor:
    """``base.weight`` of a rank file as ``[out, in]`` in ``dtype``."""
    q = unpack_nibbles(tensors[base + ".weight"])
    return dequantize_int4(q, tensors[base + ".weights_scaling_factor"], tensors[base + ".zero"], dtype)


def runtime_linears(
    tensors: dict[str, torch.Tensor], bases: list[str], modules: list[nn.Module]
) -> list[PackedLinear | None]:
    """:class:`Int4Linear` modules over the engine's codes of one fused linear (members ``bases``
    in row order), split by rows onto ``modules``; None for a module whose shape the kernel
    cannot pack (it keeps the dequantized weight)."""
    q = torch.cat([unpack_nibbles(tensors[b + ".weight"]) for b in bases])
    scale = torch.cat([tensors[b + ".weights_scaling_factor"] for b in bases])
    zero = torch.cat([tensors[b + ".zero"] for b in bases])
    return Int4Linear.for_modules((q, scale, zero), modules, q.shape[1] // scale.shape[1])


FORMAT = WeightFormat(
    name="int4",
    quant_algo="W4A16_GPTQ",
    weight_only=True,
    gemm_plugin="auto",
    quantize=quantize_linear,
    is_stored=is_stored,
    dequantize=dequantize_stored,
    runtime_linears=runtime_linears,
    trtllm_keys=lambda group_size: {"group_size": group_size, "has_zero_point": True},
    hf_config=lambda group_size, kv, ignore, producer: weight_only_hf_config(
        "W4A16_GPTQ", 4, group_size, False, ignore, producer
    ),
)
