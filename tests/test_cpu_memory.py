"""CPU memory: the C allocator settings of a CPU engine (runtime/cpu_memory.py), measured in a
fresh process; KV pools resident only as written; models built for loading take no random draws."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# a prompt-iteration-like pattern: MLP-sized activations of varying row counts, taken and freed
# layer after layer; the minor page faults of the third pass say whether freed memory was reused.
# The layer reads 64 features, not a model's 576: the activations it writes (n x 3072 fp32, up to
# 24 MiB) are the allocations under test; a 576-wide input did ~9x the arithmetic for the same
# allocations (the test 26 s against 10 s; warm-pass faults 92,000 vs 79,744 with the defaults, 0 and 0)
PATTERN = """
import resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "engine":  # the settings exactly as a CPU engine applies them
    from dflash_trt.runtime.cpu_memory import retain_freed_memory
    assert retain_freed_memory()
lin = torch.nn.Linear(64, 3072)
faults = []
with torch.inference_mode():
    for rep in range(3):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for n in (2048, 1900, 2048, 1500, 2048, 64, 2048):
            x = torch.randn(n, 64)
            for _ in range(6):
                h = lin(x)
                g = torch.nn.functional.silu(h) * h
                del h
                x = g[:, :64].contiguous()
                del g
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(faults[-1])
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_activations_are_reused_not_faulted_back_in():
    """With glibc's defaults the pattern keeps giving pages back and faulting them in again
    (tens of thousands of faults per pass); with the engine's settings a warm pass faults
    (almost) none."""
    default, engine = _faults("default"), _faults("engine")
    print(f"minor page faults in a warm pass: glibc defaults {default}, engine settings {engine}")
    assert engine < 2_000
    assert default > 5_000  # the pattern does exercise the defaults' give-back


def _resident_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/statm")
def test_kv_pool_pages_are_resident_only_once_written():
    """``runtime/kv_cache.zeroed``: a 512 MiB CPU pool reads as zeros and costs resident memory
    only for the slots written (``torch.zeros`` made all of it resident at once); the tensor
    keeps its mapping alive after the call returns."""
    import gc

    import torch

    from dflash_trt.runtime.kv_cache import zeroed

    before = _resident_mib()
    pool = zeroed((8, 1 << 14, 4, 256), torch.float32)  # 512 MiB
    gc.collect()
    assert _resident_mib() - before < 64
    pool[3, 100:200] = 1.5
    assert float(pool[3, 100:200].sum()) == 1.5 * 100 * 4 * 256
    assert not pool[3, :100].any() and not pool[7, -10:].any()
    assert _resident_mib() - before < 64


def test_skip_random_init_draws_nothing_and_restores_init():
    """``models/uninitialized.skip_random_init``: a model built inside takes no random draws (the
    generator's state is untouched) and ``torch.nn.init`` is whole again after it, also when the
    block raises."""
    import torch

    from dflash_trt.models.uninitialized import RANDOM_DRAWS, skip_random_init

    saved = {name: getattr(torch.nn.init, name) for name in RANDOM_DRAWS}
    state = torch.random.get_rng_state()
    with skip_random_init():
        torch.nn.Linear(64, 64)
        torch.nn.Embedding(100, 8)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.nn.Linear(64, 64)  # outside: drawn
    assert not torch.equal(torch.random.get_rng_state(), state)
    with pytest.raises(RuntimeError), skip_random_init():
        raise RuntimeError("a failed load")
    assert all(getattr(torch.nn.init, name) is fn for name, fn in saved.items())
