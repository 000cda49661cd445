"""The target's and the drafter's forwards compiled by torch.compile (inductor), for the CPU
decode loop.

A batch-1 decode step of the default 4-bit target is ~1,800 small eager ops around ~120 packed
int4 GEMMs: at that size dispatch and Python, not bytes, set the step time. Inductor fuses the
elementwise work (norms, RoPE, residuals, SwiGLU, dtype casts) into generated C++ kernels and
calls the GEMMs (``dflash_cpu::int4_linear`` / ``int8_linear``, opaque to it) and the
KV pool writes in place, in one graph per step shape. Shapes are dynamic (token count, key
length, sequences), but torch.compile specialises sizes 0 and 1, so a run compiles a handful of
graphs: the first decode step, the prompt prefill, with a drafter the verify block, and under
in-flight batching the batched steps; each costs tens of seconds on 2 cores the first time, and
inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) shortens later processes. Callers compile
them in an untimed warm-up (:meth:`LLMEngine.warm_up`).
The drafter's forward (its context-K/V projection, block attention and MLPs; not the draft
vocabulary's LM head and argmax, :meth:`DFlashDrafter.propose`) is compiled the same way: one
graph for a prompt's context, one for the per-step context of a few tokens.

The compiled forward is the same function as :meth:`TargetModel.forward`: greedy outputs agree
with the eager forward except where fused kernels round differently at a numerical tie, and
DFlash verifies on the same compiled forward as plain decoding, so the lossless comparison
holds within the compiled path. It must run under ``torch.no_grad`` (the runner does): a graph
that writes the KV pool cannot run in inference mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: inductor options: ``cpp_wrapper`` generates the graph's kernel-calling wrapper in C++ instead
#: of Python (a decode step calls ~500 kernels and packed GEMMs: measured here, int4 plain
#: decoding 1.08x faster, 87.7 vs 81.2 tok/s, two compiled copies interleaved prompt by prompt
#: in one process; compiling takes ~3x longer on a cold cache)
OPTIONS = {"cpp_wrapper": True}

#: torch.compile backend: inductor; a test whose subject is dynamo's graphs and recompiles, not
#: the generated kernels, may set "eager" (the same captured graphs, run by eager kernels)
BACKEND = "inductor"

#: graphs dynamo may compile per function before it gives up and runs it eagerly (its default,
#: 8, is exceeded by one process that serves an adaptive DFlash engine and a plain one on the
#: same target: torch.compile specialises sizes 0 and 1 of every input, so batch of one,
#: one-token steps, no logits rows and which layers are captured each add a graph; the start-up
#: calibration's sweep reaches 8, and the plain engine's first graph then ran eager: a load
#: benchmark's plain lane, measured at 43.8 against the compiled DFlash lane's 58.9 tok/s)
RECOMPILE_LIMIT = 64


def _traced_with_settings(fn: Callable) -> Callable:
    """``fn`` (a ``torch.compile`` result) called with dynamo's ``specialize_float`` on: float
    attributes (RMSNorm's eps, ``nn.Embedding``'s ``norm_type``) are constants of the graph
    instead of symbolic inputs. Symbolic, each function's first compile was thrown away midway
    by inductor's float-tensorify pass and traced again (dynamo: "Restarting analysis due to
    _tensorify_python_scalars"): on the test's 2-layer int4 target and drafter, 5 + 2 graphs
    compiled in ~143 s on a cold cache, ~120 s without the restarts. Dynamo reads the setting
    when it traces, which is on a call, so it wraps each call (the same signature and result):
    set and restored by hand, ~5 us a call (``config.patch`` took ~190 us, on every step)."""
    config = torch._dynamo.config

    def call(*args, **kwargs):
        before = config.specialize_float
        config.specialize_float = True
        try:
            return fn(*args, **kwargs)
        finally:
            config.specialize_float = before

    return call


def compiled_forward(model: nn.Module) -> Callable:
    """``model``'s forward compiled once per model (``torch.compile(dynamic=True)``), with the
    signature and result of its ``forward``: :meth:`TargetModel.forward` (``input_ids`` int64
    ``[B, T]``, metadata, KV pools, capture, logits_index; a
    :class:`~dflash_trt.models.target.TargetOutput`) or :meth:`DFlashDrafter.forward` (block
    embeddings ``[B, K, hidden]``, context features, metadata, KV pools; ``[B, K, hidden]``).

    Raises:
        nothing here: compilation happens on the first call; torch's errors surface there.
    """
    fn = model.__dict__.get("_compiled_forward")
    if fn is None:
        # the undecorated forward: a decorator's inference_mode (TargetModel.forward's) cannot
        # wrap a graph that mutates the KV pools
        forward = type(model).forward
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        options = {"options": OPTIONS} if BACKEND == "inductor" else {}
        fn = torch.compile(
            getattr(forward, "__wrapped__", forward).__get__(model), dynamic=True, backend=BACKEND, **options
        )
        fn = _traced_with_settings(fn)
        model.__dict__["_compiled_forward"] = fn
    return fn
