"""What speculative decoding buys on a mixture-of-experts target: expert activation of a verify
block, and DFlash's predicted speedup from tau and the step costs.

Expert activation. A block of ``n`` tokens, each routed to ``k`` of ``E`` experts, reads the
weights of every expert any of them picked. Under **uniform independent routing** (each token's
``k`` experts a uniformly random ``k``-subset, independent across tokens) one token misses a given
expert with probability ``1 - k/E``, so the expected number of distinct experts touched is

    touched(n) = E * (1 - (1 - k/E) ** n)                       (:func:`expected_experts_touched`)

(gpt-oss-20b, E=32, k=4: 4, 13.2, 21.0, 28.2 experts at n = 1, 4, 8, 16). Real routers are
correlated across consecutive tokens and touch fewer; no router checkpoint is at hand here, so
every figure of this module is for uniform routing unless a caller passes measured counts.

Speedup. One DFlash step drafts a block of ``K`` tokens in one drafter forward (``t_draft``), then
verifies the block in one target forward (``t_verify(K)``) and emits ``tau`` tokens (accepted
drafts plus the target's bonus token, ``1 <= tau <= K``). Plain decoding emits one token per
target forward (``t_decode = t_verify(1)``). So

    speedup = tau * t_decode / (t_verify(K) + t_draft)          (:func:`speedup`)

per user, at the same batch. ``t_verify`` comes either from measured layer costs (the verify-cost
ratio ``t(K) / t(1)`` of ``bench/moe_layer.py``, taken as the whole step's) or from the
roofline model of :func:`step_time`:

    bytes(n) = dense_bytes + L * touched(n) * expert_bytes      (weights read once per step)
    flops(n) = 2 * n * active_params_per_token
    t(n)     = max(bytes(n) / (G * BW), flops(n) / (G * peak))  (G GPUs, ideal split)

with ``dense_bytes`` every non-expert weight a step reads (attention, router, norms, the LM head;
the embedding is a gather of n rows and not counted) and ``n = batch * K`` tokens for a batch of
sequences. Ignored, and stated wherever results are shown: the KV cache reads (the same for
verify and decode, so they lower the true ratio), the all-reduce / all-to-all of multi-GPU runs,
kernel launch latency, and every efficiency below the datasheet bandwidth and peak.
``t_draft`` uses the same model on the drafter: its weights, the target's LM head (the DFlash
drafter shares it) over ``batch * (K - 1)`` draft positions.

Sources: the shapes are the published configs (issue 39 brief §1.1, §3.1, §5.1); MXFP4 is OCP
MX v1.0 (32 FP4 E2M1 codes + one E8M0 scale per block: 4.25 bits per weight); NVFP4 is 16 FP4
codes + one FP8 scale (4.5 bits); bandwidth and bf16 dense tensor peaks are NVIDIA datasheet
figures (H100 SXM 3.35 TB/s, 989 TFLOP/s; B300 8 TB/s, 2.25 PFLOP/s assumed as B200's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError

#: bytes per weight of the formats experts / dense weights may be stored in (block scales included)
BYTES_PER_PARAM = {
    "bf16": 2.0,
    "fp8": 1.0,
    "mxfp4": (4 + 8 / 32) / 8,  # 32 E2M1 codes + one E8M0 byte
    "nvfp4": (4 + 8 / 16) / 8,  # 16 E2M1 codes + one FP8 byte
    "int4-g32": (4 + 2 * 16 / 32) / 8,  # this project's CPU int4: bf16 (scale, zero) per 32 inputs
}


@dataclass(frozen=True)
class Drafter:
    """A DFlash drafter's shape (dense layers at the target's attention shape).

    Attributes:
        num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, attention_bias: its
            decoder layers (SwiGLU MLP of width ``intermediate``).
        num_features: target layers whose hidden states its fc projection reads
            (``len(target_layer_ids)``).
        block_size: the published block size.
        source: where the shape comes from.
    """

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    num_features: int
    block_size: int
    source: str

    def params(self) -> int:
        """Weights the drafter reads per forward (its layers and fc; not the shared LM head)."""
        attn = _attention_params(self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.attention_bias)
        mlp = 3 * self.hidden * self.intermediate
        return self.num_layers * (attn + mlp + 2 * self.hidden) + self.num_features * self.hidden * self.hidden


@dataclass(frozen=True)
class MoETarget:
    """One MoE target's shape: what a decode or verify step reads.

    Attributes:
        name: preset name.
        hidden: model width H.
        intermediate: each expert's width I.
        num_experts: E.
        top_k: experts per token k.
        num_layers: L (every layer an MoE layer).
        num_heads, num_kv_heads, head_dim: attention.
        vocab: LM head rows.
        expert_bias: experts and router have biases (gpt-oss) or not (Qwen3-MoE).
        attention_bias: q/k/v/o biases (gpt-oss).
        sinks: per-head attention sink logits (gpt-oss).
        activation: ``"gpt_oss"`` (clamped SwiGLU, interleaved gate/up, ``(up + 1)``) or
            ``"swiglu"`` (Qwen3-MoE).
        drafter: the DFlash drafter's shape, or None.
        expert_format: the format the experts are served in by default (gpt-oss: its checkpoint's
            MXFP4; Qwen3-MoE: FP8, the ``hopper-fp8`` build).
    """

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    expert_bias: bool
    attention_bias: bool
    sinks: bool
    activation: str
    drafter: Drafter | None = None
    expert_format: str = "mxfp4"

    def expert_params(self) -> int:
        """Weights (and biases) of one expert: ``3 H I`` (+ ``2 I + H``)."""
        return 3 * self.hidden * self.intermediate + (2 * self.intermediate + self.hidden if self.expert_bias else 0)

    def dense_params(self) -> int:
        """Non-expert weights a step reads: attention (+ biases, sinks), router, norms per layer,
        the final norm and the LM head (the embedding is a gather and not counted)."""
        attn = _attention_params(self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.attention_bias)
        attn += self.num_heads if self.sinks else 0
        router = self.num_experts * self.hidden + (self.num_experts if self.expert_bias else 0)
        return self.num_layers * (attn + router + 2 * self.hidden) + self.hidden + self.vocab * self.hidden

    def total_params(self) -> int:
        """Every weight including the embedding (for checking against published counts)."""
        return (
            self.dense_params() + self.num_layers * self.num_experts * self.expert_params() + self.vocab * self.hidden
        )

    def active_params_per_token(self) -> int:
        """Weights one token multiplies by: the dense ones and ``k`` experts per layer."""
        return self.dense_params() + self.num_layers * self.top_k * self.expert_params()

    def expected_touched(self, tokens: int) -> float:
        """:func:`expected_experts_touched` of this target's ``E``, ``k``."""
        return expected_experts_touched(self.num_experts, self.top_k, tokens)


def _attention_params(hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> int:
    q, kv = heads * head_dim, kv_heads * head_dim
    n = hidden * (q + 2 * kv) + q * hidden
    return n + (q + 2 * kv + hidden if bias else 0)


GPT_OSS_DRAFTER = Drafter(
    num_layers=8,
    hidden=2880,
    intermediate=7680,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    attention_bias=True,
    num_features=5,
    block_size=8,
    source="z-lab gpt-oss-20b-DFlash config.json (third-party quote, issue 39 brief §5.1)",
)

#: the shapes ``bench/moe_layer.py --preset`` measures and the model predicts for
PRESETS = {
    "gpt-oss-20b": MoETarget(
        "gpt-oss-20b", hidden=2880, intermediate=2880, num_experts=32, top_k=4, num_layers=24, num_heads=64,
        num_kv_heads=8, head_dim=64, vocab=201088, expert_bias=True, attention_bias=True, sinks=True,
        activation="gpt_oss", drafter=GPT_OSS_DRAFTER,
    ),
    "gpt-oss-120b": MoETarget(
        "gpt-oss-120b", hidden=2880, intermediate=2880, num_experts=128, top_k=4, num_layers=36, num_heads=64,
        num_kv_heads=8, head_dim=64, vocab=201088, expert_bias=True, attention_bias=True, sinks=True,
        activation="gpt_oss",
        drafter=Drafter(8, 2880, 7680, 64, 8, 64, True, 5, 8, "assumed as gpt-oss-20b's (none published)"),
    ),
    "qwen3-30b-a3b": MoETarget(
        "qwen3-30b-a3b", hidden=2048, intermediate=768, num_experts=128, top_k=8, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, vocab=151936, expert_bias=False, attention_bias=False, sinks=False,
        activation="swiglu",
        drafter=Drafter(8, 2048, 6144, 32, 4, 128, False, 5, 16, "assumed: 8 layers, ~0.47B, block 16 (listed ~0.5B)"),
        expert_format="fp8",
    ),
    # a few-KB layer for tests: the same code paths, every expert shape the int4 kernel packs
    "tiny": MoETarget(
        "tiny", hidden=64, intermediate=32, num_experts=8, top_k=2, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, vocab=256, expert_bias=True, attention_bias=True, sinks=True, activation="gpt_oss",
        drafter=Drafter(1, 64, 128, 4, 2, 16, True, 2, 8, "tiny"),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class GPU:
    """A GPU's datasheet figures: HBM bandwidth (bytes/s) and dense bf16 tensor peak (FLOP/s)."""

    name: str
    bandwidth: float
    peak_flops: float


GPUS = {
    "h100": GPU("H100 SXM", 3.35e12, 989e12),
    "h200": GPU("H200", 4.8e12, 989e12),
    "b300": GPU("B300", 8.0e12, 2.25e15),
}


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """``E * (1 - (1 - k/E) ** n)``: expected distinct experts picked by ``n`` tokens each routed to
    a uniformly random ``k``-subset of ``E`` experts, independently.

    Raises:
        ConfigError: ``E < 1``, ``k`` outside ``1..E`` or ``n < 0``.
    """
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ConfigError("top_k", f"must be in 1..num_experts ({num_experts}), got {top_k}")
    if tokens < 0:
        raise ConfigError("tokens", f"must be >= 0, got {tokens}")
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def speedup(tau: float, t_decode: float, t_verify: float, t_draft: float = 0.0) -> float:
    """``tau * t_decode / (t_verify + t_draft)``: tokens per unit time of DFlash over plain decoding.

    Args:
        tau: tokens emitted per verify step (accepted drafts + bonus), >= 1.
        t_decode: one plain decode step (any unit, the same for all three times).
        t_verify: one verify forward over the block.
        t_draft: one drafter forward.

    Raises:
        ConfigError: ``tau < 1``, a non-positive decode or verify time, a negative draft time.
    """
    if tau < 1:
        raise ConfigError("tau", f"must be >= 1 (the bonus token), got {tau}")
    if t_decode <= 0 or t_verify <= 0 or t_draft < 0:
        raise ConfigError("t_verify", f"times must be positive (draft >= 0), got {t_decode}, {t_verify}, {t_draft}")
    return tau * t_decode / (t_verify + t_draft)


@dataclass(frozen=True)
class StepCost:
    """Modelled cost of one forward: ``bytes`` read, ``flops``, ``seconds`` (roofline), and
    ``experts_touched`` per layer (expected, or as given)."""

    bytes: float
    flops: float
    seconds: float
    experts_touched: float


def step_time(
    target: MoETarget,
    tokens: int,
    gpu: GPU,
    num_gpus: int = 1,
    expert_format: str | None = None,
    dense_format: str = "bf16",
    touched: float | None = None,
) -> StepCost:
    """Roofline cost of a target forward over ``tokens`` tokens (decode: the batch; verify:
    batch * K) with weights read once per forward (module docstring).

    Args:
        expert_format, dense_format: keys of :data:`BYTES_PER_PARAM` (biases counted at the
            format's rate: a rounding error); experts default to ``target.expert_format``.
        touched: experts touched per layer (measured); default the uniform-routing expectation.

    Raises:
        ConfigError: an unknown format, ``tokens < 1`` or ``num_gpus < 1``.
    """
    expert_format = expert_format or target.expert_format
    for f in (expert_format, dense_format):
        if f not in BYTES_PER_PARAM:
            raise ConfigError("format", f"must be one of {', '.join(BYTES_PER_PARAM)}, got {f!r}")
    if tokens < 1 or num_gpus < 1:
        raise ConfigError("tokens", f"and num_gpus must be >= 1, got {tokens}, {num_gpus}")
    n = target.expected_touched(tokens) if touched is None else touched
    nbytes = target.dense_params() * BYTES_PER_PARAM[dense_format]
    nbytes += target.num_layers * n * target.expert_params() * BYTES_PER_PARAM[expert_format]
    flops = 2.0 * tokens * target.active_params_per_token()
    seconds = max(nbytes / (num_gpus * gpu.bandwidth), flops / (num_gpus * gpu.peak_flops))
    return StepCost(nbytes, flops, seconds, n)


def draft_time(
    target: MoETarget, block_size: int, batch: int, gpu: GPU, num_gpus: int = 1, fmt: str = "bf16"
) -> StepCost:
    """Roofline cost of one drafter forward: its weights and the target's LM head (shared) read
    once; FLOPs for ``batch * block_size`` positions through the drafter and ``batch *
    (block_size - 1)`` through the LM head. Zero for a target without a drafter shape.

    Raises:
        ConfigError: an unknown format, ``block_size`` or ``batch`` < 1.
    """
    if fmt not in BYTES_PER_PARAM:
        raise ConfigError("format", f"must be one of {', '.join(BYTES_PER_PARAM)}, got {fmt!r}")
    if block_size < 1 or batch < 1:
        raise ConfigError("block_size", f"and batch must be >= 1, got {block_size}, {batch}")
    d = target.drafter
    if d is None:
        return StepCost(0.0, 0.0, 0.0, 0.0)
    head = target.vocab * target.hidden
    nbytes = (d.params() + head) * BYTES_PER_PARAM[fmt]
    flops = 2.0 * batch * (block_size * d.params() + (block_size - 1) * head)
    seconds = max(nbytes / (num_gpus * gpu.bandwidth), flops / (num_gpus * gpu.peak_flops))
    return StepCost(nbytes, flops, seconds, 0.0)


def model_speedup(
    target: MoETarget,
    tau: float,
    block_size: int,
    gpu: GPU,
    batch: int = 1,
    num_gpus: int = 1,
    expert_format: str | None = None,
    dense_format: str = "bf16",
    drafter_format: str = "bf16",
    include_draft: bool = True,
) -> float:
    """:func:`speedup` with every time from the roofline model: decode over ``batch`` tokens,
    verify over ``batch * block_size``, the drafter per :func:`draft_time` (or free when
    ``include_draft`` is False).

    Raises:
        ConfigError: ``tau`` outside ``1..block_size`` and what the cost functions raise.
    """
    if not 1 <= tau <= block_size:
        raise ConfigError("tau", f"must be in 1..block_size ({block_size}), got {tau}")
    dec = step_time(target, batch, gpu, num_gpus, expert_format, dense_format).seconds
    ver = step_time(target, batch * block_size, gpu, num_gpus, expert_format, dense_format).seconds
    dr = draft_time(target, block_size, batch, gpu, num_gpus, drafter_format).seconds if include_draft else 0.0
    return speedup(tau, dec, ver, dr)


def measured_speedup(tau: float, verify_cost_ratio: float, draft_ratio: float = 0.0) -> float:
    """:func:`speedup` from a measured verify-cost ratio ``t(K) / t(1)`` and a draft cost
    ``t_draft / t(1)`` (both taken as the whole step's): ``tau / (ratio + draft_ratio)``."""
    return speedup(tau, 1.0, verify_cost_ratio, draft_ratio)


def model_table(
    target: MoETarget, gpu: GPU, blocks: tuple[int, ...], batch: int = 1, num_gpus: int = 1, **fmts
) -> list[dict]:
    """Per block size: experts touched (expected), bytes and seconds of the verify step, its ratio
    to decode, and the draft cost ratio, from :func:`step_time` / :func:`draft_time` (``fmts``:
    ``expert_format``, ``dense_format``, ``drafter_format``)."""
    drafter_format = fmts.pop("drafter_format", "bf16")
    dec = step_time(target, batch, gpu, num_gpus, **fmts)
    rows = []
    for k in blocks:
        ver = step_time(target, batch * k, gpu, num_gpus, **fmts)
        dr = draft_time(target, k, batch, gpu, num_gpus, drafter_format)
        rows.append(
            {
                "tokens_per_block": k,
                "batch": batch,
                "experts_touched": ver.experts_touched,
                "verify_bytes": ver.bytes,
                "verify_ms": ver.seconds * 1e3,
                "verify_cost_ratio": ver.seconds / dec.seconds,
                "draft_cost_ratio": dr.seconds / dec.seconds,
            }
        )
    return rows


def describe_model(target: MoETarget, gpu: GPU, num_gpus: int = 1) -> dict:
    """The model's inputs as JSON: shape, parameter counts, GPU figures and what is ignored."""
    return {
        "target": asdict(target),
        "total_params": target.total_params(),
        "active_params_per_token": target.active_params_per_token(),
        "dense_params_read_per_step": target.dense_params(),
        "expert_params": target.expert_params(),
        "gpu": asdict(gpu),
        "num_gpus": num_gpus,
        "ignored": "KV cache reads, inter-GPU communication, launch latency, efficiency below datasheet figures",
        "routing": "uniform independent (E * (1 - (1 - k/E) ** n) experts touched)",
    }


def plot_moe(result: dict, out: str | Path, gpu: GPU, taus_per_block: int = 25) -> Path:
    """Three-panel PNG of a ``bench/moe_layer.py`` result.

    Left: verify-cost ratio t(K)/t(1) against tokens per block, measured on the CPU per format,
    and the GPU roofline model's (whole step, and experts only = touched(K) / k). Middle: predicted
    speedup against tau at batch 1 for each block size, from the GPU model (solid, drafter
    included) and from the CPU-measured layer ratio (dashed, drafter cost taken from the GPU
    model's ratio; the ``int4`` format when measured, else the first). Right: the GPU model at
    batch ``result["model_batch"]``. Returns the path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = PRESETS.get(result["preset"])
    if target is None:
        raise ConfigError("preset", f"must be one of {', '.join(PRESETS)}, got {result['preset']!r}")
    blocks = [k for k in result["blocks"] if k > 1]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    a, b, c = axes
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
    colours = {k: palette[i % len(palette)] for i, k in enumerate(blocks)}
    ks = sorted(set(result["blocks"]) | {1})
    for fmt, res in result["formats"].items():
        rows = [r for r in res["rows"] if r["batch"] == 1]
        a.plot([r["tokens_per_block"] for r in rows], [r["verify_cost_ratio"] for r in rows], "o-", label=f"CPU {fmt}")
    num_gpus = result.get("num_gpus", 1)
    model = {r["tokens_per_block"]: r for r in model_table(target, gpu, tuple(ks), 1, num_gpus)}
    a.plot(ks, [model[k]["verify_cost_ratio"] for k in ks], "s--", color="k", label=f"{gpu.name} model, whole step")
    a.plot(ks, [target.expected_touched(k) / target.top_k for k in ks], ":", color="grey", label="experts touched / k")
    a.set_xlabel("tokens per verify block K")
    a.set_ylabel("verify-cost ratio t(K) / t(1)")
    a.set_title(f"{target.name}: one MoE layer (CPU) vs the model; uniform routing", fontsize=9)
    a.legend(fontsize=7)
    fmts = list(result["formats"])
    cpu_fmt = "int4" if "int4" in fmts else (fmts[0] if fmts else None)  # the 4-bit one: closest to MXFP4
    for ax, batch in ((b, 1), (c, result.get("model_batch", 32))):
        mt = {r["tokens_per_block"]: r for r in model_table(target, gpu, tuple(blocks), batch, num_gpus)}
        for j, k in enumerate(blocks):
            lw = 1.2 + 1.6 * (len(blocks) - 1 - j)  # wider first: lines that coincide stay visible
            taus = [1 + (k - 1) * i / (taus_per_block - 1) for i in range(taus_per_block)]
            ys = [model_speedup(target, t, k, gpu, batch, num_gpus) for t in taus]
            ax.plot(taus, ys, "-", color=colours[k], lw=lw, label=f"K={k} {gpu.name} model")
            if batch == 1 and cpu_fmt is not None:
                row = next(
                    (r for r in result["formats"][cpu_fmt]["rows"] if r["batch"] == 1 and r["tokens_per_block"] == k),
                    None,
                )
                if row is not None:
                    ys = [measured_speedup(t, row["verify_cost_ratio"], mt[k]["draft_cost_ratio"]) for t in taus]
                    ax.plot(taus, ys, "--", color=colours[k], label=f"K={k} CPU {cpu_fmt} layer ratio")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("tau (tokens per verify step)")
        ax.set_ylabel("predicted speedup over plain decoding")
        ax.set_title(
            f"batch {batch}, {num_gpus}x {gpu.name}, {target.expert_format} experts, bf16 rest + drafter", fontsize=9
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def check_published_counts() -> dict[str, tuple[float, float]]:
    """(our total, our active) in billions per gpt-oss preset, for comparing against the model
    card (120b: 116.83 / 5.13, 20b: 20.91 / 3.61; active counts the LM head, not the embedding)."""
    return {
        n: (PRESETS[n].total_params() / 1e9, PRESETS[n].active_params_per_token() / 1e9)
        for n in ("gpt-oss-20b", "gpt-oss-120b")
    }


__all__ = [
    "BYTES_PER_PARAM",
    "GPUS",
    "PRESETS",
    "Drafter",
    "GPU",
    "MoETarget",
    "StepCost",
    "draft_time",
    "expected_experts_touched",
    "measured_speedup",
    "model_speedup",
    "model_table",
    "plot_moe",
    "speedup",
    "step_time",
]
