"""NVFP4 weights: quantize with NVIDIA ModelOpt, read an engine's NVFP4 tensors back.

Quantization goes through ModelOpt's own single-tensor quantizer (``modelopt.torch.quantization.
qtensor.NVFP4QTensor``), the code its unified HF export and TensorRT-LLM export call, so the
packed values and scales are ModelOpt's. Dequantization is a few torch ops, so the runtime reads
an engine without ModelOpt; there is no NVFP4 GEMM at run time here (the weights are
dequantized to the compute dtype).

Format (TensorRT-LLM ``quantization/layers.py`` ``FP4Linear``; ModelOpt 0.47 ``NVFP4QTensor``):
``weight`` uint8 ``[out, in / 2]`` (two e2m1 codes per byte, the even element in the low nibble;
code = sign << 3 | index into ``[0, .5, 1, 1.5, 2, 3, 4, 6]``), one float8_e4m3fn block scale per
16 consecutive input elements ``weights_scaling_factor [out, in / 16]``, an fp32 global scale
``weights_scaling_factor_2 = amax(|W|) / (6 * 448)`` ``[1]``; ``W ~= code_value * block_scale *
s2``. Activation scale ``activation_scaling_factor = amax / (6 * 448)`` (fp32 ``[1]``).
"""

from __future__ import annotations

import torch

from ..errors import DFlashError
from .common import FP8_MAX, QuantizedLinear, WeightFormat, activation_scale, modelopt_hf_config, unpack_nibbles

FP4_MAX = 6.0
NVFP4_BLOCK = 16
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: unified HF ``config_groups`` bits of weights and input activations
HF_BITS = {"num_bits": 4, "type": "float", "dynamic": False, "group_size": NVFP4_BLOCK}


def _qtensor():
    try:
        from modelopt.torch.quantization import qtensor
    except ImportError as e:  # pragma: no cover - the Makefile installs it
        raise DFlashError(f"quantization needs NVIDIA ModelOpt (pip install nvidia-modelopt): {e}") from None
    return qtensor


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
    codes = unpack_nibbles(packed).long()
    values = _E2M1.to(packed.device)[codes & 7] * (1 - 2 * (codes >> 3)).float()
    scale = block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1) * scale_2.float().reshape(())
    return (values * scale).to(dtype)


def quantize_linear(w: torch.Tensor, act_amax: float | None, group_size: int = 0) -> QuantizedLinear:
    """One (possibly fused) linear ``w [out, in]`` as engine tensors: ``weight``,
    ``weights_scaling_factor``, ``weights_scaling_factor_2`` and ``activation_scaling_factor``
    (``act_amax / (6 * 448)``); fused members share the global scale. ``group_size`` is not used
    (NVFP4 blocks are 16).

    Raises:
        DFlashError: no activation range, or what :func:`quantize_nvfp4` raises.
    """
    if act_amax is None:
        raise DFlashError("NVFP4 needs a calibrated activation range")
    q, bs, s2 = quantize_nvfp4(w)
    return {
        "weight": q,
        "weights_scaling_factor": bs,
        "weights_scaling_factor_2": s2,
        "activation_scaling_factor": activation_scale(act_amax, FP4_MAX * FP8_MAX),
    }


def is_stored(tensors: dict[str, torch.Tensor], base: str) -> bool:
    """Whether ``base.weight`` is an NVFP4 weight (uint8 codes with a global scale)."""
    w = tensors.get(base + ".weight")
    return w is not None and w.dtype == torch.uint8 and base + ".weights_scaling_factor_2" in tensors


def dequantize_stored(tensors: dict[str, torch.Tensor], base: str, dtype: torch.dtype) -> torch.Tensor:
    """``base.weight`` of a rank file as ``[out, in]`` in ``dtype``."""
    return dequantize_nvfp4(
        tensors[base + ".weight"],
        tensors[base + ".weights_scaling_factor"],
        tensors[base + ".weights_scaling_factor_2"],
        dtype,
    )


FORMAT = WeightFormat(
    name="nvfp4",
    quant_algo="NVFP4",
    weight_only=False,
    gemm_plugin="nvfp4",
    quantize=quantize_linear,
    is_stored=is_stored,
    dequantize=dequantize_stored,
    runtime_linears=None,
    trtllm_keys=lambda group_size: {"group_size": NVFP4_BLOCK},
    hf_config=lambda group_size, kv, ignore, producer: modelopt_hf_config("NVFP4", HF_BITS, kv, ignore, producer),
)
