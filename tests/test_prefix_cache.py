"""Automatic prefix caching (``runtime/block_manager.py``): ended requests' full KV blocks serve
later prompts that start with the same tokens. The block manager's bookkeeping on its own, then
the engine on the real target: requests that reuse cached blocks (plain, DFlash with a drafter
that sees the whole context, DFlash with a sliding-window drafter) give plain decoding's tokens,
and the cache saves prefill."""

from __future__ import annotations

import pytest
from helpers import make_engine, plain_outputs

from dflash_trt.checkpoints.zlab import init_drafter
from dflash_trt.prompts import chat_prompt_ids, mixed_prompts
from dflash_trt.runtime.block_manager import BlockManager
from dflash_trt.runtime.request import Request


def _run(bm: BlockManager, sid: int, tokens: list[int], drafted=None, drafter_from=None) -> int:
    """Admit ``sid``, share what the cache has, fill its blocks, end it into the cache; returns
    the positions shared."""
    bm.reserve(sid, len(tokens) + 4)
    shared = bm.share_prefix(sid, tokens, len(tokens) - 1, drafter_from)
    bm.ensure(sid, len(tokens))
    bm.cache_prefix(sid, tokens, len(tokens), drafted)
    bm.release(sid)
    return shared


def test_block_manager_shares_counts_and_evicts():
    bm = BlockManager(6, 4, prefix_caching=True)
    a = list(range(100, 110))  # 2 full blocks + 2
    assert _run(bm, 0, a) == 0
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 6
    # the same prompt: both full blocks, never the block of the last prompt token
    assert _run(bm, 1, a) == 8 and _run(bm, 2, a[:8] + [7]) == 8 and _run(bm, 3, a[:8]) == 4
    # a different first block: nothing, although the second block's tokens are equal
    assert _run(bm, 4, [1, 2, 3, 4] + a[4:]) == 0
    # held blocks are shared, not copied: two holders, one block each
    bm.reserve(5, 12)
    bm.reserve(6, 12)
    assert bm.share_prefix(5, a, 9, None) == 8 and bm.share_prefix(6, a, 9, None) == 8
    assert bm.table(5) == bm.table(6)
    bm.release(5)
    bm.release(6)
    # a drafter that sees everything needs its K/V in every shared block; a windowed one only
    # from where its first block looks
    bm2 = BlockManager(8, 4, prefix_caching=True)
    _run(bm2, 0, a, drafted=(4, 10))
    assert _run(bm2, 1, a, drafter_from=0) == 0
    assert _run(bm2, 2, a, drafter_from=6) == 8
    # a full pool takes the least recently used cached block nobody holds
    bm3 = BlockManager(4, 4, prefix_caching=True)
    _run(bm3, 0, a[:9])  # caches 2 blocks
    bm3.reserve(1, 16)
    bm3.ensure(1, 16)  # 4 new blocks: both cached ones are taken
    assert bm3.num_cached_blocks == 0
    bm3.release(1)
    assert _run(bm3, 2, a[:9]) == 0
    assert bm3.num_free_blocks == bm3.num_blocks and bm3.num_unreserved_blocks == bm3.num_blocks
    # off: nothing cached
    off = BlockManager(6, 4)
    _run(off, 0, a)
    assert _run(off, 1, a) == 0 and off.num_cached_blocks == 0


@pytest.fixture(scope="module")
def waves(smollm2):
    """The chat prompts of two waves (the second adds longer prompts that start with two of the
    first's) and plain decoding's outputs of the second, without a cache."""
    tok = smollm2.tokenizer
    prompts = [chat_prompt_ids(tok, p) for p in mixed_prompts(4)]
    longer = [p + tok.encode(" And once more, in short.") for p in prompts[:2]]
    refs = plain_outputs(smollm2, prompts + longer, 12, batched=True, enable_prefix_caching=False)
    return prompts, longer, refs


@pytest.mark.parametrize("drafter_kind", ["plain", "full", "full-undrafted", "window", "window-undrafted"])
def test_engine_reuses_prompt_blocks_and_stays_lossless(smollm2, random_drafter, waves, drafter_kind):
    """Two waves of the same chat prompts (the second after the first has ended, plus longer
    prompts that start with the first wave's): the second wave prefills only what the cache
    lacks and every output equals plain decoding's without a cache. ``full-undrafted``: the
    first wave never drafts (``max_draft_tokens=0``, as when the adaptive controller decodes
    plainly), so only the target features written into the drafter's pool as those requests
    end give the second wave the drafter's context of the cached blocks; ``window-undrafted``:
    the same with a sliding-window drafter, which keeps no features older than its window, so
    the prompt's last window is written into the drafter's pool when the prompt is prefilled."""
    prompts, longer, refs = waves
    undrafted = drafter_kind.endswith("-undrafted")
    first = [Request(p, 12, max_draft_tokens=0 if undrafted else None) for p in prompts]
    second = [Request(p, 12) for p in prompts + longer]
    drafter = {
        "plain": None,
        "full": random_drafter,
        "window": init_drafter(smollm2.model.cfg, 1, 4, random_drafter.cfg.mask_token_id, seed=1, sliding_window=16),
    }[drafter_kind.removesuffix("-undrafted")]
    engine = make_engine(smollm2, drafter, 1 if drafter is None else 4, second, kv_capacity=8192)
    got1 = [o.output_ids for o in engine.generate(first)]
    assert got1 == refs[:4]
    hits = engine.blocks.prefix_hits
    assert hits == 0
    got2 = [o.output_ids for o in engine.generate(second)]
    assert got2 == refs
    tpb = engine.blocks.tokens_per_block
    saved = engine.blocks.prefix_hits
    # every full block of the repeated prompts, and of the longer prompts' shared starts, comes from
    # the cache, with a drafter too: an ended sequence's waiting target features are written into
    # the drafter's pool (KV injection alone) even where it never drafted (a random drafter's
    # acceptance soon has the adaptive controller decode plainly)
    assert saved >= sum((len(p) - 1) // tpb * tpb for p in prompts) + sum(len(p) // tpb * tpb for p in prompts[:2])
    bm = engine.blocks
    assert bm.num_free_blocks == bm.num_blocks and not bm.holders()
    print(f"\n{drafter_kind}: {saved} of {sum(len(r.prompt_ids) for r in second)} prompt positions from the cache")


@pytest.mark.parametrize("window", [None, 16])
def test_an_ended_undrafted_sequence_leaves_drafter_context_only_where_a_prompt_needs_it(
    smollm2, random_drafter, waves, window
):
    """Requests that never draft (as under the adaptive controller's plain iterations) and
    decode well past their prompts: with a sliding-window drafter the cached blocks hold the
    drafter's K/V of the prompt's last window only (written as the prompt is prefilled; an
    ending sequence writes no more, since only a continuation shorter than a window would read
    it), with a drafter that sees the whole context every cached block holds it. Outputs equal
    plain decoding's either way, and a second wave of the same prompts takes their full blocks
    from the cache."""
    prompts = waves[0][:2]
    drafter = init_drafter(smollm2.model.cfg, 1, 4, random_drafter.cfg.mask_token_id, seed=1, sliding_window=window)
    first = [Request(p, 40, max_draft_tokens=0) for p in prompts]
    engine = make_engine(smollm2, drafter, 4, first, kv_capacity=8192)
    outs = [o.output_ids for o in engine.generate(first)]
    assert outs == plain_outputs(smollm2, prompts, 40, batched=True, enable_prefix_caching=False)
    bm, tpb = engine.blocks, engine.blocks.tokens_per_block
    for p, out in zip(prompts, outs):
        tokens, parent = p + out, 0
        for i in range((len(tokens) - 1) // tpb):  # the sequence's cached blocks, in order
            _, parent, drafted_from = bm._entry[bm._by_key[(parent, tuple(tokens[i * tpb : (i + 1) * tpb]))]]
            has_kv = drafted_from < (i + 1) * tpb
            if window is None:
                assert has_kv
            else:  # the last window of the prompt's full blocks (what the prefill wrote), nothing after
                upto = len(p) // tpb * tpb
                assert has_kv == (upto - window + 1 < (i + 1) * tpb <= upto), (i, len(p), drafted_from)
    second = [Request(p, 4) for p in prompts]
    engine.generate(second)
    assert bm.prefix_hits >= sum((len(p) - 1) // tpb * tpb for p in prompts)
