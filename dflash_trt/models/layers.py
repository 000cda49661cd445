"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, attention over a KV
cache, gated MLP. Torch modules only, no I/O.

KV-cache contract (the runtime owns the buffers, see ``runtime/kv_cache.py``): each attention
layer gets one ``(k_buf, v_buf)`` pair and an :class:`AttentionMetadata` telling where the new
K/V go (``write_slots``) and which slots each query may see (``mask``). Two layouts:

- contiguous: buffers ``[batch, num_kv_heads, slots, head_dim]``, tokens ``[batch, T]``, slot
  ``slots - 1`` is a trash slot that padding writes into;
- paged (``meta.read_slots`` set): buffers are slot pools ``[num_slots, num_kv_heads, head_dim]``
  shared by all sequences (slot = block id * tokens_per_block + offset), the tokens of all
  sequences are packed into one row ``[1, N]`` (ragged prefill chunks and verify blocks in one
  forward, no padding), and each sequence reads its own slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import DFlashError
from ..kernels import cpu_ops

_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without dispatching an op when it already has it (a decode step makes
    hundreds of such calls; each no-op ``to`` still costs a dispatch on the CPU)."""
    return x if x.dtype == dtype else x.to(dtype)


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (int64, first maximum on ties). On the CPU where the ``dflash_cpu``
    kernels are loaded, fp32 / bf16 rows go through ``dflash_cpu::argmax_rows`` (one vectorized
    pass: 12 rows of a 49,152-token vocabulary ~0.1 ms against ~1 ms); otherwise reduced-precision
    CPU tensors go through fp32 (torch's bf16 CPU argmax measured 6-7x slower than upcasting and
    reducing). Either way the same index."""
    if x.device.type == "cpu":
        kernel = x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] > 0 and cpu_ops.loaded()
        if kernel and not torch.compiler.is_compiling():
            return cpu_ops.argmax_rows(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
    return x.argmax(-1)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (``x * rsqrt(mean(x^2) + eps) * weight``): normalized in
    fp32, rounded to the input dtype, then scaled by the weight, as HF Llama/Qwen do.

    :attr:`cpu_kernel` (set by ``runtime/model_runner.cpu_weight_layout`` for CPU targets in
    fp32 / bf16) computes the same formula in one ``dflash_cpu::rms_norm`` call
    (:func:`~dflash_trt.kernels.cpu_ops.rms_norm`) instead of torch's composite ``F.rms_norm``
    and a multiply (~25-60 us a call on one thread, measured on a 2-core AMD EPYC, torch 2.13;
    ~61 calls a decode step of a 30-layer target). Under ``torch.compile`` the op is one opaque
    call in the graph, so the compiled path's norms give the eager path's bits."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel and x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return torch.ops.dflash_cpu.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        # torch's fused kernel; for bf16 / fp16 input it accumulates in fp32 and rounds once, as
        # the upcast-normalize-downcast of HF does (equal bits on 200 random bf16 rows of 576)
        return self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)


def set_cpu_norm_kernel(model: nn.Module, on: bool) -> int:
    """Switch every :class:`RMSNorm` of ``model`` to (``on``) or from the one-call CPU kernel
    (:attr:`RMSNorm.cpu_kernel`), in place. Returns how many norms it set."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m.cpu_kernel = on
    if hasattr(model, "dense_layers"):  # planned for the norms as they were (models/fused_layer.py)
        model.dense_layers = None
    return len(norms)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse RoPE frequencies, fp32 ``[head_dim // 2]``.

    Supports the default rule, ``rope_type: llama3`` (Llama-3.1; HF
    ``_compute_llama3_parameters``) and ``rope_type: yarn`` (gpt-oss; YaRN, arXiv:2309.00071,
    op for op as transformers 5.24 ``_compute_yarn_parameters``: ``factor``,
    ``original_max_position_embeddings``, ``beta_fast`` / ``beta_slow`` (default 32 / 1),
    ``truncate`` (default true)). Other scaling types raise ``ValueError``.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's blend of interpolated (``/ factor``) and original frequencies over a linear ramp
    between the correction dimensions of ``beta_fast`` and ``beta_slow`` rotations."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def corr_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies both cos and sin tables by (so q . k scales by its square):
    ``attention_factor`` when given, else ``0.1 * mscale * ln(factor) + 1`` (over the same with
    ``mscale_all_dim`` when both are set), 1 for ``factor <= 1`` and for other RoPE types
    (transformers' ``_compute_yarn_parameters``; gpt-oss: 0.1 ln 32 + 1 = 1.3466)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; ``forward(positions [B, T] int64)`` returns cos and a signed
    sin, ``[B, 1, T, head_dim]`` in the given dtype: HF's ``rotate_half`` sign is folded into
    the sin table's first half (``-sin``), so :func:`apply_rope` rotates with one ``roll``. Both
    tables are multiplied (in fp32) by :func:`rope_attention_factor` (YaRN; 1 otherwise)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.attention_factor = rope_attention_factor(scaling)
        self._build(max_positions)

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos_table = emb.cos()
        self.sin_table = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)  # rotate_half's sign folded in
        if self.attention_factor != 1.0:
            self.cos_table = self.cos_table * self.attention_factor
            self.sin_table = self.sin_table * self.attention_factor

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need = (int(positions.max()) if max_position is None else max_position) + 1
        if need > self.cos_table.shape[0]:
            self._build(max(need, 2 * self.cos_table.shape[0]))
        if self.cos_table.device != positions.device:  # plain attributes: .to(device) does not move them
            self.cos_table, self.sin_table = self.cos_table.to(positions.device), self.sin_table.to(positions.device)
            self.inv_freq = self.inv_freq.to(positions.device)  # moved once, with the tables
        cos = self.cos_table[positions].to(dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, head_dim]`` by the tables from :class:`RotaryEmbedding` (signed
    sin): ``x * cos + rotate_half(x) * sin_hf`` of HF Llama, exactly, since
    ``rotate_half(x) * sin_hf = roll(x, D/2) * [-sin, sin]`` (a sign flip is exact)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


@dataclass
class AttentionMetadata:
    """Where one forward's tokens sit in the KV cache.

    Attributes:
        positions: int64 ``[B, T]`` absolute positions (RoPE), padding clamped to a valid value.
        write_slots: int64 ``[B, T]`` cache slot each new K/V is written to (padding -> trash slot).
        mask: bool ``[B, 1, T, kv_len]``, true where a query may attend to a cache slot
            (paged: ``[S, 1, Tq, kv_len]``, one row per sequence; the rows of padding queries
            are all true, so that no row is fully masked).
        kv_len: number of leading cache slots read by attention (paged: columns of ``read_slots``).
        read_slots: paged layout only: int64 ``[S, kv_len]`` pool slot behind each key column of
            each of the ``S`` sequences (padding columns point anywhere; ``mask`` hides them).
        query_index: paged only: int64 ``[S, Tq]`` index of each sequence's queries among the
            forward's ``N`` query tokens, in order (padding = ``N``). Sequences are contiguous
            and in packed order.
        query_valid: paged only: bool ``[S, Tq]``, false on padding.
        query_rows: paged only, optional: int64 ``[N]`` flat indices (into ``S * Tq``) of the
            valid queries in packed order; lets attention un-pad with a gather instead of a
            boolean mask (which makes a CUDA device wait for the host once per layer).
        max_position: the largest position in ``positions`` when the host knows it (spares
            RoPE a device-to-host read per forward); None: read from ``positions``.
        groups: paged only, optional: the sequences split into groups attended separately
            (each its own ``read_slots`` / ``mask`` / ``query_index`` / ``query_valid`` /
            ``query_rows``, and ``query_out``: int64 ``[n_g]`` rows of the packed output its
            queries fill), so short verify blocks are not padded to a long prompt chunk.
        query_out: in a group, the packed output rows of its queries.
        uniform: paged only: every sequence has ``Tq`` queries, packed in sequence order, none
            of them padding (``query_index`` is ``arange(S * Tq).view(S, Tq)``): attention takes
            the queries and returns the output as views, without the gathers.
        sliding_mask: bool, ``mask``'s shape: ``mask`` and a query at position p sees only keys
            at positions > p - ``window`` (the sliding-window layers of a target such as
            gpt-oss); paged: set per group by ``runtime/attention_meta``; contiguous: made from
            ``positions`` on first use (slot j holds position j there).
        window: the window ``sliding_mask`` was made for.
    """

    positions: torch.Tensor
    write_slots: torch.Tensor
    mask: torch.Tensor
    kv_len: int
    read_slots: torch.Tensor | None = None
    query_index: torch.Tensor | None = None
    query_valid: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None
    max_position: int | None = None
    groups: list[AttentionMetadata] | None = None
    query_out: torch.Tensor | None = None
    uniform: bool = False
    sliding_mask: torch.Tensor | None = None
    window: int | None = None

    @classmethod
    def causal(cls, positions: torch.Tensor, kv_len: int, write_slots: torch.Tensor | None = None) -> AttentionMetadata:
        """Causal attention by absolute position: slot j is visible to a query at position p
        iff j <= p. ``write_slots`` defaults to ``positions``."""
        slots = torch.arange(kv_len, device=positions.device)
        mask = slots.view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1)
        return cls(positions, positions if write_slots is None else write_slots, mask, kv_len)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer that attends over the last ``window`` positions (None: ``mask``).

        Raises:
            DFlashError: paged metadata planned without that window (``plan_packed``'s
                ``target_window``).
        """
        if window is None:
            return self.mask
        if self.sliding_mask is not None and self.window == window:
            return self.sliding_mask
        if self.read_slots is not None:
            raise DFlashError(f"attention metadata has no sliding-window mask for window {window}")
        slots = torch.arange(self.kv_len, device=self.mask.device)
        near = self.positions[:, None, :, None] - slots < window  # contiguous: slot j holds position j
        self.sliding_mask, self.window = self.mask & near, window
        return self.sliding_mask


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    invariant: bool = False,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Write new K/V into the cache, then attend over the visible cache slots.

    Args:
        q: ``[B, H, T, D]`` queries, RoPE applied.
        k, v: ``[B, T, Hkv, D]`` new keys (RoPE applied) and values.
        kv: cache buffers ``[B, Hkv, slots, D]`` (paged: pools ``[num_slots, Hkv, D]``), updated
            in place.
        meta: slots and mask for this forward.
        invariant: each query attended alone, in key order (``dflash_cpu::bi_attention``, the
            batch-invariant mode: ``models/batch_invariant.py``), instead of SDPA.
        sinks: optional ``[H]`` attention-sink logits (gpt-oss): each softmax row gets one more
            logit ``sinks[h]`` with no value behind it, so the row's weights sum to less than 1
            (transformers' ``GptOssAttention``: ``softmax(cat([scores, sink]))[..., :-1] @ V``).
        window: optional sliding window: the query at position p sees keys p - window + 1 .. p
            (:meth:`AttentionMetadata.mask_for`).

    Returns:
        ``[B, T, H * D]`` attention output.
    """
    if meta.read_slots is not None or meta.groups:
        return _paged_attention(q, k, v, kv, meta, invariant, sinks, window)
    k_buf, v_buf = kv
    rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
    k_buf[rows, :, meta.write_slots] = k
    v_buf[rows, :, meta.write_slots] = v
    n = meta.kv_len
    keys, values = k_buf[:, :, :n], v_buf[:, :, :n]
    out = _sdpa(q, keys, values, meta.mask_for(window), invariant, sinks)
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


def _sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    invariant: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    dtype = q.dtype
    if invariant:  # CPU only, the op loaded by models/batch_invariant.set_batch_invariant; reads bf16 as it is
        scale = 1.0 / math.sqrt(q.shape[-1])
        return torch.ops.dflash_cpu.bi_attention(q, keys, values, mask, scale, sinks).to(dtype)
    if q.device.type == "cpu" and dtype != torch.float32:
        # CPU SDPA in bf16 measured 1.65x slower end to end (batch 16 decode) than upcasting to fp32
        q, keys, values = q.float(), keys.float(), values.float()
    # head counts are static shapes (views by the model's config), so under torch.compile with
    # dynamic shapes this is a Python bool, as SDPA requires
    gqa = q.shape[1] != keys.shape[1]
    if q.device.type == "cpu" and torch.compiler.is_compiling():
        return _matmul_attention(q, keys, values, mask, sinks).to(dtype)
    if sinks is not None:
        keys, values, mask = _sink_column(keys, values, mask, sinks.to(q.dtype), q.shape[1])
    if q.device.type == "cuda":
        # not cuDNN: it plans anew for every key length, and decoding changes it every step
        # (measured on an H200: 2.8x slower plain decoding at batch 1 and 64 than without it)
        with sdpa_kernel(_CUDA_SDPA):
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa).to(dtype)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa).to(dtype)


def _sink_column(
    keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, h: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key column for SDPA: a zero key and a zero value whose
    additive mask entry is the head's sink logit (its score is ``q . 0 * scale + sink = sink``
    exactly), the bool ``mask`` turned into an additive ``[S, H, Tq, L + 1]`` float mask
    (``-inf`` where hidden). Exact: the softmax denominator gains ``exp(sink)`` and the output
    nothing, as in transformers' eager ``GptOssAttention``."""
    s, hkv, _, d = keys.shape
    zero = keys.new_zeros(s, hkv, 1, d)
    keys, values = torch.cat([keys, zero], dim=2), torch.cat([values, zero], dim=2)
    m, _, tq, length = mask.shape
    bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device).masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, h, 1, 1).expand(m, h, tq, 1)
    return keys, values, torch.cat([bias.expand(m, h, tq, length), sink], dim=-1)


def _matmul_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention as two batched matmuls and a softmax, for inductor to fuse on the CPU.

    Under ``torch.compile`` on the CPU, inductor's SDPA measured 2.5-4x slower than this for
    decode and verify shapes (30 layers, 9:3 heads, 100-600 keys: 4.3 vs 1.1 ms at 100 keys, one
    thread), and slower than eager SDPA; eagerly, SDPA stays faster, so only the compiled path
    uses this. The query heads that share a K/V head are stacked into one matmul (no GQA expand).

    Args:
        q: ``[S, H, Tq, D]`` fp32 queries.
        keys, values: ``[S, Hkv, L, D]`` fp32 (``H`` a multiple of ``Hkv``).
        mask: bool ``[S or 1, 1, Tq, L]``, true where a query may attend; no row fully false.
        sinks: optional ``[H]`` attention-sink logits (see :func:`cached_attention`).

    Returns:
        ``[S, H, Tq, D]`` fp32.
    """
    s, h, tq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = h // hkv
    qg = q.reshape(s, hkv, g * tq, d)  # head h = kv head h // g, as enable_gqa
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    visible = mask.unsqueeze(2).expand(mask.shape[0], 1, g, tq, length).reshape(mask.shape[0], 1, g * tq, length)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # one more logit per row (head h = kv head h // g, rows g-major as qg), dropped after the softmax
        sink = sinks.to(scores.dtype).view(hkv, g, 1, 1).expand(hkv, g, tq, 1).reshape(1, hkv, g * tq, 1)
        probs = torch.softmax(torch.cat([scores, sink.expand(s, -1, -1, -1)], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values).view(s, h, tq, d)


def _paged_attention(
    q, k, v, kv, meta: AttentionMetadata, invariant: bool = False, sinks=None, window: int | None = None
) -> torch.Tensor:
    """Paged layout of :func:`cached_attention`: ``q [1, H, N, D]``, ``k, v [1, N, Hkv, D]``
    packed over sequences; pools ``[num_slots, Hkv, D]``. Writes the new K/V to their slots,
    gathers each sequence's keys by ``read_slots``, runs one padded SDPA over ``[S, H, Tq, kv_len]``
    and unpads back to ``[1, N, H * D]``."""
    k_pool, v_pool = kv
    slots = meta.write_slots.reshape(-1)
    k_pool[slots] = as_dtype(k[0], k_pool.dtype)
    v_pool[slots] = as_dtype(v[0], v_pool.dtype)
    _, h, n, d = q.shape
    if uniform_queries(meta, n):
        # S * Tq queries in sequence order, none padding: views, no gathers
        s, tq = meta.mask.shape[0], meta.mask.shape[2]
        out = _attend_pools(
            q[0].view(h, s, tq, d).transpose(0, 1), k_pool, v_pool, meta, k.shape[2], invariant, sinks, window
        )
        return out.transpose(1, 2).reshape(1, n, h * d)
    qpad = torch.cat([q[0].transpose(0, 1), q.new_zeros(1, h, d)])  # [N + 1, H, D]; row N pads
    if meta.groups:
        out = q.new_empty(n, h, d)
        for g in meta.groups:
            out[g.query_out] = _attend(qpad, k_pool, v_pool, g, k.shape[2], invariant, sinks, window)
    else:
        out = _attend(qpad, k_pool, v_pool, meta, k.shape[2], invariant, sinks, window)
    return out.reshape(1, n, h * d)


def uniform_queries(meta: AttentionMetadata, n: int) -> bool:
    """Whether the ``n`` queries of a paged forward are ``S`` sequences of ``Tq`` each, in
    sequence order, none padding (``meta.uniform`` and ``n == S * Tq``): attention then takes
    them and returns its output as views, and a dense layer may run in one call
    (``models/fused_layer.py``)."""
    return meta.uniform and n == meta.mask.shape[0] * meta.mask.shape[2]


def _attend_pools(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    hkv: int,
    invariant: bool,
    sinks: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """``q [S, H, Tq, D]`` attending over each sequence's keys in the pools (``meta.read_slots``):
    ``[S, H, Tq, D]`` in ``q``'s dtype. In the batch-invariant mode with pools in ``q``'s dtype
    the kernel reads the pools through the slot table in place (``dflash_cpu::bi_paged_attention``,
    the same bits as over gathered keys; the two gathers were ~10 % of a 16-sequence fp32 decode
    step); otherwise the keys are gathered first."""
    mask = meta.mask_for(window)
    if invariant and k_pool.dtype == q.dtype:
        scale = 1.0 / math.sqrt(q.shape[-1])
        return torch.ops.dflash_cpu.bi_paged_attention(q, k_pool, v_pool, meta.read_slots, mask, scale, sinks).to(
            q.dtype
        )
    return _sdpa(q, *_keys(k_pool, v_pool, meta, q.dtype, hkv), mask, invariant, sinks)


def _keys(k_pool, v_pool, meta: AttentionMetadata, dtype, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values gathered from the pools: ``[S, Hkv, kv_len, D]``
    (``hkv``: the new keys' head count, a static shape where the pool's may be symbolic)."""
    s, n = meta.read_slots.shape
    flat = meta.read_slots.reshape(-1)
    d = k_pool.shape[-1]
    # index_select, not pool[read_slots]: advanced indexing measured 4-7x slower on the CPU
    # (22 vs 5 us for 300 keys of a [8193, 3, 64] bf16 pool, 74 vs 10 us for 1,000)
    keys = as_dtype(torch.index_select(k_pool, 0, flat), dtype).view(s, n, hkv, d).transpose(1, 2)
    values = as_dtype(torch.index_select(v_pool, 0, flat), dtype).view(s, n, hkv, d).transpose(1, 2)
    return keys, values


def _attend(
    qpad: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    hkv: int,
    invariant: bool = False,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One padded SDPA over the sequences of ``meta``: ``[n_valid, H, D]`` in packed order."""
    h, d = qpad.shape[1], qpad.shape[2]
    qs = torch.index_select(qpad, 0, meta.query_index.reshape(-1)).view(*meta.query_index.shape, h, d)
    out = _attend_pools(qs.transpose(1, 2), k_pool, v_pool, meta, hkv, invariant, sinks, window)  # [S, H, Tq, D]
    out = out.transpose(1, 2)
    if meta.query_rows is not None:
        return torch.index_select(out.reshape(-1, h, d), 0, meta.query_rows)  # a gather: no host sync
    return out[meta.query_valid]


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one GEMM: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)
