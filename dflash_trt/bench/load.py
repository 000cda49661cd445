"""``dflash-trt bench --concurrency 1,4,16``: throughput and latency under load.

For each concurrency ``C`` and both modes in the same run -- ``dflash`` (an :class:`LLMEngine`
with the drafter, the adaptive draft-length controller unless ``adaptive=False``) and ``ar``
(plain decoding: block size 1, no drafter) -- the same requests (real prompts of the bench
dataset in the chat template, cycled when there are fewer prompts than requests) arrive as a
Poisson process at ``request_rate`` req/s (``None`` / inf: all at t=0), with at most ``C`` in
flight (vLLM ``benchmark_serving --max-concurrency``: a request due while ``C`` are in flight
waits for one of them to finish).

The driver is one thread: it adds the requests that are due (arrival time passed, fewer than
``C`` in flight), calls ``engine.step()``, records the sequences that finished, and sleeps only
when nothing is in flight until the next arrival. A request's clock starts when it is released
to the engine: at its arrival time, or, when ``C`` were in flight then, when the one whose slot it
takes finished (time spent waiting for a slot is the client's, as in vLLM). Time a due request
spends waiting for the current ``step()`` to return counts in its TTFT.

Per (C, mode) row: ``output_tokens_per_s`` = all output tokens / wall seconds from the first
arrival to the last finish; ``ttft_*`` from release to first token; ``tpot_*`` per request
``(latency - ttft) / (n_out - 1)`` over requests with more than one token;
``per_user_tokens_per_s`` = median over requests of ``n_out / latency``; ``mean_draft_tokens`` and
``tau`` from the engine's counters over the timed requests (dflash rows with the adaptive
controller also carry its cost model and acceptance estimates after the run, ``controller``).
Each engine serves one untimed warm-up request first. Greedy runs also compare the dflash
outputs with the ar outputs request by request (``lossless``; ``divergences`` give the first
differing token and the target's top-2 logit margin there, as in ``bench/runner.py``: a margin
near the dtype's resolution is a numerical tie between differently shaped GEMMs, not a
lossless-ness bug).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..atomic import write_json
from ..checkpoints.engine import kv_capacity, load_models
from ..checkpoints.loader import parse_device, parse_dtype
from ..errors import DFlashError
from ..prompts import DATASETS, chat_prompt_ids
from ..runtime.distributed import TPEngines, init_tp
from ..runtime.engine import EngineConfig, LLMEngine
from ..runtime.executor import first_divergence, top2_margin
from ..runtime.request import LoopStats, Request
from ..runtime.sampling import SamplingParams
from .runner import BenchConfig, device_name

#: KV capacity (tokens) when neither ``kv_capacity`` nor an engine memory plan says otherwise,
#: and the cap applied to an engine plan's capacity

MODES = ("dflash", "ar")


@dataclass
class LoadConfig(BenchConfig):
    """Settings of one load benchmark (``dflash-trt bench --concurrency ...`` flags): the
    model, prompt and sampling settings of :class:`BenchConfig` (``peers`` unused) plus

    Attributes:
        concurrency: the ``C`` values (most requests in flight), each >= 1.
        request_rate: Poisson arrival rate in req/s; None or inf: all requests arrive at t=0.
        num_requests: requests per concurrency; None: ``max(2 * C, num_prompts)``.
        block_size: dflash block size; None: the drafter's.
        adaptive: adaptive draft length (else always ``block_size - 1`` drafts).
        kv_capacity: KV positions per engine; None: ``min(engine memory plan, 65536)`` with
            ``engine``, else 65536.
    """

    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    request_rate: float | None = None
    num_requests: int | None = None
    adaptive: bool = True
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    tokens_per_block: int = 32
    kv_capacity: int | None = None
    modes: tuple[str, ...] = field(default=MODES)

    def validate(self) -> None:
        """Raises DFlashError on a value no run could use (checked before any model loads)."""
        if not self.concurrency:
            raise DFlashError("--concurrency needs at least one value")
        for c in self.concurrency:
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise DFlashError(f"--concurrency values must be integers >= 1, got {c!r}")
        r = self.request_rate
        if r is not None and (not isinstance(r, (int, float)) or math.isnan(r) or r <= 0):
            raise DFlashError(f"--request-rate must be > 0 req/s (inf = all at once), got {r!r}")
        if self.dataset not in DATASETS and not self.prompts_file:
            raise DFlashError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        for name, v, low in (
            ("--num-requests", self.num_requests, 1),
            ("--num-prompts", self.num_prompts, 1),
            ("--max-new-tokens", self.max_new_tokens, 1),
            ("--max-batch-size", self.max_batch_size, 1),
            ("--max-num-tokens", self.max_num_tokens, 1),
            ("--tokens-per-block", self.tokens_per_block, 1),
            ("--kv-capacity", self.kv_capacity, 1),
            ("--block-size", self.block_size, 1),
        ):
            if v is not None and v < low:
                raise DFlashError(f"{name} must be >= {low}, got {v}")
        if self.temperature < 0:
            raise DFlashError(f"temperature must be >= 0, got {self.temperature}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise DFlashError(f"modes must be among {', '.join(MODES)}, got {self.modes!r}")

    def requests_for(self, c: int) -> int:
        return self.num_requests if self.num_requests is not None else max(2 * c, self.num_prompts)

    @property
    def poisson(self) -> bool:
        return self.request_rate is not None and math.isfinite(self.request_rate)


def kv_capacity_for(cfg: LoadConfig) -> tuple[int, str]:
    """``(KV capacity in tokens, where it came from)`` (:func:`~dflash_trt.checkpoints.engine.kv_capacity`)."""
    return kv_capacity(cfg.engine, cfg.kv_capacity)


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


def drive(
    engine: LLMEngine, requests: list[Request], arrivals: list[float], concurrency: int, progress=None
) -> tuple[list[_Record], float]:
    """Serve ``requests`` (arriving at ``arrivals``, non-decreasing seconds) with at most
    ``concurrency`` in flight; returns one record per request (times in seconds from the
    start) and the start's ``perf_counter``."""
    n = len(requests)
    slots = [0.0] * concurrency  # heap: when each concurrency slot (next) becomes free
    records: list[_Record | None] = [None] * n
    live: dict[int, tuple[int, float]] = {}  # seq id -> (request index, release time)
    nxt = 0
    t0 = time.perf_counter()
    while nxt < n or live:
        now = time.perf_counter() - t0
        while nxt < n and len(live) < concurrency and arrivals[nxt] <= now:
            release = max(arrivals[nxt], heapq.heappop(slots))
            live[engine.add_request(requests[nxt])] = (nxt, release)
            nxt += 1
        if live:
            for seq in engine.step():
                idx, release = live.pop(seq.seq_id)
                out = engine.result(seq.seq_id)  # times from the engine's arrival; the engine forgets it
                arrival = seq.arrival_s - t0
                records[idx] = _Record(out.output_ids, release, arrival + out.ttft_s, arrival + out.latency_s)
                heapq.heappush(slots, records[idx].finish_s)
                if progress is not None:
                    progress.update(1)
        else:
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
    engine.run()  # hands the runner the last released sequences
    return records, t0  # type: ignore[return-value]


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(records: list[_Record], stats: LoopStats) -> dict:
    """The figures of one (C, mode) run."""
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
        "mean_draft_tokens": stats.mean_draft_tokens,
        "tau": stats.tau,
    }


def controller_state(ctl) -> dict:
    """The adaptive controller's model after a run (:meth:`DraftLengthController.state`)."""
    return ctl.state()


def run_load_bench(cfg: LoadConfig, progress=print) -> dict | None:
    """Run the load benchmark and return the result dict (also written to ``cfg.json_out``).

    Under ``mpiexec -n N`` the target is tensor-parallel over the N ranks: rank 0 runs the
    benchmark and returns the result, the other ranks serve as TP workers and return None.

    Raises:
        DFlashError: bad settings, bad checkpoints, impossible block size or engine settings.
    """
    from tqdm import tqdm

    cfg.validate()
    kv_cap, kv_src = kv_capacity_for(cfg)
    progress(f"KV capacity: {kv_cap:,} tokens ({kv_src})")
    dtype = parse_dtype(cfg.dtype)
    texts = cfg.prompts()
    device = parse_device(cfg.device)
    sampling = SamplingParams(temperature=cfg.temperature, seed=cfg.seed)
    # under mpiexec: rank 0 runs the benchmark, the other ranks mirror every engine (TP shards;
    # with a tp_size N engine each rank reads only its own target rank file)
    tp = init_tp()
    target, drafter = load_models(
        cfg.target,
        cfg.drafter,
        cfg.engine,
        dtype,
        need_drafter="dflash" in cfg.modes,
        fp8_gemm=cfg.fp8_gemm,
        weights=cfg.weights,
        rank=tp.rank if tp else 0,
        world_size=tp.size if tp else 1,
        device=device if tp is None else "cpu",
    )
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in texts]
    K = cfg.block_size or (drafter.cfg.block_size if drafter is not None else 1)
    tp_engines = TPEngines(target.model, drafter, target.stop_token_ids, tp) if tp is not None else None
    if tp is not None and tp.rank != 0:
        tp_engines.serve()
        tp.shutdown()
        return None

    engines: dict[str, LLMEngine] = {}

    def engine_for(mode: str) -> LLMEngine:
        """The mode's engine, built and warmed up once (under TP: anew for every run, since the
        worker ranks mirror one engine at a time)."""
        if mode in engines and tp is None:
            return engines[mode]
        ecfg = EngineConfig(
            block_size=K if mode == "dflash" else 1,
            adaptive=cfg.adaptive and mode == "dflash",
            max_batch_size=cfg.max_batch_size,
            max_num_tokens=cfg.max_num_tokens,
            tokens_per_block=cfg.tokens_per_block,
            kv_capacity_tokens=kv_cap,
        )
        if mode not in engines:
            progress(
                f"{mode}: building the engine (block size {ecfg.block_size}"
                f"{', adaptive: measuring forward costs' if ecfg.adaptive else ''}"
                f"{f', TP {tp.size}' if tp else ''}) ..."
            )
        use_drafter = mode == "dflash"
        eng = (
            tp_engines.make(ecfg, use_drafter)
            if tp is not None
            else LLMEngine(target.model, drafter if use_drafter else None, target.stop_token_ids, ecfg)
        )
        warm = eng.add_request(Request(prompts[0], min(8, cfg.max_new_tokens), sampling))  # untimed
        eng.run()
        eng.result(warm)
        engines[mode] = eng
        return eng

    for mode in cfg.modes:
        engine_for(mode)

    rows = []
    for c in cfg.concurrency:
        n = cfg.requests_for(c)
        arrivals = arrival_times(n, cfg.request_rate, cfg.seed * 1_000_003 + c)
        req_prompts = [prompts[i % len(prompts)] for i in range(n)]
        outputs: dict[str, list[list[int]]] = {}
        for mode in cfg.modes:
            eng = engine_for(mode)
            eng.stats = LoopStats(eng.block_size)  # count the timed requests only
            reqs = [Request(p, cfg.max_new_tokens, sampling) for p in req_prompts]
            with tqdm(total=n, desc=f"C={c} {mode}", unit="req", leave=False, disable=None) as bar:
                records, _ = drive(eng, reqs, arrivals, c, bar)
            outputs[mode] = [r.output for r in records]
            row = {"concurrency": c, "mode": mode, "block_size": eng.block_size} | summarize(records, eng.stats)
            if eng.controller is not None:
                row["controller"] = controller_state(eng.controller)
            rows.append(row)
        lossless, divergences = None, None
        if cfg.temperature == 0 and set(MODES) <= set(cfg.modes):
            divergences = []
            for i, (a, b) in enumerate(zip(outputs["ar"], outputs["dflash"])):
                k = first_divergence(a, b)
                if k is not None:  # (a TP-sharded target only runs forwards on every rank: no margin)
                    margin = top2_margin(target.model, req_prompts[i] + a[:k]) if tp is None else None
                    divergences.append({"request": i, "prompt": i % len(prompts), "token": k, "top2_margin": margin})
            lossless = not divergences
        for row in rows[-len(cfg.modes) :]:
            row["lossless"] = lossless
            row["divergences"] = divergences

    result = {
        "benchmark": "load",
        "dataset": cfg.prompt_set,
        "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        # null = every request arrives at t=0 (infinite rate)
        "request_rate": cfg.request_rate if cfg.poisson else None,
        "block_size": K,
        "adaptive": cfg.adaptive,
        "temperature": cfg.temperature,
        "target": str(target.path),
        "drafter": str(cfg.drafter) if cfg.drafter else ("engine" if cfg.engine else "default"),
        "engine": cfg.engine,
        "dtype": cfg.dtype,
        "weights": cfg.weights,
        "device": device_name(device if tp is None else tp.device),
        "threads": torch.get_num_threads(),
        "seed": cfg.seed,
        "engine_config": {
            "max_batch_size": cfg.max_batch_size,
            "max_num_tokens": cfg.max_num_tokens,
            "tokens_per_block": cfg.tokens_per_block,
            "kv_capacity_tokens": kv_cap,
            "kv_capacity_source": kv_src,
        },
        "tp_size": tp.size if tp is not None else 1,
        "load": rows,
    }
    if tp is not None:
        tp_engines.close()
        tp.shutdown()
    if cfg.json_out:
        write_json(cfg.json_out, result)
    return result


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def format_load_table(r: dict) -> str:
    """A plain-text table of a :func:`run_load_bench` result, one line per (C, mode)."""
    rate = "all at t=0" if r["request_rate"] is None else f"Poisson {r['request_rate']:g} req/s"
    ec = r["engine_config"]
    head = (
        f"{r['dataset']}: {r['num_prompts']} prompts, {r['max_new_tokens']} new tokens, T={r['temperature']}, "
        f"{r['dtype']}{' + ' + r['weights'] + ' weights' if r.get('weights') else ''}, {r['device']}, "
        f"{r['threads']} threads; arrivals {rate}; dflash K={r['block_size']}"
        f"{' adaptive' if r['adaptive'] else ' fixed'}; max batch {ec['max_batch_size']}, "
        f"max tokens {ec['max_num_tokens']}, KV {ec['kv_capacity_tokens']:,} tokens"
    )
    cols = (
        f"{'C':>4} {'mode':<7} {'reqs':>5} {'tokens':>7} {'tok/s':>8} {'user tok/s':>10} "
        f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'drafts/step':>11} {'tau':>5}  lossless"
    )
    lines = [head, cols, "-" * len(cols)]
    for x in r["load"]:
        note = str(x["lossless"])
        if x["divergences"]:
            margins = [d["top2_margin"] for d in x["divergences"] if d["top2_margin"] is not None]
            note += f" ({len(x['divergences'])} diverged" + (
                f", top-2 margin <= {max(margins):.2g})" if margins else ")"
            )
        lines.append(
            f"{x['concurrency']:>4} {x['mode']:<7} {x['requests']:>5} {x['output_tokens']:>7} "
            f"{x['output_tokens_per_s']:>8.1f} {x['per_user_tokens_per_s']:>10.1f} "
            f"{_ms(x['ttft_p50_s']) + '/' + _ms(x['ttft_p99_s']):>16} "
            f"{_ms(x['tpot_p50_s']) + '/' + _ms(x['tpot_p99_s']):>16} "
            f"{x['mean_draft_tokens']:>11.2f} {x['tau']:>5.2f}  {note}"
        )
    return "\n".join(lines)
