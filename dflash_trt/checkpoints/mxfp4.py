"""MXFP4 expert weights of the official gpt-oss checkpoints: checked, then dequantized on load
or kept packed (``--weights mxfp4``: :class:`~dflash_trt.quantization.mxfp4.MXFP4Experts`).

The format is :mod:`dflash_trt.quantization.mxfp4`'s: a weight ``W [E, out, in]`` is stored as
``{name}_blocks`` uint8 ``[E, out, in / 32, 16]`` and ``{name}_scales`` uint8 ``[E, out, in / 32]``.
gpt-oss stores ``mlp.experts.gate_up_proj`` (``in`` = hidden, ``out`` = 2 * intermediate, gate and
up interleaved) and ``mlp.experts.down_proj`` (``in`` = intermediate, ``out`` = hidden) this way;
everything else is bf16. Dequantized, a tensor takes transformers' in-memory layout
``[E, in, out]`` (``GptOssExperts``), which ``TargetModel.load_hf_state_dict`` reads; the decoding
is bitwise what transformers' ``convert_moe_packed_tensors`` gives.
"""

from __future__ import annotations

import torch

from ..errors import DFlashError
from ..models.config import TargetConfig
from ..quantization.mxfp4 import BLOCK, BLOCK_BYTES, decode_mxfp4


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode one MXFP4 tensor (:func:`~dflash_trt.quantization.mxfp4.decode_mxfp4`) into
    transformers' layout.

    Args:
        blocks: uint8 ``[E, out, G, 16]``.
        scales: uint8 ``[E, out, G]`` (E8M0 exponents, bias 127).
        dtype: fp32 or bf16 (both hold every value exactly).

    Returns:
        ``[E, G * 32, out]`` in ``dtype`` (transformers' ``[E, in, out]`` layout), contiguous.
    """
    return decode_mxfp4(blocks, scales, dtype).transpose(1, 2).contiguous()


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


def mxfp4_pairs(sd: dict[str, torch.Tensor], cfg: TargetConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every ``{name}_blocks`` / ``{name}_scales`` pair of ``sd`` by ``name``, checked.

    Raises:
        DFlashError: (one line) a blocks tensor without its scales or the reverse, a family
            other than gpt-oss, or shapes other than blocks ``[E, out, in / 32, 16]`` and
            scales ``[E, out, in / 32]`` for this config's E, in and out.
    """
    names = {k.removesuffix("_blocks") for k in sd if k.endswith("_blocks")}
    names |= {k.removesuffix("_scales") for k in sd if k.endswith("_scales")}
    out = {}
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
        out[name] = (blocks, scales)
    return out


def dequantize_mxfp4_experts(
    sd: dict[str, torch.Tensor], cfg: TargetConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """``sd`` with every ``{name}_blocks`` / ``{name}_scales`` pair replaced by ``{name}``
    dequantized (:func:`dequantize_mxfp4`), the other tensors as they are.

    Raises:
        DFlashError: see :func:`mxfp4_pairs`.
    """
    out = {k: v for k, v in sd.items() if not k.endswith(("_blocks", "_scales"))}
    for name, (blocks, scales) in mxfp4_pairs(sd, cfg).items():
        out[name] = dequantize_mxfp4(blocks, scales, dtype)
    return out
