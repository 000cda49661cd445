"""MXFP4 expert weights kept packed at run time (``--weights mxfp4``, gpt-oss's own format).

Format (OCP Microscaling Formats (MX) v1.0, as transformers' ``integrations/mxfp4.py`` and
OpenAI's ``gpt_oss/torch/weights.py`` decode it): a weight ``[out, in]`` is stored as ``in / 32``
blocks per row, each 16 bytes of FP4 E2M1 codes (two per byte, **the low nibble the even
element**; code -> value :data:`FP4_VALUES`, bit 3 the sign) and one E8M0 scale byte (value
``2^(s - 127)``). Every ``+-{0, .5, 1, 1.5, 2, 3, 4, 6} * 2^k`` has at most two significant bits,
so decoding is exact in fp32 and bf16.

:class:`MXFP4Experts` holds one MoE layer's stacked expert weights that way (4.25 bits a weight)
and decodes an expert when its GEMM runs: the same values, so the same outputs, as weights
decoded once at load (``checkpoints/mxfp4.py``), in ~1/7.5 of fp32's memory (1/3.8 of bf16's),
for a decode per expert per forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DFlashError

#: FP4 E2M1 code -> value
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: elements per MXFP4 block (one scale each), bytes per block
BLOCK, BLOCK_BYTES = 32, 16


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode MXFP4 rows (module docstring).

    Args:
        blocks: uint8 (or int8) ``[..., out, G, 16]``.
        scales: uint8 (or int8) ``[..., out, G]`` (E8M0 exponents, bias 127).
        dtype: fp32 or bf16 (both hold every value exactly).

    Returns:
        ``[..., out, G * 32]`` in ``dtype``, on ``blocks``' device.
    """
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    lead = blocks.shape[:-2]
    b = (blocks if blocks.dtype == torch.uint8 else blocks.view(torch.uint8)).reshape(-1, BLOCK_BYTES)
    w = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).view(-1, BLOCK)  # even, odd
    s = scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)
    w = torch.ldexp(w, s.to(torch.int32).reshape(-1, 1) - 127).to(dtype)  # value * 2^(s - 127)
    return w.view(*lead, blocks.shape[-2] * BLOCK)


class MXFP4Experts(nn.Module):
    """One MoE layer's stacked expert weights ``[E, out, in]`` (``nn.Linear`` orientation), kept
    as MXFP4 blocks and decoded per use in the compute dtype (the dtype the module was last
    moved to with ``.to(dtype)``, fp32 by default).

    Indexing ``experts[e]`` decodes expert ``e`` (``[out, in]``); :meth:`dense` all of them.

    Attributes:
        blocks: uint8 ``[E, out, in / 32, 16]``; scales: uint8 ``[E, out, in / 32]``.
    """

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_BYTES or blocks.dim() != 4:
            raise DFlashError(
                f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit "
                f"([E, out, in / {BLOCK}, {BLOCK_BYTES}] and [E, out, in / {BLOCK}])"
            )
        self.register_buffer("blocks", blocks.view(torch.uint8) if blocks.dtype == torch.int8 else blocks)
        self.register_buffer("scales", scales.view(torch.uint8) if scales.dtype == torch.int8 else scales)
        self.register_buffer("dtype_of", torch.empty(0), persistent=False)  # follows .to(dtype): the compute dtype

    @classmethod
    def empty(cls, experts: int, out: int, fan_in: int) -> MXFP4Experts:
        """Zero codes of the given shape (to load a state dict into).

        Raises:
            DFlashError: ``fan_in`` not a multiple of 32.
        """
        if fan_in % BLOCK:
            raise DFlashError(f"MXFP4 weights need in_features divisible by {BLOCK}, not {fan_in}")
        g = fan_in // BLOCK
        return cls(
            torch.zeros(experts, out, g, BLOCK_BYTES, dtype=torch.uint8),
            torch.zeros(experts, out, g, dtype=torch.uint8),
        )

    @property
    def shape(self) -> torch.Size:
        """``[E, out, in]`` of the weights decoded."""
        e, out, g, _ = self.blocks.shape
        return torch.Size((e, out, g * BLOCK))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def __getitem__(self, e: int) -> torch.Tensor:
        return decode_mxfp4(self.blocks[e], self.scales[e], self.dtype_of.dtype)

    def dense(self) -> torch.Tensor:
        """Every expert decoded: ``[E, out, in]`` in the compute dtype."""
        return decode_mxfp4(self.blocks, self.scales, self.dtype_of.dtype)

    def select(self, experts: slice, rows: torch.Tensor | None = None, cols: slice | None = None) -> MXFP4Experts:
        """The experts ``experts``, of each the output ``rows`` (int64 indices) and the input
        columns ``cols`` (a slice on 32-element block boundaries): tensor and expert parallelism
        over packed weights (``runtime/distributed.py``).

        Raises:
            DFlashError: ``cols`` not on block boundaries.
        """
        b, s = self.blocks[experts], self.scales[experts]
        if rows is not None:
            b, s = b[:, rows.to(b.device)], s[:, rows.to(s.device)]
        if cols is not None:
            start, stop = cols.start or 0, cols.stop if cols.stop is not None else self.shape[2]
            if start % BLOCK or stop % BLOCK:
                raise DFlashError(
                    f"MXFP4 expert weights split at input columns {start}..{stop}: not on {BLOCK}-element blocks "
                    f"(split the experts instead, --moe-ep, or load them dequantized)"
                )
            b, s = b[:, :, start // BLOCK : stop // BLOCK], s[:, :, start // BLOCK : stop // BLOCK]
        out = MXFP4Experts(b.contiguous(), s.contiguous())
        return out.to(self.dtype_of.dtype)

    def extra_repr(self) -> str:
        e, out, fan_in = self.shape
        return f"experts={e}, out={out}, in={fan_in}, compute={self.dtype_of.dtype}"


def pack_experts(model: nn.Module) -> int:
    """Replace every MoE block's dense ``gate_up`` / ``down`` expert parameters in ``model`` by
    empty :class:`MXFP4Experts` of the same shapes (a state dict with ``*.blocks`` /
    ``*.scales`` is loaded into them next). Returns the number of blocks changed."""
    from ..models.moe import MoEBlock

    n = 0
    for m in model.modules():
        if isinstance(m, MoEBlock):
            for name in ("gate_up", "down"):
                shape = getattr(m, name).shape
                delattr(m, name)
                setattr(m, name, MXFP4Experts.empty(*shape))
            n += 1
    return n
