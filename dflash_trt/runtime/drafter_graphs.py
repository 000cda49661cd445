"""CUDA graphs for the drafter's forward: KV injection and the drafting forward, per bucket.

Under CUDA graphs the target's decode step replays in a few milliseconds, and an eager drafter
forward (two layers, each a few dozen short kernels launched from Python, then the LM head
over the draft vocabulary) cost as much as a whole replayed decode step: on one H200 with the
default target (docs/gpu-runs.md) 0.99x a decode step, which put batch-1 DFlash at 0.81x plain
decoding. vLLM and SGLang capture their EAGLE / DFlash drafters the same way.

A drafting iteration runs two graphs, each replayed as one launch:

- **context**: the target features of the positions not yet in the drafter's pools (``N``
  rows, any sequences) projected into every drafter layer's K/V and written at their slots
  (:meth:`~dflash_trt.models.drafter.DFlashDrafter.write_context_kv`), padded to a row bucket
  ``N_b`` (:data:`CONTEXT_BUCKETS`): padded rows have zero features and write to the pools'
  spare slot. More rows than the largest bucket (the first draft after a long prompt) are
  written eagerly.
- **draft**: ``S`` blocks ``[anchor, MASK x (B - 1)]`` through every drafter layer over the
  paged pools (:meth:`~dflash_trt.models.drafter.DFlashDrafter.forward_paged`: the drafter
  kernels on CUDA) and the greedy drafts over the draft vocabulary, for ``S`` padded to a batch
  bucket ``S_b`` (:func:`~.cuda_graphs.batch_bucket`) and the longest sequence's keys to a key
  bucket ``L_b`` (:func:`~.cuda_graphs.key_bucket`; block tables ``L_b / tokens_per_block``
  wide, RoPE tables sized for ``L_b`` once). Padded sequences write their block to the spare
  slot and attend over their own ``B`` keys only; their drafts are dropped.

Like the target's, these graphs are captured when the engine starts (:meth:`GraphedDrafter.capture_contexts`,
:meth:`GraphedDrafter.capture_draft` for the target's batch and key buckets), others on first use.

The inputs of a replay travel in ONE host-to-device copy into the graph's static int64 buffer
(ids, positions, slots, block tables, key lengths side by side); the drafts are copied out of
graph memory at once (the target's graphs replay next and may reuse it).

Without a GPU the same path runs with ``capture=False``: the same buckets, padding and static
buffers, each "replay" running the forward on those buffers (the drafter kernels' torch
references on the CPU), so all but the capture is tested on the CPU against eager drafting.

Limits: drafters with causal layers draft through the torch modules, eagerly (the kernels
attend non-causally); no graphs under tensor parallelism.
"""

from __future__ import annotations

import torch

from ..models.drafter import DFlashDrafter, PagedBlocks
from .cuda_graphs import GraphKey, batch_bucket, capture_graph, key_bucket, to_static

#: context rows captured (one graph each); more rows are written eagerly
CONTEXT_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024)


def context_bucket(n: int) -> int | None:
    """The smallest of :data:`CONTEXT_BUCKETS` ``>= n``, or None above the largest."""
    return next((b for b in CONTEXT_BUCKETS if b >= n), None)


class _ContextGraph:
    """KV injection of ``rows`` context rows: static features ``[rows, F]`` (the drafter's
    dtype) and positions / slots int64 ``[2, rows]``."""

    def __init__(self, owner: GraphedDrafter, rows: int):
        self.owner, self.rows = owner, rows
        self.feats = torch.zeros(rows, owner.features, dtype=owner.dtype, device=owner.device)
        self.where = torch.zeros(2, rows, dtype=torch.long, device=owner.device)
        self.graph = None  # captured at the first replay, once the buffers hold real inputs

    def _run(self) -> None:
        o = self.owner
        o.drafter.write_context_kv(self.feats, self.where[0], self.where[1], o.k_pools, o.v_pools)

    def replay(self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        n = len(feats)
        self.feats[:n].copy_(feats)  # (rows past n hold zeros or stale features: written to the spare slot)
        host = torch.full((2, self.rows), self.owner.spare_slot, dtype=torch.long)
        host[0] = 0
        host[0, :n], host[1, :n] = positions, slots
        to_static(self.where, host)
        if not self.owner.capture_graphs:
            self._run()
            return
        if self.graph is None:
            self.graph, _ = capture_graph(self._run, self.owner.pool)  # (called with the real inputs in place)
        self.graph.replay()


class _DraftGraph:
    """The drafting forward of ``key.batch`` blocks of ``key.queries`` (the block size) tokens:
    one static int64 input buffer holding ids,
    positions and slots ``[batch * block]`` each, block tables ``[batch, keys / tokens_per_block]``
    and key lengths ``[batch]``; static drafts int64 ``[batch, block - 1]``."""

    def __init__(self, owner: GraphedDrafter, key: GraphKey):
        self.owner, self.key = owner, key
        self.width = -(-key.keys // owner.tpb)  # block-table entries per sequence
        m = key.batch * key.queries
        self.sizes = (m, m, m, key.batch * self.width, key.batch)
        self.inputs = torch.zeros(sum(self.sizes), dtype=torch.long, device=owner.device)
        self.graph, self.out, self.tables = None, None, None  # captured at the first replay (real inputs)

    def _run(self) -> torch.Tensor:
        o, key = self.owner, self.key
        ids, pos, slots, tables, lens = self.inputs.split(self.sizes)
        hidden = o.drafter.forward_paged(
            o.embed(ids),  # [batch * block, hidden]
            o.no_context,
            o.no_slots,
            o.no_slots,
            pos,
            key.keys - 1,
            PagedBlocks(slots, tables.view(key.batch, self.width).int(), lens.int(), key.queries, o.tpb),
            o.k_pools,
            o.v_pools,
        )
        return o.drafter.propose(hidden.view(key.batch, key.queries, -1)[:, 1:], o.lm_head)

    def replay(self, ids: torch.Tensor, starts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Drafts int64 ``[S, block - 1]`` (memory of their own) for ``S`` blocks with token ids
        ``ids`` (int64 ``[S, block]``, host) at positions ``starts[i] ..`` of sequences with block
        tables ``tables``."""
        o, key = self.owner, self.key
        S, B, W = len(starts), key.queries, self.width
        host = torch.zeros(sum(self.sizes), dtype=torch.long)
        h_ids, h_pos, h_slots, h_tables, h_lens = host.split(self.sizes)
        h_ids.view(key.batch, B)[:S] = ids
        h_ids.view(key.batch, B)[S:] = o.drafter.cfg.mask_token_id
        offs = torch.arange(B)
        pos = torch.tensor(starts, dtype=torch.long).view(S, 1) + offs  # [S, B]
        h_pos.view(key.batch, B)[:S] = pos
        h_pos.view(key.batch, B)[S:] = offs
        t = torch.tensor([tb[:W] + [0] * (W - min(len(tb), W)) for tb in tables], dtype=torch.long).view(S, W)
        h_tables.view(key.batch, W)[:S] = t
        h_slots.view(key.batch, B)[:S] = t.gather(1, pos // o.tpb) * o.tpb + pos % o.tpb
        h_slots.view(key.batch, B)[S:] = o.spare_slot
        h_lens[:S] = pos[:, -1] + 1
        h_lens[S:] = B  # a padded block attends over its own keys (block 0 of the tables' zeros)
        to_static(self.inputs, host)
        if not o.capture_graphs:
            return self._run()[:S].clone()
        if self.graph is None:
            self.graph, self.out = capture_graph(self._run, o.pool)  # (with the real inputs in place)
            # the RoPE tables the graph reads stay allocated should a later eager forward rebuild them
            self.tables = (o.drafter.rope.cos_table, o.drafter.rope.sin_table)
        self.graph.replay()
        return self.out[:S].clone()


class GraphedDrafter:
    """The drafter's forward for drafting iterations, replayed from graphs (see the module
    docstring): :meth:`write_context` then :meth:`draft`.

    Args:
        drafter: the DFlash drafter (non-causal layers: the drafter kernels' path).
        embed: the target's embedding; lm_head: the target's LM head (the drafter's).
        k_pools, v_pools: the drafter's paged pools ``[L, P, Hkv, D]`` (written in the graphs).
        tokens_per_block: the pools' block size; spare_slot: their padding slot.
        max_batch: the engine's most sequences per iteration (the largest bucket).
        capture_graphs: capture CUDA graphs (a CUDA device); False: the same static path
            without capture (CPU, tests).
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        embed,
        lm_head,
        k_pools: torch.Tensor,
        v_pools: torch.Tensor,
        tokens_per_block: int,
        spare_slot: int,
        max_batch: int,
        capture_graphs: bool,
    ):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        self.k_pools, self.v_pools, self.tpb, self.spare_slot = k_pools, v_pools, tokens_per_block, spare_slot
        self.max_batch, self.capture_graphs = max_batch, capture_graphs
        self.device, self.dtype = k_pools.device, embed.weight.dtype
        self.features = len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size  # F: a context row's width
        self.pool = torch.cuda.graph_pool_handle() if capture_graphs else None
        self.no_context = torch.zeros(0, self.features, dtype=self.dtype, device=self.device)
        self.no_slots = torch.zeros(0, dtype=torch.long, device=self.device)
        # RoPE's tables and inv_freq moved to the device now: KV injection reads inv_freq, and a
        # host-to-device copy cannot be captured
        drafter.rope(self.no_slots.view(1, 0), self.dtype, 0)
        self.contexts: dict[int, _ContextGraph] = {}
        self.drafts: dict[GraphKey, _DraftGraph] = {}
        self.replays = 0  # drafting forwards served from graphs (for tests and logs)

    def key(self, starts: list[int], block: int) -> GraphKey | None:
        """The graph (:class:`~.cuda_graphs.GraphKey`, ``queries`` = ``block``) for blocks of
        ``block`` tokens at positions ``starts[i] ..``, or None when the drafting runs eagerly
        (more sequences or keys than the largest bucket)."""
        batch = batch_bucket(len(starts), self.max_batch)
        keys = key_bucket(max(starts) + block)
        return None if batch is None or keys is None else GraphKey(batch, block, keys)

    def capture_contexts(self) -> None:
        """Make every context-row bucket's graph now (unless made), replayed once on padding only
        (every row goes to the spare slot), so that no serving iteration pays for it."""
        for rows in CONTEXT_BUCKETS:
            if rows not in self.contexts:
                self.contexts[rows] = _ContextGraph(self, rows)
                self.contexts[rows].replay(self.no_context, self.no_slots.cpu(), self.no_slots.cpu())

    def capture_draft(self, key: GraphKey) -> None:
        """Make ``key``'s drafting graph now (unless made), replayed once on padding only (every
        block written to the spare slot)."""
        if key not in self.drafts:
            self.drafts[key] = _DraftGraph(self, key)
            self.drafts[key].replay(torch.zeros(0, key.queries, dtype=torch.long), [], [])

    def write_context(self, feats: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """KV injection of ``feats`` ``[N, F]`` (device) at host ``positions`` / ``slots`` (int64
        ``[N]``), from the graph of ``N``'s bucket (captured now if new), eagerly above the
        largest bucket."""
        rows = context_bucket(len(feats))
        if rows is None:
            pos, sl = positions.to(self.device), slots.to(self.device)
            self.drafter.write_context_kv(feats, pos, sl, self.k_pools, self.v_pools)
            return
        g = self.contexts.get(rows)
        if g is None:
            g = self.contexts[rows] = _ContextGraph(self, rows)
        g.replay(feats, positions, slots)

    def draft(self, key: GraphKey, ids: torch.Tensor, starts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Greedy drafts int64 ``[S, block - 1]`` on the device for the blocks ``ids`` (int64
        ``[S, block]`` on the host) at ``starts`` with block ``tables``, from ``key``'s graph
        (captured now if new). Their context must be in the pools (:meth:`write_context`)."""
        g = self.drafts.get(key)
        if g is None:
            g = self.drafts[key] = _DraftGraph(self, key)
        self.replays += 1
        return g.replay(ids, starts, tables)
