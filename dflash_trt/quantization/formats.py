"""FP8 and NVFP4 weight formats: quantize with NVIDIA ModelOpt, dequantize in plain torch.

Quantization goes through ModelOpt's own single-tensor quantizers (``modelopt.torch.quantization.
qtensor``), the code its unified HF export and TensorRT-LLM export call, so our packed values and
scales are ModelOpt's. Dequantization is a few torch ops so that the runtime can read an engine
without ModelOpt installed.

Formats (TensorRT-LLM ``quantization/layers.py`` FP8Linear / FP4Linear; ModelOpt 0.47
``NVFP4QTensor`` / ``FP8QTensor``):

* FP8: ``weight`` float8_e4m3fn ``[out, in]`` = ``W / s`` with ``s = amax(|W|) / 448`` (fp32).
* NVFP4: ``weight`` uint8 ``[out, in / 2]`` (two e2m1 codes per byte, the even element in the low
  nibble; code = sign << 3 | index into ``[0, .5, 1, 1.5, 2, 3, 4, 6]``), one float8_e4m3fn scale
  per 16 consecutive input elements ``[out, in / 16]``, and an fp32 global scale
  ``s2 = amax(|W|) / (6 * 448)``; ``W ~= code_value * block_scale * s2``.
* Activation scales: FP8 ``amax / 448``; NVFP4 ``amax / (6 * 448)`` (fp32).
"""

from __future__ import annotations

import torch

from ..errors import DFlashError

FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_BLOCK = 16
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _qtensor():
    try:
        from modelopt.torch.quantization import qtensor
    except ImportError as e:  # pragma: no cover - the Makefile installs it
        raise DFlashError(f"quantization needs NVIDIA ModelOpt (pip install nvidia-modelopt): {e}") from None
    return qtensor


def quantize_fp8(w: torch.Tensor, amax: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 e4m3 weight, as ModelOpt's export writes it.

    Args:
        w: ``[out, in]`` float weight (any float dtype).
        amax: the range to map to 448 (default ``max |w|``); a fused group passes its max.

    Returns:
        ``(weight float8_e4m3fn [out, in], weights_scaling_factor fp32 [1])``.
    """
    w = w.detach()
    amax = float(w.abs().max()) if amax is None else float(amax)
    scale = torch.tensor(max(amax, 1e-12) / FP8_MAX, dtype=torch.float32)
    # ModelOpt export (quant_utils.to_quantized_weight): (W / scale).to(float8_e4m3fn), fp32 scale
    q = (w.float() / scale).to(torch.float8_e4m3fn)
    return q, scale.reshape(1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q`` float8_e4m3fn ``[out, in]``, ``scale`` fp32 ``[1]`` -> ``[out, in]`` in ``dtype``."""
    return (q.float() * scale.float().reshape(())).to(dtype)


def quantize_nvfp4(w: torch.Tensor, amax: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 weight through ModelOpt's ``NVFP4QTensor`` (bitwise what its exports write).

    Args:
        w: ``[out, in]`` float weight, ``in`` a multiple of 16.
        amax: global range (default ``max |w|``); a fused group (q/k/v, gate/up) passes its max
            so that the members share one global scale, as ModelOpt's export does.

    Returns:
        ``(weight uint8 [out, in/2], weights_scaling_factor float8_e4m3fn [out, in/16],
        weights_scaling_factor_2 fp32 [1])``.

    Raises:
        DFlashError: ``in`` is not a multiple of 16, or ModelOpt is missing.
    """
    if w.shape[-1] % NVFP4_BLOCK:
        raise DFlashError(f"NVFP4 needs the input dimension to be a multiple of {NVFP4_BLOCK}, got {w.shape[-1]}")
    qt = _qtensor().NVFP4QTensor
    w = w.detach()
    amax = float(w.abs().max()) if amax is None else float(amax)
    s2 = torch.tensor(max(amax, 1e-12) / (FP4_MAX * FP8_MAX), dtype=torch.float32)
    ws, _ = qt.get_weights_scaling_factor(w, NVFP4_BLOCK, s2)
    packed = qt.quantize(w, NVFP4_BLOCK, ws, s2)[0]._quantized_data
    return packed, ws, s2.reshape(1)


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``packed`` uint8 ``[out, in/2]``, ``block_scale`` e4m3 ``[out, in/16]``, ``scale_2`` fp32
    ``[1]`` -> ``[out, in]`` in ``dtype`` (no ModelOpt needed)."""
    lo, hi = packed & 0x0F, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2).long()
    values = _E2M1.to(packed.device)[codes & 7] * (1 - 2 * (codes >> 3)).float()
    scale = block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1) * scale_2.float().reshape(())
    return (values * scale).to(dtype)


def activation_scale(fmt: str, amax: float) -> torch.Tensor:
    """fp32 ``[1]`` activation scale of ``fmt`` (``fp8``: amax/448, ``nvfp4``: amax/(6*448))."""
    div = FP8_MAX if fmt == "fp8" else FP4_MAX * FP8_MAX
    return torch.tensor([max(float(amax), 1e-12) / div], dtype=torch.float32)
