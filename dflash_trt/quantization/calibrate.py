"""Activation-range calibration with NVIDIA ModelOpt (``modelopt.torch.quantization``).

A copy of the model gets ModelOpt's quantizers (``mtq.quantize`` with ``FP8_DEFAULT_CFG``: per-
tensor max calibration of every ``nn.Linear`` input) and runs real prompts; the calibrated
``input_quantizer.amax`` of each linear is returned. The same amax gives FP8 (amax/448) and NVFP4
(amax/(6*448)) activation scales; the ranges are measured on the CPU in the model's dtype (ModelOpt's
NVFP4 fake-quant forward needs CUDA; the max calibrator does not).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..errors import DFlashError


def calibrate_input_amax(model: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], None]) -> dict[str, float]:
    """``{module name: max |input|}`` of every ``nn.Linear`` of ``model`` (left untouched) over
    what ``forward_loop(model_copy)`` runs. The LM head is left out (ModelOpt's default
    configs never quantize it).

    Raises:
        DFlashError: ModelOpt is missing, or a linear saw no input.
    """
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as e:  # pragma: no cover - the Makefile installs it
        raise DFlashError(f"calibration needs NVIDIA ModelOpt (pip install nvidia-modelopt): {e}") from None
    work = copy.deepcopy(model).eval()
    mtq.quantize(work, copy.deepcopy(mtq.FP8_DEFAULT_CFG), forward_loop)
    out = {}
    for name, mod in work.named_modules():
        q = getattr(mod, "input_quantizer", None)
        if q is None or not getattr(q, "is_enabled", True) or name.endswith("lm_head"):
            continue
        if q.amax is None:
            raise DFlashError(f"calibration: linear {name} saw no input")
        out[name] = float(q.amax.float().max())
    return out
