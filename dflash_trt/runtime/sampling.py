"""Sampling parameters and the target-side token choice used in verification.

DFlash drafts greedily; with temperature > 0 the target samples each block position from its
own (temperature / top-k / top-p processed) distribution and a draft token is accepted while
it equals the target's sample. For a one-hot draft distribution this is exactly rejection
sampling (Leviathan et al. 2023, §2.3), so the output distribution equals the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DFlashError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with vLLM's names (``vllm.SamplingParams``).

    Attributes:
        temperature: 0 for greedy (argmax, the default here; vLLM's default is 1.0); > 0
            divides the logits.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 disables (vLLM: 0 or -1).
        seed: seed of this request's own generator (None: nondeterministic).
        max_tokens: most tokens to generate (vLLM's default, 16).
        min_tokens: the stop tokens (EOS, ``stop_token_ids``) cannot end the output before this
            many tokens.
        stop: strings that end the output (the text is cut before the first one); the front
            ends (``LLM``, the servers) apply them, the engine sees token ids only.
        stop_token_ids: token ids that end the output besides EOS (included in it).
        ignore_eos: do not stop at the target's EOS ids (``stop_token_ids`` still stop).

    Raises:
        DFlashError: negative temperature, top_p outside (0, 1], negative top_k, max_tokens < 1,
            min_tokens outside 0..max_tokens, a stop that is not a string.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):
            raise DFlashError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:  # vLLM's "off"
            object.__setattr__(self, "top_k", 0)
        if self.top_k < 0:
            raise DFlashError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # torch.Generator's range
            raise DFlashError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.max_tokens < 1:
            raise DFlashError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise DFlashError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(x, str) for x in stop):
            raise DFlashError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target samples from: fp32 ``[..., vocab]`` probabilities after
    temperature, then top-k, then top-p (the order HF and vLLM use). The definition that
    :func:`sample_rows` (the sampler the runtime uses) is tested against, written apart from it
    on purpose."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    truncate: bool,
) -> torch.Tensor:
    """One sample per row of ``logits``, each row with its own temperature / top-k / top-p
    (:func:`target_probs`'s distribution), by inverse transform in vocabulary order: the first
    token whose cumulative probability exceeds ``uniforms[r]`` times the row's kept mass.
    Everything stays on the logits' device (no host synchronisation), so a whole batch of
    sampled verify rows is one pass; the uniforms come from each request's CPU generator (drawn
    when the step is planned), and a row's token depends only on its own logits, settings and
    uniform, not on which other rows share the batch.

    Args:
        logits: ``[R, vocab]`` (any float dtype; processed in fp32, cumulated in fp64).
        temperature: fp32 ``[R]``, > 0.
        top_k: int64 ``[R]``; 0 (or >= vocab) keeps every token.
        top_p: fp32 ``[R]`` in (0, 1]; 1 keeps every token.
        uniforms: fp32 ``[R]`` in [0, 1).
        truncate: some row has top-k or top-p below 1 (a host-side flag: the rows are then
            sorted once to find what top-k / top-p drop; without it no sort is needed).

    Returns:
        int64 ``[R]`` token ids.
    """
    probs = torch.softmax(logits.float() / temperature.unsqueeze(-1), dim=-1)
    vocab = probs.shape[-1]
    if truncate:  # what top-k, then top-p over the renormalised rest, drop; found in sorted order
        sp, order = probs.sort(dim=-1, descending=True)
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        kept = sp >= sp.gather(-1, (k - 1).unsqueeze(-1))  # ties at the k-th all stay, as in target_probs
        sp = sp * kept
        keep_p = torch.where(top_p < 1, top_p, float("inf")).unsqueeze(-1)
        drop = ~kept | ((sp.cumsum(-1) - sp) >= keep_p * sp.sum(-1, keepdim=True))
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
    cdf = probs.double().cumsum(-1)
    at = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    # right=True: a token of zero probability (dropped) is never the first to exceed ``at``
    return torch.searchsorted(cdf, at, right=True).clamp_(max=vocab - 1).squeeze(-1)
