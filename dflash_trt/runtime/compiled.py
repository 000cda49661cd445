"""The target's forward compiled by torch.compile (inductor), for the CPU decode loop.

A batch-1 decode step of the default 4-bit target is ~1,800 small eager ops around ~120 packed
int4 GEMMs: at that size dispatch and Python, not bytes, set the step time. Inductor fuses the
elementwise work (norms, RoPE, residuals, SwiGLU, dtype casts) into generated C++ kernels and
calls the GEMMs (it lowers ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``) and the
KV pool writes in place, in one graph per step shape. Shapes are dynamic (token count, key
length, sequences), so a run compiles a handful of graphs: the first decode step, the prompt
prefill, and with a drafter the verify block; each costs tens of seconds on 2 cores the first
time, and inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) shortens later processes.

The compiled forward is the same function as :meth:`TargetModel.forward`: greedy outputs agree
with the eager forward except where fused kernels round differently at a numerical tie, and
DFlash verifies on the same compiled forward as plain decoding, so the lossless comparison
holds within the compiled path. It must run under ``torch.no_grad`` (the runner does): a graph
that writes the KV pool cannot run in inference mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..models.target import TargetModel


def compiled_forward(model: TargetModel) -> Callable:
    """``model``'s forward compiled once per model (``torch.compile(dynamic=True)``), with the
    signature of :meth:`TargetModel.forward` (``input_ids`` int64 ``[B, T]``, metadata, KV pools,
    capture, logits_index) and its :class:`~dflash_trt.models.target.TargetOutput`.

    Raises:
        nothing here: compilation happens on the first call; torch's errors surface there.
    """
    fn = model.__dict__.get("_compiled_forward")
    if fn is None:
        # the undecorated forward: TargetModel.forward's inference_mode cannot wrap a graph
        # that mutates the KV pools
        fn = torch.compile(TargetModel.forward.__wrapped__.__get__(model), dynamic=True)
        model.__dict__["_compiled_forward"] = fn
    return fn
