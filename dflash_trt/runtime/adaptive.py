"""Adaptive draft length: pick each iteration's number of draft tokens (0 = plain decoding) to
maximise expected committed tokens per second.

Model (measured, not assumed):
- ``target_cost(n)``: seconds of one target forward over ``n`` tokens, measured at start-up on
  powers of two and updated with every real iteration (exponential moving average per point,
  linear interpolation between points);
- ``draft_cost(s)``: seconds of one drafter forward for ``s`` sequences, likewise;
- ``q_k``: P(draft slot k accepted | slot k reached), counts that decay with every new
  observation (recent verify steps dominate; without new drafts the estimate stays put).

With ``S`` sequences decoding, ``k`` drafts each give ``E(k) = 1 + sum_{j<=k} prod_{i<=j} q_i``
expected committed tokens per sequence, so the rate is
``S * E(k) / (target_cost(S * (k + 1)) + draft_cost(S) [k > 0])``; the controller takes the
best ``k``. When the batch grows, ``target_cost`` stops being flat in ``n`` and the best ``k``
falls toward 0: DFlash turns into plain decoding instead of losing to it. While plain decoding
wins, every ``probe`` iterations (doubling up to ``max_probe`` while drafting keeps losing) ONE
sequence of the batch drafts the full block to keep ``q_k`` current; the probe adds one drafter
forward and ``max_draft`` target tokens to that iteration, whatever the batch size.
"""

from __future__ import annotations

import bisect


class CostModel:
    """Piecewise-linear seconds as a function of a size, from measured points.

    ``observe(n, s)`` folds a measurement into the nearest point (EMA with weight ``alpha``)
    or adds the point when none is within a factor of 1.5.
    """

    def __init__(self, alpha: float = 0.2):
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.alpha = alpha

    def observe(self, n: float, seconds: float) -> None:
        if n <= 0:
            return
        i = bisect.bisect_left(self.xs, n)
        near = [j for j in (i - 1, i) if 0 <= j < len(self.xs) and max(n, self.xs[j]) / min(n, self.xs[j]) < 1.5]
        if near:
            j = min(near, key=lambda j: abs(self.xs[j] - n))
            predicted = self(n)  # move the point by the relative error of its prediction at n
            self.ys[j] *= 1 + self.alpha * (seconds / predicted - 1) if predicted > 0 else 1
            return
        self.xs.insert(i, float(n))
        self.ys.insert(i, seconds)

    def __call__(self, n: float) -> float:
        if not self.xs:
            return 0.0
        if len(self.xs) == 1:
            return self.ys[0] * max(n / self.xs[0], 1.0) if n > self.xs[0] else self.ys[0]
        i = min(max(bisect.bisect_left(self.xs, n), 1), len(self.xs) - 1)
        x0, x1, y0, y1 = self.xs[i - 1], self.xs[i], self.ys[i - 1], self.ys[i]
        if n <= x0:
            return y0
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)  # extrapolates linearly past the last point


class DraftLengthController:
    """Chooses the number of draft tokens per iteration (see the module docstring).

    Args:
        max_draft: most draft tokens (drafter block size - 1).
        decay: decay of the acceptance counts per observed verify step.
        prior: acceptance assumed before any evidence (pseudo-count 1).
        probe, max_probe: exploration interval bounds, in iterations.
    """

    def __init__(self, max_draft: int, decay: float = 0.98, prior: float = 0.5, probe: int = 8, max_probe: int = 256):
        self.max_draft = max_draft
        self.decay = decay
        self.prior = prior
        self.reached = [0.0] * max_draft
        self.accepted = [0.0] * max_draft
        self.target_cost = CostModel()
        self.draft_cost = CostModel()
        self.min_probe, self.max_probe = probe, max_probe
        self.probe_every = probe
        self.since_draft = 0

    def acceptance(self) -> list[float]:
        """Current ``q_k`` estimates, k = 1..max_draft (the prior weighs one observation)."""
        return [(a + self.prior) / (r + 1.0) for a, r in zip(self.accepted, self.reached)]

    def expected_committed(self, k: int) -> float:
        """E(tokens committed per sequence) with ``k`` drafts (bonus token included)."""
        e, p = 1.0, 1.0
        for q in self.acceptance()[:k]:
            p *= q
            e += p
        return e

    def rate(self, k: int, seqs: int) -> float:
        """Expected committed tokens per second of an iteration with ``k`` drafts."""
        cost = self.target_cost(seqs * (k + 1)) + (self.draft_cost(seqs) if k else 0.0)
        return seqs * self.expected_committed(k) / max(cost, 1e-9)

    def choose(self, seqs: int, token_budget: int | None = None) -> tuple[int, bool]:
        """``(draft tokens per sequence, probe)`` for this iteration; ``seqs`` sequences are
        decoding. ``probe`` true means plain decoding wins but one sequence should draft the
        returned number of tokens to refresh the acceptance estimates."""
        if seqs == 0 or self.max_draft == 0:
            return 0, False
        top = self.max_draft
        if token_budget is not None:
            top = max(0, min(top, token_budget // seqs - 1))
        best = max(range(top + 1), key=lambda k: (self.rate(k, seqs), -k))
        if best > 0:
            self.since_draft = 0
            self.probe_every = self.min_probe
            return best, False
        self.since_draft += 1
        if self.since_draft >= self.probe_every and top > 0:
            self.since_draft = 0
            self.probe_every = min(2 * self.probe_every, self.max_probe)
            return top, True
        return 0, False

    def observe_acceptance(self, num_draft: int, accepted: int) -> None:
        """One verify step of one sequence: ``accepted`` of its ``num_draft`` drafts taken."""
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for k in range(num_draft):
            if k > accepted:
                break
            self.reached[k] += 1
            self.accepted[k] += k < accepted
