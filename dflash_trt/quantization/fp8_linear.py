"""FP8 GEMMs at run time: a drop-in ``nn.Linear`` that keeps an engine's FP8 weight and runs
``torch._scaled_mm`` (W8A8, TensorRT-LLM ``FP8Linear`` semantics: per-tensor weight scale,
static per-tensor activation scale from calibration).

``y = (q(x / s_a) @ W8^T) * s_a * s_w`` where ``q`` rounds to float8_e4m3fn with saturation at
+-448 and ``W8 = W / s_w`` is the engine's e4m3 weight. On CUDA (sm_89+) this is a native FP8
tensor-core GEMM; on CPU torch 2.13 runs the same op (for correctness, not speed).
"""

from __future__ import annotations

import torch
from torch import nn

from .formats import FP8_MAX


class Fp8Linear(nn.Module):
    """Linear layer over an FP8 weight.

    Args:
        weight: float8_e4m3fn ``[out, in]`` (``in`` and ``out`` multiples of 16 on CUDA).
        weight_scale: fp32 ``[1]`` (``weights_scaling_factor``).
        input_scale: fp32 ``[1]`` (``activation_scaling_factor``, calibrated amax / 448).
        bias: optional ``[out]`` in the compute dtype.

    ``forward(x [..., in])`` returns ``[..., out]`` in ``x.dtype``.

    Raises:
        ValueError: a weight that is not float8_e4m3fn or scales that are not single values.
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
            raise ValueError(f"Fp8Linear needs a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
        if weight_scale.numel() != 1 or input_scale.numel() != 1:
            raise ValueError("Fp8Linear takes per-tensor scales")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(()))
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        xq = (x2.float() / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(
            xq,
            self.weight.t(),
            scale_a=self.input_scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=x.dtype if x.dtype != torch.float32 else torch.float32,
        )
        return y.reshape(*shape[:-1], self.out_features)


def replace_linear(model: nn.Module, name: str, new: nn.Module) -> None:
    """Swap the submodule at dotted path ``name`` for ``new``."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
