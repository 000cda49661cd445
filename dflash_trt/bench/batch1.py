"""``dflash-trt bench``: plain decoding, DFlash and peers on the same real prompts, in one run.

Every mode runs the same prompts one request at a time (batch 1), after one untimed warm-up
request, in the same process and dtype; plain decoding and DFlash alternate prompt by prompt,
and the llama.cpp peer (its own child process, idle meanwhile) takes its turn after them on each
prompt, so a slow or fast period of a shared machine falls on all three alike; the transformers
peers run after them.
Throughput is committed new tokens over the wall time of the generate calls (prefill included).
``verify_cost_ratio`` and ``draft_cost_ratio`` are mean per-call wall times measured inside those
same runs, relative to one plain decode forward.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..atomic import write_json
from ..checkpoints.loader import parse_dtype
from ..engine_args import EngineArgs
from ..errors import ConfigError, DFlashError
from ..models.prefill import first_divergence, top2_margin
from ..prompts import DATASETS, chat_prompt_ids, load_prompts, read_prompts_file
from ..runtime.engine import LLMEngine
from ..runtime.engine_factory import LoadedModels, load_models
from ..runtime.request import LoopStats, Request
from ..runtime.sampling import SamplingParams


@dataclass
class BenchConfig:
    """Settings of one bench run (CLI flags of ``dflash-trt bench``).

    Attributes:
        engine_args: the engine's settings (target, drafter, dtype, block size, ...); the
            engines of every mode share them, plain decoding with block size 1.
        dataset, num_prompts, prompts_file: the prompts (the first ``num_prompts`` of a
            dataset, or of a file of texts / message lists).
        max_new_tokens, temperature, seed: every request's sampling.
        peers: peers run in the same sitting (:data:`~.peers.PEERS`).
        json_out: where the result is written (JSON), or None.
    """

    engine_args: EngineArgs = field(default_factory=EngineArgs)
    dataset: str = "gsm8k"
    num_prompts: int = 10
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    peers: tuple[str, ...] = ()
    json_out: str | None = None
    prompts_file: str | None = None

    @property
    def prompt_set(self) -> str:
        """What the prompts are called in results: the dataset name or the prompts file's name."""
        return Path(self.prompts_file).name if self.prompts_file else self.dataset

    def prompts(self) -> list:
        """The prompts to run: the first ``num_prompts`` of ``prompts_file`` (texts or message
        lists) or of ``dataset``.

        Raises:
            DFlashError: unknown dataset, bad prompts file, too many prompts asked for.
        """
        if self.prompts_file:
            return read_prompts_file(self.prompts_file, self.num_prompts)
        if self.dataset not in DATASETS:
            raise DFlashError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        return load_prompts(self.dataset, self.num_prompts)


def device_name(device: torch.device | str = "cpu") -> str:
    """``cpu (<processor>)`` (with ``, bf16 GEMM: <kernel>`` once the CPU kernels are loaded:
    :func:`~dflash_trt.kernels.cpu_ops.bf16_gemm`) or the CUDA device's name."""
    from ..kernels import cpu_ops

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    gemm = f", bf16 GEMM: {cpu_ops.bf16_gemm()}" if cpu_ops.loaded() else ""
    return f"cpu ({platform.processor() or platform.machine()}{gemm})"


def _run_modes(
    modes: list[LLMEngine],
    prompts: list[list[int]],
    cfg: BenchConfig,
    sampling: SamplingParams,
    peer: Callable[[list[int]], None] | None = None,
) -> list[tuple[list[list[int]], float, LoopStats]]:
    """Every prompt in each mode (an engine of its own block size) in turn (plain decoding and
    DFlash interleaved prompt by prompt, so that a slow period of a shared machine falls on
    every mode alike), then ``peer(prompt_ids)`` when given (a peer interleaved the same way).
    Returns per mode: the outputs, the wall seconds of its requests, its loop statistics."""
    from tqdm import tqdm

    outputs = [[] for _ in modes]
    walls = [0.0 for _ in modes]
    for engine in modes:
        engine.stats = LoopStats(engine.block_size)  # the timed requests only
    for ids in tqdm(prompts, desc="prompts (plain + DFlash)", unit="prompt", leave=False, disable=None):
        for i, engine in enumerate(modes):
            t = time.perf_counter()
            sid = engine.add_request(Request(ids, cfg.max_new_tokens, sampling))
            engine.run()
            walls[i] += time.perf_counter() - t
            outputs[i].append(engine.result(sid).output_ids)
        if peer is not None:
            peer(ids)
    return list(zip(outputs, walls, [engine.stats for engine in modes]))


def batch1_engines(cfg: BenchConfig, models: LoadedModels, prompts: list[list[int]]) -> list[LLMEngine]:
    """The engines of the batch-1 modes on the same loaded models: plain decoding (block size
    1), DFlash at the configured block size (block size - 1 drafts every step, or with
    ``engine_args.adaptive`` as many as the adaptive controller chooses), and DFlash with prompt
    lookup when asked for; one sequence at a time, a KV cache just large enough for the longest
    prompt and its answer.

    Raises:
        ConfigError: a block size the drafter cannot serve.
    """
    from ..runtime.engine_factory import create_engine

    a = cfg.engine_args
    K = a.block_size or models.drafter.cfg.block_size
    longest = max(map(len, prompts)) + cfg.max_new_tokens + K
    base = a.replace(
        kv_capacity=-(-longest // a.tokens_per_block) * a.tokens_per_block,
        max_batch_size=1,
        max_num_tokens=max(longest, a.max_num_tokens),
        adaptive=a.adaptive,
    )
    engines = [create_engine(base.replace(block_size=1, prompt_lookup_min=0, adaptive=False), models)]
    engines.append(create_engine(base.replace(block_size=K, prompt_lookup_min=0), models))
    if a.prompt_lookup_min:  # a third mode: DFlash with prompt-lookup tokens merged in
        engines.append(create_engine(base.replace(block_size=K), models))
    return engines


class _InterleavedLlamaCpp:
    """The llama.cpp peer run prompt by prompt beside our modes (:func:`~.peers.open_llama_cpp`):
    call it with each prompt, then :meth:`result`. A failure (no GGUF target, a crash) is kept in
    ``error`` and ends the peer, not the benchmark."""

    def __init__(self, cfg: BenchConfig, prompts: list[list[int]], stop_token_ids: tuple[int, ...], repack: bool):
        from .peers import open_llama_cpp

        self.name = "llama.cpp-repack" if repack else "llama.cpp"
        self.prompts, self.max_new = prompts, cfg.max_new_tokens
        self.runs: list[tuple[list[int], float, float]] = []
        self.session, self.error = None, None
        try:
            gguf = _gguf_of(cfg.engine_args.model)
            threads = torch.get_num_threads()
            self.session = open_llama_cpp(gguf, prompts, cfg.max_new_tokens, stop_token_ids, threads, repack)
        except DFlashError as e:
            self.error = str(e)

    def __call__(self, ids: list[int]) -> None:
        if self.session is None:
            return
        try:
            self.runs.append(self.session.generate(ids, self.max_new))
        except DFlashError as e:
            self.session.close()
            self.error, self.session = str(e), None

    def result(self):
        """The :class:`~.peers.PeerResult`, or None after a failure (``error`` says why)."""
        from .peers import llama_cpp_result

        if self.session is None:
            return None
        self.session.close()
        return llama_cpp_result(self.prompts, self.runs, self.name)


def run_bench(cfg: BenchConfig, progress=print) -> dict:
    """Run the benchmark and return the result dict (also written to ``cfg.json_out``).

    A peer that fails (llama.cpp crashing in its native code) is reported under
    ``peer_errors``; the rest of the result is kept.

    Raises:
        DFlashError: unknown dataset or peer, llama.cpp asked for but not installed, bad
            checkpoints, impossible block size.
    """
    _check(cfg)
    sampling = SamplingParams(temperature=cfg.temperature, seed=cfg.seed)
    a = cfg.engine_args
    texts = cfg.prompts()
    models = load_models(a.create_engine_config())
    prompts = [chat_prompt_ids(models.target.tokenizer, t) for t in texts]
    modes = batch1_engines(cfg, models, prompts)
    for engine in modes:  # untimed; on the compiled path a second prompt length compiles here too
        warm_s = engine.warm_up([prompts[0]] + ([prompts[0][:-1]] if a.compile else []), sampling, 8)
        if a.compile:
            progress(f"block size {engine.block_size}: compiled in {warm_s:.0f} s (warm-up, untimed)")
    stops = models.target.stop_token_ids
    llama = [_InterleavedLlamaCpp(cfg, prompts, stops, r) for r in (False, True)] if "llama.cpp" in cfg.peers else []
    names = f"plain decoding, DFlash (block size {modes[1].block_size})"
    if len(modes) > 2:
        names += f", DFlash + prompt lookup (n-grams {a.prompt_lookup_min}-{a.prompt_lookup_max})"
    names += "".join(f" and {x.name}" for x in llama if x.session)
    progress(f"{names}, interleaved, on {len(prompts)} {cfg.prompt_set} prompts ...")
    runs = _run_modes(modes, prompts, cfg, sampling, (lambda ids: [x(ids) for x in llama]) if llama else None)
    ar_out, ar_wall, _ = runs[0]
    ar_tps = sum(map(len, ar_out)) / ar_wall
    peers, peer_errors = _peers(cfg, models, prompts, modes[1].block_size, llama, ar_out, ar_tps, progress)
    result = _result(cfg, models, prompts, modes, runs) | {"peers": peers, "peer_errors": peer_errors}
    if cfg.json_out:
        write_json(cfg.json_out, result)
    return result


def _check(cfg: BenchConfig) -> None:
    """What no run could use, before any model loads.

    Raises:
        DFlashError: an unknown peer, llama.cpp asked for but not installed, peers on an engine
            directory, ``max_new_tokens`` < 1.
    """
    from .peers import PEERS, require_llama_cpp
    from .vllm_peer import check_vllm_peer

    for p in cfg.peers:
        if p not in PEERS:
            raise DFlashError(f"unknown peer {p!r}; choose from {', '.join(PEERS)}")
    if "llama.cpp" in cfg.peers:
        require_llama_cpp()  # before minutes of benchmarking, not after
    if "vllm" in cfg.peers:
        check_vllm_peer(cfg.engine_args)
    if cfg.max_new_tokens < 1:
        raise ConfigError("max_new_tokens", f"must be >= 1, got {cfg.max_new_tokens}")
    if cfg.engine_args.engine and cfg.peers:
        raise DFlashError("peers run on HF checkpoints; bench an engine directory without peers")


def _peers(cfg, models, prompts, K, llama, ar_out, ar_tps, progress) -> tuple[dict, dict]:
    """Every peer's figures beside plain decoding's (``{name: figures}``), and the peers that
    failed (``{name: the one-line error}``; what was measured is kept)."""
    from .peers import run_peer

    peers, peer_errors = {}, {}

    def record(res) -> None:
        peers[res.name] = {
            "tokens_per_s": res.tokens_per_s,
            "speedup_vs_ar": res.tokens_per_s / ar_tps,
            "identical_to_ar": res.outputs == ar_out if cfg.temperature == 0 else None,
            # llama.cpp: prefill and decode timed apart (None for the transformers peers)
            "prefill_tokens_per_s": res.prefill_tokens_per_s,
            "decode_tokens_per_s": res.decode_tokens_per_s,
            "acceptance_length": res.acceptance_length,
        }

    for x in llama:
        res = x.result()
        if res is None:
            progress(f"peer {x.name} failed: {x.error}")
            peer_errors[x.name] = x.error
        else:
            record(res)
    target = models.target
    if "vllm" in cfg.peers:
        from .vllm_peer import run_vllm

        try:
            got = run_vllm(
                target.path,
                models.drafter,
                target.model.lm_head.weight,
                prompts,
                cfg.max_new_tokens,
                parse_dtype(models.dtype),
                target.stop_token_ids,
                K,
                threads=torch.get_num_threads(),
                progress=progress,
            )
        except DFlashError as e:  # the peer fails alone: what was measured is kept
            progress(f"peer vllm failed: {e}")
            peer_errors["vllm"] = str(e)
            got = {}
        for by_c in got.values():
            record(by_c[1])
    for name in [p for p in cfg.peers if p not in ("llama.cpp", "vllm")]:
        progress(f"peer {name} ...")
        try:
            res = run_peer(
                name,
                target.path,
                prompts,
                cfg.max_new_tokens,
                parse_dtype(models.dtype),
                target.stop_token_ids,
                device=models.device,
                drafter=models.drafter,
                block_size=K,
            )
        except DFlashError as e:  # the peer fails alone: what was measured is kept
            progress(f"peer {name} failed: {e}")
            peer_errors[name] = str(e)
            continue
        record(res)
    return peers, peer_errors


def _divergences(cfg: BenchConfig, model, prompts, ar_out, out) -> list[dict] | None:
    """Greedy runs that differ from plain decoding: the first differing token and the target's
    top-2 logit gap there (a gap near the dtype's resolution is a numerical tie between 1-row
    and K-row GEMMs); None when sampling."""
    if cfg.temperature != 0:
        return None
    found = []
    for i, (ref, got) in enumerate(zip(ar_out, out)):
        k = first_divergence(ref, got)
        if k is not None:
            found.append({"prompt": i, "token": k, "top2_margin": top2_margin(model, prompts[i] + ref[:k])})
    return found


def _result(cfg: BenchConfig, models, prompts, modes, runs) -> dict:
    """The result dict of the modes' runs (peers apart)."""
    a = cfg.engine_args
    (ar_out, ar_wall, ar_stats), (df_out, df_wall, df_stats) = runs[:2]
    ar_tokens, df_tokens = sum(map(len, ar_out)), sum(map(len, df_out))
    ar_tps, df_tps = ar_tokens / ar_wall, df_tokens / df_wall
    decode_s = ar_stats.verify_s / max(ar_stats.verify_calls, 1)
    target = models.target

    def divergences(out: list[list[int]]) -> list[dict] | None:
        return _divergences(cfg, target.model, prompts, ar_out, out)

    return {
        "dataset": cfg.prompt_set,
        "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "block_size": modes[1].block_size,
        "adaptive": modes[1].controller is not None,
        # draft tokens per DFlash step (block size - 1 unless adaptive; 0 where it decoded plainly)
        "mean_draft_tokens": df_stats.mean_draft_tokens,
        "temperature": cfg.temperature,
        "target": str(target.path),
        "drafter": str(a.drafter) if a.drafter else "default",
        "drafter_layers": models.drafter.cfg.num_layers,
        "dtype": models.dtype,
        "weights": a.weights,
        "compile": a.compile,
        "cuda_graphs": a.cuda_graphs,
        "batch_invariant": modes[0].runner.batch_invariant,
        "device": device_name(models.device),
        "threads": torch.get_num_threads(),
        "lossless": (df_out == ar_out) if cfg.temperature == 0 else None,
        "divergences": divergences(df_out),
        "tau": df_stats.tau,
        "acceptance_per_position": df_stats.acceptance_per_position,
        "ar_tokens": ar_tokens,
        "dflash_tokens": df_tokens,
        "ar_tokens_per_s": ar_tps,
        "dflash_tokens_per_s": df_tps,
        "speedup": df_tps / ar_tps,
        "verify_cost_ratio": (df_stats.verify_s / max(df_stats.verify_calls, 1)) / decode_s,
        "draft_cost_ratio": (df_stats.draft_s / max(df_stats.draft_calls, 1)) / decode_s,
        "decode_step_ms": decode_s * 1e3,
        # plain decoding's one-token steps and its prompt prefills (beside llama.cpp's)
        "ar_decode_tokens_per_s": 1 / decode_s if decode_s > 0 else None,
        "ar_prefill_tokens_per_s": sum(map(len, prompts)) / ar_stats.prefill_s if ar_stats.prefill_s > 0 else None,
        # DFlash + prompt lookup (--prompt-lookup-min), None when not run
        "prompt_lookup": _lookup_result(cfg, runs[2], ar_out, ar_tps, divergences) if len(runs) > 2 else None,
    }


def _lookup_result(cfg: BenchConfig, run, ar_out: list[list[int]], ar_tps: float, divergences: Callable) -> dict:
    """The DFlash + prompt-lookup mode's figures beside plain decoding's (``divergences``:
    :func:`run_bench`'s, outputs -> the divergence records)."""
    out, wall, st = run
    tps = sum(map(len, out)) / wall
    return {
        "min_n": cfg.engine_args.prompt_lookup_min,
        "max_n": cfg.engine_args.prompt_lookup_max,
        "tokens_per_s": tps,
        "speedup": tps / ar_tps,
        "tau": st.tau,
        "acceptance_per_position": st.acceptance_per_position,
        # verify steps whose drafts began with prompt-lookup tokens
        "lookup_step_share": st.lookup_steps / max(st.verify_steps, 1),
        "lossless": out == ar_out if cfg.temperature == 0 else None,
        "divergences": divergences(out),
    }


def _gguf_of(target: str | None) -> Path | None:
    """The GGUF file behind ``--target`` (None: the default model's), or None for a directory."""
    if target is None:
        from ..checkpoints.sources import default_target_gguf

        return default_target_gguf()
    p = Path(target).expanduser()
    return p if p.suffix == ".gguf" else None


def _identical(r: dict, n: int) -> str:
    """``", identical N/n"`` answers equal to plain decoding's, with the largest top-2 logit
    margin where one first differs; empty when sampling."""
    found = r.get("divergences")
    if found is None:
        return ""
    note = f", identical {n - len(found)}/{n}"
    if found:
        note += f" (top-2 margin at the first difference <= {max(d['top2_margin'] for d in found):.2g})"
    return note


def format_table(r: dict) -> str:
    """A plain-text table of a :func:`run_bench` result."""
    rows = [("plain decoding (ours, K=1)", r["ar_tokens_per_s"], 1.0, "")]
    adaptive = r.get("adaptive")
    drafts = f", {r['mean_draft_tokens']:.2f} drafts/step" if adaptive else ""
    rows.append(
        (
            f"DFlash (ours, K{'<=' if adaptive else '='}{r['block_size']})",
            r["dflash_tokens_per_s"],
            r["speedup"],
            f"tau {r['tau']:.2f}{drafts}, lossless {r['lossless']}" + _identical(r, r["num_prompts"]),
        )
    )
    lk = r.get("prompt_lookup")
    if lk:
        share = lk["lookup_step_share"]
        note = f"tau {lk['tau']:.2f}, lookup in {share:.0%} of steps, lossless {lk['lossless']}"
        note += _identical(lk, r["num_prompts"])
        rows.append((f"DFlash + lookup {lk['min_n']}-{lk['max_n']} (ours)", lk["tokens_per_s"], lk["speedup"], note))
    for name, p in r["peers"].items():
        note = "" if p.get("identical_to_ar") is None else f"same tokens as ours: {p['identical_to_ar']}"
        if p.get("decode_tokens_per_s"):
            note += f"; decode {p['decode_tokens_per_s']:.1f} tok/s, prefill {p['prefill_tokens_per_s']:.0f} tok/s"
        if p.get("acceptance_length"):
            note += f"; acceptance length {p['acceptance_length']:.2f}"
        rows.append((f"peer: {name}", p["tokens_per_s"], p["speedup_vs_ar"], note))
    head = (
        f"{r['dataset']}: {r['num_prompts']} prompts, {r['max_new_tokens']} new tokens, T={r['temperature']}, "
        f"{r['dtype']}{' + ' + r['weights'] + ' weights' if r.get('weights') else ''}, {r['device']}, "
        f"{r['threads']} threads, batch-invariant {'on' if r.get('batch_invariant') else 'off'}"
    )
    lines = [head, f"{'mode':<30} {'tok/s':>8} {'vs plain':>9}  notes", "-" * 78]
    lines += [f"{n:<30} {t:>8.1f} {s:>8.2f}x  {note}" for n, t, s, note in rows]
    if r.get("ar_decode_tokens_per_s") and r.get("ar_prefill_tokens_per_s"):
        lines.append(
            f"plain decoding (ours): decode {r['ar_decode_tokens_per_s']:.1f} tok/s, "
            f"prefill {r['ar_prefill_tokens_per_s']:.0f} tok/s"
        )
    which = "a DFlash step's target forward (mean, adaptive)" if adaptive else f"verify cost (K={r['block_size']})"
    lines.append(
        f"{which} {r['verify_cost_ratio']:.2f}x a decode step "
        f"({r['decode_step_ms']:.1f} ms); draft cost {r['draft_cost_ratio']:.2f}x"
    )
    acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
    lines.append(f"acceptance per draft position: {acc}")
    lines += [f"peer {name} failed: {err}" for name, err in r.get("peer_errors", {}).items()]
    return "\n".join(lines)
