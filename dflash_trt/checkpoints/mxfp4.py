"""MXFP4 expert weights of the official gpt-oss checkpoints, dequantized on load.

Format (OCP Microscaling Formats (MX) v1.0, as transformers' ``integrations/mxfp4.py`` and OpenAI's
``gpt_oss/torch/weights.py`` decode it): a weight ``W [E, out, in]`` is stored as

- ``{name}_blocks``: uint8 ``[E, out, in / 32, 16]``: 32 consecutive elements along ``in`` per
  block, two 4-bit FP4 E2M1 codes per byte, the **low nibble the even element**, the high nibble
  the odd one; code -> value ``[+0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]``
  (bit 3 the sign);
- ``{name}_scales``: uint8 ``[E, out, in / 32]``: one E8M0 exponent per block, value ``2^(s - 127)``.

gpt-oss stores ``mlp.experts.gate_up_proj`` (``in`` = hidden, ``out`` = 2 * intermediate, gate and
up interleaved) and ``mlp.experts.down_proj`` (``in`` = intermediate, ``out`` = hidden) this way;
everything else is bf16. Dequantized, a tensor takes transformers' in-memory layout
``[E, in, out]`` (``GptOssExperts``), which ``TargetModel.load_hf_state_dict`` reads. Every
``+-{0, .5, 1, 1.5, 2, 3, 4, 6} * 2^k`` has at most two significant bits, so the decoding is exact in
fp32 and bf16: bitwise what transformers' ``convert_moe_packed_tensors`` gives.
"""

from __future__ import annotations

import torch

from ..errors import DFlashError
from ..models.config import TargetConfig

#: FP4 E2M1 code -> value
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: elements per MXFP4 block (one scale each), bytes per block
BLOCK, BLOCK_BYTES = 32, 16


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode one MXFP4 tensor (module docstring).

    Args:
        blocks: uint8 ``[E, out, G, 16]``.
        scales: uint8 ``[E, out, G]`` (E8M0 exponents, bias 127).
        dtype: fp32 or bf16 (both hold every value exactly).

    Returns:
        ``[E, G * 32, out]`` in ``dtype`` (transformers' ``[E, in, out]`` layout), contiguous.
    """
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    e, out, g, _ = blocks.shape
    b = (blocks if blocks.dtype == torch.uint8 else blocks.view(torch.uint8)).reshape(-1, BLOCK_BYTES)
    w = torch.empty(b.shape[0], BLOCK, dtype=dtype)
    w[:, 0::2] = lut[(b & 0x0F).long()]
    w[:, 1::2] = lut[(b >> 4).long()]
    s = scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)
    w = torch.ldexp(w, s.to(torch.int32).reshape(-1, 1) - 127)  # value * 2^(s - 127)
    return w.view(e, out, g * BLOCK).transpose(1, 2).contiguous()


def _expected(cfg: TargetConfig, name: str) -> tuple[int, int]:
    """``(in, out)`` of the MXFP4 expert tensor ``name`` (``...gate_up_proj`` / ``...down_proj``)."""
    if name.endswith("experts.gate_up_proj"):
        return cfg.hidden_size, 2 * cfg.moe_intermediate_size
    if name.endswith("experts.down_proj"):
        return cfg.moe_intermediate_size, cfg.hidden_size
    raise DFlashError(f"MXFP4 tensor {name}_blocks: only gpt-oss expert weights (gate_up_proj, down_proj) are read")


def has_mxfp4(sd: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint state dict holds MXFP4 ``*_blocks`` tensors."""
    return any(k.endswith("_blocks") for k in sd)


def dequantize_mxfp4_experts(
    sd: dict[str, torch.Tensor], cfg: TargetConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """``sd`` with every ``{name}_blocks`` / ``{name}_scales`` pair replaced by ``{name}``
    dequantized (:func:`dequantize_mxfp4`), the other tensors as they are.

    Raises:
        DFlashError: (one line) a blocks tensor without its scales or the reverse, a family
            other than gpt-oss, or shapes other than blocks ``[E, out, in / 32, 16]`` and
            scales ``[E, out, in / 32]`` for this config's E, in and out.
    """
    out = {k: v for k, v in sd.items() if not k.endswith(("_blocks", "_scales"))}
    names = {k.removesuffix("_blocks") for k in sd if k.endswith("_blocks")}
    names |= {k.removesuffix("_scales") for k in sd if k.endswith("_scales")}
    for name in sorted(names):
        blocks, scales = sd.get(name + "_blocks"), sd.get(name + "_scales")
        if blocks is None or scales is None:
            missing = name + ("_blocks" if blocks is None else "_scales")
            raise DFlashError(f"MXFP4 checkpoint lacks {missing}")
        if cfg.family != "gpt_oss":
            raise DFlashError(f"MXFP4 tensor {name}_blocks in a {cfg.family} checkpoint (gpt-oss only)")
        fan_in, fan_out = _expected(cfg, name)
        want_b = [cfg.num_experts, fan_out, fan_in // BLOCK, BLOCK_BYTES]
        if fan_in % BLOCK or list(blocks.shape) != want_b or list(scales.shape) != want_b[:-1]:
            raise DFlashError(
                f"MXFP4 tensor {name}_blocks {list(blocks.shape)} / _scales {list(scales.shape)}: expected "
                f"{want_b} / {want_b[:-1]} (experts, out {fan_out}, in {fan_in} / {BLOCK}, {BLOCK_BYTES} bytes)"
            )
        if blocks.dtype not in (torch.uint8, torch.int8) or scales.dtype not in (torch.uint8, torch.int8):
            raise DFlashError(
                f"MXFP4 tensor {name}: blocks and scales must be uint8, not {blocks.dtype} / {scales.dtype}"
            )
        out[name] = dequantize_mxfp4(blocks, scales, dtype)
    return out
