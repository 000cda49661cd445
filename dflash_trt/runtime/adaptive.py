"""Adaptive draft length: pick each iteration's number of draft tokens (0 = plain decoding) to
maximise expected committed tokens per second, and stay right while the machine is noisy.

Model (measured, not assumed):
- ``target_cost(n)``: seconds of one target forward over ``n`` tokens; ``draft_cost(n)``:
  seconds of one drafter forward over ``n`` tokens (``S`` sequences drafting ``k`` tokens each
  run ``S * (k + 2)`` (the drafts and one shadow draft, at most a block), or ``S * (max_draft + 1)``
  where the drafter runs whole blocks, under CUDA graphs: :meth:`DraftLengthController.draft_tokens`)
  (:class:`CostModel`: per size the median of
  its recent measurements, fitted non-decreasing in the size with weights that fade for sizes
  not measured lately, so one slow period cannot lock in a wrong choice), in the machine's
  long-run time times its current speed (:class:`MachineSpeed`: every target forward's time
  against its size's long-run value; a shared host slows every size alike, and a size measured
  only in a slow period must not be compared as it was with one measured in a fast period);
  ``draft_cost`` holds the forwards of a drafter that ran for as many sequences the iteration
  before; a cold one (after plain iterations: it first writes the context that piled up, its
  weights come from memory) is a probe's price (``cold_cost``) and stands for drafting's only
  at a batch size where no warm one was ever measured (:meth:`DraftLengthController.drafter_cost`);
- ``host_cost[mode](S)``: seconds of an iteration of ``S`` decoding sequences outside those
  forwards (planning, acceptance, commit, feature bookkeeping), per mode (drafting / plain):
  the whole iteration's wall time minus its forwards. A drafting iteration does more host work
  than a plain one; left out, the model over-rates drafting exactly where it barely pays;
- ``q_k``: P(draft slot k accepted | slot k reached), counts that decay with every iteration
  that drafts, each shrunk toward ``q_{k-1}`` (a slot seldom reached is estimated like the one before it);
  the engine's shadow draft (one position past the drafts, checked against the bonus token) counts
  slot ``k + 1`` whenever all ``k`` drafts are accepted, so drafting ``k`` keeps ``q_{k+1}`` measured.

With ``S`` sequences decoding, ``k`` drafts each give ``E(k) = 1 + sum_{j<=k} prod_{i<=j} q_i``
committed tokens per sequence, so the predicted rate is
``S * E(k) / (target_cost(S * (k + 1)) + [k > 0] draft_cost(draft_tokens(S, k)) + host_cost[k > 0](S))``;
the best ``k`` is taken, unless it drafts and beats ``k = 0`` by less than ``min_gain`` (3 %; 5 %
with two or more sequences, ``min_gain_batch``). The model looks at most one draft token past
the longest draft whose verify size (``S * (k + 1)`` tokens) it measured within the cost model's
horizon: beyond that the target's cost is an extrapolation, or a stale point aged down toward the
smaller sizes' costs. A drafting choice that rests on a drafter cost not measured lately at this
batch size, or with two or more sequences on a first-position acceptance seen on fewer than half
as many sequences (decayed counts), runs as ONE draft token per sequence first.

Exploration keeps both options measured, at a bounded cost:
- while plain decoding wins, every ``probe`` iterations (doubling up to ``max_probe`` while
  drafting keeps losing, once the probes so far rule out an acceptance at which drafting would win:
  ``evidence_z``; ``far_probe`` at least where drafting is ``far_behind`` even at that plausible
  acceptance; never more often than keeps their predicted loss within ``probe_budget`` of plain
  decoding's time) a drafting iteration runs, alternately ONE sequence drafting (the acceptance of
  the draft positions stays current; the engine takes the decoding sequences in turn) and EVERY
  sequence drafting one token (the drafter's and the verify's costs at this batch size stay
  current; two iterations in a row, the second's drafter warm, unless the first's verify rules
  drafting out even at the one-sequence drafter cost; only at a batch size that has lasted
  ``steady`` iterations). A one-sequence probe drafts only as far as drafts are likely to be
  accepted (``1 + 2 * (E(max) - 1)`` rounded up: a position past the first rejection teaches
  nothing, and a probe whose drafts are all accepted makes the next one longer). The
  every-sequence probe is replaced by a one-sequence one when drafting would lose by more than
  ``guard_margin`` even at the one-sequence drafter cost and plain decoding's host cost (no
  measurement at this batch size could flip the choice), and by a one-sequence probe too while
  the drafter's cost at this batch size is less than two horizons old (four while drafting is
  further than half the guard margin behind at a plausible acceptance: an every-sequence probe
  costs up to ~2x a plain iteration);
- while drafting wins, every ``explore`` iterations (doubling up to ``max_explore`` while the
  choice holds) one iteration decodes plainly (the plain cost stays current). At batch 1 with
  acceptance length ``tau`` this costs about ``(1 - 1/tau) / explore`` of the throughput.

Guard on what was achieved: the committed tokens per second of recent drafting and plain
iterations (no prompt chunks in them, no probes; whole wall time) are tracked per batch size as
sums of tokens over sums of seconds, used only with enough recent evidence (at least 4
iterations and 16 sequence-iterations of each option within the last 64 iterations: an
iteration commits 1 or ``k + 1`` tokens per sequence, so a few unlucky drafting iterations at
batch 1 must not lock drafting out); when the predicted choice achieved ``guard_margin`` less
than the other option did, recently, at the same batch size, the other option is taken instead
(the model may be wrong; the clock is not). Once the evidence against an option is 64
iterations old it lapses and the model's choice is measured again. The one-iteration explores
alone rarely give the guard plain decoding's evidence (4 iterations within 64 while they come
every 16 at most), so when drafting, chosen by the model with two or more sequences, has
achieved ``2 * guard_margin`` less than the model predicts for it for 16 choices running (the
prediction not coming down meanwhile: a model still learning corrects itself) and plain decoding
has no recent evidence at that batch size, the next few iterations decode plainly (``measure``:
just enough for the guard's evidence), and the guard compares the two achieved rates.
"""

from __future__ import annotations

import bisect
import math
from collections import deque


def engine_settings(cuda_graphs: bool) -> dict:
    """The :class:`DraftLengthController` settings an engine uses (``LLMEngine``, and the
    controller A/B in ``bench/controller_ab.py``): under CUDA graphs probes draft for every
    sequence and the drafter runs whole blocks (a ragged step would not be replayed); with eager
    iterations the least gain grows past 4 sequences (``min_gain_seqs``)."""
    return {"uniform_probes": cuda_graphs, "full_blocks": cuda_graphs, "min_gain_seqs": None if cuda_graphs else 4}


def _median(xs: list[float]) -> float:
    """``statistics.median`` of a non-empty list of floats (the same value: the middle one, or
    the mean of the two middle ones), without its generic number handling (the controller fits
    four cost models an iteration)."""
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (pool
    adjacent violators)."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, max(w, 1e-12), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for v, _, c in blocks:
        out += [v] * c
    return out


class MachineSpeed:
    """How slow the machine runs now against the long run: the median of the last ``window``
    ratios of a forward's measured seconds to the long-run value of its size point (``CostModel``
    with ``feeds_speed``). Cost models sharing it keep their measurements divided by the speed
    at the time and multiply their fit by the current speed, so a size measured in one of a
    shared host's slow periods (steal time: every size slows alike) is not compared with another
    measured in a fast one. (Load bench, 4 bf16 sequences on a 2-core VM: the verify sizes of 8 /
    12 / 16 rows read 38-47 / 43-49 / 46-56 ms in the model, measured while drafting in slow
    periods, beside the plain size's 29-35 ms re-measured every iteration since; interleaved,
    they cost 29-34 ms, and the controller decoded plainly where drafting won by 5-9 %.)"""

    def __init__(self, window: int = 3):
        self.ratios: deque = deque(maxlen=window)
        self.value = 1.0

    def observe(self, ratio: float) -> None:
        self.ratios.append(ratio)
        self.value = _median(list(self.ratios))


class CostModel:
    """Seconds as a non-decreasing, piecewise-linear function of a size, from measurements.

    A measurement at ``n`` joins the size point within a factor ``snap`` of it (or starts a new
    point). A point's value is the median of its measurements of the last ``horizon`` ticks (or,
    when it has none that recent, of those within ``horizon`` ticks before its latest one): one
    outlier does not move it, and it follows a lasting change within a few measurements. (Of its
    last ``window`` measurements instead, a 16-sequence verify measured once at 51 ms went back to
    35 ms once stale: the median with two start-up measurements on 7-token contexts.) A point not
    measured for ``age`` ticks ages toward what fresher points imply: its value is pulled down, with
    half-life ``half_life``, toward the line through the two largest fresher smaller sizes at its
    size (at least the highest value among them; with one fresher size, that size's cost per unit of
    size): a slow period that is over must not keep an option looking expensive, and if it is not
    over the next measurement says so. Below that line (two fresher sizes) it is pulled up to it the
    same way: a verify size measured at start-up on 7-token contexts (a CPU's 64-row step at 78 ms
    beside a 32-row one measured in a load bench at 62 ms, 108 ms when measured there) made drafting
    at 32 sequences look nearly free, and the model drafted 2-3 tokens a sequence at ~2.4x a plain
    iteration until its own iterations re-measured it. (Pulled toward the fresher sizes' value
    itself, flat, a stale 64-row verify aged to a 35-row step's cost and kept a losing drafter
    looking close; so did a 32-token verify of 16 CPU sequences, 45 ms, aged toward the 16-token
    step's 28 ms within ~50 iterations, whose only fresher size it was: a batch probe every ~50
    iterations.) The curve is the isotonic (non-decreasing) fit of the point values, weighted by
    their recent measurement counts times ``0.5 ** (age / half_life)``.

    Ticks are the controller's iterations when it sets :attr:`now`, else measurements.

    With a :class:`MachineSpeed` (``speed``), measurements are kept in the machine's long-run
    time (divided by the speed when measured) and the model's seconds are its fit times the
    current speed; with ``feeds_speed`` every measurement at a size with ``min_ref`` earlier ones
    first updates the speed: its ratio to the median of that size's last ``ref_window``. (Against
    the point's value itself, the median of its last ``window``, the point took up a slow period
    in 3 measurements, before the speed's median did, and the speed stayed where it was.)

    Args:
        window: measurements kept per point.
        horizon: ticks within which a measurement counts as recent.
        half_life: ticks after which an unmeasured point weighs half and has aged halfway.
        snap: largest ratio between a measurement's size and the point it joins.
        age_down: whether stale points age down at all (the drafter's cost does not: its fresher
            smaller sizes are one-sequence probes, whose cost says nothing of 32 sequences';
            every-sequence probes re-measure it, see :meth:`DraftLengthController.choose`).
        speed, feeds_speed: the machine's speed this model scales by and whether its
            measurements update it (None: seconds as measured).
        ref_window, min_ref: see above.
        flat: with a single size point, its cost at every size (else scaled by the size, no less
            than at the point).
    """

    def __init__(
        self,
        window: int = 5,
        horizon: int = 32,
        half_life: float = 32.0,
        snap: float = 1.25,
        age_down: bool = True,
        speed: MachineSpeed | None = None,
        feeds_speed: bool = False,
        ref_window: int = 32,
        min_ref: int = 2,
        flat: bool = False,
    ):
        self.window, self.horizon, self.half_life, self.snap = window, horizon, half_life, snap
        self.flat = flat
        self.age_down = age_down
        self.speed, self.feeds_speed = speed, feeds_speed and speed is not None
        self.min_ref = min_ref
        self.xs: list[float] = []
        # per point (tick, seconds), the latest last: its last ``window`` give its value; with
        # ``feeds_speed`` its last ``ref_window`` are the speed's reference
        self.obs: list[deque] = []
        self._kept = max(window, ref_window) if self.feeds_speed else window
        self.now = 0
        self._own_clock = True
        self._fit: tuple[int, list[float]] | None = None
        #: per point ``(value, count of recent measurements, the tick from which they no longer
        #: hold)``, None where due (:meth:`_point_value`; the fit is redone every tick, they change
        #: only as measurements come or leave the horizon)
        self._points: list[tuple | None] | None = None

    def set_time(self, tick: int) -> None:
        """Use an external clock (the controller's iteration count) from now on."""
        if tick < self.now:  # (back from the own clock's count: which measurements are recent changes)
            self._points = None
        self.now, self._own_clock = tick, False

    def observe(self, n: float, seconds: float) -> None:
        if n <= 0 or not seconds > 0:
            return
        if self._own_clock:
            self.now += 1
        self._fit = None
        i = bisect.bisect_left(self.xs, n)
        near = [j for j in (i - 1, i) if 0 <= j < len(self.xs) and self.near(n, self.xs[j])]
        if near:
            j = min(near, key=lambda j: abs(self.xs[j] - n))
            if self.feeds_speed and len(self.obs[j]) >= self.min_ref:
                self.speed.observe(seconds / _median([s for _, s in self.obs[j]]))
        else:
            j = i
            self.xs.insert(j, float(n))
            self.obs.insert(j, deque(maxlen=self._kept))
            self._points = None  # (a new size point: every value is due)
        self.obs[j].append((self.now, seconds / self.speed.value if self.speed is not None else seconds))
        if self._points is not None:
            self._points[j] = None  # (its value is due again)

    @property
    def ys(self) -> list[float]:
        """The fitted seconds at each point (non-decreasing), in the machine's long-run time
        (multiplied by the speed in :meth:`__call__`)."""
        if self._fit is not None and self._fit[0] == self.now:
            return self._fit[1]
        now, horizon = self.now, self.horizon
        points = self._points = self._points or [None] * len(self.obs)
        for j, p in enumerate(points):
            if p is None or now >= p[2]:
                points[j] = self._point_value(self.obs[j])
        values = [p[0] for p in points]
        ages = [now - o[-1][0] for o in self.obs]
        weights = [p[1] * 0.5 ** (a / self.half_life) for p, a in zip(points, ages)]
        for i in range(len(values)):  # a stale point ages down toward what fresher smaller sizes imply
            if not self.age_down or ages[i] <= horizon:
                continue
            fresher = [j for j in range(i) if ages[j] < ages[i]]
            if not fresher:
                continue
            if len(fresher) >= 2:  # the line through the two largest fresher sizes, at this size
                a, b = fresher[-2], fresher[-1]
                slope = max((values[b] - values[a]) / (self.xs[b] - self.xs[a]), 0.0)
                goal = max(max(values[j] for j in fresher), values[b] + slope * (self.xs[i] - self.xs[b]))
            else:  # one fresher size: no more per unit of size than it costs (a batch never costs
                # more per token than a smaller one), not its cost itself
                goal = values[fresher[0]] * self.xs[i] / self.xs[fresher[0]]
            if goal < values[i] or len(fresher) >= 2 and goal > values[i]:  # (up only along a slope)
                f = 0.5 ** ((ages[i] - self.horizon) / self.half_life)
                values[i] = f * values[i] + (1 - f) * goal
        monotone = all(a <= b for a, b in zip(values, values[1:]))
        fit = values if monotone else _isotonic(values, weights)  # (the isotonic fit of monotone values is them)
        self._fit = (now, fit)
        return fit

    def _point_value(self, o: deque) -> tuple[float, int, float]:
        """A point's ``(value, count, until)`` from its measurements ``o``: the median of its last
        ``window`` of the last ``horizon`` ticks (or, with none that recent, of those within
        ``horizon`` ticks before its latest one), how many those recent ones are (at least 1), and
        the tick at which the earliest of them leaves the horizon (when this is due again)."""
        now, horizon = self.now, self.horizon
        if len(o) > self.window:  # (the point's own measurements)
            o = list(o)[-self.window :]
        recent = [(t, s) for t, s in o if now - t <= horizon]
        if not recent:
            return _median([s for t, s in o if o[-1][0] - t <= horizon]), 1, math.inf
        # (the earliest tick, not the first: measurements on the own clock, before set_time, may
        # carry later ticks than the controller's first iterations)
        return _median([s for _, s in recent]), len(recent), min(t for t, _ in recent) + horizon + 1

    def near(self, a: float, b: float) -> bool:
        """Whether sizes ``a`` and ``b`` (> 0) are within a factor ``snap`` of each other."""
        return max(a, b) / min(a, b) <= self.snap

    def age(self, n: float) -> float:
        """Ticks since the last measurement of the size point ``n`` would join (within ``snap``);
        infinite when there is none."""
        xs, i = self.xs, bisect.bisect_left(self.xs, n)
        lo, hi = i, i  # (the points within ``snap`` of ``n`` are the ones around where it sorts)
        while lo > 0 and self.near(n, xs[lo - 1]):
            lo -= 1
        while hi < len(xs) and self.near(n, xs[hi]):
            hi += 1
        return self.now - max(self.obs[j][-1][0] for j in range(lo, hi)) if hi > lo else math.inf

    def __call__(self, n: float) -> float:
        """Predicted seconds at size ``n`` at the machine's current speed: the fit's piecewise-
        linear value, extrapolated linearly past the last point (with a single point, its value,
        or scaled by the size unless ``flat``)."""
        xs = self.xs
        if not xs:
            return 0.0
        ys = self.ys
        speed = self.speed.value if self.speed is not None else 1.0
        if len(xs) == 1:
            return (ys[0] if self.flat else ys[0] * max(n / xs[0], 1.0)) * speed
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, y0 = xs[i - 1], ys[i - 1]
        if n <= x0:
            return y0 * speed
        return (y0 + (ys[i] - y0) * (n - x0) / (xs[i] - x0)) * speed


class _Realised:
    """Committed tokens per second actually achieved, per batch size and mode: the sum of
    committed tokens over the sum of wall seconds (a ratio of sums, not a mean of ratios) of
    the most recent iterations of that kind at most ``fresh`` iterations old, taken until they
    hold ``window`` iterations and ``window_seqs`` sequence-iterations (batch size x
    iterations).

    A rate is returned only from at least ``min_count`` iterations holding ``min_seqs``
    sequence-iterations: at batch 1 a drafting iteration commits 1 or ``k + 1`` tokens, so a
    few of them say little (a guard acting on one unlucky iteration locked a winning drafter
    out and never measured it again; with acceptance 0.41 and 2 drafts, 8 iterations commit
    one token each 1.5 % of the time, 16 iterations lose by 10 % about 0.4 % of the time).
    Each observation expires ``fresh`` iterations after it was made, so a verdict against the
    option the guard keeps out lapses and the model's choice is measured again, and evidence
    taken in a slow period (a spike) stops counting once it is old."""

    def __init__(self, window: int = 8, window_seqs: int = 32, min_count: int = 4, min_seqs: int = 16, fresh: int = 64):
        self.window, self.window_seqs, self.min_count, self.min_seqs = window, window_seqs, min_count, min_seqs
        self.fresh = fresh
        self.recent: dict[tuple[int, bool], deque] = {}  # key -> (iteration, tokens, seconds)

    def observe(self, seqs: int, drafting: bool, tokens: int, seconds: float, now: int) -> None:
        self.recent.setdefault((seqs, drafting), deque(maxlen=self.fresh)).append((now, tokens, seconds))

    def get(self, seqs: int, drafting: bool, now: int) -> float | None:
        n = tok = sec = 0.0
        for it, t, s in reversed(self.recent.get((seqs, drafting), ())):
            if now - it > self.fresh or (n >= self.window and n * seqs >= self.window_seqs):
                break
            n, tok, sec = n + 1, tok + t, sec + s
        if n < self.min_count or n * seqs < self.min_seqs:
            return None
        return tok / max(sec, 1e-9)


class DraftLengthController:
    """Chooses the number of draft tokens per iteration (see the module docstring).

    Args:
        max_draft: most draft tokens (drafter block size - 1).
        decay: decay of the acceptance counts per observed verify step.
        prior: acceptance of the first draft position assumed before any evidence.
        prior_weight: pseudo-observations behind each position's prior (the first position's
            ``prior``, every later position's the estimate of the one before it).
        probe, max_probe: while plain decoding wins, iterations between one-sequence drafting probes.
        explore, max_explore: while drafting wins, iterations between plain-decoding iterations.
        guard_margin: the achieved-rate guard overrides the model when the predicted choice
            achieved this much less (relative) than the other option at the same batch size.
        evidence_z: while plain decoding wins, probes stay at the shortest interval as long as
            drafting would come within half the guard margin of plain decoding at the upper end
            of the first position's acceptance that the probes so far allow (Wilson score bound,
            this many standard deviations, on the decayed counts). A handful of rejected probes
            says little: at acceptance 0.41, five first positions are all rejected 7 % of the
            time; backing off on them (to one probe in 256 iterations) locked a winning drafter
            out of whole runs. A useless drafter is ruled out after ~8-10 rejections.
        uniform_probes: every probe drafts one token for every sequence (a uniform step) instead
            of one sequence drafting alone (a ragged step). Under CUDA graphs a uniform step is
            replayed and a ragged one runs eagerly: on an H200 at 4 sequences ~25 ms against
            ~5 ms, so one-sequence probes every 8-16 steps held DFlash at 0.77x plain decoding.
        probe_budget: while plain decoding wins, one-sequence probes come at most as often as
            keeps their predicted loss within this share of plain decoding's time (at 4 bf16
            sequences on a 2-core CPU a probe of 3 drafts costs ~1.3x a plain iteration and
            commits ~0.5 more tokens; at such costs, scripted, one every 8 iterations cost 1.8-2.7 %
            of plain decoding's time, within the budget 0.5-1.1 %); at most 4x ``probe`` apart on
            this account. Measured as well: every plain iteration adds ``probe_budget`` of its
            wall time to a credit (at most one plain iteration's time), every probe
            iteration (one-sequence or every-sequence) takes what it cost beyond plain decoding
            committing as many tokens (:meth:`observe_wall`), and no probe starts while the
            credit is below zero, so the probes' measured loss stays within the budget over time
            whatever the model predicted (16 bf16 sequences of the load bench, 2-core AMX Xeon:
            with predicted costs alone the controller ran at 0.9725x the same engine decoding
            plainly, median of 6 paired runs: its probes' cold drafter forwards and the
            every-sequence probes' verifies cost ~2 %).
        full_blocks: the drafter runs a whole block (``max_draft + 1`` positions) a sequence
            whatever the draft length (its CUDA graphs are captured at it); else ``k + 2``
            positions for ``k`` drafts (the engine's ``draft_block``).
        far_behind, far_probe: a due probe waits until ``far_probe`` iterations have passed
            without one when drafting is predicted ``far_behind`` (relative) behind plain
            decoding even at the plausible acceptance (see ``evidence_z``): the acceptance a
            probe measures cannot flip such a batch size's choice, only a cost measured in a
            passing spike can, and that waits ``far_probe`` iterations at first; the interval
            then doubles from there, up to ``max_probe``, while the probes find drafting far
            behind. (Load bench, 16 and 32 bf16 sequences on a 2-core CPU: a verify of two tokens
            a sequence ~1.6x a plain step plus a 14.5 ms drafter, drafting ~30 % behind; the
            probes doubling from ``probe`` ran 4-6 times in a lane of 128 iterations, each a
            ragged step of +15-25 ms on a ~41 ms one: 1-2 % of the lane.)
        min_gain: the model drafts only when the predicted rate beats plain decoding's by this
            much (relative). Near a tie, what the model leaves out decides, and it goes against
            drafting: drafting sequences finish at different times, so waiting prompts are
            admitted in more, smaller chunks; the drafter ingests the context that piled up
            while it was not used. (Concurrency 64, trained drafter: the model drafted in 39 of
            ~210 near-tie iterations and the lane ran at 0.968x plain decoding.)
        min_gain_batch: ``min_gain`` with two or more sequences decoding. At 4 bf16 sequences on
            2 CPU cores the model predicted one draft each 3.7 % ahead, the decode-only
            iterations measured 2.7 % ahead, and the load bench's lane (8 requests x 64 tokens,
            one draft each forced) ran at 0.965x plain decoding: the iterations where sequences
            end at different times and prompts are admitted beside verify blocks took the rest;
            under the model's choice the lane ran at 0.93x.
        reuse: once the model (not the guard) chose plain decoding, every draft length predicted
            below the rate at which it would draft (plain decoding's plus the least gain: a near
            tie too), the next ``reuse`` iterations at the same batch size take that choice
            without evaluating the model again, unless a probe is due or the acceptance or the
            drafter's cost changed meanwhile: the model's refits and ~8 predicted rates cost
            ~0.2 ms an iteration (2-core AMD EPYC), ~1 % of a 4-sequence bf16 step, and a choice
            only flips by tens of iterations' evidence. (Held only below plain decoding itself,
            the model was evaluated every iteration at 16 bf16 sequences, where one draft each is
            predicted ~3 % ahead and chosen from 20 %: choose() 0.22-0.28 ms a call, 1.4 % of the
            lane's step time; held in the band, 0.07-0.09 ms, 0.55-0.65 %, 2-core AMX Xeon.)
            Where every draft length is predicted ``far_behind`` plain decoding, ``8 * reuse``,
            and an acceptance observed meanwhile (a probe's) does not end it (16 bf16 sequences
            of the load bench, 2-core AMX Xeon: the controller took 17-25 ms of a ~6 s lane, ~0.3 %,
            with ``reuse``; with ``4 * reuse``, ended by every probe's acceptance, it evaluated
            the model in 45 of 256 iterations, 0.56 ms each).
        min_gain_seqs, max_min_gain: past ``min_gain_seqs`` sequences (None: never) the least gain
            grows in proportion to the sequences, ``min_gain_batch * seqs / min_gain_seqs``, up to
            ``max_min_gain``, and the probes' ``close`` / ``far_behind`` tests move up with it:
            what the per-iteration model leaves out (sequences ending at different iterations,
            prompts admitted in more and smaller chunks, a ragged tail at a wave's end) grows
            with the batch while a draft's predicted gain shrinks. The engine sets 4 on the CPU
            (eager iterations). Load bench, 16 bf16 sequences, 2-core AMX Xeon (2026-11-30): one
            draft for every sequence forced, the decode-only iterations ran 1.7 % ahead of plain
            decoding's and the lane at 0.967x; the controller with 5 % at every batch size ran
            at 0.949-0.954x (medians of 3-4 paired runs), drafting in stretches and probing
            every ~10 iterations; with the gain growing, 0.980-0.984x, against 0.985-1.000x for
            the same engine never drafting. Under CUDA graphs (None there) drafting won 1.13x /
            1.07x at 16 / 32 sequences on an H200 (docs/gpu-runs.md) and is left as it was.
        steady: every-sequence probes (one draft token for every sequence, measuring the drafter's
            and the verify's costs at a batch size) only at a batch size that the last ``steady``
            iterations all had: in a load bench's lane the batch passes through sizes for one or
            two iterations each as requests end and the next are admitted (16 bf16 sequences on a
            2-core CPU: every-sequence probes at 10, 6, 9 and 2 sequences, each ~+40 % of an
            iteration, for costs that were never used again), and drafting there waits.
    """

    def __init__(
        self,
        max_draft: int,
        decay: float = 0.98,
        prior: float = 0.5,
        prior_weight: float = 1.0,
        probe: int = 8,
        max_probe: int = 256,
        explore: int = 16,
        max_explore: int = 256,
        guard_margin: float = 0.1,
        evidence_z: float = 1.5,
        min_gain: float = 0.03,
        min_gain_batch: float = 0.05,
        uniform_probes: bool = False,
        reuse: int = 3,
        probe_budget: float = 0.01,
        full_blocks: bool = False,
        far_behind: float = 0.1,
        far_probe: int = 64,
        steady: int = 3,
        min_gain_seqs: int | None = None,
        max_min_gain: float = 0.2,
    ):
        self.max_draft = max_draft
        self.decay = decay
        self.prior, self.prior_weight = prior, prior_weight
        self.reached = [0.0] * max_draft
        self.accepted = [0.0] * max_draft
        #: the machine's speed, from the target's forwards; the target's and the drafter's costs scale by it
        self.speed = MachineSpeed()
        self.target_cost = CostModel(speed=self.speed, feeds_speed=True)
        self.draft_cost = CostModel(age_down=False, speed=self.speed)
        #: the drafter's cost where it did not run the iteration before (:meth:`observe_drafter`)
        self.cold_cost = CostModel(age_down=False, speed=self.speed)
        self._batch_probe: int | None = None  # the batch size of an every-sequence probe's first iteration
        self._drafter_seen: dict[int, int] = {}  # sequences drafting -> the iteration the drafter last ran for them
        self._warm_seen: set[int] = set()  # sequences drafting in a warm forward, ever
        self.host_cost = self._host_cost_models()
        self.min_probe, self.max_probe = probe, max_probe
        self.probe_every = probe
        self.min_explore, self.max_explore = explore, max_explore
        self.explore_every = explore
        self.since_draft = 0
        self.since_plain = 0
        self.guard_margin = guard_margin
        self.evidence_z = evidence_z
        self.min_gain, self.min_gain_batch = min_gain, min_gain_batch
        self.min_gain_seqs, self.max_min_gain = min_gain_seqs, max_min_gain
        self.uniform_probes = uniform_probes
        self.full_blocks = full_blocks
        self.probe_budget = probe_budget
        self.far_behind, self.far_probe = far_behind, far_probe
        self.realised = _Realised()
        #: ``(seqs, iterations left)`` of a burst of plain iterations that measures plain
        #: decoding for the guard (see the module docstring: ``measure``)
        self._measuring: tuple[int, int] | None = None
        #: ``(iteration, predicted rate)`` where drafting began to fall short of its prediction
        self._short_since: tuple[int, float] | None = None
        self.iteration = 0
        self.overrides = 0
        self.probes = 0
        self.history: deque = deque(maxlen=4096)  # (iteration, seqs, draft tokens, why)
        self._acceptance: list[float] | None = None
        #: ``(last iteration, seqs, far behind)`` through which the model's last "plain decoding"
        #: stands without being evaluated again (see ``reuse``)
        self._plain_until: tuple[int, int, bool] | None = None
        self.reuse = reuse
        #: whether the last probe found drafting within half the guard margin of plain decoding at
        #: a plausible acceptance (its probes stay at the shortest interval; see :meth:`_probe`)
        self._close = True
        self.steady = steady
        self._steady, self._last_seqs = 0, -1  # iterations in a row at the same batch size, and that size
        #: seconds the probes may still lose (see ``probe_budget``, :meth:`observe_wall`)
        self.probe_credit = 0.0

    def acceptance(self) -> list[float]:
        """Current ``q_k`` estimates, k = 1..max_draft: each position's decayed counts shrunk
        toward the position before it (``prior_weight`` pseudo-observations of ``q_{k-1}``;
        ``q_1`` toward ``prior``). A position seldom reached thus reads like the last one with
        evidence, not like ``prior``: with a 0.5 prior on rarely reached positions, and a
        couple of lucky acceptances there, long drafts looked better than they were."""
        if self._acceptance is None:  # (cached until the next observe_acceptance: choose asks often)
            out, m = [], self.prior
            for a, r in zip(self.accepted, self.reached):
                m = (a + self.prior_weight * m) / (r + self.prior_weight)
                out.append(m)
            self._acceptance = out
        return self._acceptance

    def forget_acceptance(self) -> None:
        """Drop the acceptance evidence: every position back to the prior. For the engine after
        untimed warm-up requests, whose few draft blocks (one prompt's first 8 tokens) say little of
        the workload's: one rejected first draft there left the estimate at 0.25 before the
        workload's first token (this repository's drafter, bf16 GSM8K: ~0.4). (A few rejections
        at a lane's start still do the same: 3 in a row at batch 1 put it at 0.13, and the lane
        decoded plainly for ~40 iterations until the probes had shown otherwise.)"""
        self.reached = [0.0] * self.max_draft
        self.accepted = [0.0] * self.max_draft
        self._acceptance = None
        self._plain_until = None

    def forget_warm_up(self) -> None:
        """Drop what untimed warm-up requests taught, keeping the forward costs: the acceptance
        (:meth:`forget_acceptance`), the host costs and the achieved rates. The engine's warm-up
        decodes one short prompt alone, so its host costs are batch 1's only; kept, they stood
        for every batch size until one was measured (proportionally, 16x batch 1's at 16
        sequences, before the host models extrapolated flat from a single size), and the load
        bench's DFlash lanes of 4, 16 and 32 bf16 sequences ran 0.3-1.4 % behind those of an
        engine whose controller started after its warm-up in 6 of 6 checks (2-core AMX Xeon,
        paired lanes, 8 runs each); with the host costs dropped, within the +-1 % that two
        identically started engines pair to."""
        self.forget_acceptance()
        self.host_cost = self._host_cost_models()
        self.realised = _Realised()

    @staticmethod
    def _host_cost_models() -> dict[bool, CostModel]:
        """Empty host-cost models per mode (drafting?). A single size's cost stands for every
        size (``flat``): host work is mostly per iteration, and batch 1's scaled by the batch
        size made drafting at 16 sequences look ~9 ms dearer than it was."""
        return {False: CostModel(flat=True), True: CostModel(flat=True)}

    def idle_iterations(self) -> int:
        """Iterations after this one's choice before the drafter runs again, as far as the
        controller plans: while the model chooses plain decoding and every draft length is
        predicted ``far_behind`` it (a choice that stands for ``8 * reuse`` iterations), or the
        last probe found drafting further than half the guard margin behind even at a plausible
        acceptance (its probes back off), those until the next probe is due; else 0. Past that
        many, a drafting block sees none of the positions decoded now (a sliding-window
        drafter's), and the engine keeps no target features of them
        (:attr:`~.model_runner.StepPlan.capture`). A choice the model flips meanwhile (after a
        cost change of over ``far_behind``, or at a batch size it predicts otherwise) drafts
        once its sequences' features cover the window again (``DFlashProposer.ready``)."""
        held = self._plain_until
        if held is None or not held[2] and self._close:  # (neither far behind nor backing off)
            return 0
        return max(self.probe_every - self.since_draft, 0)

    def plausible_acceptance(self) -> list[float]:
        """:meth:`acceptance` with the first position's raised to the Wilson score upper bound
        (``evidence_z`` standard deviations) of its decayed counts: as high as the probes so far
        allow (1.0 before any)."""
        q = self.acceptance()
        n, z2 = self.reached[0], self.evidence_z**2
        if n <= 0:
            return [1.0] + q[1:]
        p = min(self.accepted[0] / n, 1.0)
        upper = (p + z2 / (2 * n) + self.evidence_z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (1 + z2 / n)
        return [max(q[0], min(upper, 1.0))] + q[1:]

    def expected_committed(self, k: int, acceptance: list[float] | None = None) -> float:
        """E(tokens committed per sequence) with ``k`` drafts (bonus token included), at the
        current acceptance estimates or at ``acceptance``."""
        e, p = 1.0, 1.0
        for q in (self.acceptance() if acceptance is None else acceptance)[:k]:
            p *= q
            e += p
        return e

    def draft_tokens(self, seqs: int, k: int) -> int:
        """Tokens of the drafter forward in which ``seqs`` sequences draft ``k`` tokens each: a
        whole block each, or ``k + 2`` positions (the anchor, the drafts and one shadow draft,
        :meth:`LLMEngine.draft_block`)."""
        return seqs * (self.max_draft + 1 if self.full_blocks else min(k + 2, self.max_draft + 1))

    def unverified_probe(self, seqs: int, k: int) -> bool:
        """Whether a one-sequence probe of ``k`` drafts at ``seqs`` decoding sequences is
        predicted to cost less unverified (the drafter alone, its drafts checked against the
        tokens committed next: no tokens gained) than verified (``k`` more target rows, the
        expected accepted drafts gained): the higher predicted rate of the two iterations. On a
        2-core CPU the verified probe wins at 4 bf16 sequences (3 more rows ~1.5 ms on a ~22 ms
        step, ~0.5 tokens gained, against a ~4 ms drafter), the unverified one at 16 (3 rows
        past the AMX tile's 16: +15-25 ms on a ~30 ms step). The verify's ragged size is charged
        the cost of the next size the model measured at or above it: between measured sizes a
        tiled GEMM's cost is a step, not the line (the model put 19 rows at 43 ms against 41 for
        16, and probes verified at 16 bf16 sequences)."""
        host = self.host_cost[False](seqs)
        drafter = self._probe_drafter_cost(k)
        n = next((x for x in self.target_cost.xs if x >= seqs + k), seqs + k)
        verified = (seqs - 1 + self.expected_committed(k)) / max(self.target_cost(n) + drafter + host, 1e-9)
        unverified = seqs / max(self.target_cost(seqs) + drafter + host, 1e-9)
        return unverified > verified

    def observe_drafter(self, seqs: int, tokens: int, seconds: float, cold: bool = False) -> None:
        """One drafter forward: ``seqs`` sequences drafting, ``tokens`` tokens in its blocks
        (:meth:`draft_tokens`), ``seconds`` long; ``cold``: the iteration before ran the drafter
        for fewer sequences or not at all. A cold forward first writes the drafter context that
        piled up while its sequences decoded plainly (KV injection, up to the drafter's window a sequence) and
        reads its weights back from memory: at 4 bf16 sequences on a 2-core CPU 4.7 / 4.8 / 5.1
        ms after 1 / 2 / 8 plain iterations, 7.2 after 40, against 4.0-4.4 drafting every
        iteration. Cold forwards go to :attr:`cold_cost` (the price of a probe), the others to
        :attr:`draft_cost` (drafting's own, :meth:`drafter_cost`): a batch size that decodes
        plainly is measured only by probes, all cold, and with their cost taken for drafting's
        it stayed plain where drafting won."""
        (self.cold_cost if cold else self.draft_cost).observe(tokens, seconds)
        self._drafter_seen[seqs] = self.iteration
        if not cold:
            self._warm_seen.add(seqs)
        self._end_hold()  # (as a new acceptance: see ``reuse``)

    def drafter_cost(self, seqs: int, k: int) -> float:
        """Predicted seconds of the drafter while ``seqs`` sequences draft ``k`` tokens each
        every iteration (:meth:`draft_tokens`): :attr:`draft_cost`'s (warm forwards, however
        old: in the machine's long-run time like every cost, and a warm drafter costs what it
        cost), or, at a batch size where the drafter never ran warm, the higher of it and
        :attr:`cold_cost`'s (a size only probes measured: an every-sequence probe's second
        iteration measures it warm, :meth:`choose`). (Where the warm cost went to the cold one
        after two horizons, a batch-1 lane locked itself into plain decoding: its probes are all
        cold, each after tens of plain iterations, and bf16 on a 2-core CPU read 14-25 ms
        against ~5 ms warm, beside a 21-30 ms decode step; three runs of 512 tokens at 0.96x -
        1.01x plain, 2-5 drafting iterations a run.)"""
        n = self.draft_tokens(seqs, k)
        warm = self.draft_cost(n)  # (0.0 before any warm forward)
        if any(self.draft_cost.near(s, seqs) for s in self._warm_seen) or not self.cold_cost.xs:
            return warm
        return max(warm, self.cold_cost(n))

    def _probe_drafter_cost(self, k: int) -> float:
        """Predicted seconds of a one-sequence probe's drafter forward of ``k`` drafts: a cold one
        (:attr:`cold_cost`, or :attr:`draft_cost` before any cold forward)."""
        n = self.draft_tokens(1, k)
        return self.cold_cost(n) if self.cold_cost.xs else self.draft_cost(n)

    def _drafter_age(self, seqs: int) -> float:
        """Iterations since the drafter last ran for about ``seqs`` sequences (within the cost
        model's ``snap``): its cost per token at other batch sizes (another number of contexts
        to ingest, another share of fixed costs) says little of this one's."""
        near = [t for n, t in self._drafter_seen.items() if self.draft_cost.near(n, seqs)]
        return self.iteration - max(near) if near else math.inf

    def rate(self, k: int, seqs: int, optimistic: bool = False, acceptance: list[float] | None = None) -> float:
        """Predicted committed tokens per second of an iteration with ``k`` drafts (at
        ``acceptance`` when given); with ``optimistic`` a drafting iteration is charged the
        lowest plausible drafter and host costs instead (the one-sequence drafter cost, plain
        decoding's host cost)."""
        draft, host = (1, False) if optimistic else (seqs, k > 0)
        drafter = self.drafter_cost(draft, k) if k else 0.0
        cost = self.target_cost(seqs * (k + 1)) + drafter + self.host_cost[host](seqs)
        return seqs * self.expected_committed(k, acceptance) / max(cost, 1e-9)

    def _guard(self, best: int, seqs: int, rates: list[float], top: int) -> tuple[int, str]:
        """The guard on the model's choice ``best`` (see the module docstring): ``(choice, why)``
        with why ``model`` (kept), ``guard`` (the other option achieved more lately at this
        batch size) or ``measure`` (plain decoding measured from this iteration on)."""
        got_draft = self.realised.get(seqs, True, self.iteration)
        got_plain = self.realised.get(seqs, False, self.iteration)
        why = "model"
        if got_draft is not None and got_plain is not None and top > 0:
            if best > 0 and got_draft < (1 - self.guard_margin) * got_plain:
                best, why = 0, "guard"
            elif best == 0 and got_plain < (1 - self.guard_margin) * got_draft:
                best = max(range(1, top + 1), key=lambda k: (rates[k], -k))
                why = "guard"
            self.overrides += why == "guard"
        elif self._falls_short(best, seqs, rates, got_draft, got_plain):
            r, self._short_since = self.realised, None
            self._measuring = (seqs, max(r.min_count, -(-r.min_seqs // seqs)))
            self._measure(seqs)
            return 0, "measure"
        return best, why

    def _measure(self, seqs: int) -> bool:
        """Whether this iteration at ``seqs`` sequences decodes plainly to measure plain
        decoding (a burst started by :meth:`_falls_short`; one at another batch size ends)."""
        m = self._measuring
        if m is None:
            return False
        if m[0] != seqs or m[1] == 0:
            self._measuring = None
            return False
        self._measuring = (seqs, m[1] - 1)
        self.history.append((self.iteration, seqs, 0, "measure"))
        return True

    def _falls_short(self, best: int, seqs: int, rates: list[float], got_draft, got_plain) -> bool:
        """Whether plain decoding is to be measured (``measure``): drafting ``best`` tokens, the
        model's choice at ``seqs`` >= 2 sequences, has achieved lately (``got_draft``, tokens/s)
        ``2 * guard_margin`` less than the model predicts (``rates[best]``) while plain decoding
        has no recent evidence (``got_plain`` None), for 16 choices running, and the prediction
        has not come down meanwhile (by 5 %). Half that shortfall comes by chance too often over
        the guard's 8 iterations (acceptance 0.45, drafting ~1.35x plain: ~5 % of the iterations
        measured plain); a model that is learning (an acceptance that collapsed) lowers its
        prediction and corrects itself, faster than plain iterations, which teach it no
        acceptance, would let it."""
        short = not (best == 0 or seqs < 2 or got_plain is not None or got_draft is None)
        short = short and got_draft < (1 - 2 * self.guard_margin) * rates[best]
        if not short:
            self._short_since = None
            return False
        if self._short_since is None or rates[best] < 0.95 * self._short_since[1]:
            self._short_since = (self.iteration, rates[best])
        return self.iteration - self._short_since[0] >= self.realised.fresh // 4

    def choose(self, seqs: int, token_budget: int | None = None) -> tuple[int, bool]:
        """``(draft tokens per sequence, probe)`` for this iteration; ``seqs`` sequences are
        decoding. ``probe`` true means plain decoding wins but one sequence should draft the
        returned number of tokens to refresh the acceptance estimates."""
        self.iteration += 1
        for m in (self.target_cost, self.draft_cost, self.cold_cost, *self.host_cost.values()):
            m.set_time(self.iteration)
        self._steady, self._last_seqs = (self._steady + 1 if seqs == self._last_seqs else 1), seqs
        if seqs == 0 or self.max_draft == 0:
            return 0, False
        decided = self._decided(seqs)
        if decided is not None:
            return decided
        top = self.max_draft
        if token_budget is not None:
            top = max(0, min(top, token_budget // seqs - 1))
        rates = [self.rate(k, seqs) for k in range(top + 1)]  # predicted rate per draft length
        # the model drafts at most one token past the longest draft whose verify size it measured
        # lately: a larger size's cost is an extrapolation, or a stale point aged down toward the
        # fresher smaller sizes (flat: a 224-row verify predicted at a 64-row one's cost picked
        # 6 drafts a sequence at batch 32, ~3x a plain iteration)
        fresh = [k for k in range(top + 1) if self.target_cost.age(seqs * (k + 1)) <= self.target_cost.horizon]
        reach = min(top, max(fresh, default=0) + 1)
        best = max(range(reach + 1), key=lambda k: (rates[k], -k))
        if best > 0 and rates[best] < (1 + self._min_gain(seqs)) * rates[0]:
            best = 0  # a near tie: plain decoding (see ``min_gain``, ``min_gain_batch``)
        best, why = self._guard(best, seqs, rates, top)
        if why == "measure":
            return 0, False
        if (
            best > 0
            and why == "model"
            and seqs > 1
            and (self._drafter_age(seqs) > self.draft_cost.horizon or self.reached[0] < seqs / 2)
        ):
            # drafting predicted to win on a drafter cost not measured lately at this batch size
            # (never, or aged toward the one-sequence probes' cost), or on a first-position
            # acceptance resting on fewer sequences than half a batch (a one-sequence probe whose
            # three drafts were all accepted read as 0.75 / 0.88 / 0.94 and 16 bf16 sequences
            # drafted five tokens each, ~2.5x a plain iteration): one token each first, which
            # measures both at a fraction of a full-length draft's price if the prediction is wrong;
            # only at a batch size that has lasted ``steady`` iterations (see there)
            if self._steady < self.steady:
                self.history.append((self.iteration, seqs, 0, "unsteady"))
                return 0, False
            return self._batch_probe_start(seqs)
        if best > 0:
            self.since_draft = 0
            self.probe_every = self.min_probe
            self.since_plain += 1
            if self.since_plain >= self.explore_every:  # re-measure the option not taken
                self.since_plain = 0
                self.explore_every = min(2 * self.explore_every, self.max_explore)
                self.history.append((self.iteration, seqs, 0, "explore"))
                return 0, False
            self.history.append((self.iteration, seqs, best, why))
            return best, False
        self.since_plain = 0
        self.explore_every = self.min_explore
        self.since_draft += 1
        # (held in the band below the rate at which drafting would be chosen too, the least gain
        # included; far behind plain decoding itself, as before)
        if why == "model" and top > 0 and max(rates[1:]) < (1 + self._min_gain(seqs)) * rates[0] and self.reuse:
            far = max(rates[1:]) < (1 - self.far_behind) * rates[0]  # (a cost change cannot flip it soon)
            self._plain_until = (self.iteration + self.reuse * (8 if far else 1), seqs, far)
        if self.since_draft >= self.probe_every and top > 0:
            picked = self._probe(seqs, top, rates[0])
            if picked is not None:
                return picked
        self.history.append((self.iteration, seqs, 0, why))
        return 0, False

    def _probe(self, seqs: int, top: int, plain_rate: float) -> tuple[int, bool] | None:
        """A drafting probe while plain decoding wins (see the module docstring): one sequence
        drafting as far as drafts are likely accepted, or every sequence drafting one token;
        ``plain_rate`` is plain decoding's predicted rate. Sets the next probe interval. None
        while the probe waits (``far_behind``)."""
        may_win = self._may_win(seqs, top)
        # a drafter predicted within half the guard margin of plain decoding keeps being
        # probed often (such a probe costs little, and the estimate it refines may flip the
        # choice); one further behind is probed ever more rarely
        # so is one that would be that close at a plausible acceptance while few probes
        # back the estimate (see ``evidence_z``)
        # (the plausible acceptance is at least the estimate, so this covers ``rates`` too)
        plausible = self.plausible_acceptance()
        best_plausible = max(self.rate(k, seqs, acceptance=plausible) for k in range(1, top + 1))
        # (both relative to the least gain at which drafting would be chosen, where it grows with
        # the batch: ``min_gain_seqs``)
        extra = max(self._min_gain(seqs) - self.min_gain_batch, 0.0)
        close = best_plausible >= (1 + extra - self.guard_margin / 2) * plain_rate
        self._close = close
        far = best_plausible < (1 + extra - self.far_behind) * plain_rate
        if far and self.since_draft < self.far_probe:
            # far behind even at a plausible acceptance: the probe waits (the acceptance it would
            # measure cannot flip this batch size's choice; a passing cost spike could)
            self.probe_every = self.far_probe
            return None
        if self.probe_credit < 0:
            return None  # the probes so far lost more than ``probe_budget`` allows: this one waits
        self.since_draft = 0
        k = min(top, math.ceil(1 + 2 * (self.expected_committed(top) - 1) - 1e-9))  # a one-sequence probe's drafts
        # (and never more often than ``probe_budget`` allows: a ragged step on a CPU costs ~1.3x a
        # plain one; at most 4x ``probe`` apart on that account, as the costs it rests on may be a
        # passing spike's that only the next probes re-measure)
        least = min(max(self.min_probe, self._affordable_interval(seqs, k)), 4 * self.min_probe)
        self.probe_every = least if close else min(max(2 * self.probe_every, least), self.max_probe)
        self.probes += 1
        # every sequence drafting one token re-measures the drafter and verify costs at this
        # batch size, at up to ~2x a plain iteration: only once those are 2 horizons old; with
        # ``uniform_probes`` always (one sequence drafting alone is a ragged step); after a
        # ``far_behind`` wait it is the one kind that could flip the choice (a drafter cost
        # measured in a passing spike), so it comes first; 4 horizons old where the probes back off
        # (not ``close``), and never at a batch size that has not lasted ``steady`` iterations
        stale = self._drafter_age(seqs) > (1 if far else 2 if close else 4) * self.draft_cost.horizon
        stale = stale and self._steady >= self.steady
        if seqs == 1 or not self.uniform_probes and (self.probes % 2 and not far or not may_win or not stale):
            self.history.append((self.iteration, seqs, k, "probe"))
            return k, True
        return self._batch_probe_start(seqs)

    def _decided(self, seqs: int) -> tuple[int, bool] | None:
        """This iteration's choice where it is made before the model is evaluated, else None:
        the second iteration of an every-sequence probe (:meth:`_batch_probe_start`) while the
        batch size holds and drafting could still be chosen at the lowest plausible drafter
        cost (``optimistic`` rates: its first iteration just measured the verify's cost);
        plain decoding as the model chose lately (``reuse``); a burst measuring plain decoding
        (:meth:`_measure`)."""
        again, self._batch_probe = self._batch_probe == seqs, None
        if again and self._may_win(seqs, self.max_draft, self._min_gain(seqs)):
            self.history.append((self.iteration, seqs, 1, "probe-batch"))
            return 1, False
        held = self._plain_until
        probe_due = self.since_draft + 1 >= self.probe_every and self.probe_credit >= 0
        if held is not None and held[1] == seqs and self.iteration <= held[0] and not probe_due:
            self.since_draft += 1  # plain decoding, as the model chose lately (``reuse``)
            self.history.append((self.iteration, seqs, 0, "model"))
            return 0, False
        self._plain_until = None
        return (0, False) if self._measure(seqs) else None

    def _batch_probe_start(self, seqs: int) -> tuple[int, bool]:
        """An every-sequence probe: one draft token for each of ``seqs`` sequences, this iteration
        and the next (if the batch size holds): the first forward is cold (the drafter writes
        the context that piled up, its weights come from memory), the second measures the
        drafter as it costs while drafting goes on (:meth:`observe_drafter`)."""
        self._batch_probe = seqs
        self.history.append((self.iteration, seqs, 1, "probe-batch"))
        return 1, False

    def _affordable_interval(self, seqs: int, k: int) -> int:
        """Iterations between one-sequence probes of ``k`` drafts at ``seqs`` sequences for
        which their predicted loss is ``probe_budget`` of plain decoding's time: a probe's
        iteration costs the verify of ``k`` more tokens and the drafter, and commits
        ``E(k) - 1`` more tokens, each worth a plain iteration's time over ``seqs``. (0 where a
        probe is predicted to lose nothing.)"""
        plain = self.target_cost(seqs) + self.host_cost[False](seqs)
        drafter = self._probe_drafter_cost(k)
        probe = self.target_cost(seqs + k) + drafter + self.host_cost[False](seqs)
        loss = probe - plain - (self.expected_committed(k) - 1) * plain / seqs
        return math.ceil(loss / (self.probe_budget * plain)) if loss > 0 and plain > 0 else 0

    def _min_gain(self, seqs: int) -> float:
        """The least predicted gain over plain decoding at which the model drafts (``min_gain``,
        ``min_gain_batch`` from two sequences on, growing in proportion to the sequences past
        ``min_gain_seqs`` up to ``max_min_gain``)."""
        if seqs == 1:
            return self.min_gain
        if self.min_gain_seqs is None:
            return self.min_gain_batch
        grown = min(self.min_gain_batch * seqs / self.min_gain_seqs, self.max_min_gain)
        return max(grown, self.min_gain_batch)

    def _may_win(self, seqs: int, top: int, margin: float | None = None) -> bool:
        """Could drafting come within ``margin`` (relative; ``-guard_margin`` unless given) of
        plain decoding at this batch size at its lowest plausible costs?"""
        best = max(self.rate(k, seqs, optimistic=True) for k in range(1, top + 1))
        return best >= (1 + (-self.guard_margin if margin is None else margin)) * self.rate(0, seqs)

    def observe_acceptance(self, num_draft: int, accepted: int, of: int = 1) -> None:
        """One verify step of one sequence: ``accepted`` of its ``num_draft`` drafts taken;
        ``of`` sequences drafted in the same iteration. The counts decay by ``decay ** (1 / of)``
        per observation, i.e. by ``decay`` per iteration at any batch size. (Decaying by
        ``decay`` per sequence forgot all but about the last iteration at batch 64, so the
        estimate rested on ~64 samples and swung the predicted rate by +-9 %.)"""
        d = self.decay ** (1 / max(of, 1))
        self.reached = [r * d for r in self.reached]
        self.accepted = [a * d for a in self.accepted]
        for k in range(num_draft):
            if k > accepted:
                break
            self.reached[k] += 1
            self.accepted[k] += k < accepted
        self._acceptance = None
        self._end_hold()

    def _end_hold(self) -> None:
        """A held plain choice (``reuse``) ends once the acceptance or the drafter's cost has
        changed, unless it was held ``far_behind`` (then it stands)."""
        if self._plain_until is not None and not self._plain_until[2]:
            self._plain_until = None

    def observe_iteration(
        self,
        seqs: int,
        drafted: bool,
        seconds: float,
        committed: int,
        forward_s: float,
        probe: bool = False,
    ) -> None:
        """A decode-only iteration (no prompt chunks) of ``seqs`` sequences, all drafting or
        all plain, that committed ``committed`` tokens in ``seconds`` of wall time (the whole
        iteration: planning, forwards, acceptance, commit).

        ``forward_s`` (the seconds its target and drafter forwards took, as fed to the cost
        models) gives the host cost of the mode: ``seconds - forward_s``. The achieved-rate
        guard is fed unless ``probe`` (a probe drafts to measure acceptance, not at the length
        the model would choose)."""
        if seqs <= 0 or not seconds > 0:
            return
        self.host_cost[drafted].observe(seqs, max(seconds - forward_s, 1e-6))
        if not probe:
            self.realised.observe(seqs, drafted, committed, seconds, self.iteration)

    def observe_wall(self, seqs: int, seconds: float, committed: int) -> None:
        """A decode-only iteration of ``seqs`` sequences that committed ``committed`` tokens in
        ``seconds`` of wall time, as :meth:`choose` chose it this iteration (its last history
        entry): a plain one adds ``probe_budget`` of its time to :attr:`probe_credit` (the credit
        at most that iteration's time), a probe (one-sequence or every-sequence) takes its cost
        beyond plain decoding committing as many tokens (``seconds - committed / seqs * plain``,
        ``plain`` the plain iteration's predicted time, the credit at most that; negative where
        the probe gained). Plain iterations leave the cost models alone (no refit on their
        account: see ``reuse``)."""
        last = self.history[-1] if self.history else None
        if seqs <= 0 or not seconds > 0 or last is None or last[0] != self.iteration:
            return  # (no choice recorded for this iteration)
        if last[3] in ("probe", "probe-batch"):
            plain = self.target_cost(seqs) + self.host_cost[False](seqs)
            self.probe_credit = min(self.probe_credit - (seconds - committed / seqs * plain), plain)
        elif last[2] == 0:
            self.probe_credit = min(self.probe_credit + self.probe_budget * seconds, seconds)

    def state(self) -> dict:
        """The model as plain data: fitted costs (ms, at the current speed) per size (host costs
        per mode), the speed, acceptance per position, the draft length chosen per iteration
        (with why: model, guard, explore, probe), overrides."""
        return {
            "target_cost_ms": [[x, self.target_cost(x) * 1e3] for x in self.target_cost.xs],
            "draft_cost_ms": [[x, self.draft_cost(x) * 1e3] for x in self.draft_cost.xs],
            "speed": self.speed.value,
            "host_cost_ms": {
                mode: [[x, y * 1e3] for x, y in zip(m.xs, m.ys)]
                for mode, m in (("plain", self.host_cost[False]), ("drafting", self.host_cost[True]))
            },
            "acceptance": self.acceptance(),
            "guard_overrides": self.overrides,
            "history": [list(h) for h in self.history],
        }
