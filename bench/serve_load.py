"""Load against ``dflash-trt serve`` with aiperf (PyPI), beside the in-process engine on the same
requests, in one run: output tokens/s, TTFT and inter-token latency at each concurrency, and the
server's throughput as a share of the engine's. Writes JSON and a PNG.

    python bench/serve_load.py --aiperf /path/to/venv/bin/aiperf --concurrency 1,4,16 \
        --requests 32 --input-tokens 128 --output-tokens 64 --json out/serve-load.json --plot out/serve-load.png

With ``--pin 0:1 --threads 1`` the server (and the in-process engine) run on core 0 and aiperf on
core 1, so the client's CPU does not come out of the server's (on a real deployment the load
generator is another machine).

The in-process engine runs the server's scheduling: at most ``--max-prefill-tokens`` prompt
tokens per iteration (default: the serving default on a CPU,
:data:`~dflash_trt.runtime.config.CPU_MAX_PREFILL_TOKENS`; 0: no cap, as servers before it had).

The requests are aiperf's synthetic prompts (``--input-tokens`` long, fixed seed), chat
completions streamed with ``ignore_eos`` so each answer is exactly ``--output-tokens`` long; the
in-process side replays the same prompt token counts (random text of that many tokens through
the chat template) at the same concurrency through :class:`~dflash_trt.runtime.engine.LLMEngine`
with the same engine settings. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_trt.runtime.config import CPU_MAX_PREFILL_TOKENS  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc, timeout: float = 600) -> None:
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def run_aiperf(aiperf: str, url: str, model: str, tokenizer: str, c: int, args, out_dir: Path) -> dict:
    """One aiperf profile at concurrency ``c``; returns its summary metrics (aiperf's JSON)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        aiperf,
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        tokenizer,
        "--concurrency",
        str(c),
        "--request-count",
        str(args.requests),
        "--synthetic-input-tokens-mean",
        str(args.input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(args.output_tokens),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--extra-inputs",
        "temperature:0",
        "--random-seed",
        "7",
        "--warmup-request-count",
        "1",
        "--output-artifact-dir",
        str(out_dir),
        "--no-auto-plot",
        # a light client: it shares the server's cores here (on a real deployment it would not)
        "--workers-max",
        "1",
        "--record-processors",
        "1",
        "--use-server-token-count",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--ui-type",
        "none",
    ]
    if args.pin:  # the client on the cores the server does not use
        cmd = ["taskset", "-c", args.pin[1], *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    found = sorted(out_dir.rglob("*aiperf*.json"))
    data = json.loads(found[-1].read_text())

    def metric(name, key="avg"):
        m = data.get(name) or data.get("records", {}).get(name) or {}
        return m.get(key)

    return {
        "output_tokens_per_s": metric("output_token_throughput"),
        "ttft_ms_p50": metric("time_to_first_token", "p50"),
        "ttft_ms_p99": metric("time_to_first_token", "p99"),
        "itl_ms_p50": metric("inter_token_latency", "p50"),
        "itl_ms_p99": metric("inter_token_latency", "p99"),
        "requests_per_s": metric("request_throughput"),
        # aiperf's own CPU use (all its processes), as a share of the run's wall time
        "client_cpu_cores": client_cpu / (time.perf_counter() - t0),
    }


def cpu_list(spec: str) -> set[int]:
    """``0,2-3`` -> {0, 2, 3} (taskset's list syntax)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def engine_baseline(args, concurrencies: list[int]) -> dict[int, dict]:
    """The in-process engine (one engine, loaded once) at each concurrency: ``args.requests``
    prompts of the same lengths, at most ``c`` in flight, fixed-length answers (no stop tokens).
    Returns per concurrency: output tokens/s, TTFT p50 (ms, from each request's arrival in the
    engine) and the p50 / p99 iteration time (ms)."""
    import random

    import torch

    from dflash_trt import EngineArgs, LLMEngine
    from dflash_trt.prompts import chat_prompt_ids
    from dflash_trt.runtime.request import Request

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            drafter=args.drafter,
            dtype=args.dtype,
            device="cpu",
            block_size=args.block_size,
            adaptive=True,
            max_batch_size=64,
            max_prefill_tokens=args.max_prefill_tokens or None,
        )
    )
    tok = engine.models.target.tokenizer
    rng = random.Random(7)
    vocab = list(tok.get_vocab().values())
    prompts = [
        chat_prompt_ids(tok, tok.decode([rng.choice(vocab) for _ in range(args.input_tokens)]))
        for _ in range(args.requests)
    ]
    torch.set_num_threads(args.threads)
    if args.pin:  # the same cores as the server had
        os.sched_setaffinity(0, cpu_list(args.pin[0]))
    warm = engine.add_request(Request(prompts[0], 4, stop_token_ids=()))
    engine.run()
    engine.result(warm)
    rates = {}
    for c in concurrencies:
        print(f"in-process engine at concurrency {c} ...", file=sys.stderr, flush=True)
        pending, done, inflight, t0 = list(prompts), 0, 0, time.perf_counter()
        ttft = []
        engine.iteration_s.clear()
        while pending or engine.has_unfinished():
            while pending and inflight < c:
                engine.add_request(Request(pending.pop(), args.output_tokens, stop_token_ids=()))
                inflight += 1
            for s in engine.step():
                inflight -= 1
                out = engine.result(s.seq_id)
                done += len(out.output_ids)
                ttft.append(out.ttft_s)
        iters = sorted(engine.iteration_s)
        rates[c] = {
            "output_tokens_per_s": done / (time.perf_counter() - t0),
            "ttft_ms_p50": 1e3 * sorted(ttft)[len(ttft) // 2],
            "iteration_ms_p50": 1e3 * iters[len(iters) // 2],
            "iteration_ms_p99": 1e3 * iters[int(0.99 * (len(iters) - 1))],
        }
    return rates


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", required=True, help="the aiperf executable (its own venv)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=CPU_MAX_PREFILL_TOKENS,
        help="prompt tokens per iteration of the server and the in-process engine (0: no cap, as before the cap)",
    )
    ap.add_argument(
        "--pin",
        type=lambda v: v.split(":"),
        default=None,
        help="SERVER:CLIENT core lists (e.g. 0:1): the server and the in-process engine on SERVER's cores, "
        "aiperf on CLIENT's, so that the client's CPU does not come out of the server's (use --threads to match)",
    )
    ap.add_argument(
        "--server-python",
        default=sys.executable,
        help="the Python that runs `dflash-trt serve` (another checkout's venv: a before / after comparison)",
    )
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--plot")
    return ap.parse_args()


def server_command(args, port: int) -> list[str]:
    """``dflash-trt serve`` with the run's settings (pinned with taskset when asked)."""
    cmd = [
        args.server_python,
        "-m",
        "dflash_trt.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--model-name",
        "dflash",
    ]
    if args.drafter:
        cmd += ["--drafter", str(Path(args.drafter).resolve())]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    if args.max_prefill_tokens != CPU_MAX_PREFILL_TOKENS:  # (0: no cap, i.e. up to the whole token budget)
        cmd += ["--max-prefill-tokens", str(args.max_prefill_tokens or 2048)]
    if args.pin:
        cmd = ["taskset", "-c", args.pin[0], *cmd]
    return cmd


def main() -> None:
    args = parse_args()
    from dflash_trt.checkpoints.sources import resolve_target

    conc = [int(x) for x in args.concurrency.split(",")]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(args, port)
    work = Path(args.json_out or "out/serve-load.json").parent / "aiperf"
    # run from elsewhere than this checkout, so that the server imports its own venv's dflash_trt
    server = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd="/")
    rows = []
    try:
        wait_health(url, server)
        for c in conc:
            print(f"aiperf at concurrency {c} ...", file=sys.stderr, flush=True)
            rows.append(
                {
                    "concurrency": c,
                    **run_aiperf(args.aiperf, url, "dflash", str(resolve_target(None)), c, args, work / f"c{c}"),
                }
            )
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    engine_rates = engine_baseline(args, conc)
    for r in rows:
        for k, v in engine_rates[r["concurrency"]].items():
            r[f"engine_{k}"] = v
        r["server_vs_engine"] = (r["output_tokens_per_s"] or 0) / r["engine_output_tokens_per_s"]
    print_rows(rows)
    if args.json_out:
        from dflash_trt.atomic import write_json

        write_json(args.json_out, {"settings": vars(args), "rows": rows})
    if args.plot:
        plot(rows, args)


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'C':>3} {'server tok/s':>13} {'engine tok/s':>13} {'ratio':>6} {'TTFT p50/p99 ms':>16} "
        f"{'engine TTFT p50':>16} {'ITL p50/p99 ms':>15} {'engine iter p50/p99 ms':>23} {'client cores':>12}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>3} {r['output_tokens_per_s']:>13.1f} {r['engine_output_tokens_per_s']:>13.1f} "
            f"{r['server_vs_engine']:>6.2f} {r['ttft_ms_p50']:>8.0f}/{r['ttft_ms_p99']:<7.0f} "
            f"{r['engine_ttft_ms_p50']:>16.0f} {r['itl_ms_p50']:>7.1f}/{r['itl_ms_p99']:<7.1f} "
            f"{r['engine_iteration_ms_p50']:>11.1f}/{r['engine_iteration_ms_p99']:<11.1f} "
            f"{r['client_cpu_cores']:>12.2f}"
        )


def plot(rows: list[dict], args) -> None:
    """Throughput, TTFT and ITL against concurrency, server beside the in-process engine (PNG at ``args.plot``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    cs = [r["concurrency"] for r in rows]
    axes[0].plot(cs, [r["output_tokens_per_s"] for r in rows], "o-", label="dflash-trt serve (aiperf)")
    axes[0].plot(cs, [r["engine_output_tokens_per_s"] for r in rows], "s--", label="in-process engine")
    axes[0].set_ylabel("output tokens / s")
    axes[0].legend(fontsize=8)
    axes[1].plot(cs, [r["ttft_ms_p50"] for r in rows], "o-", label="server p50")
    axes[1].plot(cs, [r["ttft_ms_p99"] for r in rows], "^:", label="server p99")
    axes[1].plot(cs, [r["engine_ttft_ms_p50"] for r in rows], "s--", label="in-process engine p50")
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].legend(fontsize=8)
    axes[2].plot(cs, [r["itl_ms_p50"] for r in rows], "o-", label="server ITL p50")
    axes[2].plot(cs, [r["itl_ms_p99"] for r in rows], "^:", label="server ITL p99")
    axes[2].plot(cs, [r["engine_iteration_ms_p99"] for r in rows], "s--", label="engine iteration p99")
    axes[2].set_ylabel("ms")
    axes[2].legend(fontsize=8)
    for a in axes:
        a.set_xlabel("concurrency")
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
    fig.suptitle(
        f"{args.input_tokens} in / {args.output_tokens} out tokens, {args.requests} requests, "
        f"{args.dtype}, CPU {args.threads} threads"
        + (f", server on cores {args.pin[0]}, aiperf on {args.pin[1]}" if args.pin else ""),
        fontsize=9,
    )
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
