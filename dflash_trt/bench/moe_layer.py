"""One MoE layer at a real target's shapes, timed on the CPU per verify block size: how many
experts a block of K tokens touches, how many expert-weight bytes that reads, and what it costs
against a one-token decode step (``bench/moe_layer.py`` is the command line).

The layer (:class:`MoELayer`) is a router plus ``E`` experts with random weights (std 0.02) at the
preset's shapes (:data:`~dflash_trt.bench.moe_speedup.PRESETS`). The forward is the one of
transformers' eager experts (``GptOssExperts`` / ``Qwen3MoeExperts``) and of
``models/moe.py``'s ``MoEBlock``: tokens grouped by expert, one pair of GEMMs per expert any
token picked, in increasing expert id, outputs weighted and added with ``index_add_``. gpt-oss
experts: ``gate_up [2I, H]`` with interleaved rows (even gate, odd up) and bias, the clamped
SwiGLU (limit 7, alpha 1.702, ``(up + 1)``), ``down [H, I]`` with bias; Qwen3-MoE: ``[gate; up]``
rows, SiLU, no biases. The router GEMM runs (its cost is part of the layer), but the experts
come from the routing passed in, so a benchmark chooses the routing distribution
(:func:`draw_routing`).

Expert weight formats (:data:`FORMATS`):

- ``bf16``: the project's CPU decode linear, oneDNN-prepacked bf16 (``models/cpu_linear.py``),
  or ``F.linear`` where this CPU's oneDNN has no bf16 (as ``pack_linears`` leaves it; the
  result's description says which ran);
- ``bf16-linear``: ``F.linear`` on the bf16 weight (oneDNN reorders it per call: ``MoEBlock``'s
  expert path today);
- ``int4``: the project's packed int4 CPU linear (``quantization/int4.py``: asymmetric int4, one
  bf16 (scale, zero) pair per 32 inputs, ``dflash_cpu::int4_linear``; 5.0 bits per
  weight). Not MXFP4 (4.25 bits, E2M1 codes + E8M0 scales), which has no CPU kernel here;
- ``fp32``: ``F.linear`` in fp32 (the reference the tests compare with transformers).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch import nn

from ..errors import ConfigError
from ..models.moe import expert_activation
from .moe_speedup import PRESETS, MoETarget, expected_experts_touched

#: expert weight formats :class:`MoELayer` builds
FORMATS = {
    "bf16": "bf16 weights in oneDNN's prepacked layout (models/cpu_linear.OneDNNLinear) where oneDNN has bf16",
    "bf16-linear": "bf16 weights, F.linear per call (oneDNN reorders the weight each call)",
    "int4": "packed int4 (quantization/int4.Int4Linear): asymmetric, bf16 (scale, zero) per 32 inputs, 5.0 bits/weight",
    "fp32": "fp32 weights, F.linear",
}
INT4_GROUP = 32
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702
#: routing models :func:`draw_routing` draws from
ROUTINGS = ("uniform", "sticky")


def _dense(w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    lin.bias = None if b is None else nn.Parameter(b.to(dtype), requires_grad=False)
    return lin


def make_linear(w: torch.Tensor, b: torch.Tensor | None, fmt: str) -> nn.Module:
    """A linear over fp32 ``w [out, in]`` (+ ``b [out]``) in expert format ``fmt``.

    Raises:
        ConfigError: an unknown format.
    """
    if fmt == "fp32":
        return _dense(w, b, torch.float32)
    if fmt == "bf16-linear":
        return _dense(w, b, torch.bfloat16)
    if fmt == "bf16":
        from ..models.cpu_linear import OneDNNLinear, onednn_available

        if not onednn_available():  # as pack_linears: the project keeps F.linear there
            return _dense(w, b, torch.bfloat16)
        return OneDNNLinear.from_weight(w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16))
    if fmt == "int4":
        from ..quantization.int4 import Int4Linear

        return Int4Linear.from_weight(w, INT4_GROUP, None if b is None else b.to(torch.bfloat16), torch.bfloat16)
    raise ConfigError("formats", f"must be among {', '.join(FORMATS)}, got {fmt!r}")


def linear_bytes(mod: nn.Module) -> int:
    """Bytes of weight (and bias) one call of ``mod`` reads: packed codes + scales for int4, the
    dense weight at its dtype otherwise (a prepacked bf16 weight is as large as the dense one)."""
    from ..quantization.packed import PackedLinear

    if isinstance(mod, PackedLinear):
        return mod.weight_bytes()
    if isinstance(mod, nn.Linear):
        w = mod.weight
    else:  # OneDNNLinear: opaque packed tensor of the same bf16 values
        w = torch.empty(mod.out_features, mod.in_features, dtype=torch.bfloat16, device="meta")
    n = w.numel() * w.element_size()
    return n + (0 if mod.bias is None else mod.bias.numel() * mod.bias.element_size())


def expert_weights(target: MoETarget, e: int, seed: int) -> dict[str, torch.Tensor | None]:
    """Expert ``e``'s random fp32 weights, the same for every format: ``gate_up [2I, H]``,
    ``gate_up_bias [2I]``, ``down [H, I]``, ``down_bias [H]`` (biases None without
    ``target.expert_bias``); std 0.02, seeded by ``(seed, e)``."""
    g = torch.Generator().manual_seed(seed * 100003 + e)
    h, i = target.hidden, target.intermediate
    out = {"gate_up": torch.randn(2 * i, h, generator=g) * 0.02, "down": torch.randn(h, i, generator=g) * 0.02}
    bias = target.expert_bias
    out["gate_up_bias"] = torch.randn(2 * i, generator=g) * 0.02 if bias else None
    out["down_bias"] = torch.randn(h, generator=g) * 0.02 if bias else None
    return out


class MoELayer(nn.Module):
    """Router + ``E`` experts of ``target`` with random weights in format ``fmt`` (module doc).

    ``forward(x [N, H], ids [N, k] int64, weights [N, k])`` returns ``[N, H]`` in the layer's
    activation dtype (fp32 for ``fp32``, bf16 otherwise) and records in :attr:`last_touched` the
    expert ids whose GEMMs ran (sorted).

    Args:
        target: the shape.
        fmt: a key of :data:`FORMATS`.
        seed: weights seed (the same weights, up to the format's rounding, for every format).
        progress: called once per expert built (for a progress bar).

    Raises:
        ConfigError: an unknown format.
    """

    def __init__(self, target: MoETarget, fmt: str, seed: int = 0, progress: Callable[[], None] | None = None):
        super().__init__()
        if fmt not in FORMATS:
            raise ConfigError("formats", f"must be among {', '.join(FORMATS)}, got {fmt!r}")
        self.target, self.fmt = target, fmt
        self.dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        g = torch.Generator().manual_seed(seed)
        rw = torch.randn(target.num_experts, target.hidden, generator=g) * 0.02
        rb = torch.randn(target.num_experts, generator=g) * 0.02 if target.expert_bias else None
        self.router = _dense(rw, rb, self.dtype)
        self.gate_up, self.down = nn.ModuleList(), nn.ModuleList()
        for e in range(target.num_experts):
            w = expert_weights(target, e, seed)
            self.gate_up.append(make_linear(w["gate_up"], w["gate_up_bias"], fmt))
            self.down.append(make_linear(w["down"], w["down_bias"], fmt))
            del w
            if progress is not None:
                progress()
        self.last_touched: list[int] = []

    def expert_bytes(self) -> int:
        """Bytes of weights (and biases) one expert's forward reads."""
        return linear_bytes(self.gate_up[0]) + linear_bytes(self.down[0])

    def _act(self, gu: torch.Tensor) -> torch.Tensor:
        if self.target.activation == "gpt_oss":  # interleaved rows: even gate, odd up
            return expert_activation(gu[:, ::2], gu[:, 1::2], "clamped_swiglu", SWIGLU_ALPHA, SWIGLU_LIMIT)
        gate, up = gu.chunk(2, dim=-1)
        return expert_activation(gate, up, "swiglu", SWIGLU_ALPHA, SWIGLU_LIMIT)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        h = x.to(self.dtype)
        self.router(h)  # the router GEMM's cost; the experts are the ones given
        out = torch.zeros_like(h)
        touched = torch.unique(ids).tolist()
        for e in touched:
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = self.down[e](self._act(self.gate_up[e](h[rows])))
            out.index_add_(0, rows, (y * weights[rows, slot, None].to(y.dtype)).to(out.dtype))
        self.last_touched = touched
        return out


def draw_routing(
    num_experts: int,
    top_k: int,
    batch: int,
    tokens: int,
    generator: torch.Generator,
    model: str = "uniform",
    rho: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of ``batch`` sequences of ``tokens`` tokens each (rows sequence-major).

    ``uniform``: every token's experts a uniformly random ``top_k``-subset, independent of every
    other token (the assumption of :func:`~.moe_speedup.expected_experts_touched`). ``sticky``
    (a stated correlated model, not a measured one): within a sequence, token t keeps each of
    token t-1's experts with probability ``rho`` and fills its other slots uniformly from the
    experts it does not hold; each token's marginal is still uniform, so a decode step costs the
    same and a block touches fewer experts. The routing weights are a softmax of standard normal
    logits over the ``top_k`` slots (as gpt-oss's router normalises its top-k).

    Returns:
        ``(ids int64 [batch * tokens, top_k], weights fp32 [batch * tokens, top_k])``.

    Raises:
        ConfigError: an unknown model, ``top_k`` outside ``1..num_experts``, ``rho`` outside [0, 1].
    """
    if model not in ROUTINGS:
        raise ConfigError("routing", f"must be one of {', '.join(ROUTINGS)}, got {model!r}")
    if not 1 <= top_k <= num_experts:
        raise ConfigError("top_k", f"must be in 1..{num_experts}, got {top_k}")
    if not 0.0 <= rho <= 1.0:
        raise ConfigError("routing", f"sticky probability must be in [0, 1], got {rho}")
    n = batch * tokens
    if model == "uniform":
        ids = torch.rand(n, num_experts, generator=generator).topk(top_k, dim=-1).indices
    else:
        ids = torch.empty(n, top_k, dtype=torch.long)
        for s in range(batch):
            prev: list[int] = []
            for t in range(tokens):
                keep = [e for e in prev if float(torch.rand((), generator=generator)) < rho]
                free = torch.ones(num_experts, dtype=torch.bool)
                free[keep] = False
                pool = free.nonzero().flatten()
                fill = pool[torch.randperm(pool.numel(), generator=generator)[: top_k - len(keep)]].tolist()
                prev = keep + fill
                ids[s * tokens + t] = torch.tensor(prev)
    weights = torch.softmax(torch.randn(n, top_k, generator=generator), dim=-1)
    return ids, weights


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    """Where the numbers come from: CPU, cores, torch threads and version, 1-minute load."""
    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "loadavg_1m": os.getloadavg()[0],
    }


def run_layer_bench(
    target: MoETarget,
    formats: list[str],
    blocks: list[int],
    batches: list[int],
    repeats: int,
    routing: str = "uniform",
    rho: float = 0.5,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Time one :class:`MoELayer` per format at every (batch, block size).

    One format at a time (its layer built, measured, freed). Every repeat draws a new routing
    (:func:`draw_routing`) and new inputs for each (batch, block) in turn, after one untimed
    warm-up pass over all of them, so machine noise falls on every block size alike.

    Returns:
        ``{"formats": {fmt: {"description", "bytes_per_expert", "rows": [...]}}, "machine",
        "routing", ...}``; a row per (batch, block): ``tokens_per_block``, ``batch``, ``tokens``,
        ``experts_touched_mean`` (measured: experts whose GEMMs ran), ``experts_touched_formula``,
        ``expert_bytes_read_mean`` (touched x bytes per expert), ``time_ms_median`` / ``_min`` /
        ``_max``, ``ms_per_expert_touched``, ``verify_cost_ratio`` (median time over the median
        time of 1 token per sequence at the same batch).

    Raises:
        ConfigError: no block sizes, a block size or batch < 1, ``repeats`` < 1, unknown format.
    """
    if not blocks or min(blocks) < 1 or not batches or min(batches) < 1 or repeats < 1:
        raise ConfigError(
            "blocks", f"block sizes, batches and repeats must be >= 1, got {blocks}, {batches}, {repeats}"
        )
    for fmt in formats:
        if fmt not in FORMATS:
            raise ConfigError("formats", f"must be among {', '.join(FORMATS)}, got {fmt!r}")
    blocks = sorted(set(blocks) | {1})
    cells = [(b, k) for b in batches for k in blocks]
    step = progress or (lambda n: None)
    load_before = os.getloadavg()[0]
    out: dict = {"formats": {}}
    for fmt in formats:
        layer = MoELayer(target, fmt, seed, progress=lambda: step(1))
        per_expert = layer.expert_bytes()
        gen = torch.Generator().manual_seed(seed + 1)
        times: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
        touched: dict[tuple[int, int], list[int]] = {c: [] for c in cells}
        for r in range(repeats + 1):
            for b, k in cells:
                ids, w = draw_routing(target.num_experts, target.top_k, b, k, gen, routing, rho)
                x = torch.randn(b * k, target.hidden, generator=gen).to(layer.dtype)
                t0 = time.perf_counter()
                layer(x, ids, w)
                dt = time.perf_counter() - t0
                if r:  # repeat 0 warms up
                    times[(b, k)].append(dt)
                    touched[(b, k)].append(len(layer.last_touched))
                step(1)
        rows = []
        for b, k in cells:
            med = statistics.median(times[(b, k)])
            mean_touched = statistics.fmean(touched[(b, k)])
            rows.append(
                {
                    "tokens_per_block": k,
                    "batch": b,
                    "tokens": b * k,
                    "experts_touched_mean": mean_touched,
                    "experts_touched_per_repeat": touched[(b, k)],
                    "experts_touched_formula": expected_experts_touched(target.num_experts, target.top_k, b * k),
                    "expert_bytes_read_mean": mean_touched * per_expert,
                    "time_ms_median": med * 1e3,
                    "time_ms_min": min(times[(b, k)]) * 1e3,
                    "time_ms_max": max(times[(b, k)]) * 1e3,
                    "ms_per_expert_touched": med * 1e3 / mean_touched,
                }
            )
        for row in rows:
            base = next(x for x in rows if x["batch"] == row["batch"] and x["tokens_per_block"] == 1)
            row["verify_cost_ratio"] = row["time_ms_median"] / base["time_ms_median"]
        kernel = type(layer.gate_up[0]).__name__
        desc = f"{FORMATS[fmt]}; ran {kernel}"
        out["formats"][fmt] = {"description": desc, "kernel": kernel, "bytes_per_expert": per_expert, "rows": rows}
        del layer
    out.update(
        {
            "preset": target.name,
            "shape": asdict(target),
            "blocks": blocks,
            "batches": batches,
            "repeats": repeats,
            "routing": _routing_text(routing, rho),
            "machine": {**machine(), "loadavg_1m_before": load_before},
        }
    )
    return out


def _routing_text(model: str, rho: float) -> str:
    if model == "uniform":
        return (
            "uniform: each token's top_k experts a uniformly random k-subset, independent across tokens "
            "(no router checkpoint is at hand; real routers are correlated and touch fewer experts)"
        )
    return (
        f"sticky (a stated model, not measured): each token keeps each of the previous token's experts "
        f"with probability {rho}, other slots uniform"
    )


def build_steps(target: MoETarget, formats: list[str], blocks: list[int], batches: list[int], repeats: int) -> int:
    """Progress-bar total of :func:`run_layer_bench`: experts built plus forwards run."""
    cells = len(batches) * len(set(blocks) | {1})
    return len(formats) * (target.num_experts + (repeats + 1) * cells)


__all__ = [
    "FORMATS",
    "PRESETS",
    "ROUTINGS",
    "MoELayer",
    "build_steps",
    "draw_routing",
    "expert_weights",
    "linear_bytes",
    "machine",
    "make_linear",
    "run_layer_bench",
]
