"""The C allocator settings of a CPU engine (runtime/cpu_memory.py), measured in a fresh process."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# a prompt-iteration-like pattern: MLP-sized activations of varying row counts, taken and freed
# layer after layer; the minor page faults of the third pass say whether freed memory was reused
PATTERN = """
import resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "engine":  # the settings exactly as a CPU engine applies them
    from dflash_trt.runtime.cpu_memory import retain_freed_memory
    assert retain_freed_memory()
lin = torch.nn.Linear(576, 3072)
faults = []
with torch.inference_mode():
    for rep in range(3):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for n in (2048, 1900, 2048, 1500, 2048, 64, 2048):
            x = torch.randn(n, 576)
            for _ in range(6):
                h = lin(x)
                g = torch.nn.functional.silu(h) * h
                del h
                x = g[:, :576].contiguous()
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
