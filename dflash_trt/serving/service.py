"""One served model: the in-flight-batching engine stepped on a background thread, its
tokenizer, request validation, streaming text with stop strings, and the metrics. Both the
OpenAI-compatible server and the Triton python-backend model drive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from ..engine_args import EngineArgs
from ..errors import ConfigError, DFlashError
from ..runtime.async_llm import AsyncLLM, StopStream
from ..runtime.config import CPU_MAX_PREFILL_TOKENS
from ..runtime.engine import LLMEngine
from ..runtime.request import Request, RequestResult
from ..runtime.sampling import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .metrics import ServingMetrics

log = logging.getLogger("dflash_trt.serving")


@dataclass
class ServeConfig:
    """What to serve (``dflash-trt serve`` / ``triton-repo`` flags).

    Attributes:
        engine_args: the engine's settings (``EngineArgs``: target, drafter or engine
            directory, dtype, block size, ...); serving defaults: ``adaptive`` on, and
            ``max_prefill_tokens`` on a CPU :data:`~dflash_trt.runtime.config.CPU_MAX_PREFILL_TOKENS`
            (:func:`default_max_prefill_tokens`). ``tensor_parallel_size`` N > 1 outside
            ``mpiexec`` starts the other ranks as child processes (no MPI: what tritonserver's
            python backend needs).
        model_name: the name clients ask for (None: the target directory's name).
        max_waiting_requests: most requests waiting for admission; one more is refused
            (:class:`QueueFull`: HTTP 503 with ``Retry-After``, a Triton error response).
            None: no bound.
    """

    engine_args: EngineArgs = field(default_factory=lambda: EngineArgs(adaptive=True))
    model_name: str | None = None
    max_waiting_requests: int | None = 256

    def to_json(self) -> str:
        """The config as JSON (the Triton model repository carries it)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        """The config :meth:`to_json` wrote.

        Raises:
            DFlashError: not such a config.
        """
        try:
            d = json.loads(text)
            return cls(engine_args=EngineArgs(**d.pop("engine_args", {})), **d)
        except (TypeError, ValueError) as e:
            raise DFlashError(f"not a dflash-trt serving config ({e})") from None


def default_max_prefill_tokens(device: torch.device | str) -> int | None:
    """The serving default of ``max_prefill_tokens`` on ``device``: :data:`CPU_MAX_PREFILL_TOKENS`
    on a CPU (on 2 cores, bf16, 256 prompt tokens take about 0.75 s, so a stream waits under a
    second for its next token while prompts are prefilled; 2048 held every stream for 6-8 s,
    docs/serving.md; as Sarathi-Serve's token budget / SGLang's ``--chunked-prefill-size``);
    None (prompt chunks up to ``max_num_tokens``) on a GPU, where a prefill iteration is short."""
    return CPU_MAX_PREFILL_TOKENS if torch.device(device).type == "cpu" else None


#: what a client is told about a request the engine failed on (finish reason ``error``)
ENGINE_FAILED = "the engine failed on this request; see the server log"


class QueueFull(DFlashError):
    """The waiting queue is at ``ServeConfig.max_waiting_requests``: try again later (HTTP 503)."""


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
    output: RequestResult
    completion_tokens: int


class EngineService:
    """Builds the engine (:meth:`LLMEngine.from_engine_args`) and steps it on a background thread.

    Tensor parallelism: under ``mpiexec -n N``, or with ``tensor_parallel_size`` N (the engine
    then starts ranks 1..N-1 itself), the target is split over N ranks. Rank 0 serves; the other
    ranks mirror every iteration inside the constructor and leave it (with :attr:`worker` True)
    once rank 0's :meth:`close` stops them.

    Args:
        cfg: what to serve.

    Raises:
        ConfigError: an impossible setting, named by its field.
        DFlashError: bad checkpoints or engine directory (from the loaders).
    """

    def __init__(self, cfg: ServeConfig):
        from ..checkpoints.loader import parse_device

        if cfg.max_waiting_requests is not None and cfg.max_waiting_requests < 0:
            raise ConfigError("max_waiting_requests", f"must be >= 0, got {cfg.max_waiting_requests}")
        self.max_waiting_requests = cfg.max_waiting_requests
        args = cfg.engine_args
        if args.max_prefill_tokens is None:
            args = args.replace(max_prefill_tokens=default_max_prefill_tokens(parse_device(args.device)))
        engine = LLMEngine.from_engine_args(args)
        self.worker = engine is None
        if engine is None:  # a worker rank: rank 0 has closed the service
            return
        self.engine = engine
        models = engine.models
        target = models.target
        self.tokenizer = target.tokenizer
        self.stop_token_ids = tuple(target.stop_token_ids)
        self.model_name = cfg.model_name or target.path.name
        self.max_model_len = min(target.model.cfg.max_position_embeddings, engine.config.cache.kv_capacity)
        self.metrics = ServingMetrics(self.model_name, engine)
        engine.add_finish_listener(self.metrics.observe)
        self.llm = AsyncLLM(engine)
        self.dtype = models.dtype
        tp = engine.tp
        self.device = f"{tp.device} x TP {tp.size}" if tp is not None else models.device

    def close(self) -> None:
        """Stop the engine loop (rank 0 of a TP group: and the worker ranks)."""
        if self.worker:
            return
        self.llm.close()
        self.engine.close()

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
            DFlashError: an empty prompt, a token id outside the vocabulary, ``max_tokens`` < 1,
                a prompt plus ``max_tokens`` past the model's length, or more KV than the whole
                cache.
            QueueFull: ``max_waiting_requests`` requests are already waiting.
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
        self.engine.check_token_ids("stop_token_ids", stop_token_ids or ())
        self.engine.check_token_ids("end_id", () if end_id is None else (end_id,))
        ends = self.stop_token_ids if end_id is None else (end_id,)
        stops = () if ignore_eos else tuple(sorted(set(ends) | set(stop_token_ids or ())))
        req = Request(list(prompt_ids), max_tokens, sampling, stops, max_draft_tokens, min_tokens)
        self.engine.check_request(req)
        limit = self.max_waiting_requests
        if limit is not None and self.engine.num_waiting() >= limit:
            raise QueueFull(f"{limit} requests are already waiting (max_waiting_requests); try again later")
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
                if isinstance(item, RequestResult):
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
                if detok.stopped:  # ends the request in the engine, counted as a stop
                    with contextlib.suppress(StopAsyncIteration):
                        await gen.athrow(StopStream())
                    out = RequestResult(detok.ids, "stop", [], 0.0, 0.0)
                    yield Finished("stop", out, tokens)
                    return
        finally:
            await gen.aclose()
