"""What :class:`~dflash_trt.llm.LLM` returns per prompt: vLLM's ``RequestOutput`` /
``CompletionOutput`` shape (``vllm/outputs.py``), with the speculative-decoding figures of the
request beside it (:class:`SpecDecodeStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Speculative decoding of one request (vLLM's ``spec_decode`` counters, per request).

    Attributes:
        num_steps: verify steps (target forwards that committed tokens for this request).
        num_drafts: steps that verified at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        accepted_per_position: ``[k]`` = steps that accepted more than ``k`` drafts.
        acceptance_length: tau, mean tokens committed per verify step (bonus token included;
            1.0 for plain decoding).
    """

    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_length: float = 0.0

    @classmethod
    def from_lengths(cls, commits: list[int], drafts: list[int], accepted: list[int]) -> SpecDecodeStats:
        """From the per-step commit, draft and accepted lengths of a request."""
        steps = [(d, a) for d, a in zip(drafts, accepted) if d]
        width = max((d for d, _ in steps), default=0)
        return cls(
            num_steps=len(commits),
            num_drafts=len(steps),
            num_draft_tokens=sum(d for d, _ in steps),
            num_accepted_tokens=sum(a for _, a in steps),
            accepted_per_position=[sum(1 for _, a in steps if a > i) for i in range(width)],
            acceptance_length=sum(commits) / len(commits) if commits else 0.0,
        )


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: its index among the prompt's completions (always 0: one per request).
        text: the generated text (special tokens skipped; cut before a stop string).
        token_ids: the generated token ids (a stop token included).
        finish_reason: ``stop`` (EOS, a stop token or string), ``length`` (``max_tokens``),
            ``abort`` or ``error``.
        stop_reason: the stop string or token id that ended it, None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """The result of one prompt.

    Attributes:
        request_id: its id (the prompt's index in the call, as a string).
        prompt: the prompt's text (None when given as token ids).
        prompt_token_ids: the token ids the target saw (chat template applied by ``LLM.chat``).
        outputs: its completions (one).
        finished: always True (``LLM.generate`` returns finished requests).
        spec_decode: the request's speculative-decoding figures.
        ttft_s, latency_s: seconds from arrival to the first and to the last token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    ttft_s: float = 0.0
    latency_s: float = 0.0
