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
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..atomic import write_json
from ..checkpoints.engine import load_models
from ..checkpoints.loader import parse_device, parse_dtype
from ..errors import DFlashError
from ..models.batch_invariant import resolve_batch_invariant
from ..prompts import DATASETS, chat_prompt_ids, load_prompts, read_prompts_file
from ..runtime.cuda_graphs import check_cuda_graphs
from ..runtime.executor import DFlashEngine, LoopStats, Request, first_divergence, top2_margin
from ..runtime.sampling import SamplingParams


@dataclass
class BenchConfig:
    """Settings of one bench run (CLI flags of ``dflash-trt bench``)."""

    dataset: str = "gsm8k"
    num_prompts: int = 10
    max_new_tokens: int = 128
    block_size: int | None = None
    temperature: float = 0.0
    target: str | None = None
    drafter: str | None = None
    engine: str | None = None
    fp8_gemm: bool = False
    dtype: str = "fp32"
    #: ``--weights``: int4 / int8 packed CPU linears (None: dense ``dtype``)
    weights: str | None = None
    peers: tuple[str, ...] = ()
    json_out: str | None = None
    seed: int = 0
    device: str | None = None
    prompts_file: str | None = None
    #: ``--compile``: the target forward compiled by torch.compile (``runtime/compiled.py``)
    compile: bool = False
    #: ``--cuda-graphs``: decode and verify steps replayed from CUDA graphs (``runtime/cuda_graphs.py``)
    cuda_graphs: bool = False
    #: ``--prompt-lookup-min/max``: prompt-lookup tokens merged into DFlash's drafts (``runtime/ngram.py``)
    prompt_lookup: tuple[int, int] | None = None
    #: ``--batch-invariant``: the target's rows computed independently of each other
    #: (``models/batch_invariant.py``); None: on for bf16 CPU targets
    batch_invariant: bool | None = None

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
    """``cpu (<processor>)`` or the CUDA device's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _run_modes(
    modes: list[tuple[DFlashEngine, int]],
    prompts: list[list[int]],
    cfg: BenchConfig,
    sampling: SamplingParams,
    peer: Callable[[list[int]], None] | None = None,
) -> list[tuple[list[list[int]], float, LoopStats]]:
    """Every prompt in each mode (an engine and its block size) in turn (plain decoding and
    DFlash interleaved prompt by prompt, so that a slow period of a shared machine falls on
    every mode alike), then ``peer(prompt_ids)`` when given (a peer interleaved the same way).
    Returns per mode: the outputs, the wall seconds of its generate calls, its loop statistics."""
    from tqdm import tqdm

    outputs = [[] for _ in modes]
    walls = [0.0 for _ in modes]
    stats = [LoopStats(k) for _, k in modes]
    for ids in tqdm(prompts, desc="prompts (plain + DFlash)", unit="prompt", leave=False, disable=None):
        for i, (engine, k) in enumerate(modes):
            t = time.perf_counter()
            out = engine.generate([Request(ids, cfg.max_new_tokens, sampling)], k, stats=stats[i])[0]
            walls[i] += time.perf_counter() - t
            outputs[i].append(out.output_ids)
        if peer is not None:
            peer(ids)
    return list(zip(outputs, walls, stats))


class _InterleavedLlamaCpp:
    """The llama.cpp peer run prompt by prompt beside our modes (:func:`~.peers.open_llama_cpp`):
    call it with each prompt, then :meth:`result`. A failure (no GGUF target, a crash) is kept in
    ``error`` and ends the peer, not the benchmark."""

    def __init__(self, cfg: BenchConfig, prompts: list[list[int]], stop_token_ids: tuple[int, ...]):
        from .peers import open_llama_cpp

        self.prompts, self.max_new = prompts, cfg.max_new_tokens
        self.runs: list[tuple[list[int], float, float]] = []
        self.session, self.error = None, None
        try:
            gguf = _gguf_of(cfg.target)
            self.session = open_llama_cpp(gguf, prompts, cfg.max_new_tokens, stop_token_ids, torch.get_num_threads())
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
        return llama_cpp_result(self.prompts, self.runs)


def run_bench(cfg: BenchConfig, progress=print) -> dict:
    """Run the benchmark and return the result dict (also written to ``cfg.json_out``).

    A peer that fails (llama.cpp crashing in its native code) is reported under
    ``peer_errors``; the rest of the result is kept.

    Raises:
        DFlashError: unknown dataset or peer, llama.cpp asked for but not installed, bad
            checkpoints, impossible block size.
    """
    from .peers import PEERS, require_llama_cpp, run_peer

    for p in cfg.peers:
        if p not in PEERS:
            raise DFlashError(f"unknown peer {p!r}; choose from {', '.join(PEERS)}")
    if "llama.cpp" in cfg.peers:
        require_llama_cpp()  # before minutes of benchmarking, not after
    if cfg.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    sampling = SamplingParams(temperature=cfg.temperature, seed=cfg.seed)
    dtype = parse_dtype(cfg.dtype)
    device = parse_device(cfg.device)
    check_cuda_graphs(cfg.cuda_graphs, device)
    texts = cfg.prompts()
    if cfg.engine and cfg.peers:
        raise DFlashError("peers run on HF checkpoints; bench an engine (--engine) without --peers")
    target, drafter = load_models(
        cfg.target, cfg.drafter, cfg.engine, dtype, fp8_gemm=cfg.fp8_gemm, device=device, weights=cfg.weights
    )
    # the engines of every mode: the same target, drafter and runtime settings
    make_engine = partial(
        DFlashEngine,
        target.model,
        drafter,
        target.stop_token_ids,
        compile=cfg.compile,
        cuda_graphs=cfg.cuda_graphs,
        batch_invariant=cfg.batch_invariant,
    )
    engine = make_engine()
    K = cfg.block_size or drafter.cfg.block_size
    engine.check_block_size(K)
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in texts]

    warm_s = engine.warm_up(prompts[0], K, sampling)
    if cfg.compile:
        progress(f"compiled the target and drafter forwards in {warm_s:.0f} s (warm-up, untimed)")
    llama = _InterleavedLlamaCpp(cfg, prompts, target.stop_token_ids) if "llama.cpp" in cfg.peers else None
    modes = [(engine, 1), (engine, K)]
    names = f"plain decoding, DFlash (block size {K})"
    if cfg.prompt_lookup is not None:  # a third mode: DFlash with prompt-lookup tokens merged in
        lookup = make_engine(prompt_lookup=cfg.prompt_lookup)
        lookup.warm_up(prompts[0], K, sampling)
        modes.append((lookup, K))
        names += f", DFlash + prompt lookup (n-grams {cfg.prompt_lookup[0]}-{cfg.prompt_lookup[1]})"
    names += " and llama.cpp" if llama and llama.session else ""
    progress(f"{names}, interleaved, on {len(prompts)} {cfg.prompt_set} prompts ...")
    runs = _run_modes(modes, prompts, cfg, sampling, llama)
    (ar_out, ar_wall, ar_stats), (df_out, df_wall, df_stats) = runs[:2]

    ar_tokens = sum(map(len, ar_out))
    df_tokens = sum(map(len, df_out))
    ar_tps = ar_tokens / ar_wall
    df_tps = df_tokens / df_wall
    decode_s = ar_stats.verify_s / max(ar_stats.verify_calls, 1)
    peers, peer_errors = {}, {}

    def record(res) -> None:
        peers[res.name] = {
            "tokens_per_s": res.tokens_per_s,
            "speedup_vs_ar": res.tokens_per_s / ar_tps,
            "identical_to_ar": res.outputs == ar_out if cfg.temperature == 0 else None,
            # llama.cpp: prefill and decode timed apart (None for the transformers peers)
            "prefill_tokens_per_s": res.prefill_tokens_per_s,
            "decode_tokens_per_s": res.decode_tokens_per_s,
        }

    if llama is not None:
        res = llama.result()
        if res is None:
            progress(f"peer llama.cpp failed: {llama.error}")
            peer_errors["llama.cpp"] = llama.error
        else:
            record(res)
    for name in [p for p in cfg.peers if p != "llama.cpp"]:
        progress(f"peer {name} ...")
        try:
            res = run_peer(
                name,
                target.path,
                prompts,
                cfg.max_new_tokens,
                dtype,
                target.stop_token_ids,
                device=device,
                drafter=drafter,
                block_size=K,
            )
        except DFlashError as e:  # the peer fails alone: what was measured is kept
            progress(f"peer {name} failed: {e}")
            peer_errors[name] = str(e)
            continue
        record(res)

    def divergences(out: list[list[int]]) -> list[dict] | None:
        """Greedy runs that differ from plain decoding: the first differing token and the
        target's top-2 logit gap there (a gap near the dtype's resolution is a numerical tie
        between 1-row and K-row GEMMs); None when sampling."""
        if cfg.temperature != 0:
            return None
        found = []
        for i, (a, b) in enumerate(zip(ar_out, out)):
            k = first_divergence(a, b)
            if k is not None:
                found.append({"prompt": i, "token": k, "top2_margin": top2_margin(target.model, prompts[i] + a[:k])})
        return found

    result = {
        "dataset": cfg.prompt_set,
        "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "block_size": K,
        "temperature": cfg.temperature,
        "target": str(target.path),
        "drafter": str(cfg.drafter) if cfg.drafter else "default",
        "drafter_layers": drafter.cfg.num_layers,
        "dtype": cfg.dtype,
        "weights": cfg.weights,
        "compile": cfg.compile,
        "cuda_graphs": cfg.cuda_graphs,
        "batch_invariant": resolve_batch_invariant(cfg.batch_invariant, device, target.model.embed.weight.dtype),
        "device": device_name(device),
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
        "peers": peers,
        # peers that failed (llama.cpp crashing, a missing package): name -> the one-line error
        "peer_errors": peer_errors,
    }
    if cfg.json_out:
        write_json(cfg.json_out, result)
    return result


def _lookup_result(cfg: BenchConfig, run, ar_out: list[list[int]], ar_tps: float, divergences: Callable) -> dict:
    """The DFlash + prompt-lookup mode's figures beside plain decoding's (``divergences``:
    :func:`run_bench`'s, outputs -> the divergence records)."""
    out, wall, st = run
    tps = sum(map(len, out)) / wall
    return {
        "min_n": cfg.prompt_lookup[0],
        "max_n": cfg.prompt_lookup[1],
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
    rows.append(
        (
            f"DFlash (ours, K={r['block_size']})",
            r["dflash_tokens_per_s"],
            r["speedup"],
            f"tau {r['tau']:.2f}, lossless {r['lossless']}" + _identical(r, r["num_prompts"]),
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
    lines.append(
        f"verify cost (K={r['block_size']}) {r['verify_cost_ratio']:.2f}x a decode step "
        f"({r['decode_step_ms']:.1f} ms); draft cost {r['draft_cost_ratio']:.2f}x"
    )
    acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
    lines.append(f"acceptance per draft position: {acc}")
    lines += [f"peer {name} failed: {err}" for name, err in r.get("peer_errors", {}).items()]
    return "\n".join(lines)
