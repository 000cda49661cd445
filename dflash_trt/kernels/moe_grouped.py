"""The expert computation of a mixture-of-experts layer through a grouped GEMM: every token's
``k`` routed (token, slot) pairs sorted by expert, each expert's rows put through its SwiGLU MLP
(``gate_up`` GEMM, activation, ``down`` GEMM), the results weighted by the routing weights and
added per token in slot order. :func:`grouped_experts` is the entry point.

Weights are stacked per expert in ``nn.Linear`` orientation, as ``models/moe.py`` keeps them:
``gate_up [E, 2I, H]`` (the gate rows, then the up rows) and ``down [E, H, I]``; optional biases
``gate_up_bias [E, 2I]`` and ``down_bias [E, H]`` (gpt-oss). Activations (``act``):

- ``"swiglu"``: ``silu(gate) * up`` (Qwen3-MoE, transformers' ``Qwen3MoeMLP``);
- ``"clamped_swiglu"``: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)`` (gpt-oss: OpenAI's reference ``swiglu``,
  transformers' ``GptOssExperts``; alpha 1.702, limit 7.0).

Groups are given by their **ends**: int32 ``ends [E]``, expert ``e``'s rows of the sorted input
are ``ends[e-1] .. ends[e] - 1`` (``ends[-1]`` for ``e = 0`` read as 0), the ``offs`` convention
of ``torch.nn.functional.grouped_mm``. Three implementations of the expert MLP over sorted rows:

- ``"triton"``: :func:`grouped_gemm_triton`, one launch per GEMM over all experts' row tiles
  (bf16 / fp16 / fp32 inputs, fp32 accumulation, the activation fused into the ``gate_up``
  GEMM). It reads ``ends`` on the device (no host synchronisation), so it can be captured in a
  CUDA graph. Without a GPU the tests run it through Triton's interpreter (``TRITON_INTERPRET=1``).
- ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` (torch >= 2.9; bf16 on CUDA SM80+ by
  its documentation; on the CPU torch runs it too), one call per GEMM, activation in fp32
  between them.
- ``"torch"``: the reference, one ``F.linear`` pair per non-empty expert (reads ``ends`` on the
  host).

``impl="auto"`` (:func:`pick_impl`): ``grouped_mm`` for bf16 on CUDA SM80+ with 16-byte aligned
widths, the Triton kernel elsewhere on CUDA, the torch reference on the CPU;
``DFLASH_TRT_KERNELS=triton`` / ``torch`` force those (as for the drafter kernels, :mod:`.ops`).

Combining: the routing weights multiply each expert output in fp32 and a token's ``k`` products
are added in slot order (slot 0 first) whatever the experts, so a token's result does not
depend on which other tokens share its experts (``research/issue39.md`` §7.3).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..errors import DFlashError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the references need no triton
    triton = None

ACTS = {"none": 0, "swiglu": 1, "clamped_swiglu": 2}
IMPLS = ("auto", "grouped_mm", "triton", "torch")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------------------------- routing
def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert, stably (a token before later tokens, slot order kept).

    Args:
        expert_ids: integer ``[T, k]``, each token's experts (slot order).
        num_experts: E.

    Returns:
        ``(order, ends)``: int64 ``[T * k]``, the flat pair indices (``token * k + slot``) in
        expert order; int32 ``[E]``, each expert's group end in that order. Sorted row ``i``
        is token ``order[i] // k``. Ids outside ``[0, E)`` sort past ``ends[-1]`` (in no group).
        No host synchronisation.
    """
    flat = expert_ids.reshape(-1)
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # out of range: after all groups
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)
    return order, ends


def combine_slots(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scatter the expert outputs back to their (token, slot) pairs and add each token's slots
    in slot order, weighted.

    Args:
        y_sorted: ``[T * k, H]`` expert outputs in the order of :func:`sort_by_expert`.
        order: int64 ``[T * k]`` from :func:`sort_by_expert`.
        weights: float ``[T, k]`` routing weights.

    Returns:
        fp32 ``[T, H]``: ``sum_s weights[t, s] * y[t, s]``, added for ``s = 0, 1, ...`` in turn.
    """
    T, k = weights.shape
    y = torch.empty(T * k, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device)
    y[order] = y_sorted.float()
    y, w = y.view(T, k, -1), weights.float()
    out = y[:, 0] * w[:, 0, None]
    for s in range(1, k):
        out = out + y[:, s] * w[:, s, None]
    return out


# ------------------------------------------------------------------------------- activations
def activation(gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float, limit: float) -> torch.Tensor:
    """The gated activation of the module docstring, in the inputs' dtype (fp32 in, fp32 out):
    the model's own (:func:`~dflash_trt.models.moe.expert_activation`)."""
    from ..models.moe import expert_activation

    return expert_activation(gate, up, act, alpha, limit)


# --------------------------------------------------------------------------- the torch paths
def _group_bounds(ends: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` of the non-empty groups (reads ``ends`` on the host)."""
    bounds, start = [], 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            bounds.append((e, start, end))
        start = end
    return bounds


def grouped_gemm_reference(
    x_sorted: torch.Tensor,
    ends: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str = "none",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The torch reference of :func:`grouped_gemm_triton` (same arguments and result): one
    ``F.linear`` per non-empty expert in fp32, the result cast to ``x_sorted``'s dtype; rows past
    ``ends[-1]`` are zero."""
    n_out = w.shape[1] // 2 if act != "none" else w.shape[1]
    out = torch.zeros(x_sorted.shape[0], n_out, dtype=torch.float32, device=x_sorted.device)
    for e, s, t in _group_bounds(ends):
        y = F.linear(x_sorted[s:t].float(), w[e].float(), None if bias is None else bias[e].float())
        out[s:t] = y if act == "none" else activation(*y.split(n_out, dim=-1), act, alpha, limit)
    return out.to(x_sorted.dtype)


def _bias_rows(bias: torch.Tensor, ends: torch.Tensor, n: int) -> torch.Tensor:
    """Each sorted row's expert bias ``[n, out]`` (rows past ``ends[-1]`` take the last expert's)."""
    rows = torch.arange(n, device=ends.device, dtype=torch.int32)
    expert = torch.searchsorted(ends, rows, right=True).clamp_(max=bias.shape[0] - 1)
    return bias[expert]


def expert_mlp_grouped_mm(
    x_sorted, ends, gate_up, down, gate_up_bias=None, down_bias=None, act="swiglu", alpha=1.702, limit=7.0
) -> torch.Tensor:
    """The expert MLP through ``torch.nn.functional.grouped_mm`` (``mat_b [E, in, out]``: the
    weights' transposed views, column-major as its kernels prefer): ``[N, H]`` in ``x_sorted``'s
    dtype, rows past ``ends[-1]`` zero. Per-expert biases are gathered per row (``grouped_mm``'s
    own ``bias`` is one for all groups)."""
    n = x_sorted.shape[0]
    h = F.grouped_mm(x_sorted, gate_up.transpose(-2, -1), offs=ends).float()
    if gate_up_bias is not None:
        h = h + _bias_rows(gate_up_bias, ends, n).float()
    mid = activation(*h.split(gate_up.shape[1] // 2, dim=-1), act, alpha, limit).to(x_sorted.dtype)
    y = F.grouped_mm(mid, down.transpose(-2, -1), offs=ends)
    if down_bias is not None:
        y = (y.float() + _bias_rows(down_bias, ends, n).float()).to(y.dtype)
    valid = torch.arange(n, device=y.device) < ends[-1]  # grouped_mm leaves those rows unwritten
    return torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


# ------------------------------------------------------------------------------ the Triton kernel
if triton is not None:

    @triton.jit
    def _locate_tile(Ends, pid_m, E: tl.constexpr, E_P: tl.constexpr, BM: tl.constexpr):
        """Row tile ``pid_m`` of the concatenated per-expert row tiles (expert ``e`` has
        ``cdiv(rows_e, BM)``), from the group ends on the device: ``(expert, first row, group
        end)``; past the last tile the expert is ``E_P`` (>= E) and the group end 0 (no row)."""
        e = tl.arange(0, E_P)
        ends = tl.load(Ends + e, mask=e < E, other=0)
        starts = tl.load(Ends + e - 1, mask=(e > 0) & (e < E), other=0)
        tiles = tl.where(e < E, (ends - starts + BM - 1) // BM, 0)
        cum = tl.cumsum(tiles, 0)
        expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
        sel = e == expert
        first_tile = tl.sum(tl.where(sel, cum - tiles, 0), 0)
        g_start = tl.sum(tl.where(sel, starts, 0), 0)
        g_end = tl.sum(tl.where(sel, ends, 0), 0)
        return expert, g_start + (pid_m - first_tile) * BM, g_end

    @triton.jit
    def _grouped_gemm_kernel(
        X,
        Ends,
        W,
        Bias,
        Out,
        K,
        N_OUT,
        stride_xm,
        stride_we,
        stride_wn,
        stride_wk,
        stride_be,
        stride_om,
        alpha,
        limit,
        E: tl.constexpr,
        E_P: tl.constexpr,
        ACT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Program ``(m, n)``: row tile ``m`` of the concatenated per-expert row tiles (expert
        ``e`` has ``cdiv(rows_e, BM)`` of them; programs past the last tile store nothing) times
        output columns ``n * BN ..``. With ``ACT`` the program computes the gate (``W`` rows
        ``c``) and up (rows ``N_OUT + c``) tiles and stores the activation."""
        pid_n = tl.program_id(1)
        expert, row0, g_end = _locate_tile(Ends, tl.program_id(0), E, E_P, BM)
        rows = row0 + tl.arange(0, BM)
        row_ok = rows < g_end
        k_end = tl.where(expert < E, K, 0)
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < N_OUT
        ks = tl.arange(0, BK)
        w_base = W + tl.minimum(expert, E - 1).to(tl.int64) * stride_we
        x_rows = X + rows.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros([BM, BN], tl.float32)
        acc_up = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, k_end, BK):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            b = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            if ACT != 0:
                bu = tl.load(
                    w_base + (cols + N_OUT)[None, :] * stride_wn + kk[:, None] * stride_wk, mask=w_mask, other=0.0
                )
                if UPCAST:
                    bu = bu.to(tl.float32)
                acc_up = tl.dot(a, bu, acc_up, input_precision=PREC)
        if HAS_BIAS:
            b_base = Bias + tl.minimum(expert, E - 1) * stride_be
            acc += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if ACT != 0:
                acc_up += tl.load(b_base + N_OUT + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:
            res = acc * tl.sigmoid(acc) * acc_up
        elif ACT == 2:
            g = tl.minimum(acc, limit)
            u = tl.minimum(tl.maximum(acc_up, -limit), limit)
            res = (u + 1.0) * g * tl.sigmoid(g * alpha)
        else:
            res = acc
        o_ptr = Out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(o_ptr, res.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm_triton(
    x_sorted: torch.Tensor,
    ends: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str = "none",
    alpha: float = 1.702,
    limit: float = 7.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One grouped GEMM over all experts' row groups, in one Triton launch.

    Args:
        x_sorted: ``[N, K]`` rows sorted by expert (bf16, fp16 or fp32; unit column stride).
        ends: int32 ``[E]`` group ends (module docstring).
        w: ``[E, out, K]`` in ``x_sorted``'s dtype (``nn.Linear`` orientation per expert).
        bias: optional ``[E, out]``.
        act: ``"none"``: result ``x @ w[e].T (+ bias[e])``, ``[N, out]``; ``"swiglu"`` or
            ``"clamped_swiglu"``: ``w``'s rows are [gate; up], the result is the activation,
            ``[N, out / 2]``.
        alpha, limit: of ``"clamped_swiglu"``.
        out_dtype: result dtype (default ``x_sorted``'s).

    Returns:
        ``[N, out or out / 2]``; accumulation in fp32 (``ieee`` fp32 products for fp32
        inputs); rows past ``ends[-1]`` are left zero.
    """
    if triton is None:  # pragma: no cover
        raise DFlashError("the Triton MoE kernel needs triton (pip install triton)")
    n, k = x_sorted.shape
    num_experts = w.shape[0]
    n_out = w.shape[1] // 2 if act != "none" else w.shape[1]
    x_sorted = x_sorted if x_sorted.stride(-1) == 1 else x_sorted.contiguous()
    out = torch.zeros(n, n_out, dtype=out_dtype or x_sorted.dtype, device=x_sorted.device)
    if n == 0 or n_out == 0:
        return out
    # row tile from the mean group size: 16 rows (tl.dot's least) for decode and verify blocks
    bm = min(64, max(16, triton.next_power_of_2(-(-n // num_experts))))
    bn, bk = 64, 64
    # Triton's interpreter (numpy) has no 16-bit float dot: its products are taken in fp32
    interpret = bool(triton.knobs.runtime.interpret) and x_sorted.dtype != torch.float32
    grid = (triton.cdiv(n, bm) + num_experts, triton.cdiv(n_out, bn))  # >= the tiles of any split
    _grouped_gemm_kernel[grid](
        x_sorted,
        ends,
        w,
        bias if bias is not None else out,
        out,
        k,
        n_out,
        x_sorted.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        float(alpha),
        float(limit),
        E=num_experts,
        E_P=triton.next_power_of_2(num_experts),
        ACT=ACTS[act],
        HAS_BIAS=bias is not None,
        BM=bm,
        BN=bn,
        BK=bk,
        PREC="ieee" if x_sorted.dtype == torch.float32 or interpret else "tf32",
        UPCAST=interpret,
    )
    return out


# ----------------------------------------------------------------------------------- dispatch
def pick_impl(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> str:
    """The implementation ``impl="auto"`` runs for these inputs (module docstring)."""
    from .ops import HAVE_TRITON, use_triton

    mode = os.environ.get("DFLASH_TRT_KERNELS", "")
    if mode == "torch":
        return "torch"
    if mode == "triton" and HAVE_TRITON:
        return "triton"
    if device.type != "cuda":
        return "torch"
    aligned = hidden % 8 == 0 and intermediate % 8 == 0  # 16-byte rows for bf16
    if (
        dtype == torch.bfloat16
        and aligned
        and hasattr(F, "grouped_mm")
        and torch.cuda.get_device_capability(device) >= (8, 0)
    ):
        return "grouped_mm"
    return "triton" if use_triton(device) else "torch"


def expert_mlp(
    x_sorted: torch.Tensor,
    ends: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    act: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    impl: str = "triton",
) -> torch.Tensor:
    """The experts' MLPs over rows already sorted by expert: ``[N, H]`` (fp32 from the Triton
    kernel, ``x_sorted``'s dtype otherwise); ``impl`` one of ``grouped_mm``, ``triton``,
    ``torch`` (no checks: :func:`grouped_experts` makes them)."""
    if impl == "grouped_mm":
        return expert_mlp_grouped_mm(x_sorted, ends, gate_up, down, gate_up_bias, down_bias, act, alpha, limit)
    if impl == "triton":
        mid = grouped_gemm_triton(x_sorted, ends, gate_up, gate_up_bias, act, alpha, limit)
        return grouped_gemm_triton(mid, ends, down, down_bias, "none", out_dtype=torch.float32)
    mid = grouped_gemm_reference(x_sorted, ends, gate_up, gate_up_bias, act, alpha, limit)
    return grouped_gemm_reference(mid, ends, down, down_bias)


def _check(x, expert_ids, weights, gate_up, down, gate_up_bias, down_bias, act, impl) -> None:
    """One-line :class:`DFlashError` for inputs :func:`grouped_experts` cannot take."""
    if act not in ACTS or act == "none":
        raise DFlashError(f"unknown MoE activation {act!r}; choose from swiglu, clamped_swiglu")
    if impl not in IMPLS:
        raise DFlashError(f"unknown MoE implementation {impl!r}; choose from {', '.join(IMPLS)}")
    if x.dim() != 2:
        raise DFlashError(f"MoE input must be [tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise DFlashError(f"MoE input dtype {x.dtype} not supported; use bfloat16, float16 or float32")
    h = x.shape[1]
    if gate_up.dim() != 3 or down.dim() != 3:
        raise DFlashError(
            f"MoE expert weights must be 3-D (gate_up [E, 2I, H], down [E, H, I]), "
            f"got {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    if two_i % 2 or gate_up.shape[2] != h or tuple(down.shape) != (e, h, i):
        raise DFlashError(
            f"MoE expert weights do not fit hidden {h}: gate_up {tuple(gate_up.shape)} must be [E, 2I, {h}] "
            f"and down {tuple(down.shape)} [E, {h}, I]"
        )
    for name, b, shape in (("gate_up_bias", gate_up_bias, (e, two_i)), ("down_bias", down_bias, (e, h))):
        if b is not None and tuple(b.shape) != shape:
            raise DFlashError(f"MoE {name} must be {list(shape)}, got {list(b.shape)}")
    for name, p in (("gate_up", gate_up), ("down", down), ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if p is not None and (p.dtype != x.dtype or p.device != x.device):
            raise DFlashError(
                f"MoE {name} is {p.dtype} on {p.device} but the input is {x.dtype} on {x.device}; they must match"
            )
    _check_routing(x, expert_ids, weights, e)


def _check_routing(x, expert_ids, weights, e: int) -> None:
    """The routing part of :func:`_check`."""
    t = x.shape[0]
    if expert_ids.dim() != 2 or expert_ids.shape[0] != t or tuple(weights.shape) != tuple(expert_ids.shape):
        raise DFlashError(
            f"MoE routing must be expert ids and weights of shape [{t}, k], got {tuple(expert_ids.shape)} "
            f"and {tuple(weights.shape)}"
        )
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise DFlashError(f"MoE expert ids must be an integer tensor, got {expert_ids.dtype}")
    if expert_ids.device != x.device or weights.device != x.device:
        raise DFlashError(f"MoE routing must be on the input's device {x.device}")
    if x.device.type == "cpu" and expert_ids.numel():  # on a GPU this check would synchronise
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= e:
            raise DFlashError(f"MoE expert id {hi if hi >= e else lo} out of range for {e} experts")


def grouped_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    act: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    impl: str = "auto",
) -> torch.Tensor:
    """The routed experts of an MoE layer: ``out[t] = sum_s weights[t, s] * MLP_{expert_ids[t, s]}(x[t])``.

    Args:
        x: ``[T, H]`` normalised hidden states (bf16, fp16 or fp32).
        expert_ids: integer ``[T, k]`` (each token's experts, e.g. ``MoEBlock.route``'s ids).
        weights: float ``[T, k]`` routing weights (any float dtype; used in fp32).
        gate_up: ``[E, 2I, H]`` ([gate; up] rows), ``down``: ``[E, H, I]``, in ``x``'s dtype
            and on its device; ``gate_up_bias [E, 2I]``, ``down_bias [E, H]`` optional.
        act: ``"swiglu"`` or ``"clamped_swiglu"`` (``alpha``, ``limit``; module docstring).
        impl: ``"auto"`` (:func:`pick_impl`), ``"grouped_mm"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``[T, H]`` in ``x``'s dtype: each expert output (GEMMs accumulated in fp32) times its
        routing weight in fp32, a token's slots added in slot order, then cast.

    Raises:
        DFlashError: a shape, dtype or device that does not fit, an unknown ``act`` or
            ``impl``, or (CPU tensors only: the check would synchronise a GPU) an expert id out of
            ``[0, E)``. On a GPU an out-of-range id's slot adds nothing.
    """
    _check(x, expert_ids, weights, gate_up, down, gate_up_bias, down_bias, act, impl)
    t, k = expert_ids.shape
    if impl == "auto":
        impl = pick_impl(x.device, x.dtype, x.shape[1], down.shape[2])
    order, ends = sort_by_expert(expert_ids, gate_up.shape[0])
    x_sorted = x[order // k]
    y = expert_mlp(x_sorted, ends, gate_up, down, gate_up_bias, down_bias, act, alpha, limit, impl)
    return combine_slots(y, order, weights).to(x.dtype)


# ------------------------------------------------------------------------------------- timing
def time_grouped_experts(
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    hidden: int = 2880,
    intermediate: int = 2880,
    experts: int = 32,
    top_k: int = 4,
    tokens: tuple[int, ...] = (1, 4, 8, 16),
    seqs: tuple[int, ...] = (1, 4, 16),
    repeats: int = 30,
    warmup: int = 5,
    seed: int = 0,
) -> dict:
    """Time :func:`grouped_experts` per implementation on random weights at the given expert
    shapes (defaults: gpt-oss-20b's, ``H = I = 2880``, 32 experts, top-4, bf16) for ``seqs``
    sequences of ``tokens`` tokens each (a decode step is 1 token, a verify block 4-16), routing
    drawn uniformly (each token's ``top_k`` distinct experts at random) and the routing weights
    a softmax of random logits.

    Each figure is the median over ``repeats`` calls after ``warmup`` of one eager call,
    routing sort and combine included; on CUDA timed with CUDA events after a synchronisation,
    weights not flushed from L2 (they exceed it at these shapes); on the CPU with
    ``time.perf_counter``. Implementations: ``torch`` (one GEMM pair per touched expert, as
    ``MoEBlock``), ``triton`` (on CUDA, or the CPU with ``TRITON_INTERPRET=1``: its figures then
    say nothing about speed) and ``grouped_mm`` (where ``F.grouped_mm`` exists, on CUDA bf16
    only). Each row also gives the experts touched, the expert weight bytes they read
    (``touched * 3 * H * I * itemsize``), the bandwidth that implies and each
    implementation's max difference from ``torch`` relative to its largest output.

    Returns:
        ``{"device", "dtype", "shapes", "rows": [...]}`` (JSON-ready).
    """
    import statistics
    import time
    from functools import partial

    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * intermediate, hidden, generator=g) * hidden**-0.5).to(dev, dtype)
    down = (torch.randn(experts, hidden, intermediate, generator=g) * intermediate**-0.5).to(dev, dtype)
    impls = ["torch"]
    if dev.type == "cuda" or (triton is not None and triton.knobs.runtime.interpret):
        impls.append("triton")
    if hasattr(F, "grouped_mm") and (dev.type != "cuda" or dtype == torch.bfloat16):
        impls.append("grouped_mm")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def once(fn) -> float:
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync()
        start.record()
        fn()
        end.record()
        sync()
        return start.elapsed_time(end) * 1e3

    rows = []
    for s in seqs:
        for t in tokens:
            n = s * t
            x = torch.randn(n, hidden, generator=g).to(dev, dtype)
            ids = torch.rand(n, experts, generator=g).topk(top_k, dim=-1).indices.to(dev)
            weights = torch.softmax(torch.randn(n, top_k, generator=g), -1).to(dev)
            touched = len(torch.unique(ids))
            nbytes = touched * 3 * hidden * intermediate * gate_up.element_size()
            row = {"seqs": s, "tokens_per_seq": t, "tokens": n, "experts_touched": touched, "weight_bytes": nbytes}
            ref = None
            for impl in impls:
                fn = partial(grouped_experts, x, ids, weights, gate_up, down, impl=impl)
                for _ in range(warmup):
                    out = fn()
                us = statistics.median(once(fn) for _ in range(repeats))
                ref = out.float() if ref is None else ref
                row[impl] = {
                    "us": round(us, 1),
                    "GB_per_s": round(nbytes / us / 1e3, 1),
                    "rel_diff_vs_torch": float((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)),
                }
            rows.append(row)
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": {"hidden": hidden, "intermediate": intermediate, "experts": experts, "top_k": top_k},
        "routing": "uniform: top_k distinct experts per token at random",
        "timing": f"median of {repeats} after {warmup} warm-up calls, microseconds",
        "impls": impls,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m dflash_trt.kernels.moe_grouped --json OUT``: :func:`time_grouped_experts`
    (flags for its arguments), a table on stdout, the results to ``OUT``."""
    import argparse
    import json

    ints = lambda v: tuple(int(a) for a in v.split(","))  # noqa: E731
    p = argparse.ArgumentParser(description=time_grouped_experts.__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--intermediate", type=int, default=2880)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=ints, default=(1, 4, 8, 16), help="tokens per sequence, comma-separated")
    p.add_argument("--seqs", type=ints, default=(1, 4, 16), help="sequences, comma-separated")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    res = time_grouped_experts(
        a.device, dtype, a.hidden, a.intermediate, a.experts, a.top_k, a.tokens, a.seqs, a.repeats, a.warmup
    )
    print(f"{res['device']} {res['dtype']} {res['shapes']}: {res['timing']}")
    print("seqs x tokens  experts  MB    " + "  ".join(f"{i:>18}" for i in res["impls"]))
    for r in res["rows"]:
        cells = "  ".join(f"{r[i]['us']:>9.1f} us {r[i]['rel_diff_vs_torch']:.0e}" for i in res["impls"])
        mb = r["weight_bytes"] / 1e6
        print(f"{r['seqs']:>4} x {r['tokens_per_seq']:<6} {r['experts_touched']:>7}  {mb:>5.0f}  {cells}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
