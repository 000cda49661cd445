"""One engine iteration on the models: batched drafting (``spec_decode/``), then ONE packed
target forward that verifies every decode request's block and runs every prefill chunk (ragged,
no padding), then verification on the device.

The runner is the part every TP rank executes identically: it receives a :class:`StepPlan`
(plain data: token ids, positions, block tables) built by rank 0's scheduler, owns the paged
KV pools of its shard and the proposer (which keeps each sequence's target features until the
drafter ingests them). It never decides anything: what to draft, the uniforms a sampled request
draws and what to commit are rank 0's (``engine.py``); the runner computes from them, on the
device, the target's token after every logits row and each block's accepted prefix
(``spec_decode/verify.py``), and copies them to the host once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

import torch
from tqdm import tqdm

from ..errors import ConfigError
from ..models.batch_invariant import resolve_batch_invariant, set_batch_invariant
from ..models.cpu_linear import onednn_available, pack_linears, unpack_linears
from ..models.drafter import DFlashDrafter
from ..models.fused_layer import plan_dense_layers
from ..models.layers import AttentionMetadata, set_cpu_norm_kernel
from ..models.screened_head import ScreenedHead
from ..models.target import TargetModel, TargetOutput
from .attention_meta import MetaPlan, plan_packed
from .compiled import compiled_forward
from .config import EngineConfig
from .cpu_memory import retain_freed_memory
from .cuda_graphs import (
    MAX_PROMPT_REPLAYS,
    PROMPT_BUCKETS,
    GraphedTarget,
    GraphKey,
    batch_buckets,
    capture_queries,
    key_buckets,
)
from .kv_cache import PagedKVCache
from .spec_decode.dflash import DFlashProposer
from .spec_decode.prompt_lookup import merge_lookup
from .spec_decode.verify import SampledRows, accepted, target_tokens
from .uploads import upload, upload_meta

log = logging.getLogger("dflash_trt.runtime")


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
        lookup: decode only: prompt-lookup tokens (``spec_decode/prompt_lookup.py``) that
            replace the drafter's first ``len(lookup) <= num_draft`` draft tokens; empty: the
            drafter's alone.
        sampling: ``(temperature, top_k, top_p)`` when the target's tokens after this item's
            logits rows are sampled on the device (:func:`~.sampling.sample_rows`); None: argmax.
        uniforms: with ``sampling``: one uniform in [0, 1) per logits row, drawn from the
            request's own generator when the step was planned.
        banned: token ids that cannot be chosen on the first ``banned_rows`` logits rows (the
            request's stop tokens while it is below ``min_tokens``).
        banned_rows: see ``banned``.
        probe_draft: decode only, with ``num_draft`` 0: draft tokens the drafter proposes after
            the anchor that the target does not verify (the item stays a plain decoding step):
            returned in :attr:`StepOutput.probes` for the engine to check against the tokens the
            sequence commits next (the adaptive controller's acceptance probe while plain
            decoding wins, for the price of the drafter's forward alone).
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
    banned: list[int] = field(default_factory=list)
    banned_rows: int = 0
    probe_draft: int = 0


@dataclass
class StepPlan:
    """Everything an iteration needs; rank 0 broadcasts it to the other TP ranks.

    Attributes:
        items: prefill and decode items, in packing order.
        draft_block: drafter block size used for drafting (positions ``start .. start +
            draft_block - 1`` are written in the drafter's cache); 0 when nothing is drafted.
        release: sequences that ended since the last plan (their features are dropped).
        ingest: ``(seq_id, block table, upto)`` of ended sequences whose blocks the prefix cache
            keeps: their waiting target features before ``upto`` go into the drafter's pool
            first (:meth:`~.spec_decode.dflash.DFlashProposer.ingest`).
        capture: whether the target features of the iteration's positions are kept for the
            drafter. False: none are (the eager forward captures no layers; a compiled or
            replayed one computes them as always, and they are not stored), for iterations that
            no drafting block will see (the engine's ``_captures``); the positions they leave
            out are a gap in each sequence's context
            (:meth:`~.spec_decode.dflash.DFlashProposer.ready`).
    """

    items: list[StepItem]
    draft_block: int = 0
    release: list[int] = field(default_factory=list)
    ingest: list[tuple[int, list[int], int]] = field(default_factory=list)
    capture: bool = True


@dataclass
class StepOutput:
    """What an iteration produced, per item (same order as ``StepPlan.items``).

    Attributes:
        drafts: proposed draft tokens (empty for items without drafts).
        choice: per item, the target's token after each of its logits rows: the argmax, or
            for an item with ``sampling`` a sample (computed for the whole batch on the device,
            one host copy).
        accepted: per item, its drafts accepted against ``choice`` (the longest matching
            prefix, on the device: ``dflash::accept``); None for items without drafts.
        shadow: per item, the drafter's token one position past its drafts where the drafter's
            block reached that far (:meth:`LLMEngine.draft_block`), not verified: it would have
            been accepted exactly when every draft is and it equals the bonus token
            (``choice[accepted]``), the next position's acceptance measured for free; None
            without one (no drafts, the drafter did not run, or the drafts fill the block).
        probes: per item, its unverified draft tokens (:attr:`StepItem.probe_draft` of them;
            None for other items).
        draft_s, target_s: wall seconds of the drafter and target forwards (CUDA: event
            timings, read after the iteration's one synchronisation).
        ingest_s: wall seconds of writing ended sequences' target features into the drafter's
            pool (:attr:`StepPlan.ingest`; host clock), work of either mode.
        target_tokens: tokens in the target forward.
        drafter_ran: the drafter's forward ran (False when nothing was drafted, or when
            prompt-lookup tokens filled every draft position).
        replayed: the target forward was replayed from CUDA graphs (``runtime/cuda_graphs.py``;
            False: it ran eagerly).
        prompt_replays: of those, prompt chunks replayed from prompt-chunk graphs (one each).
        captured: the iteration captured a graph (the target's or the drafter's) on first use:
            its timings include the capture (on an H200 tens of milliseconds against a ~5 ms step).
    """

    drafts: list[list[int]]
    choice: list[list[int]] = field(default_factory=list)
    accepted: list[int | None] = field(default_factory=list)
    shadow: list[int | None] = field(default_factory=list)
    probes: list[list[int] | None] = field(default_factory=list)
    draft_s: float = 0.0
    target_s: float = 0.0
    ingest_s: float = 0.0
    target_tokens: int = 0
    drafter_ran: bool = False
    replayed: bool = False
    prompt_replays: int = 0
    captured: bool = False


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
    Kept as ``nn.Linear`` when oneDNN-prepacked: the drafter's k/v projections (stacked into one
    context-K/V GEMM in :meth:`DFlashDrafter.forward`) and, under tensor parallelism, the
    target's LM head (it carries the vocab-parallel all-gather hook).

    The drafter's dense linears run through the batch-invariant kernel on the eager CPU path
    in fp32, and in bf16 where oneDNN has no bf16 GEMM (:func:`drafter_kernel_linears`): not
    for invariance (drafts never change the output) but because the kernel is the fastest CPU
    GEMM here at draft sizes.

    The target's RMSNorms run through the one-call ``dflash_cpu::rms_norm`` on the CPU in fp32 /
    bf16 where the kernels build, eager and compiled alike (one opaque call in the graph, so both
    paths get the same bits; :func:`~dflash_trt.models.layers.set_cpu_norm_kernel`); the
    drafter's in bf16 too, where the kernel gives torch's bits (a drafter norm 55 us through
    torch's composite, 10 a drafter forward), and torch's in fp32 (the kernel sums in another
    order there, and the drafter's outputs stay bit-equal to the z-lab reference's).

    In the batch-invariant mode on the eager path the target's dense layers are planned for
    ``dflash_cpu::dense_layer`` (``target.dense_layers``, :mod:`~dflash_trt.models.fused_layer`):
    one C++ call a layer on uniform steps, the same bits as the Python layer."""
    set_batch_invariant(target, batch_invariant)
    w = target.embed.weight
    set_cpu_norm_kernel(target, resolve_batch_invariant(None, w.device, w.dtype))
    # batch-invariant dense layers in one C++ call each on uniform steps (models/fused_layer.py)
    target.dense_layers = plan_dense_layers(target) if batch_invariant and not compile else None
    if drafter is not None:
        set_batch_invariant(drafter, not compile and drafter_kernel_linears(drafter))
        dw = drafter.hidden_norm.weight
        set_cpu_norm_kernel(drafter, dw.dtype == torch.bfloat16 and resolve_batch_invariant(None, dw.device, dw.dtype))
    for model, skip in ((target, ("lm_head",) if tensor_parallel else ()), (drafter, ("k_proj", "v_proj"))):
        if model is None or (model is target and batch_invariant):
            continue
        if compile:
            unpack_linears(model)
        else:
            pack_linears(model, skip=skip)


def drafter_kernel_linears(drafter: DFlashDrafter) -> bool:
    """Whether the drafter's dense linears should run through ``dflash_cpu::bi_linear_packed``
    (:class:`~dflash_trt.models.batch_invariant.BatchInvariantLinear`) rather than ``F.linear``:
    where the target's mode would be on by default (CPU, fp32 / bf16, the kernels build here;
    :func:`~dflash_trt.models.batch_invariant.resolve_batch_invariant`), except bf16 where
    oneDNN has bf16 (its prepacked GEMM stays).

    Measured (2-core AMD EPYC, AVX2 without AVX512-BF16, torch 2.13, 2 threads, 8 rows,
    ``bench/bi_linear.py --rows 8``): the kernel takes 0.14-0.22x ``F.linear``'s time in bf16
    and 0.32-0.56x in fp32; the shipped drafter's forward at block 8 in bf16, as the adaptive
    controller fits it in the load bench, went from 10.4 / 32.3 to 6.3 / 16.6 ms at 1 / 4
    sequences (docs/peers.md)."""
    w = next(drafter.parameters())
    if w.dtype == torch.bfloat16 and onednn_available():
        return False
    return resolve_batch_invariant(None, w.device, w.dtype)


class ModelRunner:
    """Runs :class:`StepPlan` s on a target (and its drafter) over paged KV pools.

    Args:
        target: the target model (this rank's shard under TP).
        drafter: the DFlash drafter (replicated under TP), or None.
        config: the engine's resolved settings (``runtime/config.py``): the pool geometry
            (``cache``: ``kv_capacity // tokens_per_block`` blocks), the most sequences per
            iteration (the largest CUDA-graph bucket), ``model.compile`` (forwards through
            :func:`~.compiled.compiled_forward`), ``model.cuda_graphs`` (decode-only iterations
            replayed from CUDA graphs per batch-size bucket, :mod:`~.cuda_graphs`; on the CPU
            the same padded static-buffer path runs without capture, for the tests) and
            ``model.batch_invariant`` (:mod:`~dflash_trt.models.batch_invariant`: each row's
            logits the same bits whatever else is in the forward; None: on for fp32 / bf16
            CPU targets).
        tp: tensor-parallel group helper (``distributed.TPGroup``) or None.
        proposer_cls: the draft proposer (:class:`~.spec_decode.dflash.DFlashProposer`; a test
            may substitute its own).

    Raises:
        ConfigError: ``cuda_graphs`` under tensor parallelism; ``batch_invariant`` off the CPU
            or with ``cuda_graphs``.

    Memory: target pool ``2 * L * (num_blocks * tokens_per_block + 1) * Hkv * D`` elements,
    the proposer's drafter pool likewise with the drafter's layer and head counts.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None,
        config: EngineConfig,
        tp=None,
        proposer_cls: type[DFlashProposer] = DFlashProposer,
    ):
        m = config.model
        if m.cuda_graphs and tp is not None:
            raise ConfigError("cuda_graphs", "is not supported under tensor parallelism yet")
        w = target.embed.weight
        batch_invariant = m.batch_invariant
        if m.cuda_graphs and batch_invariant is None:
            batch_invariant = False  # graphs are a CUDA path (the CPU runs it uncaptured, for tests)
        batch_invariant = resolve_batch_invariant(batch_invariant, w.device, w.dtype)
        if m.cuda_graphs and batch_invariant:
            raise ConfigError("batch_invariant", "runs on the CPU, without CUDA graphs")
        self.target, self.tp = target, tp
        self.batch_invariant = batch_invariant
        # models/cpu_linear.py, models/batch_invariant.py
        cpu_weight_layout(target, drafter, tp is not None, m.compile, batch_invariant)
        # the target's forward: eager, or compiled by inductor (runtime/compiled.py)
        self.forward = compiled_forward(target) if m.compile else target
        self.compile = m.compile
        #: greedy steps' token choice through an int8 screen of the LM head (the full head's
        #: tokens from a quarter of an fp32 head's bytes, half a bf16 one's: models/screened_head.py)
        #: on the eager batch-invariant path without tensor parallelism, or None
        self.screen = None
        if batch_invariant and not m.compile and tp is None and ScreenedHead.supports(target.lm_head):
            self.screen = ScreenedHead(target.lm_head)
        self.dtype, self.device = w.dtype, w.device
        if self.device.type == "cpu":
            retain_freed_memory()  # freed activations stay in the heap (runtime/cpu_memory.py)
        self.tpb = config.cache.tokens_per_block
        num_blocks = config.cache.kv_capacity // self.tpb
        tc = target.cfg
        self.tcache = PagedKVCache(tc.num_layers, num_blocks, self.tpb, tc.num_kv_heads, tc.head_dim, w.dtype, w.device)
        self.spare_slot = num_blocks * self.tpb
        # the window of the target's sliding-window attention layers (gpt-oss), planned into the metadata
        self.target_window = tc.sliding_window if tc.has_sliding_layers else None
        self.proposer = None
        if drafter is not None:
            self.proposer = proposer_cls(drafter, target, num_blocks, self.tpb, self.spare_slot, m.compile, tp)
        #: target layers whose outputs the proposer reads
        self.capture: tuple[int, ...] = self.proposer.capture if self.proposer else ()
        self.graphs = None
        if m.cuda_graphs:  # decode-only iterations replayed from graphs per batch bucket (runtime/cuda_graphs.py)
            self.graphs = GraphedTarget(
                self.forward,
                target.rope,
                target.lm_head,
                self.tcache.layers,
                self.capture,
                self.spare_slot,
                config.scheduler.max_batch_size,
                capture_graphs=self.device.type == "cuda",
                tokens_per_block=self.tpb,
                window=self.target_window,
            )
            if self.proposer is not None:  # and the drafter's forward (runtime/drafter_graphs.py)
                self.proposer.enable_graphs(config.scheduler.max_batch_size, self.device.type == "cuda")
            if m.cuda_graph_capture_len:
                self.capture_graphs(m.cuda_graph_capture_len, config.speculative.block_size or 1)

    def capture_graphs(self, max_len: int, block_size: int) -> int:
        """Capture the CUDA graphs of contexts up to ``max_len`` tokens now (at start-up, as vLLM
        does): the target's for every batch bucket x :func:`~.cuda_graphs.capture_queries` of
        ``block_size`` x key bucket, and the drafter's (every context-row bucket, a drafting
        graph per batch and key bucket), each on padding only, so that no serving iteration pays
        for a capture (on an H200 tens of milliseconds each against a ~5 ms replayed step). On
        the CPU the same static buffers are made without capture. Returns the graphs made
        (those already there count once).

        Raises:
            ValueError: CUDA graphs are not enabled on this runner.
        """
        if self.graphs is None:
            raise ValueError("capture_graphs needs a runner built with cuda_graphs")
        t, before = time.perf_counter(), self.graph_count()
        # the largest first (as vLLM): the RoPE tables are sized once, and the graph pool's memory,
        # sized by the first capture, serves the smaller ones
        batches = batch_buckets(self.graphs.max_batch)[::-1]
        keys = key_buckets(max_len)
        queries = capture_queries(block_size if self.proposer is not None else 1)[::-1]
        gt, dev = self.graphs, self.device
        dg = self.proposer.graphs if self.proposer is not None else None
        jobs = [partial(gt.capture_decode, GraphKey(b, q, k), dev) for k in keys for b in batches for q in queries]
        jobs += [partial(gt.prompt_graph, GraphKey(1, n, k), dev) for k in keys for n in PROMPT_BUCKETS[::-1] if n <= k]
        if dg is not None:
            jobs.append(dg.capture_contexts)
            jobs += [partial(dg.capture_draft, GraphKey(b, block_size, k)) for k in keys for b in batches]
        desc = f"capturing CUDA graphs (contexts up to {keys[0] if keys else 0} tokens)"
        with self.grad_mode():
            for job in tqdm(jobs, desc=desc, unit="graph", disable=dev.type != "cuda"):
                job()
        made = self.graph_count() - before
        log.info("CUDA graphs: %d made in %.1f s", made, time.perf_counter() - t)
        return made

    @property
    def drafter(self) -> DFlashDrafter | None:
        return self.proposer.drafter if self.proposer is not None else None

    def release(self, seq_ids: list[int]) -> None:
        """Drop the per-sequence state of these sequences (the proposer's features)."""
        if self.proposer is not None:
            self.proposer.release(seq_ids)

    def release_all(self) -> None:
        """Drop every sequence's state (a runner reused for new sequences)."""
        if self.proposer is not None:
            self.proposer.release_all()

    def grad_mode(self):
        """inference mode, or no_grad on the compiled path (a compiled graph that writes the KV
        pools cannot run in inference mode)."""
        return torch.no_grad() if self.compile else torch.inference_mode()

    # ---- the iteration ----
    def step(self, plan: StepPlan) -> StepOutput:
        """Run one iteration: drafting for items with ``num_draft > 0``, then one target forward,
        then the target's choices and the acceptance on the device; one host copy at the end.

        Returns:
            :class:`StepOutput`; features of every target position are kept for the drafter
            (none with :attr:`StepPlan.capture` False).
        """
        graphs = self.graph_count()
        with self.grad_mode():
            out = self._step(plan)
        out.captured = self.graph_count() != graphs
        return out

    def graph_count(self) -> int:
        """Graphs made so far (the target's and the drafter's; 0 without CUDA graphs)."""
        n = len(self.graphs.graphs) + len(self.graphs.prompts) if self.graphs is not None else 0
        dg = self.proposer.graphs if self.proposer is not None else None
        return n + (len(dg.drafts) + len(dg.contexts) if dg is not None else 0)

    def _draft(self, items: list[StepItem], block: int) -> tuple[torch.Tensor, bool]:
        """Draft tokens ``[len(items), block - 1]`` (prompt-lookup tokens written over the
        drafter's first ones) and whether the drafter's forward ran."""
        return merge_lookup(
            [it.lookup for it in items],
            [it.num_draft for it in items],
            block,
            self.device,
            lambda: self.proposer.propose(items, block),
        )

    def _drafter_step(self, items: list[StepItem], block: int, out: StepOutput):
        """The iteration's drafter forward: ``(drafting, drafts, probing, probes)``, the indices
        of the items with drafts to verify and their drafts ``[len(drafting), block - 1]``
        (:meth:`_draft`), or of the items with unverified probe drafts
        (:attr:`StepItem.probe_draft`) and the drafter's tokens for them (the same shape), None
        where there are none.

        Raises:
            ValueError: a plan with both kinds of items.
        """
        drafting = [i for i, it in enumerate(items) if it.num_draft > 0]
        probing = [i for i, it in enumerate(items) if it.probe_draft > 0]
        if probing and drafting:
            raise ValueError("a step either verifies drafts or probes the drafter unverified, not both")
        drafts = probes = None
        if drafting:
            drafts, out.drafter_ran = self._draft([items[i] for i in drafting], block)
        elif probing:
            probes, out.drafter_ran = self.proposer.propose([items[i] for i in probing], block), True
        return drafting, drafts, probing, probes

    def _target(
        self,
        plan: StepPlan,
        packed: _Packed,
        prompt_keys: list[GraphKey],
        graph: GraphKey | None,
        inputs: tuple,
        verify_in: dict,
        out: StepOutput,
    ) -> tuple[TargetOutput, torch.Tensor]:
        """The iteration's target forward and the target's token after each logits row (int64
        ``[R]``): prompt chunks replayed from their graphs (``prompt_keys``), a decode graph
        (``graph``), or one eager (or compiled) forward of every item; ``inputs``: the uploaded
        ``(ids, meta, index, off)`` (``off``: the decode part's first token). A greedy eager step
        where the screened head pays (:attr:`screen`) takes its choice, the full head's argmax,
        without the logits (``logits`` None then)."""
        ids, meta, index, off = inputs
        P = len(prompt_keys)
        screen = None
        if P:
            res = self._replay_parts(plan.items[:P], prompt_keys, graph, ids[off:], meta, len(packed.flat) - off)
            out.replayed, out.prompt_replays = True, P
        elif graph is not None:  # (every token has logits, in order: the rows are 0 .. N - 1)
            res = self.graphs.run(graph, ids, meta, len(packed.flat))
            out.replayed = True
        else:  # (compiled: the same layers always, as a change of them compiles a graph of its own)
            greedy = "sampled" not in verify_in and "banned" not in verify_in
            screen = self.screen if greedy and self.screen is not None and self.screen.pays(len(index)) else None
            res = self.forward(
                ids.unsqueeze(0),
                meta,
                self.tcache.layers,
                self.capture if plan.capture or self.compile else (),
                logits_index=index.unsqueeze(0) if screen is None else None,
                hidden_only=screen is not None,
            )
        if screen is not None:
            rows = res.hidden[0].index_select(0, index)
            choice = screen(rows)
            if choice is not None:
                return res, choice
            res.logits = self.target.lm_head(rows).unsqueeze(0)  # (a value not finite: argmax's rules)
        return res, target_tokens(res.logits[0], verify_in.get("sampled"), verify_in.get("banned"))

    def _step(self, plan: StepPlan) -> StepOutput:
        ingest_s = 0.0
        if plan.ingest and self.proposer is not None:
            t0 = time.perf_counter()
            self.proposer.ingest(plan.ingest)
            ingest_s = time.perf_counter() - t0
        self.release(plan.release)
        items = plan.items
        out = StepOutput(
            drafts=[[] for _ in items],
            accepted=[None] * len(items),
            shadow=[None] * len(items),
            probes=[None] * len(items),
            ingest_s=ingest_s,
        )
        if not items:
            return out
        clock = _Clock(self.device)
        drafting, drafts, probing, probes = self._drafter_step(items, plan.draft_block, out)
        clock.mark()
        packed = _Packed(items, drafting, drafts.shape[1] if drafting else 0)
        # under CUDA graphs: items[:P] replay as prompt chunks, the rest (planned as plan_meta) from
        # its decode graph; else one eager forward of every item
        prompt_keys, plan_meta, graph = self._target_plan(items, packed)
        P = len(prompt_keys)
        off = packed.offsets[P] if len(items) > P else len(packed.flat)  # the decode part's first token
        flat_t = torch.tensor(packed.flat, dtype=torch.long)
        if graph is not None:  # padded to the bucket's batch * q tokens
            flat_t = torch.cat([flat_t, flat_t.new_zeros(graph.batch * graph.queries - (len(flat_t) - off))])
        host = [flat_t, torch.tensor(packed.rows, dtype=torch.long), *packed.host_inputs()]
        if plan_meta is not None:
            meta, ids, index, *extra = upload_meta(self.device, plan_meta, *host)  # the iteration's host -> device copy
        else:  # prompt chunks only: their graphs take their tokens from the host
            meta, (ids, index, *extra) = None, upload(self.device, *host)
        verify_in = packed.device_inputs(extra)
        if drafting:  # drafts go into the packed input on the device
            ids[verify_in["dst"]] = drafts.view(-1)[verify_in["src"]]
        res, choice = self._target(plan, packed, prompt_keys, graph, (ids, meta, index, off), verify_in, out)
        to_host = [choice]
        if drafting:  # the longest matching prefix per drafting item, on the device
            acc = accepted(drafts, choice[verify_in["tgt"]], verify_in["n_draft"])
            to_host += [drafts.view(-1), acc.long()]
        to_host += [probes.reshape(-1)] if probing else []
        clock.mark()
        host_out = torch.cat(to_host).tolist()  # the iteration's one device -> host copy
        if probing:  # (the copy's tail: each probing item's row of the drafter's block)
            host_out = _read_probes(host_out, items, probing, probes.shape[1], out)
        out.draft_s, out.target_s = clock.seconds() if drafting or probing else (0.0, sum(clock.seconds()))
        out.target_tokens = len(packed.flat)
        packed.read(host_out, out)
        if self.proposer is not None and plan.capture:
            self._store_features(items, packed, res.features)
        return out

    def _store_features(self, items: list[StepItem], packed: _Packed, features: torch.Tensor) -> None:
        """Hand each item's rows of the forward's ``features`` ``[1, >= N, F]`` to the proposer
        (as row ranges of one tensor: no tensor op per item)."""
        base, store = features[0], self.proposer.store_rows
        for it, row, n in zip(items, packed.offsets, packed.lengths):
            store(it.seq_id, it.start, base, row, n)

    def _target_plan(
        self, items: list[StepItem], packed: _Packed
    ) -> tuple[list[GraphKey], MetaPlan | None, GraphKey | None]:
        """How the iteration's target forward runs: ``(prompt_keys, plan, graph)``. Without CUDA
        graphs, or when neither part below qualifies: ``([], plan of every item, None)``, one
        eager forward. A decode-only iteration whose sequences verify the same number of tokens:
        ``([], plan, its graph)``. Under graphs an iteration with prompt chunks (the leading
        items, up to the last that is not a decode item; at most :data:`~.cuda_graphs.MAX_PROMPT_REPLAYS`)
        replays each chunk from a prompt graph (``prompt_keys``) and the decode items after them
        from their decode graph (``plan`` of those items alone, ``graph``; None, None when there
        are none); if any chunk is longer than the buckets or the decode part has no graph (mixed
        draft lengths), the iteration runs eagerly instead."""

        def plan(first: int) -> MetaPlan:  # the metadata plan of items[first:], packed from their first token
            sub, base = items[first:], packed.offsets[first]
            lengths = packed.lengths[first:]
            offsets = [o - base for o in packed.offsets[first:]]
            return plan_packed(
                [it.start for it in sub],
                lengths,
                offsets,
                lengths,
                [it.table for it in sub],
                self.tpb,
                self.spare_slot,
                target_window=self.target_window,
            )

        if self.graphs is None:
            return [], plan(0), None
        decode = [len(it.tokens) == 1 and it.num_logits == 1 + it.num_draft for it in items]
        P = max((i + 1 for i, d in enumerate(decode) if not d), default=0)  # the prompt chunks: items[:P]
        if P == 0:  # decode only (every token has logits)
            whole = plan(0)
            return [], whole, self.graphs.key(whole, True)
        keys = [self.graphs.prompt_key(len(it.tokens), it.start) for it in items[:P]] if P <= MAX_PROMPT_REPLAYS else []
        if not keys or None in keys:
            return [], plan(0), None
        if len(items) == P:
            return keys, None, None
        rest = plan(P)
        graph = self.graphs.key(rest, True)
        return (keys, rest, graph) if graph is not None else ([], plan(0), None)

    def _replay_parts(
        self,
        chunks: list[StepItem],
        keys: list[GraphKey],
        graph: GraphKey | None,
        ids: torch.Tensor,
        meta: AttentionMetadata | None,
        n: int,
    ) -> TargetOutput:
        """The target forward of an iteration with prompt ``chunks`` from graphs: each chunk
        from its prompt graph (``keys``), then the ``n`` decode tokens ``ids`` (padded, on the
        device) under ``meta`` from ``graph`` (None: no decode items). Returns logits in packed
        row order (each chunk's last ``num_logits`` rows, then every decode token's) and
        features ``[1, N, F]`` in packed order."""
        parts = [
            self.graphs.run_prompt(k, it.tokens, it.start, it.table, it.num_logits, self.device)
            for it, k in zip(chunks, keys)
        ]
        if graph is not None:
            parts.append(self.graphs.run(graph, ids, meta, n))
        feats = [p.features for p in parts]
        return TargetOutput(
            logits=torch.cat([p.logits for p in parts], dim=1),
            features=None if feats[0] is None else torch.cat(feats, dim=1),
        )


class _Packed:
    """An iteration's items packed into one ragged target input: every item's tokens (a
    drafting item's anchor followed by placeholders its drafts fill on the device), the logits
    rows, and the host inputs of verification (where drafts go, which rows each block's
    acceptance reads, sampled and banned rows)."""

    def __init__(self, items: list[StepItem], drafting: list[int], k: int):
        self.items, self.drafting, self.k = items, drafting, k  # k: draft columns per drafting item
        self.lengths = [len(it.tokens) + it.num_draft for it in items]
        self.offsets = list(accumulate(self.lengths[:-1], initial=0))
        self.flat = [x for it in items for x in it.tokens + [0] * it.num_draft]
        ends = [o + n for o, n in zip(self.offsets, self.lengths)]
        self.rows = [e - it.num_logits + j for e, it in zip(ends, items) for j in range(it.num_logits)]
        self.first = list(accumulate([it.num_logits for it in items][:-1], initial=0))  # item -> its first row
        self.sampled = [(self.first[i], it) for i, it in enumerate(items) if it.sampling is not None and it.num_logits]
        self.banned = [
            (self.first[i] + r, t) for i, it in enumerate(items) for r in range(it.banned_rows) for t in it.banned
        ]

    def host_inputs(self) -> list[torch.Tensor]:
        """The verification inputs, in the order :meth:`device_inputs` reads them back."""
        host = []
        if self.drafting:
            items, k = self.items, self.k
            n_draft = [items[i].num_draft for i in self.drafting]
            src = [r * k + j for r, i in enumerate(self.drafting) for j in range(items[i].num_draft)]
            dst = [self.offsets[i] + len(items[i].tokens) + j for i in self.drafting for j in range(items[i].num_draft)]
            tgt = [[self.first[i] + min(j, n) for j in range(k + 1)] for i, n in zip(self.drafting, n_draft)]
            host += [torch.tensor(x, dtype=torch.long) for x in (src, dst, tgt)]
            host.append(torch.tensor(n_draft, dtype=torch.int32))
        if self.sampled:  # rows the target samples, each with its request's settings and uniforms
            host += _sampling_inputs(self.sampled)
        if self.banned:
            host.append(torch.tensor(self.banned, dtype=torch.long))
        return host

    def device_inputs(self, extra: list[torch.Tensor]) -> dict:
        """:meth:`host_inputs` on the device, by name."""
        got, extra = {}, list(extra)
        if self.drafting:
            got["src"], got["dst"], got["tgt"], got["n_draft"] = extra[:4]
            extra = extra[4:]
        if self.sampled:
            rows, temp, top_k, top_p, u = extra[:5]
            extra = extra[5:]
            truncate = any(it.sampling[1] > 0 or it.sampling[2] < 1 for _, it in self.sampled)
            got["sampled"] = SampledRows(rows, temp, top_k, top_p, u, truncate)
        if self.banned:
            pairs = extra[0]
            got["banned"] = (pairs[:, 0], pairs[:, 1])
        return got

    def read(self, host: list[int], out: StepOutput) -> None:
        """Fill ``out`` from the iteration's one host copy: the choices of every row, then each
        drafting item's ``k`` draft columns (the one past its drafts its shadow token, where the
        drafter wrote it), then its accepted count."""
        items, k, r = self.items, self.k, len(self.rows)
        for n, i in enumerate(self.drafting):
            nd = items[i].num_draft
            out.drafts[i] = host[r + n * k : r + n * k + nd]
            if nd < k and out.drafter_ran:
                out.shadow[i] = host[r + n * k + nd]
            out.accepted[i] = host[r + len(self.drafting) * k + n]
        out.choice = [host[f : f + it.num_logits] for f, it in zip(self.first, items)]


def _read_probes(host: list[int], items: list[StepItem], probing: list[int], k: int, out: StepOutput) -> list[int]:
    """Fill ``out.probes`` from the tail of the iteration's host copy (``k`` drafter tokens per
    probing item, in order); returns the copy without it."""
    tail, host = host[-len(probing) * k :], host[: -len(probing) * k]
    for n, i in enumerate(probing):
        out.probes[i] = tail[n * k : n * k + items[i].probe_draft]
    return host


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
