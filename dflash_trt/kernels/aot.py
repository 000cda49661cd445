"""Ahead-of-time compilation of the drafter kernels for Hopper and Blackwell, on a machine with
no GPU: Triton's compiler (and the ``ptxas`` its wheel ships) turns each kernel variant into a
cubin for ``sm_90a`` (H100 / H200), ``sm_100a`` (B200) and ``sm_103a`` (B300).

``dflash-trt kernels-aot --out DIR`` writes ``DIR/<arch>/<variant>.cubin``, the PTX it came
from (``<variant>.ptx``: what a TensorRT quick-deployable plugin's ``aot_impl`` returns) and
``DIR/manifest.json``: per cubin its kernel (entry) name, arch, size, shared memory, warps,
the argument signature and the compile-time constants; the TensorRT plugins
(``plugins/dflash_plugins.py``) load them from there.

The kernels take TensorRT plugin argument order (:mod:`.plugin_abi`, whose
:func:`~.plugin_abi.specs` lists the variants compiled: the shapes deployments use).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..atomic import atomic_dir, write_json
from ..errors import DFlashError

ARCHS = {"sm_90a": 90, "sm_100a": 100, "sm_103a": 103}


def compile_all(out: str | os.PathLike, archs: list[str] | None = None, progress: bool = True) -> dict:
    """Compile every variant for ``archs`` (default all of :data:`ARCHS`) into ``out``.

    Returns:
        the manifest (also written to ``out/manifest.json``).

    Raises:
        DFlashError: triton missing, an unknown arch, ``out`` exists, or a kernel that does not
            compile (its first error line in the message).
    """
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (no warning)
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        raise DFlashError("kernels-aot needs triton (pip install triton)") from None
    from tqdm import tqdm
    from triton import knobs

    if knobs.runtime.interpret:
        raise DFlashError("kernels-aot cannot compile with TRITON_INTERPRET=1 set; unset it")
    archs = archs or list(ARCHS)
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise DFlashError(f"unknown arch {bad[0]}; choose from {', '.join(ARCHS)}")
    out = Path(out).expanduser()
    if out.exists():
        raise DFlashError(f"{out} already exists; choose a new directory for the cubins")
    from .plugin_abi import specs

    jobs = [(a, v) for a in archs for v in specs()]
    entries = []
    with atomic_dir(out) as tmp:
        for arch, spec in tqdm(jobs, desc="compile kernels", unit="cubin", disable=not progress):
            name, t = spec.name, time.perf_counter()
            try:
                src = ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs)
                k = triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32))
            except Exception as e:  # Triton raises many kinds
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise DFlashError(f"kernel {name} does not compile for {arch}: {first}") from None
            ptx_target = next((ln.split()[1] for ln in k.asm["ptx"].splitlines() if ln.startswith(".target")), "?")
            path = tmp / arch / f"{name}.cubin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(k.asm["cubin"])
            path.with_suffix(".ptx").write_text(k.asm["ptx"])
            entries.append(
                {
                    "variant": name,
                    "arch": arch,
                    "ptx_target": ptx_target,
                    "file": f"{arch}/{name}.cubin",
                    "ptx": f"{arch}/{name}.ptx",
                    "bytes": path.stat().st_size,
                    "entry": k.metadata.name,
                    "num_warps": k.metadata.num_warps,
                    "shared_bytes": k.metadata.shared,
                    "inputs": spec.inputs,
                    "extras": spec.extras,
                    "outputs": spec.outputs,
                    "constexprs": spec.constexprs,
                    "grid": spec.grid,
                    "compile_s": round(time.perf_counter() - t, 2),
                }
            )
        manifest = {"triton": triton.__version__, "archs": archs, "cubins": entries}
        write_json(tmp / "manifest.json", manifest)
    return manifest
