"""Request, result and counter types shared by the engine, the scheduler and their callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass
class Request:
    """One generation request.

    Attributes:
        prompt_ids: prompt token ids (chat template already applied), non-empty.
        max_new_tokens: most tokens to generate (>= 1).
        sampling: temperature / top-p / top-k / seed.
        stop_token_ids: generation ends after any of these (included in the output); None uses
            the target's EOS ids.
        max_draft_tokens: most draft tokens this request verifies per step (Triton's
            ``num_draft_tokens``; 0 = plain decoding); None: as many as the engine chooses.
        min_new_tokens: the stop tokens cannot be chosen before this many tokens (their logits
            are masked at those positions, as ``min_tokens`` does in vLLM / TensorRT-LLM).
    """

    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] | None = None
    max_draft_tokens: int | None = None
    min_new_tokens: int = 0

    @classmethod
    def from_params(
        cls,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        max_draft_tokens: int | None = None,
    ) -> Request:
        """The request for ``prompt_ids`` under vLLM-named ``params``: ``max_tokens`` new tokens
        at most, stopping at ``params.stop_token_ids`` and, unless ``ignore_eos``, at
        ``eos_token_ids`` (the target's); ``params.stop`` strings are the caller's to apply."""
        stops = tuple(dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else tuple(eos_token_ids))))
        return cls(list(prompt_ids), params.max_tokens, params, stops, max_draft_tokens, params.min_tokens)


@dataclass
class RequestResult:
    """What a request produced in the engine (the front door turns it into the vLLM-shaped
    :class:`~dflash_trt.outputs.RequestOutput`).

    Attributes:
        output_ids: generated token ids (stop token included when one ended it).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` (cancelled) or ``"error"`` (an
            iteration failed on this request, found apart from the others by the engine's
            failed-iteration handling, ``runtime/engine.py``; under tensor parallelism every
            request in flight, :meth:`~dflash_trt.runtime.engine.LLMEngine.fail_all`).
        commit_lengths: tokens committed by each verify step (bonus token included).
        ttft_s: seconds from the request's arrival (``add_request``) to its first token.
        latency_s: seconds from its arrival to its last token.
        draft_lengths: draft tokens verified at each of its verify steps (0 = plain step).
        accepted_lengths: draft tokens accepted at each of those steps.
    """

    output_ids: list[int]
    finish_reason: str
    commit_lengths: list[int]
    ttft_s: float
    latency_s: float
    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)

    @property
    def spec_counts(self) -> tuple[int, int, int, list[int]]:
        """``(drafting steps, draft tokens, accepted draft tokens, accepted per position)`` of
        this request (vLLM's ``spec_decode_*`` counters; position ``i`` counts the steps that
        accepted more than ``i`` drafts)."""
        steps = [(d, a) for d, a in zip(self.draft_lengths, self.accepted_lengths) if d]
        width = max((d for d, _ in steps), default=0)
        per_pos = [sum(1 for _, a in steps if a > i) for i in range(width)]
        return len(steps), sum(d for d, _ in steps), sum(a for _, a in steps), per_pos


@dataclass
class LoopStats:
    """Counters over the verify steps of a run (an engine's lifetime or one ``generate`` call).

    ``tau`` is the mean number of tokens committed per verify step (bonus included);
    ``acceptance_per_position[k-1]`` is P(draft slot k accepted | slot k reached).
    ``lookup_steps`` counts the verify steps whose drafts began with prompt-lookup tokens
    (``ngram.py``). ``iterations`` counts the engine's iterations, ``replayed_iterations`` those
    whose target forward replayed a CUDA graph and ``capture_iterations`` those that captured
    one (``runtime/cuda_graphs.py``). Times are wall seconds.
    """

    block_size: int
    verify_steps: int = 0
    drafting_steps: int = 0
    committed: int = 0
    draft_tokens: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    draft_calls: int = 0
    verify_s: float = 0.0
    verify_calls: int = 0
    prefill_s: float = 0.0
    lookup_steps: int = 0
    iterations: int = 0
    replayed_iterations: int = 0
    capture_iterations: int = 0

    def __post_init__(self) -> None:
        self.reached = [0] * max(self.block_size - 1, 0)
        self.accepted = [0] * max(self.block_size - 1, 0)

    @property
    def tau(self) -> float:
        return self.committed / self.verify_steps if self.verify_steps else 0.0

    def record_verify(self, num_draft: int, accepted: int, committed: int) -> None:
        """One verify step of one sequence: ``accepted`` of ``num_draft`` drafts taken,
        ``committed`` tokens kept (bonus included, after stop / length cuts)."""
        self.verify_steps += 1
        self.drafting_steps += num_draft > 0
        self.committed += committed
        self.draft_tokens += num_draft
        for k in range(min(accepted + 1, num_draft)):
            self.reached[k] += 1
            self.accepted[k] += k < accepted

    @property
    def mean_draft_tokens(self) -> float:
        """Draft tokens verified per verify step (0 for plain decoding)."""
        return self.draft_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def merge(self, other: LoopStats) -> None:
        for name in (
            "verify_steps",
            "drafting_steps",
            "committed",
            "draft_tokens",
            "draft_s",
            "draft_calls",
            "verify_s",
            "verify_calls",
            "prefill_s",
            "lookup_steps",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted)]
