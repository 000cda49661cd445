"""dflash-trt: deployable DFlash speculative decoding (arXiv:2602.06036).

The front door, with vLLM's names::

    from dflash_trt import LLM, SamplingParams
    outputs = LLM().generate(["Why is the sky blue?"], SamplingParams(max_tokens=64))

``LLM`` (offline batches), ``AsyncLLM`` (streaming over a background engine thread),
``SamplingParams``, ``EngineArgs`` (every engine setting), ``RequestOutput`` /
``CompletionOutput`` (what ``LLM`` returns). Names are imported on first use, so that
``import dflash_trt`` and the command line stay light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "dflash_trt.llm",
    "AsyncLLM": "dflash_trt.runtime.engine",
    "LLMEngine": "dflash_trt.runtime.engine",
    "SamplingParams": "dflash_trt.runtime.sampling",
    "EngineArgs": "dflash_trt.engine_args",
    "RequestOutput": "dflash_trt.outputs",
    "CompletionOutput": "dflash_trt.outputs",
    "SpecDecodeStats": "dflash_trt.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dflash_trt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
