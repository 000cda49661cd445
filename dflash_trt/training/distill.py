"""Self-distillation data for DFlash drafter training (paper arXiv:2602.06036 §4: the drafter
learns from the target's own responses, not the dataset's).

Prompts come from ShareGPT (:func:`dflash_trt.prompts.sharegpt_prompts`, decontaminated against
the evaluation sets) or a prompts file. :func:`generate_dataset` has the target answer each prompt
(greedy for most, sampled for a fraction) and writes prompt + response token ids as shards in a
training-data directory (:mod:`.dataset`). Re-running with the same directory continues where an
interrupted run stopped.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

from tqdm import tqdm

from ..engine_args import EngineArgs
from ..errors import DFlashError
from ..prompts import chat_prompt_ids
from ..runtime.engine import LLMEngine
from ..runtime.engine_factory import LoadedModels
from ..runtime.request import Request
from ..runtime.sampling import SamplingParams
from .dataset import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SHARD_TEMPLATE,
    read_data_manifest,
    shard_entry,
    write_data_manifest,
    write_shard,
)

TOKENS_PER_BLOCK = 16  # KV page of the generation engine


def request_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt ``index`` in a dataset made with ``seed`` (63 bits of
    sha256, so each sampled prompt draws the same response whatever the batch around it)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1


def _check_settings(prompts: list, ints: dict[str, int], sampled_fraction, temperature, max_minutes) -> None:
    """Raise DFlashError on impossible settings (``ints``: name -> a value that must be >= 1)."""
    if not prompts:
        raise DFlashError("no prompts to generate a dataset from")
    if not all(isinstance(p, (str, list)) for p in prompts):
        raise DFlashError("prompts must be strings or message lists")
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DFlashError(f"{name} must be an integer >= 1, got {value!r}")
    if not 0.0 <= sampled_fraction <= 1.0:
        raise DFlashError(f"sampled_fraction must be in [0, 1], got {sampled_fraction}")
    if sampled_fraction > 0 and not temperature > 0:
        raise DFlashError(f"temperature must be > 0 when sampled_fraction > 0, got {temperature}")
    if max_minutes is not None and not max_minutes > 0:
        raise DFlashError(f"max_minutes must be > 0, got {max_minutes}")


def _open_dir(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DFlashError(f"{out_dir} exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"cannot create {out_dir} ({type(e).__name__}: {e})") from None
    return out_dir


def _done_shards(out_dir: Path, identity: dict) -> dict[int, dict]:
    """Manifest entries of the shards already in ``out_dir`` (by shard number), after checking
    that the dataset there was made the same way (``identity``)."""
    old_entries = {}
    if (out_dir / MANIFEST).exists():
        old = read_data_manifest(out_dir)
        for key, value in identity.items():
            if old.get(key) != value:
                raise DFlashError(
                    f"{out_dir} holds a dataset made with another {key} "
                    f"({old.get(key)!r} vs {value!r}); use a new directory"
                )
        old_entries = {s["file"]: s for s in old["shards"]}
    elif any(out_dir.glob("shard-*.safetensors")):
        raise DFlashError(f"{out_dir} has shards but no {MANIFEST}; use a new directory")
    N, size = identity["num_prompts"], identity["shard_size"]
    entries = {}
    for i in range(identity["num_shards"]):
        p = out_dir / SHARD_TEMPLATE.format(i)
        if p.is_file():
            e = old_entries.get(p.name)
            entries[i] = e if e is not None else shard_entry(p, i * size, min(size, N - i * size))
    return entries


def _new_engine(target, batch_size: int, max_num_tokens: int, need: int) -> tuple[LLMEngine, int]:
    """A plain-decoding engine (block size 1) whose KV pools admit ``batch_size`` sequences of
    ``need`` tokens; returns it and the sequence length it admits."""
    engine_len = -(-need // TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
    args = EngineArgs(
        block_size=1,
        max_batch_size=batch_size,
        max_num_tokens=max(max_num_tokens, need),
        tokens_per_block=TOKENS_PER_BLOCK,
        kv_capacity=engine_len * batch_size,
    )
    return LLMEngine.from_engine_args(args, LoadedModels.of(target)), engine_len


class _Distiller:
    """Has the target answer the prompts of one shard after another and writes each shard. One
    engine serves every shard; it is made again only when a shard needs longer sequences.

    Args:
        sampled: indices of the prompts answered by sampling at ``temperature`` (seeded by
            :func:`request_seed`); the others are greedy.
        bar: the tqdm bar counting prompts (skipped ones included) and showing tokens/s.
    """

    def __init__(
        self,
        target,
        prompts: list,
        max_new_tokens: int,
        batch_size: int,
        max_num_tokens: int,
        sampled: set[int],
        temperature: float,
        seed: int,
        bar,
    ):
        self.target, self.prompts, self.max_new_tokens = target, prompts, max_new_tokens
        self.batch_size, self.max_num_tokens, self.bar = batch_size, max_num_tokens, bar
        self.sampled, self.temperature, self.seed = sampled, temperature, seed
        self.engine, self.engine_len = None, 0  # the engine and the longest sequence its KV pools admit
        self.tokens, self.seconds = 0, 0.0

    def write_shard(self, path: Path, first: int, count: int) -> dict:
        """Answer prompts ``first .. first + count - 1`` (those that fit the target's context
        with ``max_new_tokens`` more) and write them to ``path``; returns its manifest entry."""
        t_shard = time.perf_counter()
        ids = {j: chat_prompt_ids(self.target.tokenizer, self.prompts[j]) for j in range(first, first + count)}
        limit = self.target.model.cfg.max_position_embeddings
        keep = {j: p for j, p in ids.items() if len(p) + self.max_new_tokens <= limit}
        self.bar.update(count - len(keep))
        outs = self._answer(keep)
        rows = [
            (j, p + outs[j][0], [0] * len(p) + [1] * len(outs[j][0]), j in self.sampled, outs[j][1])
            for j, p in keep.items()
        ]
        return write_shard(path, first, count, rows, time.perf_counter() - t_shard, self.batch_size)

    def _answer(self, ids: dict[int, list[int]]) -> dict[int, tuple[list[int], bool]]:
        """Per prompt index: ``(response ids, ended by a stop token)``."""
        need = max((len(p) for p in ids.values()), default=0) + self.max_new_tokens + 1  # admission's worst case
        if ids and need > self.engine_len:
            self.engine, self.engine_len = _new_engine(self.target, self.batch_size, self.max_num_tokens, need)
        engine, outs = self.engine, {}
        for j, p in ids.items():
            greedy = j not in self.sampled
            sp = SamplingParams() if greedy else SamplingParams(self.temperature, seed=request_seed(self.seed, j))
            engine.add_request(Request(p, self.max_new_tokens, sp), seq_id=j)
        t = time.perf_counter()
        while ids and engine.has_unfinished():
            for seq in engine.step():
                r = engine.result(seq.seq_id)
                outs[seq.seq_id] = (r.output_ids, r.finish_reason == "stop")
                self.tokens += len(r.output_ids)
                self.bar.update(1)
                rate = self.tokens / max(self.seconds + time.perf_counter() - t, 1e-9)
                self.bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        self.seconds += time.perf_counter() - t
        return outs


def generate_dataset(
    target,
    prompts: list,
    out_dir: Path,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    sampled_fraction: float = 0.25,
    temperature: float = 0.7,
    seed: int = 0,
    progress: bool = True,
    shard_size: int = 256,
    source: str | None = None,
    max_num_tokens: int = 4096,
    max_minutes: float | None = None,
) -> Path:
    """Have ``target`` answer ``prompts`` and store prompt + response ids as shards in ``out_dir``
    (the directory format of :mod:`.dataset`).

    Each prompt becomes one user turn in the target's chat template (a message list: that
    conversation; :func:`dflash_trt.prompts.chat_prompt_ids`); the response is generated
    by plain decoding through the in-flight-batching engine
    (:class:`~dflash_trt.runtime.engine.LLMEngine`, block size 1) on the target's own dtype and
    device, up to ``max_new_tokens`` tokens or a stop token (kept): at most ``batch_size``
    sequences decode together and a finished one is replaced by the next prompt at once, so the
    batch stays full (a GPU runs hundreds). A fixed random ``round(sampled_fraction *
    len(prompts))`` of the prompts (chosen with ``seed``) are sampled at ``temperature`` with a
    per-prompt seed derived from ``seed`` and the prompt index (:func:`request_seed`); the
    others are greedy. So the data is reproducible run to run (up to the last-bit numerics of
    batched GEMMs).

    Work goes shard by shard (``shard_size`` consecutive prompts, ``shard-NNNNN.safetensors``)
    and is stored in prompt order. Each shard is written atomically; ``manifest.json`` is
    rewritten after each one (``complete: true`` at the end). Re-running with the same
    ``out_dir``, target, dtype, prompts and settings skips the shards already on disk (so a
    deleted or interrupted shard is regenerated); ``batch_size``, ``max_num_tokens`` and
    ``max_minutes`` may change between runs. Prompts whose token count plus ``max_new_tokens``
    exceeds the target's ``max_position_embeddings`` are skipped and counted in the manifest.

    Args:
        target: a :class:`~dflash_trt.checkpoints.loader.LoadedTarget`.
        prompts: prompt texts (e.g. :func:`sharegpt_prompts`) or message lists, no chat
            template applied.
        out_dir: dataset directory (created when missing).
        max_new_tokens: response length limit in tokens (>= 1).
        batch_size: most sequences decoding together (>= 1).
        sampled_fraction: share of prompts answered by sampling, in [0, 1].
        temperature: sampling temperature of those (> 0 when ``sampled_fraction`` > 0).
        seed: seed of the sampled-prompt choice and the per-request sampling seeds.
        progress: show a tqdm bar (prompts, with generated tokens/s).
        shard_size: prompts per shard (>= 1): the unit of resumption.
        source: free text recorded in the manifest (where the prompts came from).
        max_num_tokens: most target tokens per engine iteration (prompt chunks + decode rows).
        max_minutes: stop after the shard during which this much wall time has passed (the
            dataset stays incomplete; a later run continues it); None: no limit.

    Returns:
        ``out_dir``.

    Raises:
        DFlashError: bad settings, empty ``prompts``, an existing ``out_dir`` dataset made with
            another target / dtype / prompts / settings, a corrupt manifest, or a chat-template-less
            tokenizer.
    """
    sizes = {
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "shard_size": shard_size,
        "max_num_tokens": max_num_tokens,
    }
    _check_settings(prompts, sizes, sampled_fraction, temperature, max_minutes)
    out_dir = _open_dir(out_dir)
    model = target.model
    N = len(prompts)
    identity = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "target": str(target.path),
        "dtype": str(model.embed.weight.dtype).replace("torch.", ""),
        "num_prompts": N,
        "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "shard_size": shard_size,
        "num_shards": -(-N // shard_size),
        "settings": {
            "max_new_tokens": max_new_tokens,
            "sampled_fraction": sampled_fraction,
            "temperature": temperature,
            "seed": seed,
            "block_size": 1,
        },
    }
    fields = identity | {
        "source": source,
        "batch_size": batch_size,
        "max_position_embeddings": model.cfg.max_position_embeddings,
        "stop_token_ids": list(target.stop_token_ids),
    }
    entries = _done_shards(out_dir, identity)
    todo = [i for i in range(identity["num_shards"]) if i not in entries]
    write_data_manifest(out_dir, fields, [entries[i] for i in sorted(entries)], not todo)
    if not todo:
        return out_dir
    done = sum(e["num_prompts"] for e in entries.values())
    bar = tqdm(total=N, initial=done, desc="self-distill", unit="prompt", disable=not progress, dynamic_ncols=True)
    k = round(sampled_fraction * N)
    sampled = set(random.Random(seed).sample(range(N), k)) if k else set()
    distiller = _Distiller(target, prompts, max_new_tokens, batch_size, max_num_tokens, sampled, temperature, seed, bar)
    t_run = time.perf_counter()
    try:
        for i in todo:
            if max_minutes is not None and time.perf_counter() - t_run > 60 * max_minutes:
                break
            first, count = i * shard_size, min(shard_size, N - i * shard_size)
            entries[i] = distiller.write_shard(out_dir / SHARD_TEMPLATE.format(i), first, count)
            write_data_manifest(
                out_dir, fields, [entries[e] for e in sorted(entries)], len(entries) == identity["num_shards"]
            )
    finally:
        bar.close()
    return out_dir
