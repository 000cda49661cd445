"""Activation-range calibration with NVIDIA ModelOpt (``modelopt.torch.quantization``).

A copy of the model gets ModelOpt's quantizers (``mtq.quantize`` with ``FP8_DEFAULT_CFG``: per-
tensor max calibration of every ``nn.Linear`` input) and runs real prompts; the calibrated
``input_quantizer.amax`` of each linear is returned. The same amax gives FP8 (amax/448) and NVFP4
(amax/(6*448)) activation scales; the ranges are measured on the CPU in the model's dtype (ModelOpt's
NVFP4 fake-quant forward needs CUDA; the max calibrator does not).

Routed experts (``models/moe.py`` ``MoEBlock``) are stacked parameters, not ``nn.Linear``s, so
ModelOpt sees only their router; a forward hook on each block records the input ranges of the
experts' two GEMMs over the (token, expert) pairs the routing picks: ``{block}.gate_up`` = max
|block input| (every token goes to some expert), ``{block}.down`` = max |act(gate, up)| over the
picked experts (``MoEBlock.act``: SwiGLU, or gpt-oss's clamped SwiGLU; expert biases included).
TensorRT-LLM's MoE keeps one activation scale per GEMM for all experts (the largest input range),
which these are.
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
    out: dict[str, float] = {}
    hooks = [
        mod.register_forward_hook(_expert_amax_hook(name, out))
        for name, mod in work.named_modules()
        if type(mod).__name__ == "MoEBlock"
    ]
    try:
        mtq.quantize(work, copy.deepcopy(mtq.FP8_DEFAULT_CFG), forward_loop)
    finally:
        for h in hooks:
            h.remove()
    for name, mod in work.named_modules():
        q = getattr(mod, "input_quantizer", None)
        if q is None or not getattr(q, "is_enabled", True) or name.endswith("lm_head"):
            continue
        if q.amax is None:
            raise DFlashError(f"calibration: linear {name} saw no input")
        out[name] = float(q.amax.float().max())
    return out


def _expert_amax_hook(name: str, out: dict[str, float]):
    """Forward hook of a ``MoEBlock`` named ``name``: raises ``out[name + ".gate_up"]`` and
    ``out[name + ".down"]`` to the largest input of the experts' GEMMs in this forward."""

    def hook(mod, args, _output):
        h = args[0].detach().reshape(-1, args[0].shape[-1])
        with torch.no_grad():
            _, ids = mod.route(h)
            down = 0.0
            for e in torch.unique(ids).tolist():
                rows = (ids == e).any(dim=-1)
                gate_up, _ = mod.expert_linears(e, False)
                gate, up = gate_up(h[rows]).split(mod.intermediate, dim=-1)
                down = max(down, float(mod.act(gate, up).abs().max()))
        for key, v in ((name + ".gate_up", float(h.abs().max())), (name + ".down", down)):
            out[key] = max(out.get(key, 0.0), v)

    return hook
