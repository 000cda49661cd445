"""What the weight formats share: the format record and its lookup, the tensors of a quantized
linear, nibble packing and the module swap.

One module per format (:mod:`.int4`, :mod:`.int8`, :mod:`.fp8`, :mod:`.nvfp4`) holds its
quantizer (what the builder calls), its reader of engine rank files (what the engine loader
calls) and its runtime linear where it has one; each exports a :class:`WeightFormat` as
``FORMAT``, found by name with :func:`weight_format` and by stored tensors with
:func:`stored_format`.

Tensors of one quantized linear (TensorRT-LLM ``quantization/layers.py`` suffixes; the unified HF
checkpoint renames them with :data:`HF_SUFFIX`): ``weight``, ``weights_scaling_factor``,
``weights_scaling_factor_2`` (NVFP4), ``activation_scaling_factor`` (FP8 / NVFP4), ``zero``
(int4). The table of layouts is in ``docs/engine-format.md``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import DFlashError

#: format names, as build configs and engine manifests spell them
FORMAT_NAMES = ("fp8", "nvfp4", "int4", "int8")
#: largest finite float8_e4m3fn value (FP8 weights and activations, NVFP4 block scales)
FP8_MAX = 448.0

#: one quantized GEMM weight over its whole (unsharded) output range: TRT-LLM suffix -> tensor;
#: the 2-D ones (weight, NVFP4 block scales, int4 / int8 scales and zeros) are per output row
QuantizedLinear = dict

#: TRT-LLM checkpoint suffix -> unified HF (ModelOpt export) suffix
HF_SUFFIX = {
    "weights_scaling_factor": "weight_scale",
    "weights_scaling_factor_2": "weight_scale_2",
    "activation_scaling_factor": "input_scale",
    "zero": "weight_zero_point",
}


@dataclass(frozen=True)
class WeightFormat:
    """One weight format: names, and the functions of its module.

    Attributes:
        name: ``fp8`` | ``nvfp4`` | ``int4`` | ``int8``.
        quant_algo: TensorRT-LLM ``QuantAlgo`` name (``quantization.quant_algo``).
        weight_only: True: no activation scale, no calibration.
        gemm_plugin: ``trtllm-build --gemm_plugin`` value for a target in this format.
        quantize: ``(w float [out, in], act_amax float | None, group_size) -> QuantizedLinear``;
            ``act_amax`` is the calibrated input range (None for weight-only formats).
        is_stored: ``(tensors, base) -> bool``: whether rank-file tensors ``base.*`` are this format.
        dequantize: ``(tensors, base, dtype) -> [out, in]`` weight in ``dtype``.
        runtime_linears: ``(tensors, bases, modules) -> [nn.Module | None]``: run-time linears over
            the stored bytes of a fused linear (members ``bases`` in row order) replacing the dense
            ``modules`` it feeds (None: that one stays dense); None when the format has no run-time
            linear (the weights are dequantized).
        trtllm_keys: ``group_size -> dict``: the format's extra keys of TensorRT-LLM's
            ``quantization`` block (``group_size``, ``has_zero_point``).
        hf_config: ``(group_size, kv_cache_dtype, ignore, producer) -> dict``: the unified HF
            ``config.json`` ``quantization_config``.
    """

    name: str
    quant_algo: str
    weight_only: bool
    gemm_plugin: str
    quantize: Callable[[torch.Tensor, float | None, int], QuantizedLinear]
    is_stored: Callable[[dict, str], bool]
    dequantize: Callable[[dict, str, torch.dtype], torch.Tensor]
    runtime_linears: Callable[[dict, list[str], list[nn.Module]], list[nn.Module | None]] | None
    trtllm_keys: Callable[[int], dict]
    hf_config: Callable[[int, str, list[str], dict], dict]


def weight_format(name: str) -> WeightFormat:
    """The :class:`WeightFormat` called ``name``.

    Raises:
        DFlashError: an unknown name.
    """
    if name not in FORMAT_NAMES:
        raise DFlashError(f"unknown weight format {name!r}; choose from {', '.join(FORMAT_NAMES)}")
    return importlib.import_module(f"{__package__}.{name}").FORMAT


def stored_format(tensors: dict[str, torch.Tensor], name: str) -> WeightFormat | None:
    """The format of rank-file tensor ``name`` (``<base>.weight`` or another tensor), None when it
    is stored unquantized (no ``<base>.weights_scaling_factor``).

    Raises:
        DFlashError: scales beside a weight that no format stores that way.
    """
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    if base + ".weights_scaling_factor" not in tensors:
        return None
    for fmt in map(weight_format, FORMAT_NAMES):
        if fmt.is_stored(tensors, base):
            return fmt
    raise DFlashError(f"engine tensor {name} ({tensors[name].dtype}) has scales of no known weight format")


def needs_calibration(*names: str) -> bool:
    """Whether any of the formats ``names`` (``none`` skipped) needs activation ranges."""
    return any(not weight_format(n).weight_only for n in names if n != "none")


def linear_rows(q: QuantizedLinear, a: int, b: int) -> QuantizedLinear:
    """Output rows ``a:b`` of a quantized linear; per-tensor scales are shared by the slices."""
    return {k: (v[a:b] if v.dim() == 2 else v) for k, v in q.items()}


def activation_scale(amax: float, div: float) -> torch.Tensor:
    """fp32 ``[1]`` activation scale ``amax / div`` (amax floored at 1e-12)."""
    return torch.tensor([max(float(amax), 1e-12) / div], dtype=torch.float32)


def modelopt_hf_config(quant_algo: str, bits: dict, kv: str, ignore: list[str], producer: dict) -> dict:
    """``quantization_config`` of a ModelOpt-format checkpoint (ModelOpt 0.47
    ``convert_hf_quant_config_format``): ``bits`` describes both weights and input activations."""
    out = {
        "config_groups": {"group_0": {"input_activations": dict(bits), "weights": dict(bits), "targets": ["Linear"]}},
        "ignore": ignore,
        "quant_algo": quant_algo,
        "quant_method": "modelopt",
        "producer": producer,
    }
    if kv == "fp8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return out


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2n]`` codes 0..15 -> uint8 ``[..., n]``, the even element in the low nibble
    (the on-disk layout of int4 codes and NVFP4 e2m1 codes)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., n]`` -> uint8 ``[..., 2n]``."""
    return torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Swap the submodule at dotted path ``name`` for ``new``; its forward hooks move to ``new``
    (e.g. the all-gather of a vocab-parallel LM head under tensor parallelism)."""
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    new._forward_hooks.update(getattr(owner, leaf)._forward_hooks)
    setattr(owner, leaf, new)
