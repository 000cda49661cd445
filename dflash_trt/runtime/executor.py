"""Static-batch front end of the engine and helpers for comparing decoding runs.

:class:`DFlashEngine` runs a list of requests to completion through :class:`LLMEngine`
(in-flight batching over a paged KV cache, see ``engine.py``) with a fixed block size: every
iteration drafts ``block_size - 1`` tokens per sequence and verifies them in one target
forward (paper arXiv:2602.06036 §3, Alg. 1). ``block_size`` 1 is plain autoregressive
decoding through the same code.
"""

from __future__ import annotations

import time

from ..models.drafter import DFlashDrafter
from ..models.prefill import first_divergence, top2_margin
from ..models.target import TargetModel
from .engine import EngineConfig, LLMEngine, check_block_size
from .model_runner import ModelRunner
from .request import LoopStats, Request, RequestOutput
from .sampling import SamplingParams
from .scheduler import TokenCallback

__all__ = ["DFlashEngine", "LoopStats", "Request", "RequestOutput", "first_divergence", "top2_margin"]


class DFlashEngine:
    """Runs DFlash speculative decoding (or plain decoding) on a target and its drafter.

    Args:
        target: the target model (eval mode, its compute dtype).
        drafter: the DFlash drafter, or None for plain decoding only.
        stop_token_ids: default stop ids (the target's EOS ids).
        runner_cls: the :class:`ModelRunner` class (a test may substitute its own proposer).
        compile: run the target's and drafter's forwards compiled by torch.compile
            (``runtime/compiled.py``).
        prompt_lookup: ``(min_n, max_n)``: merge prompt-lookup tokens into the drafter's blocks
            (:class:`~dflash_trt.runtime.engine.EngineConfig`); None: the drafter's alone.
        cuda_graphs: replay decode steps from CUDA graphs (``runtime/cuda_graphs.py``). The
            runner of each block size is then kept between :meth:`generate` calls (its graphs
            are bound to its KV pools), and rebuilt only when a call needs larger pools or batch.
        batch_invariant: the batch-invariant mode (``models/batch_invariant.py``); None = on for
            bf16 CPU targets.

    Raises:
        DFlashError: from :meth:`generate` on impossible settings (block size above the
            drafter's, block size > 1 without a drafter, empty prompt, max_new_tokens < 1).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None,
        stop_token_ids: tuple[int, ...],
        runner_cls: type[ModelRunner] = ModelRunner,
        compile: bool = False,
        prompt_lookup: tuple[int, int] | None = None,
        cuda_graphs: bool = False,
        batch_invariant: bool | None = None,
    ):
        self.compile = compile
        self.batch_invariant = batch_invariant
        self.cuda_graphs = cuda_graphs
        self._runners: dict[int, ModelRunner] = {}  # block size -> runner kept for its graphs
        self.prompt_lookup = prompt_lookup
        self.target = target
        self.drafter = drafter
        self.stop_token_ids = tuple(stop_token_ids)
        self.runner_cls = runner_cls

    def check_block_size(self, block_size: int) -> None:
        check_block_size(self.drafter, block_size)

    def warm_up(self, prompt_ids: list[int], block_size: int, sampling: SamplingParams) -> float:
        """Untimed runs before a measured one: 8 tokens of ``prompt_ids`` at block size
        ``block_size`` and at 1 (plain decoding); on the compiled path the same again on
        ``prompt_ids[:-1]``, so that inductor compiles its dynamic-shape graphs (a second prompt
        length, a second context length for the drafter) here rather than in the first timed run.

        Returns:
            seconds spent (on the compiled path, mostly compiling: report it apart from tok/s).
        """
        t = time.perf_counter()
        for ids in [prompt_ids, prompt_ids[:-1]] if self.compile and len(prompt_ids) > 1 else [prompt_ids]:
            for K in dict.fromkeys([block_size, 1]):
                self.generate([Request(ids, 8, sampling)], K)
        return time.perf_counter() - t

    def generate(
        self,
        requests: list[Request],
        block_size: int | None = None,
        on_tokens: TokenCallback | None = None,
        stats: LoopStats | None = None,
        tokens_per_block: int = 16,
    ) -> list[RequestOutput]:
        """Generate for all ``requests`` as one batch: all prompts are prefilled in the first
        iteration, then every sequence decodes until it finishes (and leaves the batch).

        Args:
            block_size: K, tokens verified per step (1 = plain decoding); defaults to the
                drafter's block size (1 without a drafter).
            on_tokens: called as ``on_tokens(request_index, new_token_ids)`` whenever tokens
                are committed (streaming).
            stats: counters to add this call's figures to.
            tokens_per_block: KV-cache block size.

        Returns:
            one :class:`RequestOutput` per request, in order.
        """
        K = block_size if block_size is not None else (self.drafter.cfg.block_size if self.drafter else 1)
        self.check_block_size(K)
        stats = stats if stats is not None else LoopStats(K)
        if len(stats.reached) != max(K - 1, 0):
            raise ValueError("stats were made for another block size")
        n = max(len(requests), 1)
        need = sum(-(-(len(r.prompt_ids) + r.max_new_tokens + K) // tokens_per_block) for r in requests)
        cfg = EngineConfig(
            block_size=K,
            max_batch_size=n,
            tokens_per_block=tokens_per_block,
            max_num_tokens=max(sum(len(r.prompt_ids) for r in requests), K * n, 1),
            kv_capacity_tokens=max(need, 1) * tokens_per_block,
            compile=self.compile,
            cuda_graphs=self.cuda_graphs,
            prompt_lookup=self.prompt_lookup,
            batch_invariant=self.batch_invariant,
        )
        runner = self._runner(K, max(need, 1), tokens_per_block, n)
        engine = LLMEngine(self.target, self.drafter, self.stop_token_ids, cfg, runner=runner)
        for i, r in enumerate(requests):
            engine.add_request(r, on_tokens, seq_id=i)
        engine.run()
        stats.merge(engine.stats)
        return [engine.result(i) for i in range(len(requests))]

    def _runner(self, K: int, num_blocks: int, tokens_per_block: int, batch: int) -> ModelRunner:
        """A runner for block size ``K`` with at least ``num_blocks`` pool blocks: a new one, or
        with CUDA graphs the one kept from an earlier call when its pools and batch bucket suffice
        (its target features of earlier sequences dropped: sequence ids restart at 0). A kept
        runner's pools are sized to the next power of two, so that a run of prompts of growing
        length rebuilds it (and captures its graphs anew) only a few times."""
        kept = self._runners.get(K)
        if kept is not None and (
            kept.tpb != tokens_per_block
            or kept.spare_slot < num_blocks * tokens_per_block
            or kept.graphs.max_batch < batch
        ):
            kept = None
        if kept is None:
            kept = self.runner_cls(
                self.target,
                self.drafter if K > 1 else None,
                1 << (num_blocks - 1).bit_length() if self.cuda_graphs else num_blocks,
                tokens_per_block,
                compile=self.compile,
                cuda_graphs=self.cuda_graphs,
                max_batch=batch,
                batch_invariant=self.batch_invariant,
            )
            if self.cuda_graphs:
                self._runners[K] = kept
        kept.release_all()
        return kept
