"""The serving engine: in-flight batching of DFlash speculative decoding over a paged KV cache
(paper arXiv:2602.06036 §3, Alg. 1, batched; scheduling after vLLM / TensorRT-LLM).

One :meth:`LLMEngine.step`:
  1. the scheduler picks the decoding sequences and the prompt chunks (``scheduler.py``);
  2. the number of draft tokens is fixed (``block_size - 1``) or chosen by the adaptive
     controller (``adaptive.py``; 0 = plain decoding);
  3. the runner drafts for all decoding sequences in ONE drafter forward and runs ONE packed
     target forward over every verify block and prompt chunk (``model_runner.py``);
  4. per sequence: the longest prefix of drafts equal to the target's own choice (argmax, or
     its sample when temperature > 0) is accepted, plus one bonus token; the KV blocks past
     the committed length are rolled back (freed); tokens are streamed; finished sequences
     leave and free their blocks.
Every rank of a TP group runs step 3 on the same plan; steps 1, 2 and 4 run on rank 0 only.

A failed iteration (``isolate_failures``: the serving loop) ends only the request that makes it
fail. Nothing of it is committed; every sequence it held is preempted by recompute (its KV
blocks freed, the runner's features of it dropped, its prompt and committed tokens prefilled
again) and the failed iteration's sequences then run apart from the others, bisected group by
group, until the one that fails alone ends with finish reason ``error``. A sequence that runs an
iteration apart and commits a token rejoins the batch. A failure while one sequence's tokens are
committed ends that sequence.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet

import torch

from ..errors import ConfigError, DFlashError
from ..models.drafter import DFlashDrafter
from ..models.target import TargetModel
from .adaptive import DraftLengthController, engine_settings
from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner, StepItem, StepPlan
from .request import LoopStats, Request, RequestResult
from .sampling import SamplingParams
from .scheduler import Schedule, Scheduler
from .sequence import Sequence, TokenCallback, callback
from .spec_decode.prompt_lookup import PromptLookup

log = logging.getLogger("dflash_trt.runtime")

#: the most sequences the start-up calibration measures the drafter at (``LLMEngine.calibrate``)
CALIBRATION_MAX_SEQS = 16
#: positions of context before every step the start-up calibration times (``LLMEngine.calibrate``)
CALIBRATION_CONTEXT = 128
#: runs of each step the start-up calibration times on the CPU, the median kept (one run each:
#: a 2-core host's stall in the 4-sequence plain step, 39.5 ms against 28 for 2 sequences, made
#: the fitted cost of 4 and 8 tokens one pooled value, verify looked free, and the controller
#: drafted 3 tokens a sequence at 4 bf16 sequences from its first iterations)
CALIBRATION_REPEATS = 3
#: the text the adaptive controller's start-up calibration decodes and verifies over
#: (``LLMEngine.calibrate``): a worked word problem, like the requests an engine serves. Its
#: steps' cost depends on what they read: on token 0 repeated, an fp32 CPU target's screened LM
#: head weighed 19,000-34,000 candidates a row (its logits flat) where serving GSM8K weighs
#: ~50-150, and a 4-sequence verify of 2 tokens each measured 55 ms against 28 in serving.
CALIBRATION_TEXT = (
    "Question: A baker makes 48 muffins in the morning and 36 in the afternoon. She sells three "
    "quarters of them and gives 6 to her neighbours. How many muffins does she have left?\n"
    "Answer: First, find the total number of muffins. 48 + 36 = 84 muffins. Next, find how many "
    "she sells: three quarters of 84 is 84 * 3 / 4 = 63 muffins. After selling, she has "
    "84 - 63 = 21 muffins. Then she gives 6 to her neighbours, so 21 - 6 = 15 muffins remain. "
    "The answer is 15.\n"
    "Question: A train travels at 60 miles per hour for 2 hours and then at 45 miles per hour for "
    "3 hours. What is the total distance it travels, and what is its average speed?\n"
    "Answer: In the first part the train covers 60 * 2 = 120 miles. In the second part it covers "
    "45 * 3 = 135 miles. The total distance is 120 + 135 = 255 miles. The whole trip takes "
    "2 + 3 = 5 hours, so the average speed is 255 / 5 = 51 miles per hour. The answer is 255 "
    "miles at an average of 51 miles per hour.\n"
)


def check_block_size(drafter: DFlashDrafter | None, block_size: int) -> None:
    """Raises :class:`ConfigError` (``block_size``) for a block size the drafter cannot serve."""
    if block_size < 1:
        raise ConfigError("block_size", f"must be >= 1, got {block_size}")
    if block_size > 1 and drafter is None:
        raise ConfigError("block_size", f"{block_size} needs a drafter")
    if drafter is not None and block_size > drafter.cfg.block_size:
        raise ConfigError("block_size", f"{block_size} is above the drafter's block_size {drafter.cfg.block_size}")


class LLMEngine:
    """DFlash (or plain) decoding of many requests with in-flight batching.

    Args:
        target: the target model (eval mode, compute dtype).
        drafter: the DFlash drafter, or None (plain decoding only).
        stop_token_ids: default stop ids (the target's EOS ids).
        config: the settings (``runtime/config.py``); what it leaves open is decided by
            :meth:`~.config.EngineConfig.with_defaults` (the drafter's block size, the default KV
            capacity). Build engines with :meth:`from_engine_args` (which also reads an engine
            directory's memory plan); this constructor takes models already loaded.
        runner: the :class:`ModelRunner` to use (default: one built from the config).
        tp: TP group helper (rank 0's view) that broadcasts each plan, or None.
        calibration_ids: token ids of natural text in the target's vocabulary for the adaptive
            controller's start-up calibration (:meth:`calibrate`; :func:`~.engine_factory.calibration_ids`
            makes them from the tokenizer, as :meth:`from_engine_args` does). None: token 0
            throughout, whose flat logits make an fp32 CPU target's screened LM head weigh
            thousands of candidates a row, and its verify steps look up to 2x their cost.

    Attributes:
        isolate_failures: False (default): an exception in an iteration propagates out of
            :meth:`step`. True (:class:`AsyncLLM` sets it): the engine handles it, ending only
            the request that makes iterations fail (module docstring); only a failure it cannot
            attribute (under tensor parallelism, or in scheduling itself) propagates.

    Raises:
        ConfigError: impossible settings (block size, capacity below one block, ...).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None,
        stop_token_ids: tuple[int, ...],
        config: EngineConfig | None = None,
        runner: ModelRunner | None = None,
        tp=None,
        calibration_ids: list[int] | None = None,
    ):
        cfg = (config or EngineConfig()).with_defaults(drafter.cfg.block_size if drafter is not None else None)
        spec, sched = cfg.speculative, cfg.scheduler
        K = spec.block_size
        check_block_size(drafter, K)
        if sched.max_num_tokens < K:
            raise ConfigError("max_num_tokens", f"({sched.max_num_tokens}) must be >= the block size ({K})")
        tpb = cfg.cache.tokens_per_block
        num_blocks = cfg.cache.kv_capacity // tpb
        if num_blocks < 1:
            raise ConfigError("kv_capacity", f"{cfg.cache.kv_capacity} is below one block of {tpb}")
        self.block_size = K
        self.config = cfg
        self.lookup = PromptLookup(*spec.prompt_lookup) if spec.prompt_lookup is not None else None
        self.stop_token_ids = tuple(stop_token_ids)
        self.blocks = BlockManager(num_blocks, tpb, cfg.cache.enable_prefix_caching)
        self.runner = runner or ModelRunner(target, drafter if K > 1 else None, cfg, tp=tp)
        proposer = self.runner.proposer
        self.scheduler = Scheduler(
            self.blocks,
            sched.max_batch_size,
            sched.max_num_tokens,
            K,
            max_prefill_tokens=sched.max_prefill_tokens,
            drafter_window=(proposer.window or 0) if proposer is not None else None,
        )
        self.tp = tp
        #: the loaded models this engine was built from (``engine_factory.LoadedModels``), when
        #: built by :meth:`from_engine_args`
        self.models = None
        self.stats = LoopStats(K)
        self.controller = self._new_controller() if spec.adaptive and K > 1 else None
        #: the controller's one-sequence probes draft for the decoding sequences in turn: always
        #: the first (the oldest, furthest into its answer) measured a first-position acceptance
        #: of 0.168 (375 probes, 4 bf16 GSM8K sequences; in turn 0.315) where every sequence
        #: drafting measured 0.39-0.46, and the controller kept a drafter that wins there from drafting
        self._probe_turn = 0
        #: sequences the drafter ran for in the last iteration: a forward for more is cold
        #: (:meth:`~.adaptive.DraftLengthController.observe_drafter`)
        self._drafted_last = 0
        #: seq id -> (position of the first probe draft, the drafts): unverified probes
        #: (:meth:`_probe_unverified`) waiting for the tokens the sequence commits next
        self._probe_checks: dict[int, tuple[int, list[int]]] = {}
        self._next_id = 0
        self._seqs: dict[int, Sequence] = {}  # every request not yet collected, by sequence id
        self._inbox: list[Sequence] = []  # added since the last iteration began
        self._aborts: dict[int, str] = {}  # seq id -> the finish reason it ends with
        self._release: list[int] = []
        # (seq_id, table, upto) of ended sequences whose drafter context goes into the pool with
        # the next plan, before the runner drops their features (StepPlan.ingest)
        self._ingest: list[tuple[int, list[int], int]] = []
        # step() holds _lock for a whole iteration. add_request and abort come from other threads
        # (an HTTP server's event loop) and must never wait for an iteration: they take _admit,
        # held for a few dict operations, and the next iteration picks up what they left
        self._lock = threading.RLock()
        self._admit = threading.Lock()
        self.iteration_s: deque[float] = deque(maxlen=4096)
        self._listeners: list[Callable[[RequestResult, int], None]] = []
        self.isolate_failures = False
        # the sequences of failed iterations, in groups that run apart from the others (front first)
        self._suspects: deque[list[int]] = deque()
        self._suspects_turn = False
        #: token ids of natural text the start-up calibration's steps read (:meth:`calibrate`)
        self.calibration_ids = list(calibration_ids or [])
        if self.controller is not None:
            self.calibrate()

    @classmethod
    def from_engine_args(cls, args, models=None, tp=None) -> LLMEngine | None:
        """The engine of ``args`` (``EngineArgs`` or a :class:`~.config.EngineConfig`): the one
        way in that loads the models (unless ``models`` are given), joins or starts the
        tensor-parallel ranks, sizes the KV cache and builds the runner
        (:func:`~.engine_factory.create_engine`, whose arguments these are).

        Returns:
            the engine; None on a tensor-parallel worker rank, once rank 0 has closed it.

        Raises:
            ConfigError: an impossible setting, named by its field.
            DFlashError: what loading raises.
        """
        from .engine_factory import create_engine

        return create_engine(args, models, tp)

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks that mirror this engine and leave their group
        (nothing without tensor parallelism). The engine cannot step afterwards."""
        if self.tp is not None:
            self.tp.stop_workers()
            self.tp.shutdown()
            self.tp = None

    # ---- requests ----
    def add_request(
        self,
        request: Request,
        on_tokens: TokenCallback | None = None,
        seq_id: int | None = None,
        on_finish: Callable[[int, RequestResult], None] | None = None,
    ) -> int:
        """Queue a request; returns its sequence id. ``on_tokens(seq_id, tokens)`` is called
        with every batch of committed tokens, ``on_finish(seq_id, output)`` once when it ends
        (finished or aborted) with its :class:`RequestResult` (the engine then forgets it;
        without ``on_finish``, :meth:`result` collects it). Both run on the thread that steps
        the engine. Thread-safe, and it never waits for a running iteration: the request joins
        the scheduler's queue when the next iteration begins.

        Raises:
            DFlashError: empty prompt, ``max_new_tokens < 1``, more KV than the whole cache, a
                ``seq_id`` in use.
        """
        self.check_request(request)
        stops = request.stop_token_ids if request.stop_token_ids is not None else self.stop_token_ids
        with self._admit:
            sid = self._next_id if seq_id is None else seq_id
            if sid in self._seqs:
                raise DFlashError(f"sequence id {sid} is in use")
            self._next_id = max(self._next_id, sid + 1)
            seq = Sequence(sid, request, frozenset(stops), request.sampling.make_generator(), on_tokens, on_finish)
            self._seqs[sid] = seq
            self._inbox.append(seq)
            return sid

    def check_request(self, request: Request) -> None:
        """Raises DFlashError for a request the engine could never serve: an empty prompt, a
        token id outside the target's vocabulary, ``max_new_tokens`` < 1, more KV than the
        whole cache."""
        self.check_token_ids("prompt", request.prompt_ids)
        self.scheduler.check(request)

    def check_token_ids(self, name: str, ids) -> None:
        """Raises DFlashError naming ``name`` for an id that is not an int in the target's
        vocabulary."""
        vocab = self.runner.target.cfg.vocab_size
        for t in ids:
            if type(t) is not int or not 0 <= t < vocab:
                raise DFlashError(f"{name} token id {t!r} is not in the vocabulary (0..{vocab - 1})")

    def abort(self, seq_id: int, reason: str = "abort") -> None:
        """Cancel a request: it ends (finish reason ``reason``: ``abort``, or ``stop`` when a
        front end found a stop string; KV blocks freed, callbacks run) when the next iteration
        begins. Thread-safe and never waits for a running iteration; unknown ids are ignored;
        the first reason given wins."""
        with self._admit:
            self._aborts.setdefault(seq_id, reason)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._inbox or self._aborts)

    def num_waiting(self) -> int:
        """Requests queued and not yet admitted to the running batch."""
        return len(self.scheduler.waiting) + len(self._inbox)

    def _admit_new(self) -> dict[int, str]:
        """Move the requests added since the last iteration into the scheduler's queue; returns
        the aborts asked for meanwhile, ``{seq id: finish reason}`` (the stepping thread only)."""
        with self._admit:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, {}
        for seq in inbox:
            self.scheduler.add(seq)
        return aborts

    def add_finish_listener(self, fn: Callable[[RequestResult, int], None]) -> None:
        """Call ``fn(output, prompt_tokens)`` for every request that ends (aborted ones too), on
        the thread that steps the engine (serving metrics)."""
        self._listeners.append(fn)

    def result(self, seq_id: int) -> RequestResult:
        """The output of a finished sequence (removes it from the engine)."""
        with self._admit:
            seq = self._seqs.pop(seq_id)
        return self._output(seq)

    @staticmethod
    def _output(s: Sequence) -> RequestResult:
        end = s.finish_s or s.arrival_s
        first = s.first_token_s or end  # an abort before any token
        return RequestResult(
            s.output,
            s.finish_reason or "length",
            s.commit_lengths,
            first - s.arrival_s,
            end - s.arrival_s,
            s.draft_lengths,
            s.accepted_lengths,
        )

    # ---- the iteration ----
    def _finish(self, seq: Sequence, done: list[Sequence]) -> None:
        if seq.finish_reason != "error":  # its K/V may serve later prompts (prefix cache)
            self.blocks.cache_prefix(seq.seq_id, seq.tokens, seq.num_cached, self._drafter_context(seq, ending=True))
        self.scheduler.remove(seq)
        self._probe_checks.pop(seq.seq_id, None)
        if self.lookup is not None:
            self.lookup.release(seq.seq_id)
        self._release.append(seq.seq_id)
        done.append(seq)
        if self._listeners:
            out = self._output(seq)
            for fn in self._listeners:
                callback(fn, out, seq.prompt_len)
        if seq.on_finish is not None:  # streamed: the callback gets the result, nobody collects it
            callback(seq.on_finish, seq.seq_id, self.result(seq.seq_id))

    def _drafter_context(self, seq: Sequence, ending: bool = False) -> tuple[int, int] | None:
        """The positions of ``seq`` (its prompt just prefilled, or ``ending``) whose drafter K/V
        its blocks will hold: those its drafting steps wrote, and, with the prefix cache on, the
        full blocks' waiting target features, queued for the runner to write (:attr:`StepPlan.ingest`,
        KV injection without drafting) before it drops them. At the prompt's end that is the
        prompt's last drafter window (a sliding-window drafter keeps no older features): a
        sequence that then decodes without drafting (the adaptive controller's plain iterations)
        leaves prompt blocks that a repeat of the prompt takes whole instead of prefilling their
        last window again. A sliding-window drafter's sequence that ends writes nothing more:
        its last window is what a later prompt needs only if it continues this sequence by
        fewer than a window's positions (the cache then hands over the blocks before that
        window, and the rest is prefilled), while writing it cost every plainly decoded
        sequence ~31 positions of the drafter's context projection (~half a decode step's work
        a sequence; 16 bf16 sequences of the load bench: ~0.5 % of the DFlash lane)."""
        proposer = self.runner.proposer
        if proposer is None:
            return None
        upto = seq.num_cached // self.blocks.tokens_per_block * self.blocks.tokens_per_block
        if (
            not self.blocks.prefix_caching
            or (ending and proposer.window is not None)
            or proposer.pending(seq.seq_id, upto) is None
        ):
            return proposer.drafted(seq.seq_id)
        self._ingest.append((seq.seq_id, list(self.blocks.table(seq.seq_id)), upto))
        return proposer.drafted_after_ingest(seq.seq_id, upto)

    def fail_all(self) -> int:
        """End every queued and running request with finish reason ``error`` (after an
        iteration failed: out of memory, a device error); their KV blocks are freed and their
        callbacks run. Returns how many."""
        with self._lock:
            self._admit_new()
            with self._admit:
                seqs = [s for s in self._seqs.values() if not s.finished]
            now = time.perf_counter()
            for s in seqs:
                s.finish_reason, s.finish_s = "error", now
                self._finish(s, [])
            self._suspects.clear()
            return len(seqs)

    def _run(self, plan: StepPlan):
        if self.tp is not None:
            self.tp.send_plan(plan)
        return self.runner.step(plan)

    def step(self) -> list[Sequence]:
        """Run one iteration; returns the sequences that finished in it (aborts and failed ones
        included). Its wall time (seconds) joins :attr:`iteration_s` (the last 4096 iterations).

        Raises:
            Exception: whatever the iteration raised, unless :attr:`isolate_failures` (then only
                what cannot be attributed to a request: under tensor parallelism, or raised
                while scheduling).
        """
        with self._lock:
            t0 = time.perf_counter()
            done = self._step()
            self.iteration_s.append(time.perf_counter() - t0)
            return done

    def _step(self) -> list[Sequence]:
        done: list[Sequence] = []
        for sid, reason in self._admit_new().items():
            seq = self._seqs.get(sid)
            if seq is not None and not seq.finished:
                seq.finish_reason = reason
                seq.finish_s = time.perf_counter()
                self._finish(seq, done)
        t0 = time.perf_counter()
        only, held = self._turn()
        decoding = self.scheduler.decoding(only, held)
        probe = False
        if self.controller is not None:
            nd, probe = self.controller.choose(len(decoding), token_budget=self.config.scheduler.max_num_tokens)
        else:
            nd = self.block_size - 1
        sched = self.scheduler.schedule(1 if probe else 1 + nd, only, held)
        drafts, unverified = self._drafts(sched, nd, probe)
        seqs = sched.decode + [s for s, _ in sched.prefill]
        rng = {s.seq_id: s.generator.get_state() for s in seqs if s.generator is not None}
        plan = None
        try:
            plan = self._plan(sched, drafts, unverified)
            if not plan.items:
                if plan.release or plan.ingest:
                    self._run(plan)  # let the other ranks drop released state
                return done
            out = self._run(plan)
        except Exception:
            if not self.isolate_failures or self.tp is not None:
                raise
            if plan is not None:
                self._release[:0], self._ingest[:0] = plan.release, plan.ingest
            self._failed(seqs, rng, done)
            return done
        before = {s.seq_id: len(s.output) for s in seqs} if only is not None else {}
        committed = self._commit(sched, plan, out, done)
        if only is not None:  # a turn apart: whoever committed a token since rejoins the batch
            self._clear([s.seq_id for s in seqs if s.finished or len(s.output) > before[s.seq_id]])
        if self.controller is not None:
            self._feedback(sched, plan, out, committed, time.perf_counter() - t0, probe)
        return done

    def _drafts(self, sched: Schedule, nd: int, probe: bool) -> tuple[list[int], tuple[int, int] | None]:
        """The draft tokens of each decoding sequence of ``sched`` and the unverified probe
        (:meth:`_plan`'s ``drafts`` and ``unverified``) for the controller's choice: ``nd`` drafts
        each (at most a request's ``max_draft_tokens``), or with ``probe`` one sequence's, each
        in turn. A sequence whose drafter context has a gap (iterations that kept no features,
        :meth:`_captures`) decodes plainly, and is not probed, until blocks no longer see it."""
        if not nd:  # plain decoding (a probe drafts too): no sequence drafts (``_plan`` reads past the list as 0)
            return [], None
        caps = [s.request.max_draft_tokens for s in sched.decode]
        drafts = [nd if c is None else min(nd, c) for c in caps]
        ready = self.runner.proposer.ready  # (drafting: an engine with a drafter)
        if not (probe and drafts):
            return [k if ready(s.seq_id, s.num_cached) else 0 for s, k in zip(sched.decode, drafts)], None
        j = self._probe_turn % len(drafts)  # one sequence drafts, each in turn (see ``_probe_turn``)
        self._probe_turn += 1
        s = sched.decode[j]
        if not ready(s.seq_id, s.num_cached):
            return [], None
        if self._probe_unverified(s, len(drafts), drafts[j]):  # (none while one is checked)
            return [], ((j, drafts[j]) if s.seq_id not in self._probe_checks else None)
        return [0] * j + drafts[j : j + 1], None

    # ---- failed iterations ----
    def _turn(self) -> tuple[AbstractSet[int] | None, AbstractSet[int]]:
        """Who runs this iteration while failed iterations' sequences are being run apart:
        ``(only, held)`` for :meth:`Scheduler.schedule`. Turns alternate between the front group
        of suspects alone and everyone else (the suspects held), so that the other requests
        keep streaming meanwhile; the group runs whenever no one else can."""
        if not self._suspects:
            return None, frozenset()
        running = {s.seq_id for s in self.scheduler.running}
        groups = [kept for g in self._suspects if (kept := [sid for sid in g if sid in running])]
        self._suspects = deque(groups)
        if not groups:
            return None, frozenset()
        held = frozenset(sid for g in groups for sid in g)
        others = self.scheduler.waiting or len(running) > len(held)
        self._suspects_turn = not self._suspects_turn
        if self._suspects_turn or not others:
            return frozenset(groups[0]), frozenset()
        return None, held

    def _clear(self, seq_ids: list[int]) -> None:
        """These sequences ran apart and committed: they rejoin the batch."""
        gone = set(seq_ids)
        self._suspects = deque(kept for g in self._suspects if (kept := [sid for sid in g if sid not in gone]))

    def _failed(self, seqs: list[Sequence], rng: dict[int, torch.Tensor], done: list[Sequence]) -> None:
        """The iteration of ``seqs`` raised (the exception is being handled) and nothing of it
        was committed. One sequence: it ends with ``error``. Several: each is preempted by
        recompute (its generator back where the iteration found it) and they are split in two
        groups that run apart from the others, ahead of any earlier suspects."""
        for s in seqs:
            if s.seq_id in rng:
                s.generator.set_state(rng[s.seq_id])
        ids = [s.seq_id for s in seqs]
        self._clear(ids)
        if len(seqs) == 1:
            log.error("an engine iteration failed on request %d alone: it ends with an error", ids[0], exc_info=True)
            self._fail(seqs[0], done)
            return
        if not seqs:
            log.exception("an engine iteration without requests failed")
            return
        log.warning(
            "an engine iteration of %d requests failed; they are recomputed and run apart to find the one that fails",
            len(seqs),
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
        for s in seqs:
            s.preempt(self.blocks)
            self._release.append(s.seq_id)  # the runner drops its features with the next plan
        half = (len(ids) + 1) // 2
        self._suspects.extendleft([ids[half:], ids[:half]])

    def _fail(self, s: Sequence, done: list[Sequence]) -> None:
        """End ``s`` with finish reason ``error`` (unless it has ended already)."""
        if s in done:
            return
        s.finish_reason, s.finish_s = "error", time.perf_counter()
        self._finish(s, done)

    def _feedback(self, sched: Schedule, plan: StepPlan, out, committed: int, wall_s: float, probe: bool) -> None:
        """The adaptive controller learns from the iteration: forward costs (every iteration),
        and, for decode-only iterations where every sequence drafted or none did, the mode's
        host cost and achieved rate from the whole iteration's wall time ``wall_s``. Nothing is
        learnt from an iteration that captured a CUDA graph (its times include the capture)."""
        ctl = self.controller
        # (a plan without a drafter block drafted and probed nothing: its items are not walked)
        drafting = [it.num_draft > 0 for it in plan.items] if plan.draft_block else []
        probing = sum(it.probe_draft > 0 for it in plan.items) if plan.draft_block else 0
        n = sum(drafting) + probing if out.drafter_ran else 0  # (not when prompt-lookup tokens filled every draft)
        cold, self._drafted_last = n > self._drafted_last, n
        if out.captured:
            return
        decode_only = sched.decode and not sched.prefill
        ragged = probe and not probing and len(sched.decode) > 1  # (a verified one-sequence probe among others)
        if decode_only and (out.replayed or not self.config.model.cuda_graphs) and not ragged:
            # decode-only iterations, the forwards the controller chooses between (an iteration
            # with a prompt chunk is not; nor a one-sequence probe's ragged verify among other
            # sequences: at 4 bf16 sequences on a 2-core CPU one measured at 54 ms among 28-31,
            # and the fit, which rises with the size, put every verify size above it; alone,
            # at batch 1, a probe's verify is the one measurement of the verify sizes while plain
            # decoding wins); under CUDA graphs replayed ones (an eager forward costs several
            # times a replay of its size)
            ctl.target_cost.observe(out.target_tokens, out.target_s)
        if n:
            ctl.observe_drafter(n, n * plan.draft_block, out.draft_s, cold=cold)
        if decode_only and not probing and (all(drafting) or not any(drafting)):
            # (not a batch probe, not capped per request)
            ctl.observe_iteration(  # (less the ended sequences' KV injection: either mode does it)
                len(sched.decode), any(drafting), wall_s - out.ingest_s, committed, out.target_s + out.draft_s, probe
            )
        if decode_only:  # the probes' measured budget (every kind of iteration)
            ctl.observe_wall(len(sched.decode), wall_s - out.ingest_s, committed)

    def _plan(self, sched: Schedule, drafts: list[int], unverified: tuple[int, int] | None = None) -> StepPlan:
        """Items for the schedule; decoding sequence ``j`` drafts ``drafts[j]`` tokens (0 past
        the list's end); ``unverified``: ``(j, k)``, decoding sequence ``j`` decodes plainly and
        the drafter proposes ``k`` tokens and a shadow for it, unverified (the drafts are
        checked against what it commits next: :meth:`_probe_unverified`)."""
        items = []
        for s, n in sched.prefill:
            table = self.blocks.ensure(s.seq_id, s.num_cached + n)
            ends_prompt = not s.output and s.num_cached + n == s.prompt_len  # (a recompute commits nothing)
            item = StepItem(
                s.seq_id,
                s.tokens[s.num_cached : s.num_cached + n],
                s.num_cached,
                list(table),
                num_logits=int(ends_prompt),
            )
            _sample_on_device(s, item)
            items.append(item)
        block = self.draft_block(unverified[1] if unverified else max(drafts, default=0))
        for j, s in enumerate(sched.decode):
            nd = drafts[j] if j < len(drafts) else 0
            probe = block - 1 if unverified and unverified[0] == j else 0
            span = block if nd or probe else 1  # the drafter writes a whole block
            table = self.blocks.ensure(s.seq_id, s.num_cached + span)
            item = StepItem(
                s.seq_id, [s.tokens[-1]], s.num_cached, list(table), num_draft=nd, num_logits=1 + nd, probe_draft=probe
            )
            if nd and self.lookup is not None:
                item.lookup = self.lookup.propose(s.seq_id, s.tokens, nd)
            _sample_on_device(s, item)
            items.append(item)
        release, self._release = self._release, []
        ingest, self._ingest = self._ingest, []
        capture = self._captures(sched, block)
        return StepPlan(items, block, release, ingest, capture)

    def _captures(self, sched: Schedule, block: int) -> bool:
        """Whether the iteration keeps its target features for the drafter
        (:attr:`StepPlan.capture`): always, but in the decode-only iterations without drafting
        that no drafting block of a sliding-window drafter will see, as the controller plans
        (:meth:`~.adaptive.DraftLengthController.idle_iterations` past the window). Capturing
        them and storing each sequence's cost the DFlash engine ~1 % of a plain iteration's
        time at 16 bf16 sequences on a 2-core CPU, where the controller decodes plainly; the
        positions left out are a gap that keeps a sequence from drafting until blocks no longer
        see it (:meth:`~.spec_decode.dflash.DFlashProposer.ready`)."""
        ctl = self.controller  # (an adaptive engine's: it has a drafter)
        if block or sched.prefill or ctl is None or self.runner.proposer.window is None:
            return True
        return ctl.idle_iterations() <= self.runner.proposer.window

    def _probe_unverified(self, s: Sequence, seqs: int, k: int) -> bool:
        """Whether the controller's one-sequence probe of ``s`` (``k`` drafts, ``seqs``
        sequences decoding) runs the drafter alone, its drafts checked against the tokens ``s``
        commits over the next iterations (:meth:`_check_probe`), instead of a verify of ``s``'s
        drafts in the target's forward. For a greedy request the two measure the same acceptance
        (a draft is accepted exactly when it equals the target's token); the unverified probe
        adds no target rows and gains no tokens, and is taken where the controller predicts it
        the cheaper (:meth:`~.adaptive.DraftLengthController.unverified_probe`: at 16 bf16
        sequences on a 2-core CPU a verified probe's ragged step, 16 rows past the AMX tile's
        16, cost +15-25 ms on a ~30 ms step, the drafter alone ~4 ms; at 4 the verified one).
        Sampled requests (accepted by rejection sampling, not by equality), prompt lookup (its
        tokens replace the drafter's) and the controller's every-sequence probes (they measure
        a verify's cost too) verify. A probe of ``s`` while its last one is still being checked
        is skipped (that check's evidence is on its way)."""
        ctl = self.controller
        return s.generator is None and self.lookup is None and not ctl.uniform_probes and ctl.unverified_probe(seqs, k)

    def _check_probe(self, s: Sequence) -> None:
        """Check ``s``'s unverified probe drafts against the tokens it has committed: the
        longest matching prefix goes to the controller as one verify would
        (:meth:`~.adaptive.DraftLengthController.observe_acceptance`), once a draft differs or
        every draft's position is committed (or ``s`` finished: what it committed counts)."""
        first, drafts = self._probe_checks[s.seq_id]
        got = s.tokens[first : first + len(drafts)]
        acc = 0
        while acc < len(got) and got[acc] == drafts[acc]:
            acc += 1
        if acc == len(got) < len(drafts) and not s.finished:
            return  # all matched so far: the next tokens decide
        del self._probe_checks[s.seq_id]
        self.controller.observe_acceptance(len(got) if acc == len(got) else len(drafts), acc, 1)

    def draft_block(self, most: int) -> int:
        """The drafter's block for an iteration whose sequences draft at most ``most`` tokens
        (0: nothing drafted): ``most + 2`` positions (at most the block size), or the whole block
        size under CUDA graphs (the drafter's graphs are captured at it). A block ``[anchor, MASK
        x (most + 1)]`` drafts its first positions as well as a whole one does (this repository's
        drafter, bf16, 8 GSM8K prompts: first-position acceptance 0.39 with block 2, 0.42 with
        block 8), and the drafter's layers and its LM head run over ``most + 2`` rows a sequence
        instead of ``block_size`` (one draft a sequence at 4 sequences: 12 rows instead of 32).
        The position past the drafts is a shadow draft (:attr:`StepOutput.shadow`): checked
        against the bonus token, it measures the next position's acceptance, which drafting
        ``most`` tokens alone never reaches (at 4 bf16 sequences the controller drafted one
        token a sequence on a second-position acceptance of 0.31 read from a few early blocks,
        and its lanes ran at 0.96-1.00x plain decoding where two drafts each ran at 1.05-1.07x)."""
        if most == 0:
            return 0
        return self.block_size if self.config.model.cuda_graphs else min(most + 2, self.block_size)

    def _commit(self, sched: Schedule, plan: StepPlan, out, done: list[Sequence]) -> int:
        """Commit and stream the iteration's tokens (the runner chose the target's tokens and
        accepted drafts against them on the device); returns how many were committed."""
        st = self.stats
        st.iterations += 1
        st.replayed_iterations += out.replayed
        st.capture_iterations += out.captured
        if sched.decode:
            st.verify_s += out.target_s
            st.verify_calls += 1
            if out.drafter_ran:
                st.draft_s += out.draft_s
                st.draft_calls += 1
        else:
            st.prefill_s += out.target_s
        ctl = self.controller
        n_prefill = len(sched.prefill)
        committed_before = st.committed

        def prefill(i: int, s: Sequence, n: int) -> None:
            s.num_cached += n
            if plan.items[i].num_logits:
                s.commit(out.choice[i][:1])
                if s.finished:
                    self._finish(s, done)
                elif self.blocks.prefix_caching:  # the prompt's full blocks serve repeats from now on
                    self.blocks.cache_prefix(s.seq_id, s.tokens, s.num_cached, self._drafter_context(s))

        n_drafting = sum(bool(out.drafts[n_prefill + j]) for j in range(len(sched.decode)))

        def verify(i: int, s: Sequence) -> None:
            drafts = out.drafts[i]
            acc = out.accepted[i] if drafts else 0  # accepted against the target's tokens on the device
            kept = s.commit(drafts[:acc] + [out.choice[i][acc]])
            s.commit_lengths.append(len(kept))
            s.draft_lengths.append(len(drafts))
            s.accepted_lengths.append(acc)
            if out.probes[i] is not None:  # its drafts are checked as it commits the next tokens
                self._probe_checks[s.seq_id] = (s.num_cached + 1, out.probes[i])
            s.num_cached += acc + 1
            if s.seq_id in self._probe_checks:
                self._check_probe(s)
            st.record_verify(len(drafts), acc, len(kept))
            st.lookup_steps += bool(plan.items[i].lookup)
            if ctl is not None and drafts:
                n, shadow = len(drafts), out.shadow[i]
                if shadow is not None and acc == n:  # the shadow's position reached: the bonus token says
                    n, acc = n + 1, acc + (shadow == out.choice[i][acc])
                ctl.observe_acceptance(n, acc, n_drafting)
            if s.finished:
                self._finish(s, done)
            else:
                self.blocks.truncate(s.seq_id, s.num_cached)  # roll back rejected positions

        for i, (s, n) in enumerate(sched.prefill):
            self._guarded(s, done, prefill, i, s, n)
        for j, s in enumerate(sched.decode):
            self._guarded(s, done, verify, n_prefill + j, s)
        return st.committed - committed_before

    def _guarded(self, s: Sequence, done: list[Sequence], fn: Callable, *args) -> None:
        """``fn(*args)``, which commits sequence ``s``'s tokens; with :attr:`isolate_failures`,
        an exception in it ends ``s`` alone with ``error`` (the other sequences of the iteration
        commit theirs)."""
        if not self.isolate_failures:
            return fn(*args)
        try:
            fn(*args)
        except Exception:
            log.error("committing the tokens of request %d failed: it ends with an error", s.seq_id, exc_info=True)
            self._fail(s, done)

    def run(self) -> None:
        """Step until every queued request has finished, then hand the runner (every TP rank)
        the last released sequences so it drops their state."""
        while self.has_unfinished():
            self.step()
        with self._lock:
            if self._release or self._ingest:
                release, self._release = self._release, []
                ingest, self._ingest = self._ingest, []
                self._run(StepPlan([], release=release, ingest=ingest))

    def generate(self, requests: list[Request], on_tokens: TokenCallback | None = None) -> list[RequestResult]:
        """Run ``requests`` to completion with in-flight batching (all queued at once) and
        return their results in order; ``on_tokens(index, tokens)`` streams each request's
        committed tokens by its index in ``requests``.

        Raises:
            DFlashError: a request the engine could never serve (nothing is queued then).
        """
        for r in requests:
            self.check_request(r)
        cb = (lambda i: lambda _sid, toks: on_tokens(i, toks)) if on_tokens is not None else (lambda i: None)
        sids = [self.add_request(r, cb(i)) for i, r in enumerate(requests)]
        self.run()
        return [self.result(sid) for sid in sids]

    def rewarm(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int = 3) -> float:
        """One untimed request between measured runs, the adaptive controller held aside meanwhile
        (it neither chooses nor learns: the request drafts whole blocks, so the drafter runs too).
        After the host left the engine idle its first forwards run slow (2-core VM, a prefill of
        two prompts: 54-93 ms one after another, 365-407 ms after 1 s idle, 661 ms after 3 s),
        and a measured run started cold takes it all in its first iterations.

        Returns:
            seconds spent.

        Raises:
            DFlashError: as :meth:`generate`.
        """
        t = time.perf_counter()
        ctl, self.controller = self.controller, None
        try:
            self.generate([Request(prompt, max_new_tokens, sampling)])
        finally:
            self.controller = ctl
        return time.perf_counter() - t

    def warm_up(self, prompts: list[list[int]], sampling: SamplingParams, max_new_tokens: int = 8) -> float:
        """Untimed requests before a measured run: ``prompts[0]`` alone, ``max_new_tokens``
        tokens. On the compiled path (``ModelConfig.compile``) then all ``prompts`` at once,
        and ``prompts[0]`` again joining them while they decode: torch.compile specialises a
        batch of one sequence and the shape of the attention metadata (one prompt, uniform
        decode blocks, prompts beside decode blocks), so these graphs compile here rather than
        in the first timed iterations; the adaptive controller then starts afresh and is
        calibrated again (what it measured meanwhile included compiling). Otherwise the
        controller keeps its forward costs and forgets the acceptance, host costs and achieved
        rates it saw (:meth:`~.adaptive.DraftLengthController.forget_warm_up`).

        Args:
            prompts: prompt token ids (at least one; two or more to warm batched steps up).
            sampling: sampling parameters of the warm-up requests.
            max_new_tokens: tokens generated per warm-up request.

        Returns:
            seconds spent (on the compiled path, mostly compiling: report it apart from tok/s).

        Raises:
            DFlashError: as :meth:`add_request` (empty prompt, ``max_new_tokens < 1``, ...).
        """
        t = time.perf_counter()
        compiled = self.config.model.compile

        def add(batch: list[list[int]]) -> list[int]:
            return [self.add_request(Request(p, max_new_tokens, sampling)) for p in batch]

        sids = add(prompts[:1])
        self.run()
        if compiled and len(prompts) > 1:
            sids += add(prompts)
            for _ in range(2):  # the batch decodes; then a request joins it (a prompt beside verify blocks)
                self.step()
            sids += add(prompts[:1])
            self.run()
        for sid in sids:
            self.result(sid)
        if compiled and self.controller is not None:
            self.controller = self._new_controller()
            self.calibrate()
        elif self.controller is not None:
            self.controller.forget_warm_up()  # (its forward costs stay: measured warm, after the first forwards)
        return time.perf_counter() - t

    def _new_controller(self) -> DraftLengthController:
        """A fresh adaptive draft-length controller for this engine's block size, set for its
        kind of iterations (:func:`~.adaptive.engine_settings`)."""
        return DraftLengthController(self.block_size - 1, **engine_settings(self.config.model.cuda_graphs))

    # ---- start-up cost measurement for the adaptive controller ----
    def calibrate(self, max_tokens: int = 256) -> None:
        """Measure the target's forward cost on decode steps of ``s`` = 1, 2, 4, ... sequences
        (powers of two up to :data:`CALIBRATION_MAX_SEQS` and ``max_tokens``, ``s * block_size``
        within the token budget): plain (``s`` tokens), one draft each (``2 s``) and whole blocks
        (``s * block_size``), and the drafter's cost vs its tokens (sequences x block; blocks of one
        draft where :meth:`draft_block` follows the drafts), on scratch sequences that are freed
        afterwards: each has 7 tokens of its own after :data:`CALIBRATION_CONTEXT` positions that
        one prefill wrote once and every scratch sequence's block table shares (none where the
        KV cache is too small for them), all of them the calibration text's tokens
        (:data:`CALIBRATION_TEXT` as :attr:`calibration_ids`, by position: what a step reads
        sets its cost where the screened LM head weighs the candidates of its rows). Each step
        runs :data:`CALIBRATION_REPEATS` times, its
        median time kept; the first size's forwards run once more before (untimed): only a path's
        first call carries one-time costs (the drafter's: 0.78 s against 0.09 s warm, SmolLM2
        fp32, one thread); under CUDA graphs every forward runs twice (the first captures its
        graphs), the second timed. The controller goes on measuring every decode-only
        iteration (``_feedback``), and its cost model extends its last points linearly past the
        largest size measured here until the batches the engine really runs measure them. (The
        drafter sweep's 32- and 64-sequence points were ~3/4 of its cost. Single prompts of 1-256
        tokens, measured here before, are not forwards the controller chooses between.)"""
        ctl, K, bm = self.controller, self.block_size, self.blocks
        sched = self.config.scheduler
        sizes = [n for n in (2**i for i in range(12)) if n <= min(max_tokens, sched.max_num_tokens)]
        scratch: list[int] = []  # negative ids, never a request's

        def reserve(sids: list[int], n: int) -> list[list[int]] | None:
            if bm.num_unreserved_blocks < len(sids) * bm.blocks_for(n):
                return None
            for sid in sids:
                bm.reserve(sid, n)
            scratch.extend(sids)
            return [list(bm.ensure(sid, n)) for sid in sids]

        # every scratch sequence's context starts with the same CALIBRATION_CONTEXT positions (whole
        # blocks, one prefill, shared by every table; none where the cache has little room): a
        # verify's attention over a decoding context costs what it costs in serving (on 7-token
        # contexts a 32-token verify at 16 bf16 sequences measured ~45 ms against ~58 ms in the
        # load bench, and the model drafted at 16 sequences)
        ctx = CALIBRATION_CONTEXT // bm.tokens_per_block * bm.tokens_per_block
        if bm.num_unreserved_blocks <= 2 * bm.blocks_for(ctx):
            ctx = 0
        shared = reserve([-1], ctx)[0] if ctx else []
        if ctx:
            self._run(StepPlan([StepItem(-1, self._calibration_ids(0, ctx), 0, shared)]))
        at = ctx + 7  # each scratch sequence's 7 own tokens follow the shared context

        graphs = self.config.model.cuda_graphs

        def measure(plan: StepPlan, warm: bool):  # warm: one untimed run first
            if warm:
                self._run(plan)
            if graphs:
                return self._run(plan)
            outs = [self._run(plan) for _ in range(CALIBRATION_REPEATS)]
            out = outs[0]  # with the median of each time: a stall of the host in one run is not the size's cost
            out.target_s = statistics.median(o.target_s for o in outs)
            out.draft_s = statistics.median(o.draft_s for o in outs)
            return out

        # the target is measured on decode and verify steps alone, the forwards the controller
        # chooses between (not single prompts); the decode-only iterations' measurements then
        # replace these; under CUDA graphs each runs twice (the first captures its graph)
        most = min(sched.max_batch_size, CALIBRATION_MAX_SEQS)
        draft_sizes = [s for s in sizes if s <= most and s * K <= sched.max_num_tokens]
        for j, s in enumerate(draft_sizes):
            sids = [-1 - len(scratch) - i for i in range(s)]
            own = reserve(sids, 8 + K)
            if own is None:
                break
            tables = [shared + t for t in own]  # (the own blocks hold positions ctx on)
            self._run(StepPlan([StepItem(sid, self._calibration_ids(ctx, 7), ctx, t) for sid, t in zip(sids, tables)]))
            warm = j == 0 or graphs
            # a plain decode step of s sequences
            last = self._calibration_ids(at, 1)
            out = measure(StepPlan([StepItem(sid, last, at, t, num_logits=1) for sid, t in zip(sids, tables)]), warm)
            ctl.target_cost.observe(s, out.target_s)
            # a whole block each, and one draft each where the drafter's block follows the drafts
            for k in sorted({K - 1, K - 1 if graphs else 1}):
                out = measure(
                    StepPlan(
                        [StepItem(sid, last, at, t, num_draft=k, num_logits=k + 1) for sid, t in zip(sids, tables)],
                        draft_block=self.draft_block(k),
                    ),
                    warm,
                )
                ctl.observe_drafter(s, s * self.draft_block(k), out.draft_s)
                ctl.target_cost.observe(out.target_tokens, out.target_s)
        for sid in scratch:
            bm.release(sid)  # (a no-op for those already released)
        self._run(StepPlan([], release=scratch))  # the runner drops their features

    def _calibration_ids(self, start: int, n: int) -> list[int]:
        """Positions ``start .. start + n - 1`` of the calibration's text (:attr:`calibration_ids`,
        repeated as far as needed; token 0 throughout without one)."""
        ids = self.calibration_ids
        return [ids[i % len(ids)] for i in range(start, start + n)] if ids else [0] * n


def _sample_on_device(s: Sequence, item: StepItem) -> None:
    """What the runner needs to choose ``s``'s tokens after ``item``'s logits rows: for a sampled
    request its settings and one uniform per row, drawn now from the request's own generator (in
    row order, so a seed gives the same tokens at any batch size and on any device); while the
    request is below ``min_tokens``, its stop tokens banned on the rows that could end it."""
    if not item.num_logits:
        return
    p = s.request.sampling
    if not p.greedy:
        item.sampling = (p.temperature, p.top_k, p.top_p)
        item.uniforms = torch.rand(item.num_logits, generator=s.generator).tolist()
    early = s.request.min_new_tokens - len(s.output)
    if early > 0 and s.stops:
        item.banned, item.banned_rows = sorted(s.stops), min(early, item.num_logits)
