"""Helpers shared by the tests (imported as ``helpers``: pytest puts tests/ on sys.path, and
``tests/tp_worker.py`` runs from this folder)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys

import torch

from dflash_trt.engine_args import EngineArgs
from dflash_trt.models.layers import AttentionMetadata
from dflash_trt.models.prefill import KVCache, first_divergence, top2_margin
from dflash_trt.runtime.engine import LLMEngine
from dflash_trt.runtime.model_runner import ModelRunner
from dflash_trt.runtime.request import LoopStats, Request, RequestResult
from dflash_trt.runtime.spec_decode.dflash import DFlashProposer

CLI = [sys.executable, "-m", "dflash_trt.cli"]
#: one TLS context for the httpx clients that tests create by the hundred (a stream per client,
#: polling loops): httpx builds a context and loads certifi's CA bundle for every client it
#: creates unless given one (~50 ms each; the servers here speak plain HTTP)
TLS = ssl.create_default_context()
#: fp32 top-2 logit margin below which two decoding runs may differ (a numerical tie)
TIE = 1e-4


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``dflash-trt ARGS`` in a subprocess."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout, env=env)


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The last stderr line, after checking it is our one-line error with exit status 2."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dflash-trt: error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def main_error(capsys, *args: str) -> str:
    """``dflash-trt ARGS`` in this process (``dflash_trt.cli.main``): exit status 2, one error
    line on stderr, no traceback; returns the line."""
    from dflash_trt.cli import main

    capsys.readouterr()
    rc = main(list(args))
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("dflash-trt: error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def shipped_drafter(model, dtype: torch.dtype = torch.float32):
    """The shipped default drafter (``dflash_trt/drafters``) in ``dtype`` on ``model``'s device
    (``DFLASH_TRT_TEST_DEVICE=cuda`` puts the target on a GPU: a drafter left on the CPU beside it
    fails there)."""
    from dflash_trt.checkpoints.loader import DEFAULT_DRAFTER, SHIPPED_DRAFTERS
    from dflash_trt.checkpoints.zlab import load_drafter

    return load_drafter(SHIPPED_DRAFTERS / DEFAULT_DRAFTER, dtype).to(model.embed.weight.device)


def engine_config(**kw):
    """The engine configuration tree of ``EngineArgs(**kw)``."""
    return EngineArgs(**kw).create_engine_config()


def make_engine(
    target,
    drafter=None,
    block_size: int | None = None,
    requests: list[Request] = (),
    proposer_cls: type[DFlashProposer] | None = None,
    stop_token_ids: tuple[int, ...] = (),
    **kw,
) -> LLMEngine:
    """An engine on models already in memory (``target``: a loaded target with its stop ids, or
    a bare ``TargetModel`` with ``stop_token_ids``), every request of ``requests`` admitted at
    once: a batch as large as the list, a token budget for all prompts in one iteration and a KV
    cache just large enough for them (16-position blocks); ``kw``: other ``EngineArgs`` fields
    (they win). ``proposer_cls``: a draft proposer in place of the drafter's (an oracle)."""
    model = getattr(target, "model", target)
    stops = getattr(target, "stop_token_ids", stop_token_ids)
    K = block_size if block_size is not None else (drafter.cfg.block_size if drafter is not None else 1)
    tpb = kw.pop("tokens_per_block", 16)
    need = sum(-(-(len(r.prompt_ids) + r.max_new_tokens + K) // tpb) for r in requests)
    args = dict(
        block_size=K,
        max_batch_size=max(len(requests), 1),
        max_num_tokens=max(sum(len(r.prompt_ids) for r in requests), K * max(len(requests), 1), 1),
        tokens_per_block=tpb,
        kv_capacity=max(need, 1) * tpb,
    )
    config = engine_config(**(args | kw))
    drafter = drafter if K > 1 else None
    runner = None
    if proposer_cls is not None:
        resolved = config.with_defaults(K)
        runner = ModelRunner(model, drafter, resolved, proposer_cls=proposer_cls)
    return LLMEngine(model, drafter, stops, config, runner=runner)


def generate(
    target,
    drafter,
    requests: list[Request],
    block_size: int | None = None,
    stats: LoopStats | None = None,
    on_tokens=None,
    **kw,
) -> list[RequestResult]:
    """Run ``requests`` as one batch on a fresh :func:`make_engine` (``kw`` as there); add the
    run's loop statistics to ``stats``."""
    engine = make_engine(target, drafter, block_size, requests, **kw)
    outs = engine.generate(requests, on_tokens)
    if stats is not None:
        stats.merge(engine.stats)
    return outs


def plain_outputs(
    target, prompts: list[list[int]], max_new: int | list[int], batched: bool = False, **kw
) -> list[list[int]]:
    """Plain decoding (block size 1, no drafter, greedy) of each prompt, one request at a time;
    ``max_new`` for all prompts or one per prompt; ``kw``: ``EngineArgs`` fields.
    ``batched``: all prompts in one batch instead (faster: one decode step for all): with the
    target in batch-invariant mode (fp32 / bf16 on the CPU, the default there) the same tokens
    bit for bit (measured: 16 chat prompts x 16 tokens, 12.4 s batched against 21.3 s one at a
    time, equal; ``tests/test_batch_invariant.py`` holds the mode), otherwise the same except
    where the top-2 logits tie between row counts (for comparisons that allow ties)."""
    lens = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    if batched:
        return [o.output_ids for o in generate(target, None, [Request(p, n) for p, n in zip(prompts, lens)], 1, **kw)]
    return [generate(target, None, [Request(p, n)], 1, **kw)[0].output_ids for p, n in zip(prompts, lens)]


def same_text(target, prompt_ids: list[int], ref_ids: list[int], text: str) -> bool:
    """A server's text is the decoded reference, or they part where the target's top-2 logits
    tie (fp32 margin < TIE)."""
    tok = target.tokenizer
    if text == tok.decode(ref_ids, skip_special_tokens=True):
        return True
    k = first_divergence(ref_ids, tok.encode(text))
    return k is not None and top2_margin(target.model, prompt_ids + ref_ids[:k]) < TIE


def check_same(model, prompt, ref, got) -> int:
    """0 if identical; 1 if they first differ at a numerical tie; fails otherwise."""
    i = first_divergence(ref, got)
    if i is None:
        return 0
    margin = top2_margin(model, prompt + ref[:i])
    assert margin < TIE, f"mismatch at new token {i} with top-2 margin {margin:.3g} (not a tie): {ref} vs {got}"
    return 1


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` relative to the reference's scale (``max(1, max |b|)``): hidden states carry
    activations in the hundreds, where one fp32 ulp is ~1e-4 and a batched GEMM may round
    differently from a one-row one."""
    return max_diff(a, b) / max(1.0, float(b.float().abs().max()))


@torch.inference_mode()
def full_features(model, ids: list[int], capture) -> torch.Tensor:
    """Target features ``[len(ids), len(capture) * hidden]`` of ``ids`` from the runtime's own
    target forward (``TargetModel.forward``, one causal prefill in the model's dtype)."""
    cfg = model.cfg
    S = len(ids)
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, S, model.embed.weight.dtype)
    pos = torch.arange(S).unsqueeze(0)
    out = model(
        torch.tensor([ids]), AttentionMetadata.causal(pos, S), cache.layers, tuple(capture), logits_index=pos[:, -1:]
    )
    return out.features[0].clone()


#: a bf16 tie between two runs of the SAME model whose GEMMs differ only in their row count
#: (1-row decode vs K-row verify) or their fusion (compiled vs eager): at most two bf16 steps of
#: a logit in [16, 32)
ROWS_TIE = 0.25


def same_or_tie(model, prompt: list[int], ref: list[int], got: list[int], tie: float) -> int:
    """0 if ``got == ref``; 1 if they first differ where ``model``'s top-2 margin is <= ``tie``
    (printed); fails otherwise."""
    k = first_divergence(ref, got)
    if k is None:
        return 0
    margin = top2_margin(model, prompt + ref[:k])
    print(f"  diverged at token {k}: top-2 margin {margin:.3f}")
    assert margin <= tie, f"diverged at token {k} with top-2 margin {margin:.3f} (not a tie): {ref} vs {got}"
    return 1


class OracleProposer(DFlashProposer):
    """Drafts ``continuations[seq_id]`` (prompt + its plain-decoding output) with every 5th
    position corrupted, so verify accepts long prefixes and rejects mid-block: exercises
    multi-token acceptance and KV rollback on the real model (a random drafter is almost never
    accepted). Still runs the real drafter forward to keep that path live. Sequence ids are
    request indices; set ``OracleProposer.continuations`` before use."""

    continuations: list[list[int]] = []

    def propose(self, items, block):
        out = super().propose(items, block).clone()  # [S, block - 1] on the device
        for r, it in enumerate(items):
            seq = self.continuations[it.seq_id]
            for j, p in enumerate(range(it.start + 1, it.start + 1 + it.num_draft)):
                tok = seq[p] if p < len(seq) else 0
                out[r, j] = tok if p % 5 else (tok + 1) % self.target.cfg.vocab_size
        return out


def check_lossless_oracle_and_drafter(target, prompts: list[list[int]], new: int, name: str, drafter=None) -> None:
    """DFlash on ``target`` (a loaded target with ``.model``) equals plain decoding token for
    token over ``new`` tokens of each prompt: with :class:`OracleProposer` at batch 1 and in
    flight (tau above 1.5: long acceptances and mid-block rejections), and with ``drafter``
    (block size 4; default a random 1-layer one) for all prompts at once."""
    from dflash_trt.checkpoints.zlab import init_drafter

    ref = plain_outputs(target, prompts, new)
    drafter = drafter or init_drafter(target.model.cfg, 1, 4, 0, seed=0)
    stats = LoopStats(4)
    for i, p in enumerate(prompts):  # batch 1 (sequence ids are request indices within an engine)
        OracleProposer.continuations = [p + ref[i]]
        got = generate(target, drafter, [Request(p, new)], 4, stats, proposer_cls=OracleProposer)[0].output_ids
        assert got == ref[i], i
    OracleProposer.continuations = [p + r for p, r in zip(prompts, ref)]
    reqs = [Request(p, new) for p in prompts]
    in_flight = [o.output_ids for o in generate(target, drafter, reqs, 4, stats, proposer_cls=OracleProposer)]
    drafted = [o.output_ids for o in generate(target, drafter, [Request(p, new) for p in prompts], 4)]
    same = {"oracle": in_flight == ref, "drafter": drafted == ref}
    print(f"\n{name}: oracle tau {stats.tau:.2f}; in flight, equal to plain decoding: {same}")
    assert stats.tau > 1.5
    assert in_flight == ref and drafted == ref


def burst_share(times: list[float], window: float) -> float:
    """The largest share of a stream's chunks that arrived within ``window`` seconds of each other."""
    best, j = 0, 0
    for k in range(len(times)):
        while times[k] - times[j] > window:
            j += 1
        best = max(best, k - j + 1)
    return best / len(times)


def saved_drafter(drafter, directory) -> str:
    """``drafter`` (a copy, on the CPU) saved as a z-lab drafter directory under ``directory``;
    its path, for servers started from settings."""
    import copy

    from dflash_trt.checkpoints.zlab import save_drafter

    return str(save_drafter(copy.deepcopy(drafter).cpu(), directory / "drafter"))


def serving_args(drafter, directory, **kw) -> EngineArgs:
    """The serving tests' engine settings: ``drafter`` (saved under ``directory``) at block size 4
    with the adaptive draft length, fp32 on the CPU, 16-position KV pages, 16384 KV positions;
    ``kw``: other ``EngineArgs`` fields (they win)."""
    base = dict(drafter=saved_drafter(drafter, directory), dtype="fp32", device="cpu", block_size=4, adaptive=True)
    return EngineArgs(**(base | dict(tokens_per_block=16, kv_capacity=16384) | kw))


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (bound together, then released)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
