"""A request's live state in the engine (:class:`Sequence`: its tokens, KV progress, per-step
figures and callbacks), and how a caller's callback is invoked from the engine thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .block_manager import BlockManager
from .request import Request

TokenCallback = Callable[[int, list[int]], None]
log = logging.getLogger("dflash_trt.runtime")


def callback(fn: Callable, *args) -> None:
    """Call a caller's callback; an exception in it is logged, never raised into the engine
    (a broken client must not stop the other requests)."""
    try:
        fn(*args)
    except Exception:
        log.exception("a request callback failed")


@dataclass
class Sequence:
    """A request's live state.

    Attributes:
        seq_id: engine-wide id.
        request: the request.
        tokens: prompt then committed output tokens.
        num_cached: positions whose target K/V is in the cache (decode: ``len(tokens) - 1``).
        output: committed output tokens.
        finish_reason: None while running; ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
    """

    seq_id: int
    request: Request
    stops: frozenset[int]
    generator: torch.Generator | None
    on_tokens: TokenCallback | None = None
    on_finish: Callable[[int, object], None] | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    num_cached: int = 0
    output: list[int] = field(default_factory=list)
    commit_lengths: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_s: float | None = None
    finish_s: float | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def prefill_len(self) -> int:
        """Positions to prefill before the sequence decodes: its prompt, or, when it has
        committed tokens (recomputed after a preemption), every token but the last (the next
        verify block's anchor)."""
        return len(self.tokens) - 1 if self.output else self.prompt_len

    @property
    def prefilled(self) -> bool:
        return self.num_cached >= self.prefill_len

    def preempt(self, blocks: BlockManager) -> None:
        """Preemption by recompute: free the sequence's KV blocks (keeping its reservation)
        and prefill it again from position 0."""
        self.num_cached = 0
        blocks.truncate(self.seq_id, 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, toks: list[int]) -> list[int]:
        """Append tokens, cut at a stop token or the length limit; returns what was kept and
        sets ``finish_reason`` when the sequence ends."""
        room = self.request.max_new_tokens - len(self.output)
        toks = toks[:room]
        for i, t in enumerate(toks):
            if t in self.stops:
                toks = toks[: i + 1]
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and len(self.output) + len(toks) >= self.request.max_new_tokens:
            self.finish_reason = "length"
        now = time.perf_counter()
        if toks and self.first_token_s is None:
            self.first_token_s = now
        self.output.extend(toks)
        self.tokens.extend(toks)
        if self.finish_reason is not None:
            self.finish_s = now
        if self.on_tokens is not None and toks:
            callback(self.on_tokens, self.seq_id, toks)
        return toks
