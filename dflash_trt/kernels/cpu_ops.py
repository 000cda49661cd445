"""The batch-invariant CPU kernels (``cpu/batch_invariant.cpp``) as torch ops
``dflash_cpu::bi_linear`` (with ``bi_pack`` / ``bi_linear_packed``, the same arithmetic over a
weight packed once), ``dflash_cpu::int4_linear`` / ``int8_linear`` (packed integer weights),
``dflash_cpu::bi_attention``, ``dflash_cpu::rms_norm`` and the one-call dense layer, with the
host-side paged attention metadata builder (``cpu/paged_meta.cpp``), the drafter's KV injection
writes (``dflash_cpu::context_kv``, ``cpu/context_kv.cpp``) and the argmax of logits rows
(``dflash_cpu::argmax_rows``, ``cpu/argmax.cpp``), built once per machine.

The C++ source is compiled with the machine's own compiler on first use
(``torch.utils.cpp_extension``, ``-O3 -march=native -ffp-contract=off``; ~15-60 s on 2 cores) into
``~/.cache/dflash-trt/ext/<key>/`` (``DFLASH_TRT_EXT_DIR`` overrides the root), where ``key``
hashes the source, the torch version and this CPU's instruction-set flags, so a cache shared
between different machines never loads a binary built for another CPU. Later processes load the
built library in well under a second.

What the ops compute, and why the order of every sum is fixed per row, is in the C++ file's
header.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path

import torch

from ..errors import DFlashError

CPU_DIR = Path(__file__).with_name("cpu")
#: every source of the extension: the kernels, the host-side paged attention metadata builder, the
#: KV injection's norm / RoPE / pool writes, and the greedy choice (argmax) of logits rows
SOURCES = tuple(CPU_DIR / n for n in ("batch_invariant.cpp", "paged_meta.cpp", "context_kv.cpp", "argmax.cpp"))

_lock = threading.Lock()
_loaded = False
_failed: DFlashError | None = None  # a failed build is not retried in the same process


def _cpu_flags() -> str:
    """This CPU's instruction-set flags (``/proc/cpuinfo``), or the machine name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def build_dir() -> Path:
    """Where this machine's build of the kernels lives (see the module docstring)."""
    from ..checkpoints.sources import cache_root

    root = Path(os.environ["DFLASH_TRT_EXT_DIR"]) if os.environ.get("DFLASH_TRT_EXT_DIR") else cache_root() / "ext"
    code = b"".join(src.read_bytes() for src in SOURCES)
    key = hashlib.sha256(code + torch.__version__.encode() + _cpu_flags().encode()).hexdigest()[:16]
    return root / f"batch_invariant-{key}"


def load() -> None:
    """Build (first use on this machine) and load the ``dflash_cpu`` ops into this process.

    Raises:
        DFlashError: no C++ compiler, or the build failed (one line; the compiler's output is
            in ``build.log`` of :func:`build_dir`).
    """
    global _loaded, _failed
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        if _failed is not None:
            raise _failed
        from torch.utils import cpp_extension

        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        # FMAs are written out in the source; nothing else may be contracted (-ffp-contract=off)
        flags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17"]
        try:
            cpp_extension.load(
                name="dflash_cpu_batch_invariant",
                sources=[str(src) for src in SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(out),
                is_python_module=False,
                verbose=False,
            )
        except (RuntimeError, OSError, FileNotFoundError) as e:
            (out / "build.log").write_text(str(e))
            lines = str(e).strip().splitlines()
            # the compiler's first error (or the shell's: no compiler), not ninja's first command line
            marks = (": error", "fatal error", "Killed", ": not found")
            errors = [ln.strip() for ln in lines if any(m in ln for m in marks)]
            first = (errors or lines or [type(e).__name__])[0]
            _failed = DFlashError(
                f"the batch-invariant CPU kernels could not be built (needs a C++ compiler, g++): {first}; "
                f"log in {out / 'build.log'}"
            )
            raise _failed from None
        _register_fakes()
        _loaded = True


def loaded() -> bool:
    """Whether the ``dflash_cpu`` ops are loaded in this process (without building them)."""
    return _loaded


def _register_fakes() -> None:
    """Shapes for ``torch.compile`` (the ops are opaque to inductor, called from its graph)."""

    @torch.library.register_fake("dflash_cpu::bi_linear")
    def _(x, w, bias):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("dflash_cpu::bi_linear_packed")
    def _(x, wp, n, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("dflash_cpu::int4_linear")
    def _(x, codes, scales, n, group_size, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("dflash_cpu::int8_linear")
    def _(x, codes, scales, n, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("dflash_cpu::bi_attention")
    def _(q, k, v, mask, scale, sinks=None):
        return q.new_empty(q.shape, dtype=torch.float32)

    @torch.library.register_fake("dflash_cpu::argmax_rows")
    def _(x):
        return x.new_empty(x.shape[0], dtype=torch.long)

    @torch.library.register_fake("dflash_cpu::rms_norm")
    def _(x, w, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("dflash_cpu::bi_paged_attention")
    def _(q, k_pool, v_pool, slots, mask, scale, sinks=None):
        return q.new_empty(q.shape, dtype=torch.float32)


def bi_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with a per-row order of summation fixed whatever the rows.

    Args:
        x: ``[M, K]`` fp32 or bf16 (CPU).
        w: ``[N, K]`` fp32 or bf16, as ``nn.Linear`` keeps it.
        bias: optional ``[N]`` (any float dtype; added in fp32 before the final rounding).

    Returns:
        ``[M, N]`` in ``x``'s dtype; fp32 accumulation (bf16 x bf16 on an AVX512-BF16 CPU: pairs
        of inputs per ``vdpbf16ps``, or on an AMX CPU 32 inputs per ``tdpbf16ps``: a fixed order
        too, :func:`bf16_gemm`), one rounding at the end.
    """
    load()
    return torch.ops.dflash_cpu.bi_linear(x, w, bias)


def bf16_gemm() -> str:
    """The kernel that multiplies bf16 activations by bf16 weights in this process's
    :func:`bi_linear`: ``amx`` (AMX tiles, ``tdpbf16ps``; for inputs a multiple of 32, the others
    ``avx512-bf16``), ``avx512-bf16`` (``vdpbf16ps``) or ``fma`` (widened to fp32). Each keeps
    one order of summation per output whatever the rows; their orders differ, so bits differ
    between machines, never between the rows of one."""
    load()
    return torch.ops.dflash_cpu.bf16_gemm()


def bi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with each (sequence, head, query) computed alone, over its visible keys in key
    order (GQA: query head ``h`` reads KV head ``h // (H / Hkv)``).

    Args:
        q: ``[S, H, T, D]``; k, v: ``[S, Hkv, L, D]`` (same dtype, fp32 or bf16; any strides).
        mask: bool ``[S or 1, 1, T, L]``, true where a query may attend.
        scale: score scale (``1 / sqrt(D)`` as SDPA's default).
        sinks: optional ``[H]`` attention-sink logits (gpt-oss; read as fp32): one more logit per
            softmax row, with no value (transformers' ``GptOssAttention``).

    Returns:
        ``[S, H, T, D]`` fp32 (a query with no visible key gets zeros).
    """
    load()
    return torch.ops.dflash_cpu.bi_attention(q, k, v, mask, scale, sinks)


def bi_paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`bi_attention` over a paged KV cache: sequence ``s``'s key ``l`` is read at pool slot
    ``slots[s, l]`` in place (no gathered copy); the same bits as ``bi_attention(q,
    k_pool[slots].transpose(1, 2), v_pool[slots].transpose(1, 2), mask, scale, sinks)``.

    Args:
        q: ``[S, H, T, D]``; k_pool, v_pool: ``[num_slots, Hkv, D]`` in ``q``'s dtype (fp32 or
            bf16), contiguous in ``D``.
        slots: int64 ``[S, L]`` (the paged cache's read table; entries under a false mask are
            never read).
        mask: bool ``[S or 1, 1, T, L]``, true where a query may attend.
        scale, sinks: as :func:`bi_attention`.

    Returns:
        ``[S, H, T, D]`` fp32.
    """
    load()
    return torch.ops.dflash_cpu.bi_paged_attention(q, k_pool, v_pool, slots, mask, scale, sinks)


def context_kv(
    kv: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_pools: torch.Tensor,
    v_pools: torch.Tensor,
) -> None:
    """:func:`~dflash_trt.kernels.context_kv.context_kv_reference` in one call (DFlash KV
    injection, arXiv:2602.06036 section 3: each layer's K heads k_norm-ed and rotated, K and V
    written to the pools at ``slots``), with the reference's roundings; its mean square summed
    in order (the reference's vectorized sum: an ulp apart now and then). The eager CPU path's
    KV injection: where the kernels are not loaded in this process (they are not built for it
    here) or the dtypes are not one of fp32 / bf16 throughout, the torch reference itself.

    Args:
        kv: ``[T, L * 2 * Hkv * D]`` fp32 or bf16 (rows contiguous), layer ``l``'s K then V heads.
        k_norm: ``[L, D]``, ``kv``'s dtype; eps: its RMSNorm epsilon.
        inv_freq: fp32 ``[D / 2]`` RoPE inverse frequencies (rotate-half convention).
        positions, slots: int64 ``[T]``.
        k_pools, v_pools: ``[L, P, Hkv, D]`` contiguous, ``kv``'s dtype; written in place.

    Raises:
        RuntimeError: another layout, or a slot outside ``[0, P)``.
    """
    if not (_loaded and kv.dtype in (torch.float32, torch.bfloat16) and kv.dtype == k_norm.dtype == k_pools.dtype):
        from .context_kv import context_kv_reference

        return context_kv_reference(kv, k_norm, eps, inv_freq, positions, slots, k_pools, v_pools)
    ang = positions.float().unsqueeze(1) * inv_freq  # [T, D / 2], as the reference's
    torch.ops.dflash_cpu.context_kv(kv, k_norm, eps, ang.cos(), ang.sin(), slots.contiguous(), k_pools, v_pools)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a CPU ``[R, V]`` fp32 or bf16 tensor (rows contiguous) in one call: the
    first maximum on ties, the first NaN where a row has one (torch's rules), read once at
    vector width (torch's bf16 CPU argmax, even upcast to fp32 first, took ~1 ms for 12 rows of
    a 49,152-token vocabulary on a 2-core AMX Xeon).

    Returns:
        int64 ``[R]``.

    Raises:
        RuntimeError: another dtype, device or layout.
    """
    load()
    return torch.ops.dflash_cpu.argmax_rows(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm in one call: ``round(weight * round(x * rsqrt(mean(x^2) + eps)))``,
    the mean in fp32, each row alone (the same bits whatever the other rows).

    Args:
        x: ``[..., D]`` fp32 or bf16 (CPU).
        weight: ``[D]``, ``x``'s dtype.
        eps: added to the mean square.

    Returns:
        ``[..., D]`` in ``x``'s dtype.
    """
    load()
    return torch.ops.dflash_cpu.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
