"""The DFlash proposer: the drafter on the runner's paged pools (paper arXiv:2602.06036 §3).

Every target forward's features (the outputs of the drafter's ``target_layer_ids``) are kept per
sequence until the next drafting step ingests them: the drafter projects them into its context
K/V (KV injection) in the same forward that drafts. One drafter forward per iteration drafts for
every drafting sequence at once: each block is ``[anchor, MASK x (block - 1)]`` at positions
``start ..``, attending non-causally to the sequence's whole context and to itself (z-lab's
sliding rule when the drafter has a window); the target's LM head over the draft vocabulary
(``d2t``) gives greedy drafts.
"""

from __future__ import annotations

import torch

from ...errors import DFlashError
from ...models.batch_invariant import resolve_batch_invariant
from ...models.drafter import DFlashDrafter, PagedBlocks
from ...models.fused_layer import dense_layer_attention, fused_forward_wanted, plan_drafter_layers, run_dense_layer
from ...models.target import TargetModel
from ..attention_meta import plan_packed
from ..compiled import compiled_forward
from ..drafter_graphs import GraphedDrafter
from ..kv_cache import PagedKVCache
from ..uploads import upload, upload_meta, written_slots


def kernels_wanted(device: torch.device) -> bool:
    """Whether drafting runs the drafter kernels on ``device`` (:func:`dflash_trt.kernels.ops.use_triton`)."""
    try:
        from ...kernels.ops import use_triton
    except ImportError:  # pragma: no cover - torch too old for torch.library.custom_op
        return False
    return use_triton(device)


class DFlashProposer:
    """Draft tokens for many sequences in ONE drafter forward.

    Args:
        drafter: the DFlash drafter (replicated under tensor parallelism).
        target: the target (its embedding and LM head are the drafter's).
        num_blocks, tokens_per_block: the paged pool geometry (the target's block tables are
            the drafter's: both hold exactly the same positions).
        spare_slot: the pool slot padded writes go to.
        compile: the drafter forward compiled by torch.compile (``runtime/compiled.py``).
        tp: the TP group, or None: rank 0's drafts are broadcast so every rank verifies the same.

    Memory: a pool of ``2 * L_d * (num_blocks * tokens_per_block + 1) * Hkv_d * D_d`` elements in
    the target's dtype, and each sequence's target features not yet ingested
    (``len(target_layer_ids) * hidden`` per position).
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        target: TargetModel,
        num_blocks: int,
        tokens_per_block: int,
        spare_slot: int,
        compile: bool = False,
        tp=None,
    ):
        w = target.embed.weight
        self.drafter, self.target, self.tp = drafter, target, tp
        self.device, self.tpb, self.spare_slot, self.compile = w.device, tokens_per_block, spare_slot, compile
        dc = drafter.cfg
        self.cache = PagedKVCache(
            dc.num_layers, num_blocks, tokens_per_block, dc.num_kv_heads, dc.head_dim, w.dtype, w.device
        )
        #: target layers whose outputs the drafter reads (HF ``hidden_states[i + 1]``)
        self.capture: tuple[int, ...] = tuple(dc.target_layer_ids)
        # the window of a drafter whose every layer slides: context before it is never ingested nor read
        self.window = dc.context_window
        self.forward = compiled_forward(drafter) if compile else drafter
        # per sequence: (first position, chunks of target features [n_i, F], end position) not yet in
        # the drafter's cache
        self._features: dict[int, tuple[int, list[torch.Tensor], int]] = {}
        # per sequence: the positions [lo, hi) whose drafter K/V its drafting steps wrote (the prefix cache
        # may keep those blocks for later requests)
        self._drafted: dict[int, tuple[int, int]] = {}
        # per sequence: the first position stored after its features were last skipped (iterations
        # planned without them, :attr:`~..model_runner.StepPlan.capture`), until blocks see past it
        self._gaps: dict[int, int] = {}
        # the drafter kernels (dflash_trt.kernels) on CUDA, or when forced by DFLASH_TRT_KERNELS=triton
        # (interpreted on the CPU); else the torch modules
        # (non-causal layers only: a drafter with causal layers drafts through the torch modules)
        self.kernels = kernels_wanted(self.device) and not dc.causal_layers
        #: drafting replayed from CUDA graphs per bucket (:meth:`enable_graphs`), or None
        self.graphs: GraphedDrafter | None = None
        # on the eager CPU path, each drafter layer as one ``dflash_cpu::dense_layer`` call and the
        # KV injection's linears (models/fused_layer.py): planned at the first draft, False where
        # it does not apply
        self._fused: tuple[list[tuple], tuple] | bool | None = None

    def enable_graphs(self, max_batch: int, capture_graphs: bool) -> bool:
        """Draft from CUDA graphs (:mod:`~..drafter_graphs`) for up to ``max_batch`` sequences;
        ``capture_graphs`` False runs the same static path uncaptured (CPU, tests). Returns
        whether graphs are used: not for a drafter with causal layers (it drafts through the
        torch modules) nor under tensor parallelism."""
        if self.drafter.cfg.causal_layers or self.tp is not None:
            return False
        t = self.target
        self.graphs = GraphedDrafter(
            self.drafter,
            t.embed,
            t.lm_head,
            self.cache.k,
            self.cache.v,
            self.tpb,
            self.spare_slot,
            max_batch,
            capture_graphs,
        )
        return True

    # ---- target features waiting for the drafter (public so a test can seed a context) ----
    def store_features(self, seq_id: int, start: int, feats: torch.Tensor) -> None:
        """Keep features ``feats`` ``[n, F]`` of positions ``start ..`` (:meth:`store_rows` of all its rows)."""
        self.store_rows(seq_id, start, feats, 0, feats.shape[0])

    def store_rows(self, seq_id: int, start: int, base: torch.Tensor, row: int, n: int) -> None:
        """Keep features of positions ``start .. start + n``: rows ``[row, row + n)`` of ``base``
        ``[N, F]`` (a target forward's features for every sequence of the iteration: a
        reference to them is kept, sliced only when the drafter takes them, so a plain
        iteration stores a sequence's rows without a tensor op: 16 bf16 sequences on a 2-core
        CPU, 0.13-0.27 ms an iteration as views). Drops stale ones at or past ``start``
        (rejected draft positions of the previous verify). Appends to a list of chunks
        ``[base, row, n]`` (joined once when the drafter takes them); stale rows are cut from
        the tail, so long stretches of plain decoding cost O(1) per step (walking every chunk
        from the head made each step O(steps since the last draft): 2.7 ms per iteration at 64
        sequences after ~60 plain steps). With a sliding-window drafter, whole chunks that no
        later block can see (every position before ``start + 1 - window + 1``: the next anchor
        is at ``start + 1`` or later) are dropped, so a sequence keeps O(window) rows however
        long it decodes without drafting.

        Positions skipped since the last store (``start`` past the stored end: iterations that
        captured no features) leave a gap: what was stored before it is dropped, and the
        sequence's blocks are not :meth:`ready` until their window lies past it."""
        old = self._features.get(seq_id)
        if old is None:
            self._features[seq_id] = (start, [[base, row, n]], start + n)
            return
        first, chunks, end = old
        if start > end:  # a gap: the features of positions [end, start) were never captured
            self._gaps[seq_id] = start
            self._features[seq_id] = (start, [[base, row, n]], start + n)
            return
        while chunks and end - chunks[-1][2] >= start:  # whole chunks at or past ``start``
            end -= chunks.pop()[2]
        if chunks and end > start:
            chunks[-1][2] -= end - start
        if not chunks:
            first = start
        chunks.append([base, row, n])
        if self.window is not None:
            while len(chunks) > 1 and first + chunks[0][2] < start + 2 - self.window:
                first += chunks.pop(0)[2]
        self._features[seq_id] = (first, chunks, start + n)

    def ready(self, seq_id: int, start: int) -> bool:
        """Whether a block anchored at ``start`` has its whole context: every position it sees
        had its features captured (always, but after iterations that skipped them: those of a
        sliding-window drafter's blocks whose window starts past the gap they left)."""
        stored = self._features.get(seq_id)
        if stored is None:
            return True
        if stored[2] < start:  # the last positions before the anchor were not captured
            return False
        gap = self._gaps.get(seq_id)
        if gap is None:
            return True
        if self.window is None or gap > start - self.window + 1:
            return False
        del self._gaps[seq_id]  # (later blocks see even further past it)
        return True

    def _take_features(self, seq_id: int, upto: int) -> tuple[int, torch.Tensor]:
        """Features of positions ``[lo, upto)`` (removed from the store) and ``lo``: ``lo`` is the
        first stored position, or with a sliding-window drafter of window ``W`` the first one a
        block anchored at ``upto`` can see (``upto - W + 1``, z-lab's rule, :func:`sliding_visible`;
        positions before it are never visible again, so they are not ingested at all)."""
        first, chunks, end = self._features[seq_id]
        parts = [b[r : r + n] for b, r, n in chunks]
        f = parts[0] if len(parts) == 1 else torch.cat(parts)
        n = upto - first
        self._features[seq_id] = (upto, [[f, n, max(len(f) - n, 0)]], end)
        lo = self._ingested_from(first, upto)
        self._drafted[seq_id] = self._drafted_with(seq_id, lo, upto)
        return lo, f[lo - first : n]

    def _ingested_from(self, first: int, upto: int) -> int:
        """The first of stored positions ``[first, upto)`` that a block anchored at ``upto`` can
        see: ``first``, or with a sliding window ``W`` at least ``upto - W + 1``."""
        return first if self.window is None else max(first, upto - self.window + 1)

    def _drafted_with(self, seq_id: int, lo: int, upto: int) -> tuple[int, int]:
        """:meth:`drafted` once positions ``[lo, upto)`` are written: extended when they follow the
        range already written, else that range alone."""
        old = self._drafted.get(seq_id)
        return (old[0] if old and old[1] == lo else lo, upto)

    def drafted(self, seq_id: int) -> tuple[int, int] | None:
        """Positions ``[lo, hi)`` of ``seq_id`` whose drafter K/V are in the pool (None: none yet)."""
        return self._drafted.get(seq_id)

    def pending(self, seq_id: int, upto: int) -> tuple[int, int] | None:
        """Positions ``[lo, upto)`` of ``seq_id`` whose target features wait for the drafter and
        that :meth:`ingest` would write (a sliding-window drafter's ``lo`` as in
        :meth:`_take_features`), or None when there are none."""
        stored = self._features.get(seq_id)
        if stored is None or stored[0] >= upto:
            return None
        lo = self._ingested_from(stored[0], upto)
        return (lo, upto) if lo < upto else None

    def drafted_after_ingest(self, seq_id: int, upto: int) -> tuple[int, int] | None:
        """:meth:`drafted` as it will be once :meth:`ingest` has written ``seq_id``'s features up
        to ``upto``."""
        new = self.pending(seq_id, upto)
        return self.drafted(seq_id) if new is None else self._drafted_with(seq_id, new[0], upto)

    def ingest(self, entries: list[tuple[int, list[int], int]]) -> None:
        """Write the waiting target features of ended sequences into the drafter's pool (KV
        injection without drafting), so that the prefix cache can hand their blocks to later
        prompts with the drafter's context in place: a sequence that never drafted (the
        adaptive controller chose plain decoding) would otherwise leave blocks whose drafter K/V
        were never written, and a later request with the same prompt would prefill it again.

        Args:
            entries: ``(seq_id, block table, upto)``: positions before ``upto`` are written (the
                rest of the stored features are rejected draft positions of the last verify).
        """
        firsts, feats, tables = [], [], []
        for seq_id, table, upto in entries:
            if self.pending(seq_id, upto) is None:
                continue
            first, f = self._take_features(seq_id, upto)
            firsts.append(first)
            feats.append(f)
            tables.append(table)
        if not feats:
            return
        pos, slots = written_slots(tables, firsts, [len(f) for f in feats], self.tpb)
        pos, slots = upload(self.device, pos, slots)
        self.drafter.write_context_kv(torch.cat(feats), pos, slots, self.cache.k, self.cache.v)

    def release(self, seq_ids: list[int]) -> None:
        """Drop these sequences' features (they ended, or are recomputed)."""
        for s in seq_ids:
            self._features.pop(s, None)
            self._drafted.pop(s, None)
            self._gaps.pop(s, None)

    def release_all(self) -> None:
        """Drop every sequence's stored features."""
        self._features.clear()
        self._drafted.clear()
        self._gaps.clear()

    # ---- drafting ----
    def propose(self, items: list, block: int) -> torch.Tensor:
        """ONE drafter forward for all ``items`` (:class:`~..model_runner.StepItem` s): each gets
        ``item.num_draft`` greedy draft tokens.

        Each item's block is ``[anchor, MASK x (block - 1)]`` at positions ``start ..``; it
        ingests the target features of positions not yet in the drafter's context cache
        (``[first, start)``) and sees all committed context plus its whole block.

        Returns:
            int64 ``[len(items), block - 1]`` on the device: row ``i`` starts with item ``i``'s
            ``num_draft`` tokens (the rest of the row is not verified). No host copy.
        """
        d = self.drafter
        ctx = [self._take_features(it.seq_id, it.start) for it in items]
        tables = [it.table for it in items]
        starts = [it.start for it in items]
        # packed order: every item's context tokens, then every item's block tokens
        ctx_pos, ctx_slots = written_slots(tables, [first for first, _ in ctx], [len(f) for _, f in ctx], self.tpb)
        feats = torch.cat([f for _, f in ctx])  # [N_ctx, F]; N_ctx may be 0
        if self.compile and not self.kernels and len(feats) < 2:
            # torch.compile specialises sizes 0 and 1: a context of 1 row (one token accepted)
            # would compile a graph of its own mid-run; pad to 2 rows written to the spare slot
            pad = 2 - len(feats)
            feats = torch.cat([feats, feats.new_zeros(pad, feats.shape[1])])
            ctx_pos = torch.cat([ctx_pos, torch.zeros(pad, dtype=torch.long)])
            ctx_slots = torch.cat([ctx_slots, torch.full((pad,), self.spare_slot, dtype=torch.long)])
        ids = torch.full((len(items), block), d.cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([it.tokens[0] for it in items])
        key = self.graphs.key(starts, block) if self.graphs is not None else None
        if key is not None:  # two graph replays: KV injection, then the drafting forward and its drafts
            if len(feats):
                self.graphs.write_context(feats, ctx_pos, ctx_slots)
            return self.graphs.draft(key, ids, starts, tables)
        if self.kernels:
            hidden = self._forward_kernels(ids, feats, ctx_pos, ctx_slots, tables, starts, block)
        elif self.fused_layers():
            hidden = self._forward_fused(ids, feats, ctx_pos, ctx_slots, tables, starts, block)
        else:
            # one metadata per kind of layer (window, causality): most drafters have one kind
            metas = {}
            for causal, window in d.cfg.layer_kinds:
                if (causal, window) not in metas:
                    plan = plan_packed(
                        starts,
                        [block] * len(items),
                        [i * block for i in range(len(items))],
                        block,
                        tables,
                        self.tpb,
                        self.spare_slot,
                        window,
                        causal=causal,
                        pre=(ctx_pos, ctx_slots),  # the context rows are written before the blocks
                    )
                    metas[causal, window], up_ids = upload_meta(self.device, plan, ids)
            ids = up_ids
            meta = [metas[kind] for kind in d.cfg.layer_kinds] if len(metas) > 1 else next(iter(metas.values()))
            embeds = self.target.embed(ids.view(-1))  # [S * B, hidden]
            hidden = self.forward(embeds.unsqueeze(0), feats.unsqueeze(0), meta, self.cache.layers)
        drafts = d.propose(hidden.view(len(items), block, -1)[:, 1:], self.target.lm_head, self.tp is not None)
        if self.tp is not None:
            drafts = self.tp.broadcast(drafts)
        return drafts

    def fused_layers(self) -> tuple[list[tuple], tuple] | None:
        """The drafter's layers as ``dflash_cpu::dense_layer`` arguments and its KV injection's
        linears (:func:`~dflash_trt.models.fused_layer.plan_drafter_layers`), planned once, or None
        where drafting runs the torch modules: off the CPU, compiled, under tensor parallelism,
        without the CPU kernels, a drafter with causal layers or layers of different windows."""
        if self._fused is None:
            d, dtype = self.drafter, self.target.embed.weight.dtype
            plan = None
            if (
                self.device.type == "cpu"
                and not self.compile
                and self.tp is None
                and len(set(d.cfg.layer_kinds)) == 1
                and not d.cfg.causal_layers
                and resolve_batch_invariant(None, self.device, dtype)
            ):
                plan = plan_drafter_layers(d, dtype)
            self._fused = plan or False
        return self._fused or None

    def _forward_fused(self, ids, feats, ctx_pos, ctx_slots, tables, starts, block) -> torch.Tensor:
        """The drafter forward with each layer in one ``dflash_cpu::dense_layer`` call: every
        layer's context K/V first (one stacked GEMM), then the blocks, whose attention reads
        the context from the pools; hidden states ``[1, S * block, hidden]``."""
        d = self.drafter
        layers, context = self._fused
        if len(feats):
            d.write_context_kv(feats, ctx_pos, ctx_slots, self.cache.k, self.cache.v, context)
        n = len(starts)
        window = d.cfg.layer_kinds[0][1]
        plan = plan_packed(
            starts,
            [block] * n,
            [i * block for i in range(n)],
            block,
            tables,
            self.tpb,
            self.spare_slot,
            window,
            causal=False,
        )
        meta, ids = upload_meta(self.device, plan, ids)
        x = self.target.embed(ids.view(-1)).unsqueeze(0)  # [1, S * B, hidden]
        if not fused_forward_wanted(x, meta, self.cache.layers):
            raise DFlashError("the drafter's fused layers need one uniform attention group")  # (never: S blocks of B)
        cos, sin = d.rope(meta.positions, x.dtype, meta.max_position)
        attention = dense_layer_attention(meta)  # (the plan put the window into meta.mask)
        for args, kv in zip(layers, self.cache.layers):
            x = run_dense_layer(args, x, cos, sin, kv, attention)
        return d.norm(x)

    def _forward_kernels(self, ids, feats, ctx_pos, ctx_slots, tables, starts, block) -> torch.Tensor:
        """The drafter forward through the drafter kernels over the paged pools
        (``dflash_trt.kernels``): hidden states ``[S * block, hidden]``."""
        bpos, bslots = written_slots(tables, starts, [block] * len(tables), self.tpb)
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = [s + block for s in starts]
        ids, bslots, bt, lens_t, ctx_pos, ctx_slots, bpos = upload(
            self.device, ids, bslots, bt, torch.tensor(lens, dtype=torch.int32), ctx_pos, ctx_slots, bpos
        )
        return self.drafter.forward_paged(
            self.target.embed(ids.view(-1)),  # [S * B, hidden]
            feats,
            ctx_pos,
            ctx_slots,
            bpos,
            max(lens) - 1,
            PagedBlocks(bslots, bt, lens_t, block, self.tpb),
            self.cache.k,
            self.cache.v,
        )
