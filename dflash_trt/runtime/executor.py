"""The DFlash draft-verify loop for a batch of requests (paper arXiv:2602.06036 §3, Alg. 1).

One iteration, for every running request at once:
  1. draft: ONE drafter forward over the blocks ``[last committed token, MASK x (K-1)]``
     (embedded with the target's embedding), reading the drafter's context K/V cache plus the
     target features of the positions accepted last round; the target's LM head on slots
     ``1..K-1`` gives ``K-1`` greedy draft tokens;
  2. verify: ONE target forward over the K block tokens, capturing the target features;
  3. accept: the longest prefix of drafts equal to the target's own choice (argmax, or its
     sample when temperature > 0), plus one bonus token from the target;
  4. roll back: both caches simply keep their committed lengths (see ``kv_cache.py``).

With K = 1 the loop is plain autoregressive decoding through the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import DFlashError
from ..models.drafter import DFlashDrafter, sliding_visible
from ..models.layers import AttentionMetadata
from ..models.target import TargetModel
from .kv_cache import KVCache
from .sampling import SamplingParams, accepted_lengths, choose_tokens


@dataclass
class Request:
    """One generation request.

    Attributes:
        prompt_ids: prompt token ids (chat template already applied), non-empty.
        max_new_tokens: most tokens to generate (>= 1).
        sampling: temperature / top-p / top-k / seed.
        stop_token_ids: generation ends after any of these (included in the output); None uses
            the target's EOS ids.
    """

    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] | None = None


@dataclass
class RequestOutput:
    """What a request produced.

    Attributes:
        output_ids: generated token ids (stop token included when one ended it).
        finish_reason: ``"stop"`` or ``"length"``.
        commit_lengths: tokens committed by each verify step (bonus token included).
        ttft_s: seconds from the start of ``generate`` to the first token.
        latency_s: seconds from the start of ``generate`` to the last token.
    """

    output_ids: list[int]
    finish_reason: str
    commit_lengths: list[int]
    ttft_s: float
    latency_s: float


@dataclass
class LoopStats:
    """Counters over one :meth:`DFlashEngine.generate` call.

    ``tau`` is the mean number of tokens committed per verify step (bonus included);
    ``acceptance_per_position[k-1]`` is P(draft slot k accepted | slot k reached).
    Times are wall seconds.
    """

    block_size: int
    verify_steps: int = 0
    committed: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    draft_calls: int = 0
    verify_s: float = 0.0
    verify_calls: int = 0
    prefill_s: float = 0.0

    def __post_init__(self) -> None:
        self.reached = [0] * max(self.block_size - 1, 0)
        self.accepted = [0] * max(self.block_size - 1, 0)

    @property
    def tau(self) -> float:
        return self.committed / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def merge(self, other: "LoopStats") -> None:
        for name in ("verify_steps", "committed", "draft_s", "draft_calls", "verify_s", "verify_calls", "prefill_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted)]


TokenCallback = Callable[[int, list[int]], None]


@torch.inference_mode()
def top2_margin(model: TargetModel, ids: list[int]) -> float:
    """Gap between the target's two largest logits for the token after ``ids`` (one fresh
    full forward in the model's dtype). Used to tell a numerical tie from a real divergence
    when two decoding runs differ."""
    cfg = model.cfg
    T = len(ids)
    dtype = model.embed.weight.dtype
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, T, dtype, model.embed.weight.device)
    pos = torch.arange(T, device=cache.layers[0][0].device).unsqueeze(0)
    logits = model(torch.tensor([ids], device=pos.device), AttentionMetadata.causal(pos, T),
                   cache.layers, logits_index=pos[:, -1:]).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class DFlashEngine:
    """Runs DFlash speculative decoding (or plain decoding) on a target and its drafter.

    Args:
        target: the target model (eval mode, its compute dtype).
        drafter: the DFlash drafter, or None for plain decoding only.
        stop_token_ids: default stop ids (the target's EOS ids).

    Raises:
        DFlashError: from :meth:`generate` on impossible settings (block size above the
            drafter's, block size > 1 without a drafter, empty prompt, max_new_tokens < 1).
    """

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, stop_token_ids: tuple[int, ...]):
        self.target = target
        self.drafter = drafter
        self.stop_token_ids = tuple(stop_token_ids)
        self.dtype = target.embed.weight.dtype
        self.device = target.embed.weight.device

    def check_block_size(self, block_size: int) -> None:
        if block_size < 1:
            raise DFlashError(f"block size must be >= 1, got {block_size}")
        if block_size > 1 and self.drafter is None:
            raise DFlashError("block size > 1 needs a drafter")
        if self.drafter is not None and block_size > self.drafter.cfg.block_size:
            raise DFlashError(
                f"block size {block_size} is above the drafter's block_size {self.drafter.cfg.block_size}"
            )

    def draft(self, block: torch.Tensor, block_pos: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
              ctx_feat: torch.Tensor, dcache: KVCache, rows: torch.Tensor) -> torch.Tensor:
        """One drafter forward for all live rows: K-1 greedy draft tokens per row.

        Args:
            block: int64 ``[n, K]``; column 0 holds each row's last committed token (the anchor).
            block_pos: int64 ``[n, K]`` absolute positions of the block.
            ctx_pos, ctx_valid: int64 / bool ``[n, N]`` positions of the target features not yet
                in the drafter's context cache (invalid entries are padding).
            ctx_feat: ``[n, N, len(target_layer_ids) * hidden]`` those target features.
            dcache: the drafter's context K/V cache (updated in place).
            rows: int64 ``[n]`` request index of each row (unused here; for other proposers).

        Returns:
            int64 ``[n, K-1]`` draft tokens.
        """
        n, K = block.shape
        start = block_pos[:, 0]
        kv_len = int(start.max()) + K
        masked = block.clone()
        masked[:, 1:] = self.drafter.cfg.mask_token_id
        pos = torch.cat([ctx_pos, block_pos], dim=1)
        slots = torch.cat([torch.where(ctx_valid, ctx_pos, dcache.trash_slot), block_pos], dim=1)
        keys = torch.arange(kv_len, device=block.device).view(1, 1, 1, -1)
        visible = (keys < (start + K).view(-1, 1, 1, 1)).expand(n, 1, K, kv_len)
        W = self.drafter.cfg.sliding_window
        if W is not None:
            visible = visible & sliding_visible(block_pos.view(n, 1, K, 1), keys, W)
        meta = AttentionMetadata(pos, slots, visible, kv_len)
        hidden = self.drafter(self.target.embed(masked), ctx_feat, meta, dcache.layers)
        return self.target.lm_head(hidden[:, 1:]).argmax(-1)

    @torch.inference_mode()
    def generate(
        self,
        requests: list[Request],
        block_size: int | None = None,
        on_tokens: TokenCallback | None = None,
        stats: LoopStats | None = None,
    ) -> list[RequestOutput]:
        """Generate for all ``requests`` as one batch (rows leave the batch as they finish).

        Args:
            block_size: K, tokens verified per step (1 = plain decoding); defaults to the
                drafter's block size (1 without a drafter).
            on_tokens: called as ``on_tokens(request_index, new_token_ids)`` whenever tokens
                are committed (streaming).
            stats: counters to add this call's figures to.

        Returns:
            one :class:`RequestOutput` per request, in order.
        """
        K = block_size if block_size is not None else (self.drafter.cfg.block_size if self.drafter else 1)
        self.check_block_size(K)
        for r in requests:
            if not r.prompt_ids:
                raise DFlashError("empty prompt")
            if r.max_new_tokens < 1:
                raise DFlashError(f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
        stats = stats if stats is not None else LoopStats(K)
        if len(stats.reached) != max(K - 1, 0):
            raise ValueError("stats were made for another block size")
        t0 = time.perf_counter()
        dev = self.device
        B = len(requests)
        tcfg = self.target.cfg
        lens = torch.tensor([len(r.prompt_ids) for r in requests], device=dev)
        capacity = max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + K
        tcache = KVCache(tcfg.num_layers, B, tcfg.num_kv_heads, tcfg.head_dim, capacity, self.dtype, dev)
        dcache = None
        capture: tuple[int, ...] = ()
        if K > 1:
            dc = self.drafter.cfg
            dcache = KVCache(dc.num_layers, B, dc.num_kv_heads, dc.head_dim, capacity, self.dtype, dev)
            capture = tuple(dc.target_layer_ids)
        gens = [r.sampling.make_generator() for r in requests]
        all_greedy = all(r.sampling.greedy for r in requests)
        stops = [set(r.stop_token_ids if r.stop_token_ids is not None else self.stop_token_ids) for r in requests]
        outputs: list[list[int]] = [[] for _ in requests]
        commits: list[list[int]] = [[] for _ in requests]
        finish: list[str | None] = [None] * B
        ttft = [0.0] * B
        done_at = [0.0] * B

        def commit(row_req: int, toks: list[int]) -> bool:
            """Append tokens (truncated at a stop token / the length limit); True when finished."""
            req = requests[row_req]
            room = req.max_new_tokens - len(outputs[row_req])
            toks = toks[:room]
            for i, t in enumerate(toks):
                if t in stops[row_req]:
                    toks = toks[: i + 1]
                    finish[row_req] = "stop"
                    break
            if finish[row_req] is None and len(outputs[row_req]) + len(toks) >= req.max_new_tokens:
                finish[row_req] = "length"
            outputs[row_req].extend(toks)
            now = time.perf_counter() - t0
            if len(outputs[row_req]) == len(toks):
                ttft[row_req] = now
            if on_tokens is not None and toks:
                on_tokens(row_req, toks)
            if finish[row_req] is not None:
                done_at[row_req] = now
            return finish[row_req] is not None

        # ---- prefill: right-padded prompts, one target forward ----
        tp = time.perf_counter()
        T = int(lens.max())
        ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, r in enumerate(requests):
            ids[b, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, device=dev)
        pos = torch.arange(T, device=dev).expand(B, T)
        valid = pos < lens.unsqueeze(1)
        meta = AttentionMetadata.causal(pos, T, torch.where(valid, pos, tcache.trash_slot))
        out = self.target(ids, meta, tcache.layers, capture, logits_index=(lens - 1).unsqueeze(1))
        stats.prefill_s += time.perf_counter() - tp
        rows = torch.arange(B, device=dev)  # request index of each live batch row
        last = torch.empty(B, dtype=torch.long, device=dev)
        live = []
        for b in range(B):
            tok = int(choose_tokens(out.logits[b], requests[b].sampling, gens[b])[0])
            last[b] = tok
            if not commit(b, [tok]):
                live.append(b)
        start = lens.clone()  # position of each row's last committed token (not yet in the target cache)
        # context features not yet in the drafter cache: positions, validity, features
        ctx_pos, ctx_valid, ctx_feat = pos, valid, out.features

        def drop_finished(live: list[int]):
            keep = torch.tensor(live, dtype=torch.long, device=dev)
            tcache.keep_rows(keep)
            if dcache is not None:
                dcache.keep_rows(keep)
            return [t[keep] if t is not None else None for t in (rows, last, start, ctx_pos, ctx_valid, ctx_feat)]

        if len(live) < B:
            rows, last, start, ctx_pos, ctx_valid, ctx_feat = drop_finished(live)

        offs = torch.arange(K, device=dev)
        while rows.numel():
            n = rows.numel()
            block_pos = start.unsqueeze(1) + offs  # [n, K]
            block = last.unsqueeze(1).repeat(1, K)
            kv_len = int(start.max()) + K
            if K > 1:
                td = time.perf_counter()
                block[:, 1:] = self.draft(block, block_pos, ctx_pos, ctx_valid, ctx_feat, dcache, rows)
                if ctx_pos.shape[1] <= K:  # steady state; the first call also ingests the prompt
                    stats.draft_s += time.perf_counter() - td
                    stats.draft_calls += 1
            tv = time.perf_counter()
            out = self.target(block, AttentionMetadata.causal(block_pos, kv_len), tcache.layers, capture)
            if all_greedy:
                choice = out.logits.argmax(-1)
            else:
                choice = torch.stack([choose_tokens(out.logits[i], requests[r].sampling, gens[r])
                                      for i, r in enumerate(rows.tolist())])
            acc = accepted_lengths(block[:, 1:], choice)
            stats.verify_s += time.perf_counter() - tv
            stats.verify_calls += 1
            bonus = choice.gather(1, acc.unsqueeze(1)).squeeze(1)
            acc_l, bonus_l, block_l = acc.tolist(), bonus.tolist(), block.tolist()
            live = []
            for i in range(n):
                a = acc_l[i]
                req = int(rows[i])
                before = len(outputs[req])
                finished = commit(req, block_l[i][1 : a + 1] + [bonus_l[i]])
                committed = len(outputs[req]) - before
                commits[req].append(committed)
                stats.verify_steps += 1
                stats.committed += committed
                for k in range(min(a + 1, K - 1)):
                    stats.reached[k] += 1
                    if k < a:
                        stats.accepted[k] += 1
                if not finished:
                    live.append(i)
            start = start + acc + 1
            last = bonus
            if K > 1:
                m = int(acc.max()) + 1
                ctx_pos = block_pos[:, :m]
                ctx_valid = offs[:m].unsqueeze(0) <= acc.unsqueeze(1)
                ctx_feat = out.features[:, :m]
            if len(live) < n:
                rows, last, start, ctx_pos, ctx_valid, ctx_feat = drop_finished(live)

        return [
            RequestOutput(outputs[i], finish[i] or "length", commits[i], ttft[i], done_at[i]) for i in range(B)
        ]
