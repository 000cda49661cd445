"""One engine iteration on the models: batched drafting, then ONE packed target forward that
verifies every decode request's block and runs every prefill chunk (ragged, no padding).

The runner is the part every TP rank executes identically: it receives a :class:`StepPlan`
(plain data: token ids, positions, block tables) built by rank 0's scheduler, owns the paged
KV pools of its shard, and keeps each sequence's target features until the drafter ingests
them. It never decides anything: what to draft, the uniforms a sampled request draws and what
to commit are rank 0's (``engine.py``); the runner computes from them, on the device, the
target's token after every logits row (argmax or sample) and each block's accepted prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ..errors import DFlashError
from ..kernels import ops
from ..models.batch_invariant import resolve_batch_invariant, set_batch_invariant
from ..models.cpu_linear import pack_linears, unpack_linears
from ..models.drafter import DFlashDrafter, PagedBlocks
from ..models.layers import argmax_last
from ..models.target import TargetModel
from .attention_meta import MetaPlan, plan_packed
from .block_manager import slots_of
from .compiled import compiled_forward
from .cpu_memory import retain_freed_memory
from .cuda_graphs import GraphedTarget
from .kv_cache import PagedKVCache
from .sampling import sample_rows


@dataclass
class StepItem:
    """One sequence's work in an iteration.

    Attributes:
        seq_id: the sequence.
        tokens: prefill: the prompt chunk; decode: ``[last committed token]`` (the anchor).
        start: absolute position of ``tokens[0]`` (= tokens already in the target KV cache).
        table: the sequence's block table (covers every position this step writes).
        num_draft: decode only: draft tokens to propose and verify after the anchor (0 = plain
            decoding step).
        num_logits: logits wanted for the last ``num_logits`` target positions of this item
            (prefill: 1 on the chunk that ends the prompt, else 0; decode: ``1 + num_draft``).
        lookup: decode only: prompt-lookup tokens (``ngram.py``) that replace the drafter's
            first ``len(lookup) <= num_draft`` draft tokens; empty: the drafter's alone.
        sampling: ``(temperature, top_k, top_p)`` when the target's tokens after this item's
            logits rows are sampled on the device (:func:`~.sampling.sample_rows`); None: argmax.
        uniforms: with ``sampling``: one uniform in [0, 1) per logits row, drawn from the
            request's own generator when the step was planned.
    """

    seq_id: int
    tokens: list[int]
    start: int
    table: list[int]
    num_draft: int = 0
    num_logits: int = 0
    lookup: list[int] = field(default_factory=list)
    sampling: tuple[float, int, float] | None = None
    uniforms: list[float] = field(default_factory=list)


@dataclass
class StepPlan:
    """Everything an iteration needs; rank 0 broadcasts it to the other TP ranks.

    Attributes:
        items: prefill and decode items, in packing order.
        draft_block: drafter block size used for drafting (positions ``start .. start +
            draft_block - 1`` are written in the drafter's cache); 0 when nothing is drafted.
        release: sequences that ended since the last plan (their features are dropped).
    """

    items: list[StepItem]
    draft_block: int = 0
    release: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    """What an iteration produced, per item (same order as ``StepPlan.items``).

    Attributes:
        drafts: proposed draft tokens (empty for items without drafts).
        logits: ``[num_logits, vocab]`` target logits (model dtype), or None.
        choice: per item, the target's token after each of its logits rows: the argmax, or
            for an item with ``sampling`` a sample (computed for the whole batch on the device,
            one host copy).
        accepted: per item, its drafts accepted against ``choice`` (the longest matching
            prefix, on the device: ``dflash::accept``); None for items without drafts.
        draft_s, target_s: wall seconds of the drafter and target forwards (CUDA: event
            timings, read after the iteration's one synchronisation).
        target_tokens: tokens in the target forward.
        drafter_ran: the drafter's forward ran (False when nothing was drafted, or when
            prompt-lookup tokens filled every draft position).
    """

    drafts: list[list[int]]
    logits: list[torch.Tensor | None]
    choice: list[list[int]] = field(default_factory=list)
    accepted: list[int | None] = field(default_factory=list)
    draft_s: float = 0.0
    target_s: float = 0.0
    target_tokens: int = 0
    drafter_ran: bool = False


def _written(
    tables: list[list[int]], starts: list[int], lengths: list[int], tpb: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and pool slots of ``lengths[i]`` tokens from ``starts[i]`` of each sequence,
    concatenated in sequence order (int64 ``[N]`` each; empty when nothing is written)."""
    pos = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
    empty = [torch.zeros(0, dtype=torch.long)]
    return torch.cat(pos + empty), torch.cat([slots_of(t, p, tpb) for t, p in zip(tables, pos)] + empty)


def upload(device: torch.device, *host: torch.Tensor, pack: bool | None = None) -> list[torch.Tensor]:
    """Host tensors on ``device`` with ONE host-to-device copy, never a synchronisation.

    A plain ``.to("cuda")`` of a pageable CPU tensor waits for the device (PyTorch copies and
    then synchronises the stream), so an iteration that moved its metadata tensor by tensor
    waited on the GPU ~20 times. Here every tensor is flattened into one int64 buffer (bool and
    int32 values are exact in int64; fp32 travels as its int32 bit pattern), pinned, copied
    ``non_blocking``, and split back into views of the original shapes and dtypes on the device
    (the dtype casts are device kernels).

    Args:
        device: the target device; on the CPU the tensors are returned as they are unless
            ``pack`` is True (which runs the packing on the CPU, for tests).
        host: CPU tensors of integer, bool or fp32 dtype, any shapes.

    Returns:
        The tensors in the same order, shapes and dtypes, on ``device``.
    """
    if not host or not _packs(device, pack):
        return list(host)
    flat = torch.cat([_bits(t).reshape(-1).to(torch.long) for t in host])
    if device.type == "cuda":
        flat = flat.pin_memory()  # the caching host allocator keeps it until the copy is done
    flat = flat.to(device, non_blocking=True)
    out, at = [], 0
    for t in host:
        x = flat[at : at + t.numel()].view(t.shape)
        out.append(x.to(torch.int32).view(torch.float32) if t.dtype == torch.float32 else x.to(t.dtype))
        at += t.numel()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as exact integers: fp32 as its int32 bit pattern, integer and bool as they are."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"upload carries integer, bool and fp32 tensors, got {t.dtype}")
    return t


def _packs(device: torch.device, pack: bool | None) -> bool:
    """Whether :func:`upload` packs and copies (off the CPU, or when a test forces it)."""
    return device.type != "cpu" if pack is None else pack


def upload_meta(device: torch.device, plan: MetaPlan, *host: torch.Tensor, pack: bool | None = None) -> tuple:
    """:func:`upload` of the tensors of ``plan`` (:mod:`~.attention_meta`: a few integers per
    sequence and the block tables) together with ``host``, one copy for the whole iteration's
    inputs; the attention metadata is then built from the plan on ``device``.

    Returns:
        ``(AttentionMetadata on device, *host on device)``; on the CPU (nothing to copy) the
        metadata built on the host and ``host`` as they are.
    """
    if not _packs(device, pack):
        return (plan.build(), *host)
    ts = plan.tensors()
    flat = upload(device, *ts, *host, pack=pack)
    return (plan.with_tensors(flat[: len(ts)]).build(), *flat[len(ts) :])


def _kernels_wanted(device: torch.device) -> bool:
    """Whether drafting runs the drafter kernels on ``device`` (:func:`dflash_trt.kernels.ops.use_triton`)."""
    try:
        from ..kernels.ops import use_triton
    except ImportError:  # pragma: no cover - torch too old for torch.library.custom_op
        return False
    return use_triton(device)


def cpu_weight_layout(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    tensor_parallel: bool,
    compile: bool,
    batch_invariant: bool = False,
) -> None:
    """Put the CPU linears of ``target`` and ``drafter`` in the layout this runner's forward
    wants, in place. With ``batch_invariant`` the target's dense linears become batch-invariant
    ones and its attention the per-query kernel (:func:`~dflash_trt.models.batch_invariant.set_batch_invariant`);
    without it they leave that mode, and bf16 CPU linears are oneDNN-prepacked for the eager
    path (:func:`~dflash_trt.models.cpu_linear.pack_linears`), plain ``nn.Linear`` for the
    compiled one (inductor lowers only weights it froze itself: a prepacked one fails there).
    Kept as ``nn.Linear`` on the eager path: the drafter's k/v projections (stacked into one
    context-K/V GEMM in :meth:`DFlashDrafter.forward`) and, under tensor parallelism, the
    target's LM head (it carries the vocab-parallel all-gather hook)."""
    set_batch_invariant(target, batch_invariant)
    for model, skip in ((target, ("lm_head",) if tensor_parallel else ()), (drafter, ("k_proj", "v_proj"))):
        if model is None or (model is target and batch_invariant):
            continue
        if compile:
            unpack_linears(model)
        else:
            pack_linears(model, skip=skip)


class ModelRunner:
    """Runs :class:`StepPlan` s on a target (and drafter) over paged KV pools.

    Args:
        target: the target model (this rank's shard under TP).
        drafter: the DFlash drafter (replicated under TP), or None.
        num_blocks, tokens_per_block: KV pool geometry (same for target and drafter pools).
        tp: tensor-parallel group helper (``distributed.TPGroup``) or None; rank 0's drafts are
            broadcast so every rank verifies the same tokens.
        compile: run the target's and the drafter's forwards through
            :func:`~.compiled.compiled_forward`.
        cuda_graphs: replay decode-only iterations' target forwards from CUDA graphs per
            batch-size bucket (:mod:`~.cuda_graphs`); on the CPU the same padded static-buffer
            path runs without capture (what the tests check without a GPU).
        max_batch: the most sequences per iteration (the largest graph bucket).
        batch_invariant: run the target in the batch-invariant mode
            (:mod:`~dflash_trt.models.batch_invariant`): each row's logits the same bits
            whatever else is in the forward, so DFlash equals plain decoding token for token in
            bf16 too; None: :func:`~dflash_trt.models.batch_invariant.resolve_batch_invariant`
            (on for bf16 CPU targets).

    Raises:
        DFlashError: ``cuda_graphs`` under tensor parallelism; ``batch_invariant`` off the CPU
            or with ``cuda_graphs``.

    Memory: target pool ``2 * L * (num_blocks * tokens_per_block + 1) * Hkv * D`` elements,
    drafter pool likewise with the drafter's layer and head counts.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None,
        num_blocks: int,
        tokens_per_block: int,
        tp=None,
        compile: bool = False,
        cuda_graphs: bool = False,
        max_batch: int = 64,
        batch_invariant: bool | None = None,
    ):
        if cuda_graphs and tp is not None:
            raise DFlashError("CUDA graphs are not supported under tensor parallelism yet")
        w = target.embed.weight
        if cuda_graphs and batch_invariant is None:
            batch_invariant = False  # graphs are a CUDA path (the CPU runs it uncaptured, for tests)
        batch_invariant = resolve_batch_invariant(batch_invariant, w.device, w.dtype)
        if cuda_graphs and batch_invariant:
            raise DFlashError("the batch-invariant mode runs on the CPU, without CUDA graphs")
        self.target, self.drafter, self.tp = target, drafter, tp
        self.batch_invariant = batch_invariant
        # models/cpu_linear.py, models/batch_invariant.py
        cpu_weight_layout(target, drafter, tp is not None, compile, batch_invariant)
        # the target's and drafter's forwards: eager, or compiled by inductor (runtime/compiled.py)
        self.forward = compiled_forward(target) if compile else target
        self.draft_forward = compiled_forward(drafter) if compile and drafter is not None else drafter
        self.compile = compile
        self.dtype = target.embed.weight.dtype
        self.device = target.embed.weight.device
        if self.device.type == "cpu":
            retain_freed_memory()  # freed activations stay in the heap (runtime/cpu_memory.py)
        self.tpb = tokens_per_block
        tc = target.cfg
        self.tcache = PagedKVCache(
            tc.num_layers, num_blocks, tokens_per_block, tc.num_kv_heads, tc.head_dim, self.dtype, self.device
        )
        self.spare_slot = num_blocks * tokens_per_block
        self.dcache = None
        self.capture: tuple[int, ...] = ()
        if drafter is not None:
            dc = drafter.cfg
            self.dcache = PagedKVCache(
                dc.num_layers, num_blocks, tokens_per_block, dc.num_kv_heads, dc.head_dim, self.dtype, self.device
            )
            self.capture = tuple(dc.target_layer_ids)
        # a sliding-window drafter's window: context before it is never ingested nor read
        self.window = drafter.cfg.sliding_window if drafter is not None else None
        # per sequence: (first position, chunks of target features [n_i, F], end position) not yet in
        # the drafter's cache
        self._features: dict[int, tuple[int, list[torch.Tensor], int]] = {}
        # draft with the drafter kernels (dflash_trt.kernels) on CUDA, or when forced by
        # DFLASH_TRT_KERNELS=triton (interpreted on the CPU); else the torch modules
        self.kernels = drafter is not None and _kernels_wanted(self.device)
        self.graphs = None
        if cuda_graphs:  # decode-only iterations replayed from graphs per batch bucket (runtime/cuda_graphs.py)
            self.graphs = GraphedTarget(
                self.forward,
                target.rope,
                target.lm_head,
                self.tcache.layers,
                self.capture,
                self.spare_slot,
                max_batch,
                capture_graphs=self.device.type == "cuda",
            )

    # ---- target features waiting for the drafter (public so a test can seed a context) ----
    def store_features(self, seq_id: int, start: int, feats: torch.Tensor) -> None:
        """Keep features of positions ``start ..``; drops stale ones at or past ``start``
        (rejected draft positions of the previous verify). Appends to a list of chunks (joined
        once when the drafter takes them); stale rows are cut from the tail, so long stretches of
        plain decoding cost O(1) per step (walking every chunk from the head made each step
        O(steps since the last draft): 2.7 ms per iteration at 64 sequences after ~60 plain steps).
        With a sliding-window drafter, whole chunks that no later block can see (every position
        before ``start + 1 - window + 1``: the next anchor is at ``start + 1`` or later) are dropped,
        so a sequence keeps O(window) rows however long it decodes without drafting."""
        old = self._features.get(seq_id)
        if old is None:
            self._features[seq_id] = (start, [feats], start + len(feats))
            return
        first, chunks, end = old
        while chunks and end - len(chunks[-1]) >= start:  # whole chunks at or past ``start``
            end -= len(chunks.pop())
        if chunks and end > start:
            chunks[-1] = chunks[-1][: len(chunks[-1]) - (end - start)]
        if not chunks:
            first = start
        chunks.append(feats)
        if self.window is not None:
            while len(chunks) > 1 and first + len(chunks[0]) < start + 2 - self.window:
                first += len(chunks.pop(0))
        self._features[seq_id] = (first, chunks, start + len(feats))

    def _take_features(self, seq_id: int, upto: int) -> tuple[int, torch.Tensor]:
        """Features of positions ``[lo, upto)`` (removed from the store) and ``lo``: ``lo`` is the
        first stored position, or with a sliding-window drafter of window ``W`` the first one a
        block anchored at ``upto`` can see (``upto - W + 1``, z-lab's rule, :func:`sliding_visible`;
        positions before it are never visible again, so they are not ingested at all)."""
        first, chunks, end = self._features[seq_id]
        f = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        n = upto - first
        self._features[seq_id] = (upto, [f[n:]], end)
        lo = 0 if self.window is None else max(0, n - self.window + 1)
        return first + lo, f[lo:n]

    def release(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self._features.pop(s, None)

    def release_all(self) -> None:
        """Drop every sequence's stored features (a runner reused for new sequences)."""
        self._features.clear()

    # ---- the iteration ----
    def _grad_mode(self):
        """inference mode, or no_grad on the compiled path (a compiled graph that writes the KV
        pools cannot run in inference mode)."""
        return torch.no_grad() if self.compile else torch.inference_mode()

    def draft(self, items: list[StepItem], block: int) -> torch.Tensor:
        """ONE drafter forward for all ``items``: each gets ``item.num_draft`` greedy draft tokens.

        Each item's block is ``[anchor, MASK x (block - 1)]`` at positions ``start ..``; it
        ingests the target features of positions not yet in the drafter's context cache
        (``[first, start)``) and sees all committed context plus its whole block (non-causal,
        z-lab sliding rule when the drafter has a window).

        Returns:
            int64 ``[len(items), block - 1]`` on the device: row ``i`` starts with item ``i``'s
            ``num_draft`` tokens (the rest of the row is not verified). No host copy.
        """
        with self._grad_mode():
            return self._draft(items, block)

    def _draft(self, items: list[StepItem], block: int) -> torch.Tensor:
        d, dev = self.drafter, self.device
        ctx = [self._take_features(it.seq_id, it.start) for it in items]
        tables = [it.table for it in items]
        starts = [it.start for it in items]
        # packed order: every item's context tokens, then every item's block tokens
        ctx_pos, ctx_slots = _written(tables, [first for first, _ in ctx], [len(f) for _, f in ctx], self.tpb)
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
        if self.kernels:  # the drafter kernels over the paged pools (dflash_trt.kernels)
            bpos, bslots = _written(tables, starts, [block] * len(items), self.tpb)
            width = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
            lens = [s + block for s in starts]
            ids, bslots, bt, lens_t, ctx_pos, ctx_slots, bpos = upload(
                dev, ids, bslots, bt, torch.tensor(lens, dtype=torch.int32), ctx_pos, ctx_slots, bpos
            )
            hidden = d.forward_paged(
                self.target.embed(ids.view(-1)),  # [S * B, hidden]
                feats,
                ctx_pos,
                ctx_slots,
                bpos,
                max(lens) - 1,
                PagedBlocks(bslots, bt, lens_t, block, self.tpb),
                self.dcache.k,
                self.dcache.v,
            )
        else:
            plan = plan_packed(
                starts,
                [block] * len(items),
                [i * block for i in range(len(items))],
                block,
                tables,
                self.tpb,
                self.spare_slot,
                d.cfg.sliding_window,
                causal=False,
                pre=(ctx_pos, ctx_slots),  # the context rows are written before the blocks
            )
            meta, ids = upload_meta(dev, plan, ids)
            embeds = self.target.embed(ids.view(-1))  # [S * B, hidden]
            hidden = self.draft_forward(embeds.unsqueeze(0), feats.unsqueeze(0), meta, self.dcache.layers)
        drafts = d.propose(hidden.view(len(items), block, -1)[:, 1:], self.target.lm_head, self.tp is not None)
        if self.tp is not None:
            drafts = self.tp.broadcast(drafts)
        return drafts

    def _drafts(self, items: list[StepItem], block: int) -> tuple[torch.Tensor, bool]:
        """:meth:`draft`'s ``[len(items), block - 1]`` with each item's prompt-lookup tokens
        written over its first draft tokens, and whether the drafter's forward ran: not when
        every item's lookup covers all of its draft tokens (the drafter ingests the skipped
        context at its next forward)."""
        lookups = [it.lookup[: it.num_draft] for it in items]
        if not any(lookups):
            return self.draft(items, block), True
        if all(len(lk) == it.num_draft for lk, it in zip(lookups, items)):
            rows = [lk + [0] * (block - 1 - len(lk)) for lk in lookups]
            return upload(self.device, torch.tensor(rows, dtype=torch.long))[0], False
        drafts = self.draft(items, block)
        at = [(r, j, t) for r, lk in enumerate(lookups) for j, t in enumerate(lk)]  # (row, column, token)
        r, j, t = upload(self.device, torch.tensor(at, dtype=torch.long))[0].unbind(1)
        drafts[r, j] = t
        return drafts, True

    def step(self, plan: StepPlan) -> StepOutput:
        """Run one iteration: drafting for items with ``num_draft > 0``, then one target forward,
        then the target's choices (argmax, or samples for items with ``sampling``) and the
        acceptance on the device; one host copy at the end.

        Returns:
            :class:`StepOutput`; features of every target position are kept for the drafter.
        """
        with self._grad_mode():
            return self._step(plan)

    def _step(self, plan: StepPlan) -> StepOutput:
        self.release(plan.release)
        items = plan.items
        out = StepOutput(drafts=[[] for _ in items], logits=[None] * len(items), accepted=[None] * len(items))
        if not items:
            return out
        clock = _Clock(self.device)
        drafting = [i for i, it in enumerate(items) if it.num_draft > 0]
        drafts = None
        if drafting:
            drafts, out.drafter_ran = self._drafts([items[i] for i in drafting], plan.draft_block)
        k = drafts.shape[1] if drafting else 0  # draft columns per drafting item
        clock.mark()
        lengths = [len(it.tokens) + it.num_draft for it in items]
        offsets = list(accumulate(lengths[:-1], initial=0))
        tables = [it.table for it in items]
        plan = plan_packed([it.start for it in items], lengths, offsets, lengths, tables, self.tpb, self.spare_slot)
        flat = [x for it in items for x in it.tokens + [0] * it.num_draft]
        rows = [o + n - it.num_logits + j for o, n, it in zip(offsets, lengths, items) for j in range(it.num_logits)]
        flat_t = torch.tensor(flat, dtype=torch.long)
        # a decode-only iteration (every token has logits) replays its bucket's graph
        graph = self.graphs.key(plan, len(rows) == len(flat)) if self.graphs is not None else None
        if graph is not None:
            flat_t = self.graphs.pad_ids(graph, flat_t)
        first = list(accumulate([it.num_logits for it in items][:-1], initial=0))  # item -> its first row
        host = [flat_t, torch.tensor(rows, dtype=torch.long)]
        if drafting:  # where the drafts go in the packed input; target rows and counts for acceptance
            n_draft = [items[i].num_draft for i in drafting]
            src = [r * k + j for r, i in enumerate(drafting) for j in range(items[i].num_draft)]
            dst = [offsets[i] + len(items[i].tokens) + j for i in drafting for j in range(items[i].num_draft)]
            tgt = [[first[i] + min(j, n) for j in range(k + 1)] for i, n in zip(drafting, n_draft)]
            host += [torch.tensor(x, dtype=torch.long) for x in (src, dst, tgt)]
            host.append(torch.tensor(n_draft, dtype=torch.int32))
        sampled = [(first[i], it) for i, it in enumerate(items) if it.sampling is not None and it.num_logits]
        if sampled:  # rows the target samples, each with its request's settings and uniforms
            host += _sampling_inputs(sampled)
        meta, ids, index, *extra = upload_meta(self.device, plan, *host)  # the iteration's one host -> device copy
        if drafting:  # drafts go into the packed input on the device
            src, dst, tgt, n_draft_t, *extra = extra
            ids[dst] = drafts.view(-1)[src]
        if graph is not None:  # (every token has logits, in order: the rows are 0 .. N - 1)
            res = self.graphs.run(graph, ids, meta, len(flat))
        else:
            res = self.forward(
                ids.unsqueeze(0), meta, self.tcache.layers, self.capture, logits_index=index.unsqueeze(0)
            )
        choice = argmax_last(res.logits[0])  # [R]
        if sampled:
            srows, *params = extra
            truncate = any(it.sampling[1] > 0 or it.sampling[2] < 1 for _, it in sampled)
            choice[srows] = sample_rows(res.logits[0, srows], *params, truncate=truncate)
        packed = [choice]
        if drafting:  # the longest matching prefix per drafting item, on the device
            acc = ops.accept(drafts, choice[tgt], n_draft_t)
            packed += [drafts.view(-1), acc.long()]
        clock.mark()
        host = torch.cat(packed).tolist()  # the iteration's one device -> host copy
        out.draft_s, out.target_s = clock.seconds() if drafting else (0.0, sum(clock.seconds()))
        out.target_tokens = len(flat)
        if drafting:
            r = len(rows)
            for n, i in enumerate(drafting):
                out.drafts[i] = host[r + n * k : r + n * k + items[i].num_draft]
                out.accepted[i] = host[r + len(drafting) * k + n]
        out.choice = [host[f : f + it.num_logits] for f, it in zip(first, items)]
        for i, (it, o, n) in enumerate(zip(items, offsets, lengths)):
            if it.num_logits:
                out.logits[i] = res.logits[0, first[i] : first[i] + it.num_logits]
            if self.drafter is not None:
                self.store_features(it.seq_id, it.start, res.features[0, o : o + n])
        return out


def _sampling_inputs(sampled: list[tuple[int, StepItem]]) -> list[torch.Tensor]:
    """Host inputs of :func:`~.sampling.sample_rows` for the items that sample, given as
    ``(first logits row, item)``: rows int64 ``[S]``, temperature fp32, top-k int64, top-p fp32,
    uniforms fp32 (``[S]`` each, one entry per logits row)."""
    per_row = [(f + j, it.sampling, u) for f, it in sampled for j, u in enumerate(it.uniforms)]
    rows, params, u = zip(*per_row)
    temp, top_k, top_p = zip(*params)
    return [
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(temp, dtype=torch.float32),
        torch.tensor(top_k, dtype=torch.long),
        torch.tensor(top_p, dtype=torch.float32),
        torch.tensor(u, dtype=torch.float32),
    ]


class _Clock:
    """Wall time of the iteration's phases without extra host synchronisation: host clock
    marks on the CPU, CUDA events on a GPU (read after the iteration's one copy)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = [self._now()]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def mark(self) -> None:
        self.marks.append(self._now())

    def seconds(self) -> tuple[float, ...]:
        """Seconds between consecutive marks (call after the device has caught up)."""
        m = self.marks
        if not self.cuda:
            return tuple(b - a for a, b in zip(m, m[1:]))
        m[-1].synchronize()  # (a no-op after the iteration's copy)
        return tuple(a.elapsed_time(b) / 1e3 for a, b in zip(m, m[1:]))
