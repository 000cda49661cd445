"""In-flight (continuous) batching: which sequences run in the next iteration.

Requests join (``add``) and leave (finish, ``abort``) between iterations. Each iteration
(decode first, then prompt chunks, as vLLM v1's scheduler and Sarathi-Serve's stall-free batching):
1. every running sequence whose prompt is in the KV cache decodes (one verify block each);
2. the remaining token budget (``max_num_tokens``), at most ``max_prefill_tokens``, goes to
   prompt chunks: first sequences already part-way through their prompt, then waiting requests
   in arrival order (FIFO: the head of the queue is never overtaken), each admitted only when
   the block manager can reserve its worst case (prompt + max new tokens + one draft block) and
   fewer than ``max_batch_size`` sequences run. Admitted sequences are never evicted for memory.

A running sequence can be preempted by recompute (vLLM's ``PreemptionMode.RECOMPUTE``, used
here after a failed iteration, ``engine.py``): its KV blocks are freed (its reservation kept)
and ``num_cached`` goes back to 0, so its prompt and the tokens it has committed are prefilled
again before it decodes on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from ..errors import DFlashError
from .block_manager import BlockManager
from .request import Request
from .sequence import Sequence


@dataclass
class Schedule:
    """One iteration's work: decoding sequences and ``(sequence, chunk length)`` prefills."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]


class Scheduler:
    """FIFO admission by KV capacity, chunked prefill within a token budget.

    Args:
        blocks: the block manager (capacity).
        max_batch_size: most running sequences.
        max_num_tokens: most target tokens per iteration (verify blocks + prompt chunks).
        reserve_extra: positions reserved past ``prompt + max_new_tokens`` (the drafter writes
            a whole block past the last committed token).
        max_prefill_tokens: most prompt tokens per iteration (None: ``max_num_tokens``); bounds
            how long an iteration that prefills holds back the decoding sequences.
        drafter_window: None: no drafter; 0: a drafter that sees the whole context; W: a drafter
            with a sliding window of W (which prompt blocks need its K/V in the prefix cache).

    Raises:
        DFlashError: ``max_prefill_tokens`` < 1.
    """

    def __init__(
        self,
        blocks: BlockManager,
        max_batch_size: int,
        max_num_tokens: int,
        reserve_extra: int,
        max_prefill_tokens: int | None = None,
        drafter_window: int | None = None,
    ):
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise DFlashError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.max_prefill_tokens = max_num_tokens if max_prefill_tokens is None else max_prefill_tokens
        self.reserve_extra = reserve_extra
        self.drafter_window = drafter_window
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def need(self, req: Request) -> int:
        """Positions reserved for ``req``."""
        return len(req.prompt_ids) + req.max_new_tokens + self.reserve_extra

    def check(self, req: Request) -> None:
        """Raises DFlashError when ``req`` could never be admitted."""
        if not req.prompt_ids:
            raise DFlashError("empty prompt")
        if req.max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        n = self.blocks.blocks_for(self.need(req))
        if n > self.blocks.num_blocks:
            raise DFlashError(
                f"request needs {self.need(req)} KV positions ({n} blocks of {self.blocks.tokens_per_block}); "
                f"the cache holds {self.blocks.num_blocks} blocks"
            )

    def _drafter_from(self, s: Sequence) -> int | None:
        """The first position whose drafter K/V ``s``'s drafts can see (None: no drafter): with a
        sliding window W, a block anchored at ``q`` sees positions after ``q - W``
        (:func:`~dflash_trt.models.drafter.sliding_visible`), and the first anchor is ``prompt_len``."""
        w = self.drafter_window
        return None if w is None else (0 if w == 0 else max(0, s.prompt_len - w + 1))

    def add(self, seq: Sequence) -> None:
        self.check(seq.request)
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.seq_id)

    def runs(self, only: AbstractSet[int] | None = None, held: AbstractSet[int] = frozenset()) -> list[Sequence]:
        """The running sequences that take part in the next iteration: those in ``only`` when
        given, else all but those ``held``."""
        if only is not None:
            return [s for s in self.running if s.seq_id in only]
        return [s for s in self.running if s.seq_id not in held]

    def decoding(self, only: AbstractSet[int] | None = None, held: AbstractSet[int] = frozenset()) -> list[Sequence]:
        """The sequences that decode in the next iteration (``only`` / ``held``: :meth:`runs`)."""
        return [s for s in self.runs(only, held) if s.prefilled]

    def schedule(
        self, decode_tokens: int, only: AbstractSet[int] | None = None, held: AbstractSet[int] = frozenset()
    ) -> Schedule:
        """Plan the iteration given ``decode_tokens`` target tokens per decoding sequence.

        Args:
            decode_tokens: target tokens of each decoding sequence's verify block.
            only: run just these running sequences, and admit nobody (a failed iteration's
                sequences, run apart from the others); None: every running sequence not
                ``held``, and admit waiting requests.
            held: running sequences that sit this iteration out.

        Returns:
            the :class:`Schedule`: every decoding sequence that runs, then prompt chunks of at
            most ``max_num_tokens`` minus the verify tokens, and at most ``max_prefill_tokens``,
            in all.
        """
        runs = self.runs(only, held)
        decode = [s for s in runs if s.prefilled]
        budget = min(self.max_num_tokens - decode_tokens * len(decode), self.max_prefill_tokens)
        prefill: list[tuple[Sequence, int]] = []
        for s in runs:
            if not s.prefilled and budget > 0:
                n = min(s.prefill_len - s.num_cached, budget)
                prefill.append((s, n))
                budget -= n
        while only is None and self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            s = self.waiting[0]
            if not self.blocks.can_reserve(self.need(s.request)):
                break  # FIFO: nothing overtakes the head of the queue
            self.waiting.popleft()
            self.blocks.reserve(s.seq_id, self.need(s.request))
            self.running.append(s)
            s.num_cached = self.blocks.share_prefix(s.seq_id, s.tokens, s.prompt_len - 1, self._drafter_from(s))
            n = min(s.prompt_len - s.num_cached, budget)
            prefill.append((s, n))
            budget -= n
        return Schedule(decode, prefill)
