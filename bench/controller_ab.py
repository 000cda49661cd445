"""The adaptive draft-length controller against fixed draft lengths, and against another version
of itself, in the load benchmark's lanes: every contender is a DFlash engine of its own, served
beside plain decoding in one process, the lanes interleaved step by step (``bench --concurrency``'s
lanes), so a noisy machine's slow periods fall on all of them alike.

    .venv/bin/python bench/controller_ab.py --concurrency 4 --runs 10
    .venv/bin/python bench/controller_ab.py --concurrency 16 --fixed 0 --runs 6
    .venv/bin/python bench/controller_ab.py --concurrency 4 --old /tmp/old/dflash_trt/runtime/adaptive.py

Contenders: ``dflash`` (the controller as it is), ``fixed-K`` for each ``--fixed K`` (K draft
tokens per sequence every iteration; 0 is the DFlash engine decoding plainly: its own work per
iteration against the plain engine's), ``old`` with ``--old FILE`` (the ``DraftLengthController``
of another ``runtime/adaptive.py``, e.g. one checked out at an earlier commit). Prints and writes
(``--json``) each run's tokens/s ratio to plain decoding and draft tokens per step per contender,
and their mean and median; every contender's outputs are compared with plain decoding's
(``identical N/N``). Greedy, GSM8K prompts, all requests arriving at t=0.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dflash_trt import EngineArgs  # noqa: E402
from dflash_trt.bench import load  # noqa: E402
from dflash_trt.runtime.adaptive import DraftLengthController, engine_settings  # noqa: E402


def fixed_controller(ctl: DraftLengthController, k: int) -> None:
    """Make ``ctl`` choose ``k`` draft tokens per sequence every iteration (no probes)."""
    ctl.choose = lambda seqs, token_budget=None: (k, False)


def controller_class(path: Path) -> type:
    """``DraftLengthController`` of the ``adaptive.py`` at ``path`` (a module of its own)."""
    spec = importlib.util.spec_from_file_location("adaptive_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DraftLengthController


def contender_engines(run, fixed: list[int], old: Path | None) -> list[str]:
    """Build plain decoding's engine and every contender's in ``run`` (a ``load._LoadRun``), each
    as the load bench builds its DFlash engine, and set ``run``'s modes to them: the contenders'
    names."""
    run.engine_for("ar")
    main_engine = run.engine_for("dflash")
    contenders = {f"fixed-{k}": k for k in fixed} | ({"old": None} if old is not None else {})
    for name, k in contenders.items():
        del run.engines["dflash"]
        eng = run.engine_for("dflash")
        if k is not None:
            fixed_controller(eng.controller, k)
        else:
            graphs = eng.config.model.cuda_graphs  # (as the engine makes its own controller)
            cls = controller_class(old)
            known = inspect.signature(cls).parameters  # (an older one takes fewer settings)
            kw = {k: v for k, v in engine_settings(graphs).items() if k in known}
            eng.controller = cls(eng.block_size - 1, **kw)
            if not hasattr(eng.controller, "idle_iterations"):  # (older: every iteration keeps its features)
                eng.controller.idle_iterations = lambda: 0
            observe = eng.controller.observe_drafter
            if "cold" not in inspect.signature(observe).parameters:  # (older: cold forwards not apart)
                eng.controller.observe_drafter = lambda seqs, tokens, seconds, cold=False, f=observe: f(
                    seqs, tokens, seconds
                )
            eng.calibrate()
        run.engines[name] = eng
    run.engines["dflash"] = main_engine
    names = ["dflash", *contenders]
    run.cfg.modes = ("ar", *names)
    return names


def lane_arguments(ap: argparse.ArgumentParser, concurrency: int, runs: int, dtype: str) -> None:
    """The options every A/B of load-bench lanes takes (concurrency, runs, dtype, prompts, new
    tokens, threads), with these defaults."""
    ap.add_argument("--concurrency", type=int, default=concurrency)
    ap.add_argument("--runs", type=int, default=runs)
    ap.add_argument("--dtype", default=dtype)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)


def lane_run(a: argparse.Namespace, modes: tuple[str, ...] | None = None) -> load._LoadRun:
    """The load bench's run for :func:`lane_arguments`' options ``a`` (GSM8K, adaptive DFlash,
    torch's threads set), its engines built on demand (``run.engine_for``)."""
    torch.set_num_threads(a.threads)
    kw = {} if modes is None else {"modes": modes}
    cfg = load.LoadConfig(
        dataset="gsm8k",
        num_prompts=a.num_prompts,
        max_new_tokens=a.max_new_tokens,
        concurrency=(a.concurrency,),
        engine_args=EngineArgs(adaptive=True, dtype=a.dtype),
        **kw,
    )
    cfg.validate()
    kv_cap, _ = load.kv_capacity_for(cfg)
    return load._LoadRun(cfg, kv_cap, None, lambda msg: print(msg, file=sys.stderr))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    lane_arguments(ap, concurrency=4, runs=6, dtype="bf16")
    ap.add_argument("--fixed", type=int, action="append", default=[], help="a fixed draft length (repeatable)")
    ap.add_argument("--old", type=Path, help="another runtime/adaptive.py whose controller runs beside")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.old is not None and not a.old.is_file():
        print(f"error: --old {a.old}: no such file", file=sys.stderr)
        return 2
    c = a.concurrency
    run = lane_run(a)
    names = contender_engines(run, a.fixed, a.old)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    drafts: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.runs):
        rows = {x["mode"]: x for x in run._run_lanes(c)[0]}
        plain = rows["ar"]["output_tokens_per_s"]
        line = [f"run {r + 1}/{a.runs}: plain {plain:.1f} tok/s"]
        for n in names:
            ratios[n].append(rows[n]["output_tokens_per_s"] / plain)
            drafts[n].append(rows[n]["mean_draft_tokens"])
            n_req = rows[n]["requests"]
            same = n_req - len(rows[n]["divergences"] or [])
            line.append(f"{n} {ratios[n][-1]:.4f}x ({drafts[n][-1]:.2f} drafts/step, identical {same}/{n_req})")
        print("; ".join(line), flush=True)
    summary = {
        n: {"mean": statistics.mean(ratios[n]), "median": statistics.median(ratios[n]), "runs": ratios[n]}
        for n in names
    }
    for n, s in summary.items():
        print(f"{n}: mean {s['mean']:.4f}x plain, median {s['median']:.4f}x over {a.runs} runs")
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        body = {"command": " ".join(["bench/controller_ab.py", *(argv if argv is not None else sys.argv[1:])])}
        body |= {"concurrency": c, "dtype": a.dtype, "summary": summary, "drafts_per_step": drafts}
        a.json.write_text(json.dumps(body, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
