"""The paged attention metadata of one packed forward: planned on the host from a few integers
per sequence, built where the forward runs.

The host knows, per sequence: the first position it writes and how many tokens, where its
queries sit in the packed query tensor and how many there are, the first key it may read (0, or
with a sliding window the first one its first query sees), and its block table.
:func:`plan_packed` puts those into a :class:`MetaPlan`: ``[S]`` integer tensors, the block
tables padded to ``[S, max_blocks]``, and a few Python ints (key length and queries per sequence
of each attention group). :meth:`MetaPlan.build` turns a plan into
:class:`~dflash_trt.models.layers.AttentionMetadata` (positions, write and read slots, mask,
query gathers) with vectorized torch ops on the device its tensors are on, without a host
synchronisation (``repeat_interleave`` is given its output size).

The runner uploads a plan together with the iteration's other inputs in ONE copy
(``model_runner.upload_meta``) and builds the metadata on the GPU. A batch-64 verify over 2,000
keys then sends ~5 KB of integers instead of ~5 MB of masks and slots, and the host no longer
builds them in a Python loop over sequences (6.6 ms per iteration on this CPU at that size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..kernels import cpu_ops
from ..models.drafter import sliding_visible
from ..models.layers import AttentionMetadata

#: queries per sequence up to which a sequence counts as a verify block (grouped apart from
#: prompt chunks, so that short blocks are not padded to a long chunk in attention)
SHORT_QUERIES = 16


@dataclass
class GroupPlan:
    """One attention group: the sequences ``idx`` (int64 ``[S_g]``), attended in one padded
    batch of ``tq`` queries per sequence over ``kv_len`` key columns; ``queries`` valid queries
    in all; ``uniform``: see :class:`~dflash_trt.models.layers.AttentionMetadata`."""

    idx: torch.Tensor
    kv_len: int
    tq: int
    queries: int
    uniform: bool


@dataclass
class MetaPlan:
    """What :meth:`build` needs (see the module docstring). Tensors: int64 ``[S]`` each
    (``starts``, ``lengths``: written tokens; ``query_from``, ``qlen``: queries; ``lo``: first
    key read), ``tables`` int64 ``[S, max_blocks]`` (padded with block 0, never read), and
    ``pre_positions`` / ``pre_slots`` int64 ``[P]``: tokens written before all sequences' own
    (the drafter's context rows; empty for the target)."""

    starts: torch.Tensor
    lengths: torch.Tensor
    query_from: torch.Tensor
    qlen: torch.Tensor
    lo: torch.Tensor
    tables: torch.Tensor
    pre_positions: torch.Tensor
    pre_slots: torch.Tensor
    groups: list[GroupPlan] = field(default_factory=list)
    tokens_per_block: int = 32
    spare_slot: int = 0
    window: int | None = None
    causal: bool = True
    target_window: int | None = None
    tokens: int = 0
    queries: int = 0
    max_position: int = 0

    _TENSORS = ("starts", "lengths", "query_from", "qlen", "lo", "tables", "pre_positions", "pre_slots")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the plan, in a fixed order (:meth:`with_tensors` takes them back)."""
        return [getattr(self, n) for n in self._TENSORS] + [g.idx for g in self.groups]

    def with_tensors(self, ts: list[torch.Tensor]) -> MetaPlan:
        """The plan with :meth:`tensors` replaced by ``ts`` (e.g. their copies on a device)."""
        k = len(self._TENSORS)
        groups = [dataclasses.replace(g, idx=t) for g, t in zip(self.groups, ts[k:])]
        return dataclasses.replace(self, **dict(zip(self._TENSORS, ts[:k])), groups=groups)

    @property
    def gathers(self) -> bool:
        """Whether the groups carry query gathers: not for one uniform group, whose queries
        attention takes as views."""
        return len(self.groups) > 1 or not self.groups[0].uniform

    def build(self) -> AttentionMetadata:
        """The metadata, on the plan's device: ``positions`` / ``write_slots`` int64 ``[1, P + T]``
        (the pre rows, then every sequence's written tokens in order); per group ``read_slots``
        int64 ``[S_g, kv_len]``, ``mask`` bool ``[S_g, 1, tq, kv_len]``, ``query_index`` /
        ``query_valid`` ``[S_g, tq]``, ``query_rows`` / ``query_out`` int64 ``[queries]``; two
        groups become :attr:`AttentionMetadata.groups` under a base that holds the positions. A
        single uniform group has no query gathers (None): attention takes its queries as views.
        ``query_index`` of a padding query is ``queries`` (the padding row)."""
        if self.starts.device.type == "cpu" and cpu_ops.loaded():
            return self._build_cpu()
        return self._build_torch()

    def _build_torch(self) -> AttentionMetadata:
        """:meth:`build` in vectorized torch ops on the plan's device (no host synchronisation)."""
        dev, tpb = self.starts.device, self.tokens_per_block
        S = len(self.starts)
        seq = torch.repeat_interleave(torch.arange(S, device=dev), self.lengths, output_size=self.tokens)
        first = torch.cumsum(self.lengths, 0) - self.lengths
        pos = self.starts[seq] + torch.arange(self.tokens, device=dev) - first[seq]
        slots = self.tables[seq, pos // tpb] * tpb + pos % tpb
        ends = self.starts + self.lengths
        metas = [self._group(g, ends, self.gathers) for g in self.groups]
        pre = (torch.cat([self.pre_positions, pos]).unsqueeze(0), torch.cat([self.pre_slots, slots]).unsqueeze(0))
        return self._base(metas, *pre)

    def _build_cpu(self) -> AttentionMetadata:
        """:meth:`build` on the host in one C++ call per group (``dflash_cpu::paged_meta_*``,
        ``kernels/cpu/paged_meta.cpp``): the same tensors without ~25 torch ops' dispatch each
        (~0.3 ms of a batch-1 decode step on a 2-core CPU)."""
        ops, tpb, gathers = torch.ops.dflash_cpu, self.tokens_per_block, self.gathers
        has_sliding = self.causal and self.target_window is not None
        metas = []
        for g in self.groups:
            read, mask, sliding, rows, out, index, valid = ops.paged_meta_group(
                self.starts,
                self.lengths,
                self.query_from,
                self.qlen,
                self.lo,
                self.tables,
                g.idx,
                g.kv_len,
                g.tq,
                self.queries,
                tpb,
                self.spare_slot,
                self.window or 0,
                self.causal,
                self.target_window or 0,
                gathers,
            )
            meta = AttentionMetadata(None, None, mask, g.kv_len, read_slots=read, uniform=g.uniform)
            meta.sliding_mask, meta.window = (sliding, self.target_window) if has_sliding else (None, None)
            if gathers:
                meta.query_rows, meta.query_out, meta.query_index, meta.query_valid = rows, out, index, valid
            metas.append(meta)
        return self._base(
            metas,
            *ops.paged_meta_positions(
                self.starts, self.lengths, self.tables, self.pre_positions, self.pre_slots, tpb, self.tokens
            ),
        )

    def _base(self, metas: list[AttentionMetadata], positions: torch.Tensor, slots: torch.Tensor):
        """The metadata of the groups ``metas`` (one: itself; several: under a base) with the
        written ``positions`` and ``slots`` int64 ``[1, P + T]``."""
        if len(metas) == 1:
            base = metas[0]
        else:
            base = AttentionMetadata(None, None, None, self.max_position + 1)
            base.groups = metas
        base.positions, base.write_slots, base.max_position = positions, slots, self.max_position
        return base

    def _group(self, g: GroupPlan, ends: torch.Tensor, gathers: bool) -> AttentionMetadata:
        """Read slots, mask and (with ``gathers``) the query gathers of one group. Sequence
        ``r`` reads keys ``lo_r + j`` for ``j < kv_len`` (columns at or past its end read the
        spare slot and are masked); its queries are its last ``qlen_r`` written positions."""
        dev, tpb, i = self.starts.device, self.tokens_per_block, g.idx
        e, lo, ql, qf, tab = ends[i], self.lo[i], self.qlen[i], self.query_from[i], self.tables[i]
        j = torch.arange(g.kv_len, device=dev)
        keys = lo[:, None] + j  # [S_g, kv_len] key positions
        block = (keys // tpb).clamp(max=tab.shape[1] - 1)
        read = torch.where(j < (e - lo)[:, None], tab.gather(1, block) * tpb + keys % tpb, self.spare_slot)
        t = torch.arange(g.tq, device=dev)
        valid = t < ql[:, None]  # [S_g, tq]
        qpos = torch.where(valid, (e - ql)[:, None] + t, 0)
        k3, q3 = keys[:, None, :], qpos[:, :, None]
        mask = k3 <= q3 if self.causal else k3 < e[:, None, None]
        if self.window is not None:
            mask = mask & sliding_visible(q3, k3, self.window)
        sliding = None
        if self.causal and self.target_window is not None:  # the target's sliding-window layers
            sliding = (mask & (q3 - k3 < self.target_window) | ~valid[:, :, None]).unsqueeze(1)
        mask = mask | ~valid[:, :, None]  # padding queries see everything: no all-masked (NaN) rows
        meta = AttentionMetadata(None, None, mask.unsqueeze(1), g.kv_len, read_slots=read, uniform=g.uniform)
        meta.sliding_mask, meta.window = sliding, self.target_window if sliding is not None else None
        if gathers:
            # the valid queries in packed order: row r * tq + u, packed index query_from[r] + u
            r = torch.repeat_interleave(torch.arange(len(i), device=dev), ql, output_size=g.queries)
            u = torch.arange(g.queries, device=dev) - (torch.cumsum(ql, 0) - ql)[r]
            meta.query_rows, meta.query_out = r * g.tq + u, qf[r] + u
            meta.query_index, meta.query_valid = torch.where(valid, qf[:, None] + t, self.queries), valid
        return meta


def plan_packed(
    starts: list[int],
    lengths: list[int],
    query_from: list[int],
    query_len: int | list[int],
    tables: list[list[int]],
    tpb: int,
    spare_slot: int,
    window: int | None = None,
    causal: bool = True,
    pre: tuple[torch.Tensor, torch.Tensor] | None = None,
    target_window: int | None = None,
) -> MetaPlan:
    """The plan of ``S`` sequences packed into one forward (host tensors).

    Sequence ``i`` writes positions ``starts[i] .. starts[i] + lengths[i] - 1`` (to its slots);
    its queries are its last ``query_len`` tokens, whose index in the query tensor starts at
    ``query_from[i]``. Keys are positions ``0 .. starts[i] + lengths[i] - 1`` of the sequence;
    causal: a query at ``p`` sees keys ``<= p``; non-causal: all of them; minus, either way, the
    sliding ``window`` rule, z-lab's, when set (a windowed sequence reads only from the first key
    its first query can see, so it reads O(window + block) keys however long its context). When
    short (verify, ``<= SHORT_QUERIES``) and long (prompt-chunk) query runs are mixed, they
    become two attention groups. ``pre``: positions and slots (int64 ``[P]``) written before
    every sequence's own tokens. ``target_window`` (causal only): each group also gets the
    mask of a target's sliding-window layers (``AttentionMetadata.sliding_mask``: a query at
    ``p`` sees keys ``p - target_window < k <= p``; the keys read stay the whole context).
    """
    S = len(starts)
    qlen = query_len if isinstance(query_len, list) else [query_len] * S
    ends = [s + n for s, n in zip(starts, lengths)]
    lo = [0 if window is None else max(0, e - q - window + 1) for e, q in zip(ends, qlen)]
    short = [i for i in range(S) if qlen[i] <= SHORT_QUERIES]
    split = 0 < len(short) < S
    sets = [short, [i for i in range(S) if qlen[i] > SHORT_QUERIES]] if split else [list(range(S))]
    groups = []
    for idx in sets:
        tq = max(qlen[i] for i in idx)
        groups.append(
            GroupPlan(
                torch.tensor(idx, dtype=torch.long),
                kv_len=max(ends[i] - lo[i] for i in idx),
                tq=tq,
                queries=sum(qlen[i] for i in idx),
                uniform=all(qlen[i] == tq and query_from[i] == r * tq for r, i in enumerate(idx)),
            )
        )
    width = max(len(t) for t in tables)
    empty = torch.zeros(0, dtype=torch.long)
    long = torch.long
    return MetaPlan(
        starts=torch.tensor(starts, dtype=long),
        lengths=torch.tensor(lengths, dtype=long),
        query_from=torch.tensor(query_from, dtype=long),
        qlen=torch.tensor(qlen, dtype=long),
        lo=torch.tensor(lo, dtype=long),
        tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=long),
        pre_positions=pre[0] if pre is not None else empty,
        pre_slots=pre[1] if pre is not None else empty,
        groups=groups,
        tokens_per_block=tpb,
        spare_slot=spare_slot,
        window=window,
        causal=causal,
        target_window=target_window,
        tokens=sum(lengths),
        queries=sum(qlen),
        max_position=max(ends) - 1,
    )
