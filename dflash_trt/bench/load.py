"""``dflash-trt bench --concurrency 1,4,16``: throughput and latency under load.

For each concurrency ``C`` and both modes in the same run -- ``dflash`` (an :class:`LLMEngine`
with the drafter, the adaptive draft-length controller unless ``adaptive=False``) and ``ar``
(plain decoding: block size 1, no drafter) -- the same requests (real prompts of the bench
dataset in the chat template, cycled when there are fewer prompts than requests) arrive as a
Poisson process at ``request_rate`` req/s (``None`` / inf: all at t=0), with at most ``C`` in
flight (vLLM ``benchmark_serving --max-concurrency``: a request due while ``C`` are in flight
waits for one of them to finish).

The driver is one thread. Each mode is a :class:`Lane` with its own clock that advances only
while that mode's engine runs an iteration (or, idle, jumps to the next arrival); the lanes of
one concurrency run interleaved, the one whose clock is behind stepping next, so a period in
which another process takes the CPU (or the GPU's clocks drop) slows every mode in proportion to
its compute instead of whichever mode ran then (under TP the modes run one after the other: the
worker ranks mirror one engine at a time). A lane adds the requests that are due (arrival time
passed, fewer than ``C`` in flight) and calls ``engine.step()``. A request's clock starts when
it is released to the engine: at its arrival time, or, when ``C`` were in flight then, when the
one whose slot it takes finished (time spent waiting for a slot is the client's, as in vLLM).
Time a due request spends waiting for the current ``step()`` to return counts in its TTFT.

Per (C, mode) row: ``output_tokens_per_s`` = all output tokens / seconds on the lane's clock from the
first arrival to the last finish; ``ttft_*`` from release to first token; ``tpot_*`` per request
``(latency - ttft) / (n_out - 1)`` over requests with more than one token;
``per_user_tokens_per_s`` = median over requests of ``n_out / latency``; ``iteration_p50_s`` /
``iteration_max_s`` = the median and longest ``step()`` of the lane; ``mean_draft_tokens`` and
``tau`` from the engine's counters over the timed requests (dflash rows with the adaptive
controller also carry its cost model and acceptance estimates after the run, ``controller``).
Each engine serves one untimed warm-up request first. Greedy runs also compare the dflash
outputs with the ar outputs request by request (``lossless``; ``divergences`` give the first
differing token and the target's top-2 logit margin there, as in ``bench/batch1.py``: a margin
near the dtype's resolution is a numerical tie between differently shaped GEMMs, not a
lossless-ness bug).
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..atomic import write_json
from ..checkpoints.engine_dir import kv_capacity
from ..checkpoints.loader import parse_dtype
from ..engine_args import EngineArgs
from ..errors import ConfigError, DFlashError
from ..models.prefill import first_divergence, top2_margin
from ..prompts import DATASETS, chat_prompt_ids
from ..runtime.distributed import TPEngines, init_tp
from ..runtime.engine import LLMEngine
from ..runtime.engine_factory import create_engine, load_models, speculative_off
from ..runtime.request import LoopStats, Request
from ..runtime.sampling import SamplingParams
from .batch1 import BenchConfig, device_name

MODES = ("dflash", "ar")


@dataclass
class LoadConfig(BenchConfig):
    """Settings of one load benchmark (``dflash-trt bench --concurrency ...`` flags): the
    engine, prompt and sampling settings of :class:`BenchConfig` (``peers``: only ``vllm``, run
    at each concurrency next to our modes in every repeat; the engine's ``adaptive`` on by default here) plus

    Attributes:
        concurrency: the ``C`` values (most requests in flight), each >= 1.
        request_rate: Poisson arrival rate in req/s; None or inf: all requests arrive at t=0.
        num_requests: requests per concurrency; None: ``max(2 * C, num_prompts)``.
        modes: ``dflash`` and / or ``ar`` (plain decoding).
        repeats: runs of each concurrency's lanes (the modes interleaved in each); a mode's row
            is its run of median tokens/s (the lower middle one of an even count), with every
            run's tokens/s under ``repeats_tok_s``. On a shared host one stalled second in a
            lane of ~8 s moves its tokens/s by ~10 %: the lane ratios of one concurrency spread
            0.91-1.03 over six runs in one sitting (2-core VM, 16 bf16 sequences).
    """

    engine_args: EngineArgs = field(default_factory=lambda: EngineArgs(adaptive=True))
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    request_rate: float | None = None
    num_requests: int | None = None
    modes: tuple[str, ...] = field(default=MODES)
    repeats: int = 1

    def validate(self) -> None:
        """Raises ConfigError on a value no run could use (checked before any model loads)."""
        if not self.concurrency:
            raise ConfigError("concurrency", "needs at least one value")
        for c in self.concurrency:
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ConfigError("concurrency", f"values must be integers >= 1, got {c!r}")
        r = self.request_rate
        if r is not None and (not isinstance(r, (int, float)) or math.isnan(r) or r <= 0):
            raise ConfigError("request_rate", f"must be > 0 req/s (inf = all at once), got {r!r}")
        if self.dataset not in DATASETS and not self.prompts_file:
            raise DFlashError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        for name, v in (
            ("num_requests", self.num_requests),
            ("num_prompts", self.num_prompts),
            ("max_new_tokens", self.max_new_tokens),
            ("repeats", self.repeats),
        ):
            if v is not None and v < 1:
                raise ConfigError(name, f"must be >= 1, got {v}")
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError("modes", f"must be among {', '.join(MODES)}, got {self.modes!r}")
        if any(p != "vllm" for p in self.peers):
            raise DFlashError(f"the load benchmark's only peer is vllm, got {','.join(self.peers)}")
        if self.peers:
            from .vllm_peer import check_vllm_peer

            check_vllm_peer(self.engine_args)
        self.engine_args.create_engine_config()  # the engine's own settings

    def requests_for(self, c: int) -> int:
        return self.num_requests if self.num_requests is not None else max(2 * c, self.num_prompts)

    @property
    def poisson(self) -> bool:
        return self.request_rate is not None and math.isfinite(self.request_rate)


def kv_capacity_for(cfg: LoadConfig) -> tuple[int, str]:
    """``(KV capacity in tokens, where it came from)`` (:func:`~dflash_trt.checkpoints.engine_dir.kv_capacity`)."""
    return kv_capacity(cfg.engine_args.engine, cfg.engine_args.kv_capacity)


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each of ``n`` requests arrives: 0 for all when ``rate``
    is None or inf, else a Poisson process (exponential gaps, the first request at 0)."""
    if rate is None or not math.isfinite(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


@dataclass
class _Record:
    output: list[int]
    release_s: float
    first_s: float
    finish_s: float

    @property
    def ttft(self) -> float:
        return self.first_s - self.release_s

    @property
    def latency(self) -> float:
        return self.finish_s - self.release_s


class Lane:
    """One mode's closed loop: ``requests`` arriving at ``arrivals`` (seconds, non-decreasing)
    served by ``engine`` with at most ``concurrency`` in flight, timed on the lane's own clock.

    The clock advances only while the lane's engine runs an iteration (:meth:`tick` times its
    ``step()``) or, with nothing in flight, jumps to the next arrival. Lanes driven together by
    :func:`drive_lanes` therefore each see the machine as it was during their own iterations:
    a period of contention falls on every mode in proportion to the time it computes in it,
    not on whichever mode happened to run then. Engine timestamps (first token, finish; wall
    ``perf_counter`` seconds taken inside ``step()``) are mapped onto the lane's clock.
    """

    def __init__(
        self, engine: LLMEngine, requests: list[Request], arrivals: list[float], concurrency: int, progress=None
    ):
        self.engine, self.requests, self.arrivals = engine, requests, arrivals
        self.concurrency, self.progress = concurrency, progress
        self.clock = 0.0
        self.records: list[_Record | None] = [None] * len(requests)
        self._slots = [0.0] * concurrency  # heap: when each concurrency slot (next) becomes free
        self._live: dict[int, tuple[int, float]] = {}  # seq id -> (request index, release time)
        self._next = 0
        self._wall: list[float] = []  # wall time at the start of each iteration
        self._at_start: list[float] = []  # the lane's clock then
        self.iteration_s: list[float] = []  # seconds of each iteration

    @property
    def done(self) -> bool:
        return self._next >= len(self.requests) and not self._live

    def _on_clock(self, wall: float) -> float:
        i = max(bisect.bisect_right(self._wall, wall) - 1, 0)
        return self._at_start[i] + (wall - self._wall[i])

    def tick(self) -> None:
        """Release the requests that are due (arrived, a slot free), then run one engine
        iteration; with nothing in flight, move the clock to the next arrival instead."""
        n, arrivals = len(self.requests), self.arrivals
        while self._next < n and len(self._live) < self.concurrency and arrivals[self._next] <= self.clock:
            release = max(arrivals[self._next], heapq.heappop(self._slots))
            self._live[self.engine.add_request(self.requests[self._next])] = (self._next, release)
            self._next += 1
        if not self._live:
            if self._next < n:
                self.clock = max(self.clock, arrivals[self._next])
            return
        start = time.perf_counter()
        self._wall.append(start)
        self._at_start.append(self.clock)
        finished = self.engine.step()
        self.iteration_s.append(time.perf_counter() - start)
        self.clock += self.iteration_s[-1]
        for seq in finished:
            idx, release = self._live.pop(seq.seq_id)
            first, end = self._on_clock(seq.first_token_s or seq.finish_s), self._on_clock(seq.finish_s)
            rec = self.records[idx] = _Record(self.engine.result(seq.seq_id).output_ids, release, first, end)
            heapq.heappush(self._slots, rec.finish_s)
            if self.progress is not None:
                self.progress.update(1)


def drive_lanes(lanes: list[Lane]) -> None:
    """Run the lanes to completion interleaved: the lane whose clock is furthest behind runs
    the next iteration, so every lane has computed for about the same time at any moment."""
    while pending := [lane for lane in lanes if not lane.done]:
        min(pending, key=lambda lane: lane.clock).tick()
    for lane in lanes:
        lane.engine.run()  # hands the runner the last released sequences


def drive(
    engine: LLMEngine, requests: list[Request], arrivals: list[float], concurrency: int, progress=None
) -> list[_Record]:
    """Serve ``requests`` (arriving at ``arrivals``) with at most ``concurrency`` in flight,
    alone; one record per request, times in seconds on the lane's clock (:class:`Lane`)."""
    lane = Lane(engine, requests, arrivals, concurrency, progress)
    drive_lanes([lane])
    return lane.records  # type: ignore[return-value]


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(records: list[_Record], stats: LoopStats, iteration_s: list[float]) -> dict:
    """The figures of one (C, mode) run; ``iteration_s``: the lane's iteration times (the
    median and the longest are reported: one stalled iteration, e.g. when another process
    takes the cores, shows as a maximum far above the median)."""
    n_out = [len(r.output) for r in records]
    tokens = sum(n_out)
    wall = max(r.finish_s for r in records) - min(r.release_s for r in records)
    ttft = [r.ttft for r in records]
    tpot = [(r.latency - r.ttft) / (k - 1) for r, k in zip(records, n_out) if k > 1]
    per_user = [k / r.latency for r, k in zip(records, n_out) if r.latency > 0]
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "per_user_tokens_per_s": float(np.median(per_user)) if per_user else None,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "iteration_p50_s": _pct(iteration_s, 50),
        "iteration_max_s": max(iteration_s, default=None),
        "mean_draft_tokens": stats.mean_draft_tokens,
        "tau": stats.tau,
        # under CUDA graphs: iterations whose target forward ran eagerly (prompt chunks, ...) and
        # those that captured a graph, out of all (the medians above hide both)
        "iterations": stats.iterations,
        "eager_iterations": stats.iterations - stats.replayed_iterations,
        "capture_iterations": stats.capture_iterations,
    }


def controller_state(ctl) -> dict:
    """The adaptive controller's model after a run (:meth:`DraftLengthController.state`)."""
    return ctl.state()


def median_index(values: list[float]) -> int:
    """The index of ``values``' median (the lower middle one of an even count)."""
    return sorted(range(len(values)), key=values.__getitem__)[(len(values) - 1) // 2]


def run_load_bench(cfg: LoadConfig, progress=print) -> dict | None:
    """Run the load benchmark and return the result dict (also written to ``cfg.json_out``).

    Under ``mpiexec -n N`` the target is tensor-parallel over the N ranks: rank 0 runs the
    benchmark and returns the result, the other ranks serve as TP workers and return None.

    Raises:
        DFlashError: bad settings, bad checkpoints, impossible block size or engine settings.
    """
    cfg.validate()
    kv_cap, kv_src = kv_capacity_for(cfg)
    progress(f"KV capacity: {kv_cap:,} tokens ({kv_src})")
    # under mpiexec: rank 0 runs the benchmark, the other ranks mirror every engine (TP shards;
    # with a tp_size N engine each rank reads only its own target rank file)
    run = _LoadRun(cfg, kv_cap, init_tp(), progress)
    if run.tp is not None and run.tp.rank != 0:
        run.tp_engines.serve()
        run.tp.shutdown()
        return None
    try:
        for mode in cfg.modes:
            run.engine_for(mode)
        rows, peer_rows = [], []
        for c in cfg.concurrency:
            mine, theirs = run.at_concurrency(c)
            rows += mine
            peer_rows += theirs
    finally:
        run.close_peers()
    result = run.result(rows, kv_src)
    if "vllm" in cfg.peers:
        result["peers"], result["peer_errors"] = peer_rows, run.peer_errors
    if run.tp is not None:
        run.tp_engines.close()
        run.tp.shutdown()
    if cfg.json_out:
        write_json(cfg.json_out, result)
    return result


class _LoadRun:
    """One load benchmark's models, prompts and engines (one per mode, built and warmed up
    once; under TP anew for every run, since the worker ranks mirror one engine at a time)."""

    def __init__(self, cfg: LoadConfig, kv_cap: int, tp, progress):
        self.cfg, self.kv_cap, self.tp, self.progress = cfg, kv_cap, tp, progress
        self.sampling = SamplingParams(temperature=cfg.temperature, seed=cfg.seed)
        config = cfg.engine_args.create_engine_config()
        if "dflash" not in cfg.modes:
            config = speculative_off(config)
        self.models = load_models(config, tp.rank if tp else 0, tp.size if tp else 1)
        drafter = self.models.drafter
        self.prompts = [chat_prompt_ids(self.models.target.tokenizer, t) for t in cfg.prompts()]
        self.K = cfg.engine_args.block_size or (drafter.cfg.block_size if drafter is not None else 1)
        self.tp_engines = TPEngines(self.models, tp) if tp is not None else None
        self.engines: dict[str, LLMEngine] = {}
        self.vllm = None  # the vLLM peers (VllmPeers), opened at the first concurrency
        self.peer_errors: dict[str, str] = {}

    def engine_for(self, mode: str) -> LLMEngine:
        """The mode's engine (its warm-up untimed; on the compiled path a batch and a request
        joining it compile there)."""
        a, tp = self.cfg.engine_args, self.tp
        if mode in self.engines and tp is None:
            return self.engines[mode]
        dflash = mode == "dflash"
        args = a.replace(
            block_size=self.K if dflash else 1,
            adaptive=a.adaptive and dflash,
            kv_capacity=self.kv_cap,
            prompt_lookup_min=a.prompt_lookup_min if dflash else 0,
        )
        if mode not in self.engines:
            self.progress(
                f"{mode}: building the engine (block size {args.block_size}"
                f"{', adaptive: measuring forward costs' if args.adaptive else ''}"
                f"{f', TP {tp.size}' if tp else ''}) ..."
            )
        eng = self.tp_engines.make(args) if tp is not None else create_engine(args, self.models)
        warm_s = eng.warm_up(self.prompts[:3], self.sampling, min(8, self.cfg.max_new_tokens))
        if a.compile:
            self.progress(f"{mode}: compiled in {warm_s:.0f} s (warm-up, untimed)")
        self.engines[mode] = eng
        return eng

    def at_concurrency(self, c: int) -> tuple[list[dict], list[dict]]:
        """One row per mode at concurrency ``c``: of :attr:`LoadConfig.repeats` runs, the mode's
        run of median tokens/s, with every run's tokens/s (``repeats_tok_s``) and lossless only
        if every run was; and with ``--peers vllm`` one row per vLLM peer the same way, each of
        its runs next to one of ours (after it, or before it in every other repeat), so that a
        slow period of the host falls on both."""
        runs, plain, theirs = [], [], []
        for i in range(self.cfg.repeats):
            peers_first = i % 2 == 1
            got = self._run_peers(c) if peers_first else None
            rows, ar = self._run_lanes(c)
            runs.append(rows)
            plain.append(ar)
            if not peers_first:
                got = self._run_peers(c)
            if got:
                theirs.append(got)
        rows = []
        for mine in zip(*runs):  # one mode's row of every run
            tok_s = [r["output_tokens_per_s"] or 0.0 for r in mine]
            row = dict(mine[median_index(tok_s)])
            row["repeats_tok_s"] = tok_s
            if row["lossless"] is not None:
                row["lossless"] = all(r["lossless"] for r in mine)
            rows.append(row)
        return rows, self._peer_rows(c, theirs, plain)

    def requests(self, c: int) -> list[list[int]]:
        """The prompts of concurrency ``c``'s requests (the bench prompts cycled)."""
        return [self.prompts[i % len(self.prompts)] for i in range(self.cfg.requests_for(c))]

    def _run_lanes(self, c: int) -> tuple[list[dict], list[list[int]] | None]:
        """One run of every mode's lane at concurrency ``c``: a row per mode, and plain
        decoding's outputs (None without the ``ar`` mode)."""
        from tqdm import tqdm

        cfg = self.cfg
        req_prompts = self.requests(c)
        n = len(req_prompts)
        arrivals = arrival_times(n, cfg.request_rate, cfg.seed * 1_000_003 + c)
        # one process: the modes' lanes interleaved, so contention falls on each in proportion to
        # its compute; under TP the worker ranks mirror one engine at a time: one after the other
        groups = [list(cfg.modes)] if self.tp is None else [[m] for m in cfg.modes]
        lanes: dict[str, Lane] = {}
        with tqdm(total=n * len(cfg.modes), desc=f"C={c}", unit="req", leave=False, disable=None) as bar:
            for group in groups:
                for mode in group:
                    eng = self.engine_for(mode)
                    if self.tp is None:  # warm again after the pause before this run (under TP: built anew)
                        eng.rewarm(self.prompts[0], self.sampling)
                    eng.stats = LoopStats(eng.block_size)  # count the timed requests only
                    reqs = [Request(p, cfg.max_new_tokens, self.sampling) for p in req_prompts]
                    lanes[mode] = Lane(eng, reqs, arrivals, c, bar)
                drive_lanes([lanes[m] for m in group])
        outputs = {mode: [r.output for r in lane.records] for mode, lane in lanes.items()}
        # every mode's requests against plain decoding's (the ar row shows DFlash's)
        divergences = {mode: self._divergences(outputs, mode, req_prompts) for mode in outputs if mode != "ar"}
        rows = []
        for mode in cfg.modes:
            lane = lanes[mode]
            eng = lane.engine
            row = {"concurrency": c, "mode": mode, "block_size": eng.block_size, "interleaved": len(groups[0]) > 1}
            row |= summarize(lane.records, eng.stats, lane.iteration_s)
            if eng.controller is not None:
                row["controller"] = controller_state(eng.controller)
            found = divergences.get("dflash" if mode == "ar" else mode)
            row["lossless"] = None if found is None else not found
            row["divergences"] = found
            rows.append(row)
        return rows, outputs.get("ar")

    def _run_peers(self, c: int) -> dict | None:
        """vLLM plain and DFlash (:class:`~.vllm_peer.VllmPeers`, opened on first use) on
        concurrency ``c``'s requests: ``{name: PeerResult}``; None when not asked for or failed
        (the error in :attr:`peer_errors`; what was measured before is kept)."""
        from .vllm_peer import VllmPeers, vllm_max_model_len

        cfg, target = self.cfg, self.models.target
        if "vllm" not in cfg.peers or self.peer_errors:
            return None
        if self.tp is not None:
            self.peer_errors["vllm"] = "peer vllm runs without tensor parallelism: bench it without mpiexec"
            return None
        try:
            if self.vllm is None:
                self.vllm = VllmPeers(
                    target.path,
                    self.models.drafter,
                    target.model.lm_head.weight,
                    parse_dtype(self.models.dtype),
                    target.stop_token_ids,
                    self.K,
                    max(cfg.concurrency),
                    vllm_max_model_len(self.prompts, cfg.max_new_tokens, self.K),
                    self.prompts[0],
                    torch.get_num_threads(),
                    self.progress,
                )
            return self.vllm.run(self.requests(c), cfg.max_new_tokens, c)
        except DFlashError as e:  # the peer fails alone: what was measured is kept
            self.progress(f"peer vllm failed: {e}")
            self.peer_errors["vllm"] = str(e)
            self.close_peers()
            return None

    def close_peers(self) -> None:
        """End the vLLM peers' children (idempotent)."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    def _peer_rows(self, c: int, theirs: list[dict], plain: list[list[list[int]] | None]) -> list[dict]:
        """One row per vLLM peer at concurrency ``c`` from its runs ``theirs`` (``{name:
        PeerResult}`` each): its run of median tokens/s, every run's under ``repeats_tok_s``,
        ``identical_to_ar`` against plain decoding's outputs of the same repeat."""
        rows = []
        for name in theirs[0] if theirs else ():
            res = [t[name] for t in theirs]
            tok_s = [r.tokens_per_s for r in res]
            r = res[median_index(tok_s)]
            same = [None if ar is None or self.cfg.temperature else x.outputs == ar for x, ar in zip(res, plain)]
            rows.append(
                {
                    "concurrency": c,
                    "mode": name,
                    "requests": len(r.outputs),
                    "output_tokens": r.new_tokens,
                    "output_tokens_per_s": r.tokens_per_s,
                    "tau": r.acceptance_length,
                    "identical_to_ar": None if None in same else all(same),
                    "repeats_tok_s": tok_s,
                }
            )
        return rows

    def _divergences(
        self, outputs: dict[str, list[list[int]]], mode: str, req_prompts: list[list[int]]
    ) -> list[dict] | None:
        """Greedy runs of plain decoding and ``mode``: the requests where ``mode`` parts from
        plain decoding, with the target's top-2 margin there (None under TP: a sharded target
        runs forwards on every rank only); None when sampling or a mode did not run."""
        if self.cfg.temperature != 0 or "ar" not in outputs or mode not in outputs:
            return None
        found = []
        for i, (ar, df) in enumerate(zip(outputs["ar"], outputs[mode])):
            k = first_divergence(ar, df)
            if k is not None:
                model = self.models.target.model
                margin = top2_margin(model, req_prompts[i] + ar[:k]) if self.tp is None else None
                found.append({"request": i, "prompt": i % len(self.prompts), "token": k, "top2_margin": margin})
        return found

    def result(self, rows: list[dict], kv_src: str) -> dict:
        cfg, a, tp, models = self.cfg, self.cfg.engine_args, self.tp, self.models
        return {
            "benchmark": "load",
            "dataset": cfg.prompt_set,
            "num_prompts": len(self.prompts),
            "max_new_tokens": cfg.max_new_tokens,
            # null = every request arrives at t=0 (infinite rate)
            "request_rate": cfg.request_rate if cfg.poisson else None,
            "block_size": self.K,
            "adaptive": a.adaptive,
            "temperature": cfg.temperature,
            "target": str(models.target.path),
            "drafter": str(a.drafter) if a.drafter else ("engine" if a.engine else "default"),
            "engine": a.engine,
            "dtype": models.dtype,
            "weights": a.weights,
            "batch_invariant": next(iter(self.engines.values())).runner.batch_invariant,
            "device": device_name(models.device if tp is None else tp.device),
            "threads": torch.get_num_threads(),
            "seed": cfg.seed,
            "engine_config": {
                "max_batch_size": a.max_batch_size,
                "max_num_tokens": a.max_num_tokens,
                "tokens_per_block": a.tokens_per_block,
                "kv_capacity_tokens": self.kv_cap,
                "kv_capacity_source": kv_src,
                "cuda_graphs": a.cuda_graphs,
                "cuda_graph_capture_len": a.cuda_graph_capture_len,
            },
            "tp_size": tp.size if tp is not None else 1,
            "load": rows,
        }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _runs_note(runs: list[float], paired: list[float], label: str) -> str:
    """A row's note on its repeats: their tokens/s range, and ``paired`` (a ratio per run to the
    run it was paired with, ``label`` naming it) when every run has one."""
    if len(runs) < 2:
        return ""
    note = f"; {len(runs)} runs {min(runs):.1f}-{max(runs):.1f} tok/s"
    if len(paired) == len(runs):
        note += f"; {label} per run " + "/".join(f"{p:.3f}" for p in paired)
    return note


def format_load_table(r: dict) -> str:
    """A plain-text table of a :func:`run_load_bench` result, one line per (C, mode)."""
    rate = "all at t=0" if r["request_rate"] is None else f"Poisson {r['request_rate']:g} req/s"
    ec = r["engine_config"]
    head = (
        f"{r['dataset']}: {r['num_prompts']} prompts, {r['max_new_tokens']} new tokens, T={r['temperature']}, "
        f"{r['dtype']}{' + ' + r['weights'] + ' weights' if r.get('weights') else ''}, {r['device']}, "
        f"{r['threads']} threads, batch-invariant {'on' if r.get('batch_invariant') else 'off'}; "
        f"arrivals {rate}; dflash K={r['block_size']}"
        f"{' adaptive' if r['adaptive'] else ' fixed'}; max batch {ec['max_batch_size']}, "
        f"max tokens {ec['max_num_tokens']}, KV {ec['kv_capacity_tokens']:,} tokens"
    )
    cols = (
        f"{'C':>4} {'mode':<11} {'reqs':>5} {'tokens':>7} {'tok/s':>8} {'user tok/s':>10} "
        f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'iter p50/max ms':>16} {'drafts/step':>11} "
        f"{'tau':>5}  lossless"
    )
    lines = [head, cols, "-" * len(cols)]
    ours = {(x["concurrency"], x["mode"]): x.get("repeats_tok_s") or [] for x in r["load"]}
    for x in r["load"]:
        note = str(x["lossless"])
        if x["divergences"] is not None:
            note += f", identical {x['requests'] - len(x['divergences'])}/{x['requests']}"
        if x["divergences"]:
            margins = [d["top2_margin"] for d in x["divergences"] if d["top2_margin"] is not None]
            note += f" ({len(x['divergences'])} diverged" + (
                f", top-2 margin <= {max(margins):.2g})" if margins else ")"
            )
        runs = x.get("repeats_tok_s") or []
        plain = ours.get((x["concurrency"], "ar"), []) if x["mode"] != "ar" else []
        note += _runs_note(runs, [a / b for a, b in zip(runs, plain) if b], "vs ar")
        if r["engine_config"].get("cuda_graphs") and x.get("iterations"):
            note += f"; eager {x['eager_iterations']}/{x['iterations']} iterations, {x['capture_iterations']} captured"
        lines.append(
            f"{x['concurrency']:>4} {x['mode']:<11} {x['requests']:>5} {x['output_tokens']:>7} "
            f"{x['output_tokens_per_s']:>8.1f} {x['per_user_tokens_per_s']:>10.1f} "
            f"{_ms(x['ttft_p50_s']) + '/' + _ms(x['ttft_p99_s']):>16} "
            f"{_ms(x['tpot_p50_s']) + '/' + _ms(x['tpot_p99_s']):>16} "
            f"{_ms(x['iteration_p50_s']) + '/' + _ms(x['iteration_max_s']):>16} "
            f"{x['mean_draft_tokens']:>11.2f} {x['tau']:>5.2f}  {note}"
        )
    for x in r.get("peers", []):
        tau = "-" if x["tau"] is None else f"{x['tau']:.2f}"
        runs = x.get("repeats_tok_s") or []
        # each run next to ours of the same repeat: ours / the peer's, run by run
        mine = ours.get((x["concurrency"], "dflash" if x["mode"].endswith("dflash") else "ar"), [])
        note = f"same tokens as plain: {x['identical_to_ar']}"
        note += _runs_note(runs, [a / b for a, b in zip(mine, runs) if b], f"ours/{x['mode']}")
        lines.append(
            f"{x['concurrency']:>4} {x['mode']:<11} {x['requests']:>5} {x['output_tokens']:>7} "
            f"{x['output_tokens_per_s']:>8.1f} {'':>10} {'':>16} {'':>16} {'':>16} {'':>11} {tau:>5}  {note}"
        )
    lines += [f"peer {name} failed: {err}" for name, err in r.get("peer_errors", {}).items()]
    return "\n".join(lines)
