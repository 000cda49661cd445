"""FP8 (e4m3) weights: quantize as ModelOpt's export does, read an engine's FP8 tensors back,
and run them as FP8 GEMMs.

Format (TensorRT-LLM ``quantization/layers.py`` ``FP8Linear``; ModelOpt 0.47 ``FP8QTensor`` /
``export/quant_utils.to_quantized_weight``): ``weight`` float8_e4m3fn ``[out, in]`` = ``W / s``
with ``s = amax(|W|) / 448`` (``weights_scaling_factor`` fp32 ``[1]``), and the static input
scale ``activation_scaling_factor`` = calibrated ``amax / 448`` (fp32 ``[1]``). Members of a
fused linear (q/k/v, gate/up) share both scales, as ModelOpt's fused export makes them.

Dequantization is plain torch, so the runtime reads an FP8 engine without ModelOpt.
:class:`Fp8Linear` runs ``torch._scaled_mm`` (W8A8): a native FP8 tensor-core GEMM on CUDA
sm_89+; on the CPU torch 2.13 runs the same op (for correctness, not speed).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DFlashError
from .common import FP8_MAX, QuantizedLinear, WeightFormat, activation_scale, modelopt_hf_config

#: unified HF ``config_groups`` bits of weights and input activations
HF_BITS = {"num_bits": 8, "type": "float", "dynamic": False}


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


def quantize_linear(w: torch.Tensor, act_amax: float | None, group_size: int = 0) -> QuantizedLinear:
    """One (possibly fused) linear ``w [out, in]`` as engine tensors: ``weight``,
    ``weights_scaling_factor`` and ``activation_scaling_factor`` (``act_amax / 448``);
    ``group_size`` is not used.

    Raises:
        DFlashError: no activation range.
    """
    if act_amax is None:
        raise DFlashError("FP8 needs a calibrated activation range")
    q, s = quantize_fp8(w)
    return {"weight": q, "weights_scaling_factor": s, "activation_scaling_factor": activation_scale(act_amax, FP8_MAX)}


def is_stored(tensors: dict[str, torch.Tensor], base: str) -> bool:
    """Whether ``base.weight`` is an FP8 weight (float8_e4m3fn)."""
    w = tensors.get(base + ".weight")
    return w is not None and w.dtype == torch.float8_e4m3fn


def dequantize_stored(tensors: dict[str, torch.Tensor], base: str, dtype: torch.dtype) -> torch.Tensor:
    """``base.weight`` of a rank file as ``[out, in]`` in ``dtype``."""
    return dequantize_fp8(tensors[base + ".weight"], tensors[base + ".weights_scaling_factor"], dtype)


class Fp8Linear(nn.Module):
    """Linear layer over an FP8 weight: ``y = (q(x / s_a) @ W8^T) * s_a * s_w`` where ``q``
    rounds to float8_e4m3fn with saturation at +-448 (TensorRT-LLM ``FP8Linear`` semantics:
    per-tensor weight scale, static per-tensor activation scale from calibration).

    Args:
        weight: float8_e4m3fn ``[out, in]`` (``in`` and ``out`` multiples of 16 on CUDA).
        weight_scale: fp32 ``[1]`` (``weights_scaling_factor``).
        input_scale: fp32 ``[1]`` (``activation_scaling_factor``, calibrated amax / 448).
        bias: optional ``[out]`` in the compute dtype.

    ``forward(x [..., in])`` returns ``[..., out]`` in ``x.dtype``: ``torch._scaled_mm`` on a
    GPU; on the CPU the same product of the e4m3 values as an fp32 GEMM (torch's CPU
    ``_scaled_mm`` is a reference loop: 0.2-1.1 s for one 16-row linear of this repository's
    target on 2 cores against ~8 ms, ~75 s a forward), equal to it up to the fp32 summation order.

    Raises:
        DFlashError: a weight that is not 2-D float8_e4m3fn or scales that are not single values.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise DFlashError(f"Fp8Linear needs a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
        if weight_scale.numel() != 1 or input_scale.numel() != 1:
            raise DFlashError("Fp8Linear takes per-tensor scales")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(()))
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        xq = (x2.float() / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if x.device.type == "cpu":
            y = (xq.float() @ self.weight.float().t()) * (self.input_scale * self.weight_scale)
            y = y if self.bias is None else y + self.bias.float()
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        y = torch._scaled_mm(
            xq,
            self.weight.t(),
            scale_a=self.input_scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=x.dtype if x.dtype != torch.float32 else torch.float32,
        )
        return y.reshape(*shape[:-1], self.out_features)


def runtime_linears(tensors: dict[str, torch.Tensor], bases: list[str], modules: list[nn.Module]) -> list[Fp8Linear]:
    """:class:`Fp8Linear` modules over the engine's own e4m3 bytes of one fused linear (members
    ``bases`` in row order), split by rows onto the dense ``modules`` it replaces (their biases
    kept). The builder quantizes a fused source as one tensor, so its members share the
    per-tensor scales and the FP8 GEMM is exact to the stored format.

    Raises:
        DFlashError: members with different scales (not a file the builder wrote).
    """
    ws = {tensors[b + ".weights_scaling_factor"].item() for b in bases}
    acts = {tensors[b + ".activation_scaling_factor"].item() for b in bases}
    if len(ws) != 1 or len(acts) != 1:
        raise DFlashError(f"engine tensors {', '.join(bases)} have different FP8 scales; rebuild the engine")
    w = torch.cat([tensors[b + ".weight"] for b in bases])
    w_scale = tensors[bases[0] + ".weights_scaling_factor"]
    a_scale = tensors[bases[0] + ".activation_scaling_factor"]
    pieces = torch.split(w, [m.weight.shape[0] for m in modules])
    return [Fp8Linear(piece, w_scale, a_scale, m.bias) for m, piece in zip(modules, pieces)]


FORMAT = WeightFormat(
    name="fp8",
    quant_algo="FP8",
    weight_only=False,
    gemm_plugin="fp8",
    quantize=quantize_linear,
    is_stored=is_stored,
    dequantize=dequantize_stored,
    runtime_linears=runtime_linears,
    trtllm_keys=lambda group_size: {},
    hf_config=lambda group_size, kv, ignore, producer: modelopt_hf_config("FP8", HF_BITS, kv, ignore, producer),
)
