"""CUDA graphs for the target's decode and verify forwards, one per batch-size bucket.

On a GPU a decode step of a small target is a few hundred short kernels, and launching them
from Python costs more than running them; vLLM, SGLang and TensorRT-LLM capture the decode
forward in CUDA graphs per batch size and replay it. Here an iteration qualifies when every
item is a decode item that verifies the same ``q`` tokens (plain decoding: ``q = 1``; DFlash:
the anchor plus ``q - 1`` draft tokens, all with logits). Its ``S`` sequences are padded to a
batch bucket ``S_b >= S`` (:data:`BATCH_BUCKETS`) and its key length to a power-of-two key
bucket ``L_b >= kv_len`` (:data:`MIN_KEYS` .. :data:`MAX_KEYS`; vLLM's ``max_seq_len_to_capture``
is the same 8,192), and the forward is replayed from the graph captured for ``(S_b, q, L_b)``.

An iteration with prompt chunks (a request joining the batch; chunked prefill) replays too: each
chunk of ``n`` tokens from the graph of its token bucket (:data:`PROMPT_BUCKETS`, ``n`` padded
to at most 2n) and key bucket, its metadata built inside the graph from the chunk's start,
length and block table (:func:`chunk_meta`), then the iteration's decode items from their decode
graph; logits and features are put back in packed order. Eagerly, on a GPU, such an iteration
cost ~36 ms against ~5 ms replayed (one H200, the default target): in a 48-request load run at
16 sequences 17 of them made ~22 % of plain decoding's time, and DFlash, whose sequences end at
different iterations, had 26. Iterations with more than :data:`MAX_PROMPT_REPLAYS` chunks,
chunks longer than the largest bucket, mixed draft lengths or longer contexts run eagerly.

Graphs are captured when the engine starts (as vLLM captures its batch sizes), for every batch
bucket, every ``q`` of :func:`capture_queries` and every key bucket of contexts up to
``ModelConfig.cuda_graph_capture_len`` tokens (``ModelRunner.capture_graphs``, on buckets of
padding only); the others on first use, with that iteration's inputs. A capture costs tens of
milliseconds against a ~5 ms replayed step (one H200, docs/gpu-runs.md): captured while serving,
they cost a 48-request load run at 16 sequences ~14 of them.

Padding is exact: padded key columns are masked, so a real query's softmax gets exact zeros
there; padded sequences write their K/V to the pool's spare slot, read only that slot, and
their rows are dropped.

The graphs end at the final norm, as vLLM's do: the LM head runs after the replay, on the real
rows only, so a graph keeps ``[batch * q, hidden]`` in its memory rather than
``[batch * q, vocab]`` (at batch 256, 16 queries and a 152K vocabulary that would be 1.2 GB in
bf16, per graph). A graph's outputs live in the graph pool's memory, which every graph's next
replay may reuse. So the target features are copied out before they leave
:meth:`GraphedTarget.run`:
the drafter reads those features an iteration later, and a view into graph memory would hand
it another iteration's hidden states (the "tau 1.00 / garbage drafts under CUDA graphs" class
of bug that vLLM and SGLang users report for EAGLE/DFlash drafters).

Without a GPU the same path runs with ``capture=False``: the same buckets, padding and static
buffers, and each "replay" runs the forward on those buffers and copies its results into static
output buffers, so everything but the capture itself (padding, bucket choice, buffer reuse and
the copies out) is tested on the CPU against eager decoding.

Mixture-of-experts targets (Qwen3-MoE, gpt-oss) run their expert layers on the static-shape
path of ``models/moe.py`` inside the graphs (:func:`~dflash_trt.models.moe.static_experts`:
no host read of the routing), on the CPU too; gpt-oss's sliding-window layers read the padded
``sliding_mask`` (:func:`pad_decode_meta`).

The drafter's forward has graphs of its own (:mod:`.drafter_graphs`). Limits: no graphs under
tensor parallelism (the CLI refuses the combination).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..models.layers import AttentionMetadata
from ..models.moe import static_experts
from ..models.target import TargetOutput
from .attention_meta import MetaPlan

#: batch sizes captured (vLLM's default list starts the same way); larger batches run eagerly
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: smallest key bucket: key lengths are rounded up to a power of two from here
MIN_KEYS = 256
#: longest context captured; longer ones run eagerly (vLLM's ``max_seq_len_to_capture``)
MAX_KEYS = 8192
#: prompt-chunk sizes with graphs of their own: a chunk of ``n`` tokens replays the graph of the
#: smallest bucket ``>= n`` (at most 2x the tokens); longer chunks run eagerly
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
#: the most prompt chunks an iteration replays one by one beside its decode graph; with more
#: (the first iteration of a burst of requests) the iteration runs eagerly, in one forward
MAX_PROMPT_REPLAYS = 8


def check_cuda_graphs(enabled: bool, device: torch.device, tp_size: int = 1) -> None:
    """Raises :class:`~.config.ConfigError` (``cuda_graphs``) when CUDA graphs are asked for off a
    CUDA device or under tensor parallelism (neither is supported)."""
    if enabled and device.type != "cuda":
        raise ConfigError("cuda_graphs", f"needs a CUDA device, got {device}")
    if enabled and tp_size > 1:
        raise ConfigError("cuda_graphs", "is not supported with tensor parallelism yet")


def batch_buckets(max_batch: int) -> list[int]:
    """The batch buckets of an engine of at most ``max_batch`` sequences, ascending:
    :data:`BATCH_BUCKETS` below ``max_batch``, then ``max_batch`` itself."""
    return sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch})


def batch_bucket(n: int, max_batch: int) -> int | None:
    """The smallest of :func:`batch_buckets` ``>= n``, or None when ``n > max_batch``."""
    return next((b for b in batch_buckets(max_batch) if b >= n), None)


def key_bucket(n: int) -> int | None:
    """``n`` keys rounded up to a power of two, at least :data:`MIN_KEYS`; None above
    :data:`MAX_KEYS`."""
    b = MIN_KEYS
    while b < n:
        b *= 2
    return b if b <= MAX_KEYS else None


def prompt_bucket(n: int) -> int | None:
    """The smallest of :data:`PROMPT_BUCKETS` ``>= n``, or None above the largest."""
    return next((b for b in PROMPT_BUCKETS if b >= n), None)


def to_static(buf: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into a graph's static device buffer (pinned, non-blocking: no
    synchronisation)."""
    if buf.device.type == "cuda":
        buf.copy_(host.pin_memory(), non_blocking=True)
    else:
        buf.copy_(host)


def chunk_meta(
    start: torch.Tensor,
    length: torch.Tensor,
    table: torch.Tensor,
    queries: int,
    keys: int,
    tokens_per_block: int,
    spare_slot: int,
    window: int | None = None,
) -> AttentionMetadata:
    """The paged metadata of one prompt chunk padded to ``queries`` tokens over ``keys`` key
    columns, built on the device from its start and length (int64 ``[1]`` each, device
    tensors) and its block table (int64 ``[keys / tokens_per_block]``, padded with block 0):
    static shapes and no host read, so that a CUDA graph holds it.

    The chunk's ``length`` tokens sit at positions ``start ..`` and write their slots; each sees
    the keys at or before its position (the sequence's cached context and the chunk's own
    earlier tokens). Padding queries (``length ..``) sit at position 0, write the spare slot and
    see every column (no all-masked row); key columns at or past ``start + length`` read the
    spare slot, masked for every real query. ``window``: a target's sliding-window layers
    (gpt-oss) get ``sliding_mask`` too, as :func:`~.attention_meta.plan_packed` plans it.

    Returns:
        uniform metadata of one sequence: ``positions`` / ``write_slots`` int64 ``[1, queries]``,
        ``read_slots`` int64 ``[1, keys]``, ``mask`` bool ``[1, 1, queries, keys]``,
        ``max_position`` ``keys - 1`` (the RoPE tables are sized for the bucket once).
    """
    tpb, width = tokens_per_block, table.shape[0]
    u = torch.arange(queries, device=table.device)
    valid = u < length
    pos = torch.where(valid, start + u, 0)

    def slot(p: torch.Tensor) -> torch.Tensor:
        return table[(p // tpb).clamp(max=width - 1)] * tpb + p % tpb

    j = torch.arange(keys, device=table.device)
    read = torch.where(j < start + length, slot(j), spare_slot)
    mask = (j[None, :] <= pos[:, None]) | ~valid[:, None]  # [queries, keys]
    meta = AttentionMetadata(
        pos.view(1, queries),
        torch.where(valid, slot(pos), spare_slot).view(1, queries),
        mask.view(1, 1, queries, keys),
        keys,
        read_slots=read.view(1, keys),
        max_position=keys - 1,
        uniform=True,
    )
    if window is not None:
        sliding = mask & (pos[:, None] - j[None, :] < window) | ~valid[:, None]
        meta.sliding_mask, meta.window = sliding.view(1, 1, queries, keys), window
    return meta


def key_buckets(max_len: int) -> list[int]:
    """The key buckets of contexts of up to ``max_len`` tokens (capped at :data:`MAX_KEYS`),
    descending; empty for ``max_len < 1``."""
    if max_len < 1:
        return []
    out = [key_bucket(min(max_len, MAX_KEYS))]
    while out[-1] > MIN_KEYS:
        out.append(out[-1] // 2)
    return out


def capture_queries(block_size: int) -> list[int]:
    """The per-sequence query counts whose graphs are captured ahead for an engine of block size
    ``block_size`` (1: plain decoding; ``1 + k`` for ``k`` draft tokens, any ``k`` the adaptive
    controller may choose): all of ``1 .. block_size`` up to 8, beyond that 1, the powers of two
    and ``block_size`` (a 16-token block would otherwise mean 16 graphs per bucket; the others
    are captured on first use)."""
    if block_size <= 8:
        return list(range(1, block_size + 1))
    return sorted({1, block_size} | {2**i for i in range(block_size.bit_length()) if 2**i < block_size})


def padding_meta(queries: int, device: torch.device, window: int | None = None) -> AttentionMetadata:
    """The uniform decode metadata of no sequence at all (``queries`` each): what
    :func:`pad_decode_meta` turns into a bucket of padding only, for a graph captured before any
    sequence runs (every row writes and reads only the spare slot). ``window``: the target's
    sliding window (gpt-oss), planned as :func:`~.attention_meta.plan_packed` plans it."""
    none = torch.zeros(1, 0, dtype=torch.long, device=device)
    mask = torch.zeros(0, 1, queries, 0, dtype=torch.bool, device=device)
    meta = AttentionMetadata(none, none, mask, 0, read_slots=none.view(0, 0), max_position=0, uniform=True)
    if window is not None:
        meta.sliding_mask, meta.window = mask, window
    return meta


def pad_decode_meta(
    meta: AttentionMetadata, batch: int, keys: int, spare_slot: int, out: AttentionMetadata | None = None
) -> AttentionMetadata:
    """The uniform paged metadata of ``S`` sequences with ``q`` queries each (as
    :meth:`~.attention_meta.MetaPlan.build` makes it for a decode-only iteration, on any device)
    padded to ``batch`` sequences and ``keys`` key columns, written into ``out`` (a graph's
    static metadata, same shapes) or into new tensors on ``meta``'s device.

    Padded key columns read ``spare_slot`` and are masked; padded sequences sit at position 0,
    write and read only ``spare_slot`` and see all of their (spare) keys, so no softmax row is
    fully masked. ``max_position`` is ``keys - 1``: the RoPE tables are sized for the bucket
    once, so a replay never rebuilds them.

    A target with sliding-window layers (gpt-oss) has ``meta.sliding_mask`` (and ``window``)
    planned too (``plan_packed``'s ``target_window``): it is padded the same way into
    ``sliding_mask`` bool ``[batch, 1, q, keys]`` (``out`` must then have one).

    Returns:
        metadata with ``positions`` / ``write_slots`` int64 ``[1, batch * q]``, ``read_slots``
        int64 ``[batch, keys]``, ``mask`` bool ``[batch, 1, q, keys]``, ``uniform`` True, and
        ``sliding_mask`` / ``window`` when ``meta`` has them.

    Raises:
        ValueError: ``meta`` is not uniform, or is larger than the bucket.
    """
    seqs, _, q, cols = meta.mask.shape
    if not meta.uniform or meta.groups or seqs > batch or cols > keys:
        raise ValueError(
            f"cannot pad metadata of {seqs} sequences x {cols} keys (uniform={meta.uniform}) to {batch} x {keys}"
        )
    if out is None:
        pos, mask = meta.positions, meta.mask
        out = AttentionMetadata(
            pos.new_zeros(1, batch * q),
            pos.new_full((1, batch * q), spare_slot),
            mask.new_ones(batch, 1, q, keys),
            keys,
            read_slots=pos.new_full((batch, keys), spare_slot),
            max_position=keys - 1,
            uniform=True,
        )
        if meta.sliding_mask is not None:
            out.sliding_mask, out.window = torch.ones_like(out.mask), meta.window
    else:
        out.positions.zero_()
        out.write_slots.fill_(spare_slot)
        out.mask.fill_(True)
        out.read_slots.fill_(spare_slot)
    out.positions[:, : seqs * q] = meta.positions
    out.write_slots[:, : seqs * q] = meta.write_slots
    out.read_slots[:seqs, :cols] = meta.read_slots
    out.mask[:seqs] = False
    out.mask[:seqs, :, :, :cols] = meta.mask
    if meta.sliding_mask is not None:  # the same padding (padded sequences see all their keys)
        if out.sliding_mask is None or out.window != meta.window:
            raise ValueError(f"the graph's metadata has no sliding-window mask for window {meta.window}")
        out.sliding_mask.fill_(True)
        out.sliding_mask[:seqs] = False
        out.sliding_mask[:seqs, :, :, :cols] = meta.sliding_mask
    return out


def capture_graph(run: Callable, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``run`` up on a side stream (allocator, cuBLAS workspaces, tables moved to the
    device, Triton kernels compiled), then capture it into a CUDA graph in memory pool ``pool``.

    Returns:
        the graph and the captured call's outputs (static, in graph memory: each replay
        rewrites them).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


@dataclass(frozen=True)
class GraphKey:
    """What a graph is captured for: ``batch`` sequences (a bucket) of ``queries`` tokens each,
    over ``keys`` key columns (a bucket)."""

    batch: int
    queries: int
    keys: int


class _StaticForward:
    """A target forward over static input buffers (filled by the subclass before each replay),
    ending at the final norm: on a CUDA device captured into a CUDA graph whose outputs are
    static (graph memory, rewritten by every replay); elsewhere run at every replay with its
    results copied into the first run's outputs, so that the CPU exercises the same buffers."""

    graph = None

    def _forward(self) -> TargetOutput:
        raise NotImplementedError

    def _capture(self, target: GraphedTarget, device: torch.device) -> None:
        if device.type == "cuda":  # (the warm-up writes the same K/V to the same slots as the replays will)
            self.graph, self.out = capture_graph(self._forward, target.pool)
        else:
            self.out = self._forward()
        # the RoPE tables the graph reads: should a later, longer eager forward rebuild them, these
        # stay allocated (and correct for every position a bucket holds) instead of being freed
        # under the graph
        self.tables = (target.rope.cos_table, target.rope.sin_table)

    def _replay(self) -> TargetOutput:
        if self.graph is not None:
            self.graph.replay()
            return self.out
        res = self._forward()  # no GPU: the same static buffers, results copied into static outputs
        self.out.hidden.copy_(res.hidden)
        if res.features is not None:
            self.out.features.copy_(res.features)
        return self.out


class _Graph(_StaticForward):
    """One captured decode forward: static inputs (token ids ``[1, batch * q]``, positions, write
    slots, read slots, mask) and static outputs (final-norm hidden states ``[1, batch * q,
    hidden]``, features ``[1, batch * q, F]``)."""

    def __init__(self, target: GraphedTarget, key: GraphKey, meta: AttentionMetadata, ids: torch.Tensor):
        self.forward, self.pools, self.capture = target.forward, target.pools, target.capture
        self.key, self.spare_slot = key, target.spare_slot
        # static inputs: allocated outside the graph pool, refilled before each replay
        self.ids = ids.clone()
        self.meta = pad_decode_meta(meta, key.batch, key.keys, self.spare_slot)
        self._capture(target, ids.device)

    def _forward(self) -> TargetOutput:
        # MoE layers take their static-shape expert path (no host read of the routing: capturable)
        with static_experts():
            return self.forward(self.ids, self.meta, self.pools, self.capture, hidden_only=True)

    def replay(self, ids: torch.Tensor, meta: AttentionMetadata) -> TargetOutput:
        """Write the padded ids and the unpadded ``meta`` into the static buffers (padding them
        there) and replay; returns the static outputs."""
        self.ids.copy_(ids)
        pad_decode_meta(meta, self.key.batch, self.key.keys, self.spare_slot, out=self.meta)
        return self._replay()


class _PromptGraph(_StaticForward):
    """One prompt chunk's forward: ``key.queries`` tokens (a :data:`PROMPT_BUCKETS` size; ``key.batch``
    is 1) over ``key.keys`` key columns, its metadata built inside the graph (:func:`chunk_meta`)
    from one static int64 buffer: ids ``[queries]``, start ``[1]``, length ``[1]``, block table
    ``[keys / tokens_per_block]``. Captured at once on padding only (length 0: every row writes
    and reads the spare slot)."""

    def __init__(self, target: GraphedTarget, key: GraphKey, device: torch.device):
        self.target, self.key = target, key
        self.width = -(-key.keys // target.tpb)
        self.sizes = (key.queries, 1, 1, self.width)
        self.inputs = torch.zeros(sum(self.sizes), dtype=torch.long, device=device)
        self._capture(target, device)

    def _forward(self) -> TargetOutput:
        t, key = self.target, self.key
        ids, start, length, table = self.inputs.split(self.sizes)
        meta = chunk_meta(start, length, table, key.queries, key.keys, t.tpb, t.spare_slot, t.window)
        with static_experts():
            return t.forward(ids.view(1, -1), meta, t.pools, t.capture, hidden_only=True)

    def replay(self, tokens: list[int], start: int, table: list[int]) -> TargetOutput:
        """Write the chunk (``tokens`` at positions ``start ..``, the sequence's block ``table``)
        into the static buffer in one copy and replay; returns the static outputs."""
        q, n = self.key.queries, len(tokens)
        host = torch.zeros(sum(self.sizes), dtype=torch.long)
        host[:n] = torch.tensor(tokens, dtype=torch.long)
        host[q], host[q + 1] = start, n
        tb = table[: self.width]
        host[q + 2 : q + 2 + len(tb)] = torch.tensor(tb, dtype=torch.long)
        to_static(self.inputs, host)
        return self._replay()


class GraphedTarget:
    """The target's forward for decode-only iterations, replayed from graphs per
    :class:`GraphKey` (see the module docstring), and the prompt chunks of other iterations,
    one graph replay per chunk (:meth:`run_prompt`).

    Args:
        forward: the target's forward (:meth:`~dflash_trt.models.target.TargetModel.forward`,
            eager or compiled).
        rope: the target's :class:`~dflash_trt.models.layers.RotaryEmbedding` (its tables are
            read by the graphs).
        lm_head: the target's LM head, run after each replay on the real rows.
        pools: the target's paged KV pools (``PagedKVCache.layers``), written in the graphs.
        capture: target layer ids whose outputs are the drafter's features.
        spare_slot: the pools' padding slot.
        max_batch: the engine's most sequences per iteration (the largest bucket).
        capture_graphs: capture CUDA graphs (a CUDA device); False: the same static path
            without capture (CPU, tests).
        tokens_per_block: the pools' block size (prompt-chunk graphs build their slots).
        window: the target's sliding window (gpt-oss), or None.
    """

    def __init__(
        self,
        forward: Callable,
        rope,
        lm_head: Callable,
        pools,
        capture: tuple[int, ...],
        spare_slot: int,
        max_batch: int,
        capture_graphs: bool,
        tokens_per_block: int,
        window: int | None = None,
    ):
        self.forward, self.rope, self.lm_head, self.pools, self.capture = forward, rope, lm_head, pools, capture
        self.spare_slot, self.max_batch, self.tpb, self.window = spare_slot, max_batch, tokens_per_block, window
        self.graphs: dict[GraphKey, _Graph] = {}
        self.prompts: dict[GraphKey, _PromptGraph] = {}  # prompt-chunk graphs (batch 1)
        self.pool = torch.cuda.graph_pool_handle() if capture_graphs else None
        self.replays = 0  # decode replays served (for tests and logs)
        self.prompt_replays = 0  # prompt-chunk replays served

    def key(self, plan: MetaPlan, all_logits: bool) -> GraphKey | None:
        """The graph for a target forward planned as ``plan`` (causal, every token a query), or
        None when it runs eagerly: not every token has logits (``all_logits``: a prompt chunk
        is in the batch), the sequences' token counts differ (not one uniform attention
        group), or it is beyond the largest batch or key bucket."""
        if not all_logits or len(plan.groups) != 1 or not plan.groups[0].uniform:
            return None
        g = plan.groups[0]
        batch, keys = batch_bucket(len(plan.starts), self.max_batch), key_bucket(g.kv_len)
        if batch is None or keys is None:
            return None
        return GraphKey(batch, g.tq, keys)

    def capture_decode(self, key: GraphKey, device: torch.device) -> None:
        """Make ``key``'s decode graph now (unless made), on padding only (:func:`padding_meta`:
        no sequence's K/V is read or written), so that no serving iteration pays for it."""
        if key not in self.graphs:
            ids = torch.zeros(1, key.batch * key.queries, dtype=torch.long, device=device)
            self.graphs[key] = _Graph(self, key, padding_meta(key.queries, device, self.window), ids)

    def prompt_graph(self, key: GraphKey, device: torch.device) -> _PromptGraph:
        """``key``'s prompt-chunk graph, made now if new (on padding only: :func:`chunk_meta` of
        length 0)."""
        g = self.prompts.get(key)
        if g is None:
            g = self.prompts[key] = _PromptGraph(self, key, device)
        return g

    def prompt_key(self, n: int, start: int) -> GraphKey | None:
        """The graph of a prompt chunk of ``n`` tokens at positions ``start ..``, or None when it
        runs eagerly (longer than the largest :data:`PROMPT_BUCKETS` or the largest key bucket)."""
        q, keys = prompt_bucket(n), key_bucket(start + n)
        return None if q is None or keys is None else GraphKey(1, q, keys)

    def run_prompt(
        self, key: GraphKey, tokens: list[int], start: int, table: list[int], logits: int, device: torch.device
    ) -> TargetOutput:
        """The forward of one prompt chunk (host ``tokens`` at positions ``start ..`` of the
        sequence with block ``table``; its K/V written to the pools) from ``key``'s graph
        (captured now if new).

        Returns:
            logits ``[1, logits, vocab]`` of the chunk's last ``logits`` tokens and features
            ``[1, n, F]`` of its ``n`` tokens, both in memory of their own (the next replay
            reuses the graph's).
        """
        out = self.prompt_graph(key, device).replay(tokens, start, table)
        self.prompt_replays += 1
        n = len(tokens)
        features = None if out.features is None else out.features[:, :n].clone()
        return TargetOutput(logits=self.lm_head(out.hidden[:, n - logits : n]), features=features)

    def run(self, key: GraphKey, ids: torch.Tensor, meta: AttentionMetadata, n: int) -> TargetOutput:
        """The forward of padded ``ids`` (int64 ``[batch * q]`` on the device) under ``meta`` (the
        iteration's own, padded here into the graph's buffers), from ``key``'s graph (captured
        now if new).

        Returns:
            logits ``[1, n, vocab]`` (the LM head on the graph's hidden states) and features
            ``[1, n, F]`` of the ``n`` real tokens, both in memory of their own.
        """
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = _Graph(self, key, meta, ids.unsqueeze(0))
        out = g.replay(ids.unsqueeze(0), meta)
        self.replays += 1
        features = None if out.features is None else out.features[:, :n].clone()
        return TargetOutput(logits=self.lm_head(out.hidden[:, :n]), features=features)
