"""The packed forward's attention metadata, built from a plan of a few integers per sequence
(``runtime/attention_meta.py``), against the definition: for random packed batches (verify
blocks beside prompt chunks, causal and non-causal, with and without a sliding window, ragged
tables) every query sees exactly the pool slots of the key positions it may attend to, with
both builders: the vectorized torch ops (any device) and the host's one C++ call per group
(``dflash_cpu::paged_meta_*``), which give the same tensors."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_trt.kernels import cpu_ops
from dflash_trt.runtime.attention_meta import SHORT_QUERIES, MetaPlan, plan_packed
from dflash_trt.runtime.block_manager import slots_of

SPARE = 10_000


def random_batch(rng: random.Random):
    S, tpb = rng.randint(1, 6), rng.choice([4, 16, 32])
    starts, lengths, qlen, tables = [], [], [], []
    for _ in range(S):
        start, n = rng.randint(0, 150), rng.choice([1, 4, 5, 8, 16, 17, rng.randint(1, 70)])
        starts.append(start)
        lengths.append(n)
        qlen.append(n if rng.random() < 0.7 else rng.randint(1, n))
        tables.append(rng.sample(range(300), (start + n + tpb - 1) // tpb + rng.randint(0, 2)))
    return starts, lengths, qlen, tables, tpb


def build(plan: MetaPlan, builder: str):
    """The plan's metadata from ``builder`` (``torch`` / ``cpu``: the C++ call)."""
    if builder == "torch":
        return plan._build_torch()
    cpu_ops.load()
    return plan._build_cpu()


@pytest.mark.parametrize("builder", ["torch", "cpu"])
@pytest.mark.parametrize("mode", ["causal", "non-causal", "window"])
def test_every_query_sees_exactly_its_keys(mode, builder):
    rng = random.Random(mode)
    groups_seen = set()
    for _ in range(60):
        starts, lengths, qlen, tables, tpb = random_batch(rng)
        window = rng.randint(4, 40) if mode == "window" else None
        qfrom = [sum(qlen[:i]) for i in range(len(qlen))]
        pre = (torch.tensor([3, 4]), torch.tensor([77, 78]))
        plan = plan_packed(starts, lengths, qfrom, qlen, tables, tpb, SPARE, window, mode == "causal", pre)
        meta = build(plan, builder)
        # written tokens: the pre rows, then each sequence's positions and their slots
        pos = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
        assert torch.equal(meta.positions[0], torch.cat([pre[0], *pos]))
        want = [slots_of(t, p, tpb) for t, p in zip(tables, pos)]
        assert torch.equal(meta.write_slots[0], torch.cat([pre[1], *want]))
        assert meta.max_position == max(s + n for s, n in zip(starts, lengths)) - 1
        groups = meta.groups or [meta]
        groups_seen.add(len(groups))
        seen = []
        for g in groups:
            if g.query_index is None:  # one uniform group: queries r * tq .. r * tq + tq - 1, taken as views
                assert g.uniform and len(groups) == 1
                s, tq = g.mask.shape[0], g.mask.shape[2]
                g.query_index, g.query_valid = torch.arange(s * tq).view(s, tq), torch.ones(s, tq, dtype=torch.bool)
                g.query_rows = g.query_out = torch.arange(s * tq)
            rows = g.query_index  # [S_g, tq]: packed query index of each (sequence, query)
            flat = g.query_index.reshape(-1)[g.query_rows]
            assert torch.equal(flat, g.query_out)  # the valid queries, in packed order
            for r in range(rows.shape[0]):
                valid = g.query_valid[r].nonzero().flatten().tolist()
                i = qfrom.index(int(rows[r, 0]))  # the sequence behind row r
                assert valid == list(range(qlen[i]))
                if len(groups) == 2:  # verify blocks apart from prompt chunks
                    assert (qlen[i] <= SHORT_QUERIES) == (g is groups[0])
                end = starts[i] + lengths[i]
                for u in valid:
                    q = end - qlen[i] + u  # the query's position
                    seen.append(int(rows[r, u]))
                    keys = range(q + 1) if mode == "causal" else range(end)
                    keys = [k for k in keys if window is None or q - k < window]
                    got = g.read_slots[r][g.mask[r, 0, u]].tolist()
                    assert sorted(got) == sorted(slots_of(tables[i], torch.tensor(keys), tpb).tolist())
        assert sorted(seen) == list(range(sum(qlen)))  # every query once
    assert groups_seen == {1, 2}  # batches with and without a prompt chunk beside verify blocks


FIELDS = ("positions", "write_slots", "read_slots", "mask", "sliding_mask", "query_rows", "query_out")
FIELDS += ("query_index", "query_valid", "kv_len", "max_position", "uniform", "window")


def test_cpu_builder_gives_the_torch_builders_tensors():
    """The host's C++ builder against the torch ops, field by field (dtype, shape, values) on
    random plans of every kind: causal with a target's sliding window, non-causal with and
    without the drafter's window, pre rows or none, one group or two; and ``build`` on the CPU
    takes the C++ builder once the ops are loaded."""
    rng = random.Random(7)
    cpu_ops.load()
    for n in range(120):
        starts, lengths, qlen, tables, tpb = random_batch(rng)
        causal = n % 3 != 0
        window = rng.randint(4, 40) if not causal and n % 2 else None
        target_window = rng.randint(2, 60) if causal and n % 2 else None
        qfrom = [sum(qlen[:i]) for i in range(len(qlen))]
        pre = (torch.tensor([3, 4]), torch.tensor([77, 78])) if n % 4 == 1 else None
        plan = plan_packed(starts, lengths, qfrom, qlen, tables, tpb, SPARE, window, causal, pre, target_window)
        a, b = plan._build_torch(), plan.build()
        assert len(a.groups or []) == len(b.groups or [])
        for ga, gb in zip([a, *(a.groups or [])], [b, *(b.groups or [])]):
            for f in FIELDS:
                x, y = getattr(ga, f), getattr(gb, f)
                if isinstance(x, torch.Tensor):
                    assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), (n, f)
                else:
                    assert x == y, (n, f)


def test_written_slots_are_the_block_tables_slots():
    # short runs (worked in Python lists) and long ones (tensor ops) give the slots slots_of gives,
    # position by position, in sequence order; a position past a table's end is an IndexError
    from dflash_trt.runtime.uploads import written_slots

    rng = random.Random(3)
    for _ in range(200):
        tpb = rng.choice([4, 16, 32])
        lengths = [rng.choice([0, 1, 2, 8, 33, 64, 65, 100]) for _ in range(rng.randint(0, 6))]
        tables = [rng.sample(range(1000), 40) for _ in lengths]
        starts = [rng.randint(0, 40 * tpb - n) for n in lengths]
        pos, slots = written_slots(tables, starts, lengths, tpb)
        want = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
        assert pos.dtype == slots.dtype == torch.long
        assert pos.tolist() == [p for w in want for p in w.tolist()]
        assert slots.tolist() == [x for t, w in zip(tables, want) for x in slots_of(t, w, tpb).tolist()]
    with pytest.raises(IndexError):
        written_slots([[1, 2]], [60], [8], 32)
