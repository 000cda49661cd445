"""One served model: the in-flight-batching engine stepped on a background thread, its
tokenizer, request validation, streaming text with stop strings, and the metrics. Both the
OpenAI-compatible server and the Triton python-backend model drive it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

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
        dtype, device: compute dtype (None: the engine's, else bf16: ``checkpoints/loader.auto_dtype``)
            and device (None: cuda when visible).
        block_size: most tokens per verify block (None: the drafter's; 1: plain decoding).
        adaptive: choose the draft length per iteration (never slower than plain decoding).
        max_batch_size, max_num_tokens, tokens_per_block: engine settings.
        kv_capacity: KV positions (None: the engine's memory plan, capped, or 65536).
        model_name: the name clients ask for (None: the target directory's name).
        fp8_gemm: with an FP8 engine, run its linears as FP8 GEMMs.
        weights: ``int4`` / ``int8``: packed weight-only CPU linears for a checkpoint pair (the
            default Q4_1 GGUF's own blocks for int4; activations bf16 unless ``dtype`` says
            otherwise); an int4/int8 engine needs none.
        tp_size: tensor-parallel ranks the service starts itself (no MPI: the other ranks are
            child processes, :func:`~dflash_trt.runtime.distributed.spawn_tp`); under
            ``mpiexec -n N`` the job's N ranks are used instead.
        prompt_lookup: ``(min_n, max_n)``: prompt-lookup tokens merged into the drafter's
            blocks (``runtime/ngram.py``); None: the drafter's alone.
        cuda_graphs: replay decode and verify steps from CUDA graphs per batch-size bucket
            (``runtime/cuda_graphs.py``; a CUDA device, no tensor parallelism).
        batch_invariant: the target's rows computed independently of each other
            (``models/batch_invariant.py``): a request's tokens do not depend on what else is
            in the batch; None: on for bf16 CPU targets.
        max_waiting_requests: most requests waiting for admission; one more is refused
            (:class:`QueueFull`: HTTP 503 with ``Retry-After``, a Triton error response).
            None: no bound.
        max_prefill_tokens: most prompt tokens per engine iteration (the decoding streams wait
            for an iteration that prefills); None: :func:`default_max_prefill_tokens` (a CPU:
            :data:`CPU_MAX_PREFILL_TOKENS`; a GPU: up to ``max_num_tokens``).
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
    tp_size: int = 1
    weights: str | None = None
    prompt_lookup: tuple[int, int] | None = None
    cuda_graphs: bool = False
    batch_invariant: bool | None = None
    max_waiting_requests: int | None = 256
    max_prefill_tokens: int | None = None


#: a CPU server's prompt tokens per iteration: on 2 cores (bf16) 256 prompt tokens take about
#: 0.75 s, so a stream waits under a second for its next token while prompts are prefilled
#: (2048, all of ``max_num_tokens``, held every stream for 6-8 s; docs/serving.md). As
#: Sarathi-Serve's token budget / SGLang's ``--chunked-prefill-size``; vLLM's CPU server keeps a
#: 2048-token budget on faster CPU kernels.
CPU_MAX_PREFILL_TOKENS = 256


def default_max_prefill_tokens(device: torch.device | str) -> int | None:
    """The serving default of ``max_prefill_tokens`` on ``device``: :data:`CPU_MAX_PREFILL_TOKENS`
    on a CPU; None (prompt chunks up to ``max_num_tokens``, as before) on a GPU, where a
    prefill iteration is short."""
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
    output: RequestOutput
    completion_tokens: int


class EngineService:
    """Loads the models, builds the engine and steps it on a background thread.

    Tensor parallelism: under ``mpiexec -n N``, or with ``cfg.tp_size = N`` (the service then
    starts ranks 1..N-1 itself: ``python -m dflash_trt.serving.tp_worker``), the target is split
    over N ranks (with a tp_size N engine each rank reads only its own rank file). Rank 0
    serves; the other ranks mirror every iteration inside the constructor and leave it (with
    :attr:`worker` True) once rank 0's :meth:`close` stops them.

    Args:
        cfg: what to serve.
        tp: this rank's group when it is a spawned worker (:func:`~dflash_trt.runtime.distributed.join_tp`).

    Raises:
        DFlashError: bad checkpoints, engine or settings (from the loaders and the engine); a
            ``tp_size`` that differs from the mpiexec job's size.
    """

    def __init__(self, cfg: ServeConfig, tp=None):
        from ..runtime.distributed import init_tp, spawn_tp

        if cfg.tp_size < 1:
            raise DFlashError(f"tp_size must be >= 1, got {cfg.tp_size}")
        if cfg.max_waiting_requests is not None and cfg.max_waiting_requests < 0:
            raise DFlashError(f"max_waiting_requests must be >= 0, got {cfg.max_waiting_requests}")
        if cfg.max_prefill_tokens is not None and cfg.max_prefill_tokens < 1:
            raise DFlashError(f"max_prefill_tokens must be >= 1, got {cfg.max_prefill_tokens}")
        self.max_waiting_requests = cfg.max_waiting_requests
        self.tp = tp if tp is not None else init_tp()
        if self.tp is not None and cfg.tp_size not in (1, self.tp.size):
            raise DFlashError(f"tp_size {cfg.tp_size} but this mpiexec job has {self.tp.size} ranks")
        if self.tp is None and cfg.tp_size > 1:
            threads = max(1, torch.get_num_threads() // cfg.tp_size)  # the cores, shared by the ranks
            torch.set_num_threads(threads)
            cfg_json = json.dumps(dataclasses.asdict(cfg))
            args = ["-m", "dflash_trt.serving.tp_worker", cfg_json, "--threads", str(threads)]
            self.tp = spawn_tp(cfg.tp_size, args)
        try:
            self._start(cfg)
        except BaseException:
            if self.tp is not None and self.tp.rank == 0:
                self.tp.abort()
            raise

    def _start(self, cfg: ServeConfig) -> None:
        from ..checkpoints.engine import kv_capacity, load_models
        from ..checkpoints.loader import auto_dtype, parse_device, parse_dtype
        from ..runtime.cuda_graphs import check_cuda_graphs
        from ..runtime.distributed import tp_engine

        dtype = cfg.dtype or auto_dtype(cfg.engine, cfg.weights, cfg.target)
        device = parse_device(cfg.device)
        check_cuda_graphs(cfg.cuda_graphs, device, self.tp.size if self.tp else 1)
        need_drafter = cfg.block_size is None or cfg.block_size > 1
        target, drafter = load_models(
            cfg.target,
            cfg.drafter,
            cfg.engine,
            parse_dtype(dtype),
            need_drafter=need_drafter,
            fp8_gemm=cfg.fp8_gemm,
            weights=cfg.weights,
            rank=self.tp.rank if self.tp else 0,
            world_size=self.tp.size if self.tp else 1,
            device=device if self.tp is None else "cpu",
        )
        cap, _ = kv_capacity(cfg.engine, cfg.kv_capacity)
        ecfg = EngineConfig(
            block_size=cfg.block_size,
            adaptive=cfg.adaptive,
            max_batch_size=cfg.max_batch_size,
            max_num_tokens=cfg.max_num_tokens,
            tokens_per_block=cfg.tokens_per_block,
            kv_capacity_tokens=cap,
            prompt_lookup=tuple(cfg.prompt_lookup) if cfg.prompt_lookup else None,  # a list after JSON
            cuda_graphs=cfg.cuda_graphs,
            batch_invariant=cfg.batch_invariant,
            max_prefill_tokens=cfg.max_prefill_tokens or default_max_prefill_tokens(device),
        )
        self.worker = False
        if self.tp is None:
            self.engine = LLMEngine(target.model, drafter, target.stop_token_ids, ecfg)
        else:
            engine = tp_engine(target.model, drafter, tuple(target.stop_token_ids), ecfg, self.tp)
            if engine is None:  # a worker rank: rank 0 has closed the service
                self.tp.shutdown()
                self.worker = True
                return
            self.engine = engine
            device = f"{self.tp.device} x TP {self.tp.size}"
        self.tokenizer = target.tokenizer
        self.stop_token_ids = tuple(target.stop_token_ids)
        self.model_name = cfg.model_name or target.path.name
        self.max_model_len = min(target.model.cfg.max_position_embeddings, cap)
        self.metrics = ServingMetrics(self.model_name, self.engine)
        self.engine.add_finish_listener(self.metrics.observe)
        self.llm = AsyncLLM(self.engine)
        self.dtype, self.device = dtype, device

    def close(self) -> None:
        """Stop the engine loop (rank 0 of a TP group: and the worker ranks)."""
        if self.worker:
            return
        self.llm.close()
        if self.tp is not None:
            self.tp.shutdown()

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
