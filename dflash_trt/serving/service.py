"""One served model: the in-flight-batching engine stepped on a background thread, its
tokenizer, request validation, streaming text with stop strings, and the metrics. Both the
OpenAI-compatible server and the Triton python-backend model drive it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..errors import DFlashError
from ..runtime.engine import AsyncLLM, EngineConfig, LLMEngine
from ..runtime.request import Request, RequestOutput
from ..runtime.sampling import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .metrics import ServingMetrics

log = logging.getLogger("dflash_trt.serving")


@dataclass
class ServeConfig:
    """What to serve and the engine's knobs (``dflash-trt serve`` / ``triton-repo`` flags).

    Attributes:
        target, drafter, engine: a checkpoint pair or an engine directory (as ``generate``).
        dtype, device: compute dtype (None: the engine's, else fp32) and device (None: cuda
            when visible).
        block_size: most tokens per verify block (None: the drafter's; 1: plain decoding).
        adaptive: choose the draft length per iteration (never slower than plain decoding).
        max_batch_size, max_num_tokens, tokens_per_block: engine settings.
        kv_capacity: KV positions (None: the engine's memory plan, capped, or 65536).
        model_name: the name clients ask for (None: the target directory's name).
        fp8_gemm: with an FP8 engine, run its linears as FP8 GEMMs.
    """

    target: str | None = None
    drafter: str | None = None
    engine: str | None = None
    dtype: str | None = None
    device: str | None = None
    block_size: int | None = None
    adaptive: bool = True
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    tokens_per_block: int = 32
    kv_capacity: int | None = None
    model_name: str | None = None
    fp8_gemm: bool = False


@dataclass
class Delta:
    """A piece of a streamed answer: new text and how many tokens it took."""

    text: str
    tokens: int


@dataclass
class Finished:
    """The end of an answer: why it ended (``stop``, ``length``, ``abort``), the engine's
    output, and the tokens counted for it (cut at a stop string, when one ended it)."""

    reason: str
    output: RequestOutput
    completion_tokens: int


class EngineService:
    """Loads the models, builds the engine and steps it on a background thread.

    Raises:
        DFlashError: bad checkpoints, engine or settings (from the loaders and the engine).
    """

    def __init__(self, cfg: ServeConfig):
        from ..checkpoints.engine import kv_capacity, load_models, read_manifest
        from ..checkpoints.loader import parse_device, parse_dtype

        dtype = cfg.dtype or (read_manifest(cfg.engine).get("dtype", "fp32") if cfg.engine else "fp32")
        device = parse_device(cfg.device)
        need_drafter = cfg.block_size is None or cfg.block_size > 1
        target, drafter = load_models(
            cfg.target,
            cfg.drafter,
            cfg.engine,
            parse_dtype(dtype),
            need_drafter=need_drafter,
            fp8_gemm=cfg.fp8_gemm,
            device=device,
        )
        cap, _ = kv_capacity(cfg.engine, cfg.kv_capacity)
        self.engine = LLMEngine(
            target.model,
            drafter,
            target.stop_token_ids,
            EngineConfig(
                block_size=cfg.block_size,
                adaptive=cfg.adaptive,
                max_batch_size=cfg.max_batch_size,
                max_num_tokens=cfg.max_num_tokens,
                tokens_per_block=cfg.tokens_per_block,
                kv_capacity_tokens=cap,
            ),
        )
        self.tokenizer = target.tokenizer
        self.stop_token_ids = tuple(target.stop_token_ids)
        self.model_name = cfg.model_name or target.path.name
        self.max_model_len = min(target.model.cfg.max_position_embeddings, cap)
        self.metrics = ServingMetrics(self.model_name, self.engine)
        self.engine.add_finish_listener(self.metrics.observe)
        self.llm = AsyncLLM(self.engine)
        self.dtype, self.device = dtype, device

    def close(self) -> None:
        self.llm.close()

    def request(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        ignore_eos: bool = False,
        stop_token_ids: list[int] | None = None,
        max_draft_tokens: int | None = None,
        min_tokens: int = 0,
        end_id: int | None = None,
    ) -> Request:
        """A checked engine request.

        Args:
            ignore_eos: no stop token at all (load testers' fixed-length requests).
            stop_token_ids: stop tokens besides the end token (vLLM's ``stop_token_ids``).
            max_draft_tokens: cap on the draft tokens per verify step (Triton's ``num_draft_tokens``).
            min_tokens: stop tokens cannot end the answer before this many tokens.
            end_id: the end token instead of the target's EOS ids (TensorRT-LLM's ``end_id``).

        Raises:
            DFlashError: an empty prompt, ``max_tokens`` < 1, a prompt plus ``max_tokens`` past
                the model's length, or more KV than the whole cache.
        """
        if not prompt_ids:
            raise DFlashError("the prompt is empty")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise DFlashError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise DFlashError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"limit of {self.max_model_len} tokens"
            )
        if max_draft_tokens is not None and max_draft_tokens < 0:
            raise DFlashError(f"num_draft_tokens must be >= 0, got {max_draft_tokens}")
        if min_tokens < 0:
            raise DFlashError(f"min_tokens must be >= 0, got {min_tokens}")
        ends = self.stop_token_ids if end_id is None else (end_id,)
        stops = () if ignore_eos else tuple(sorted(set(ends) | set(stop_token_ids or ())))
        req = Request(list(prompt_ids), max_tokens, sampling, stops, max_draft_tokens, min_tokens)
        self.engine.scheduler.check(req)
        return req

    async def stream(self, req: Request, stop: list[str] | None = None) -> AsyncIterator[Delta | Finished]:
        """Text deltas of ``req`` as the engine commits tokens, then :class:`Finished`. A stop
        string ends the answer before it (the request is aborted in the engine, its KV freed).
        Leaving the iterator early aborts the request too."""
        detok = IncrementalDetokenizer(self.tokenizer, stop)
        tokens = 0
        gen = self.llm.stream(req)
        try:
            async for item in gen:
                if isinstance(item, RequestOutput):
                    tail = detok.finish()
                    if tail:
                        yield Delta(tail, 0)
                    reason = "stop" if detok.stopped else item.finish_reason
                    yield Finished(reason, item, tokens if detok.stopped else len(item.output_ids))
                    return
                tokens += len(item)
                text = detok.push(item)
                if text:
                    yield Delta(text, len(item))
                if detok.stopped:
                    await gen.aclose()  # aborts the request in the engine
                    out = RequestOutput(detok.ids, "stop", [], 0.0, 0.0)
                    yield Finished("stop", out, tokens)
                    return
        finally:
            await gen.aclose()
