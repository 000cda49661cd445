"""Self-distillation data for DFlash drafter training (paper arXiv:2602.06036 §4: the drafter
learns from the target's own responses, not the dataset's).

Prompts come from ShareGPT (:func:`dflash_trt.prompts.sharegpt_prompts`, decontaminated against
the evaluation sets) or a prompts file. :func:`generate_dataset` has the target answer each prompt
(greedy for most, sampled for a fraction) and writes the token ids as shards in a directory;
:func:`load_dataset` reads them back.

Directory layout (``out_dir``)::

    manifest.json                 settings, target, prompt count, shard list, totals
    shard-00000.safetensors       one shard per ``shard_size`` consecutive prompts
    shard-00001.safetensors       ...

Each shard holds, for its ``n`` samples (ordered by prompt index):

- ``input_ids``   int32 ``[T]``   prompt (chat template applied) + response ids, all samples
  concatenated; the response ends with the stop token when one ended it;
- ``offsets``     int64 ``[n+1]`` sample ``i`` is ``input_ids[offsets[i]:offsets[i+1]]``;
- ``loss_mask``   uint8 ``[T]``   1 on response tokens, 0 on prompt tokens;
- ``prompt_index`` int64 ``[n]``  index into the ``prompts`` list given to :func:`generate_dataset`;
- ``sampled``     uint8 ``[n]``   1 when the response was sampled (temperature > 0), 0 when greedy;
- ``stopped``     uint8 ``[n]``   1 when a stop token ended the response, 0 when it hit the length limit.

Shards are written atomically (temporary file, then rename), so an interrupted run leaves only
complete shards and re-running with the same directory continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import atomic_write, write_json
from ..errors import DFlashError

FORMAT = "dflash-trt-selfdistill"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_TEMPLATE = "shard-{:05d}.safetensors"


# ----------------------------------------------------------------------------- dataset files


@dataclass(frozen=True)
class Sample:
    """One training sample.

    Attributes:
        input_ids: prompt (chat template applied) followed by the target's response.
        loss_mask: same length; 1 on response tokens (stop token included), 0 on prompt tokens.
        prompt_index: index of its prompt in the list given to :func:`generate_dataset`.
        sampled: True when the response was sampled at the dataset's temperature, False when greedy.
        stopped: True when a stop token ended the response, False when it hit ``max_new_tokens``.
        labels: ``text`` (the response is the target's own: train on its tokens) or ``target``
            (text written by someone else: train on the target's greedy predictions along it,
            :mod:`dflash_trt.training.feature_cache`).
    """

    input_ids: list[int]
    loss_mask: list[int]
    prompt_index: int
    sampled: bool
    stopped: bool
    labels: str = "text"

    @property
    def response_start(self) -> int:
        """Index in ``input_ids`` of the first response token."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)


def _read_manifest(out_dir: Path) -> dict:
    path = out_dir / MANIFEST
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DFlashError(f"{out_dir} has no {MANIFEST}: not a self-distillation dataset") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"cannot read {path} ({type(e).__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path} is corrupt (not JSON: {e.msg})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DFlashError(f"{path} is not a {FORMAT} manifest")
    if m.get("version") != FORMAT_VERSION:
        raise DFlashError(f"{path} has format version {m.get('version')!r}; this code reads {FORMAT_VERSION}")
    try:
        int(m["num_prompts"]), int(m["shard_size"]), int(m["num_shards"]), dict(m["settings"])
        [str(s["file"]) for s in m["shards"]]
    except (KeyError, TypeError, ValueError):
        raise DFlashError(f"{path} is corrupt (missing or malformed fields)") from None
    return m


def _load_shard(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except FileNotFoundError:
        raise DFlashError(f"dataset shard {path} is missing (re-run generation with the same directory)") from None
    except (OSError, SafetensorError) as e:
        raise DFlashError(f"dataset shard {path} is corrupt ({type(e).__name__}: {e})") from None
    need = ("input_ids", "offsets", "loss_mask", "prompt_index", "sampled", "stopped")
    missing = [k for k in need if k not in t]
    if missing:
        raise DFlashError(f"dataset shard {path} lacks {', '.join(missing)}")
    n = t["prompt_index"].numel()
    if (
        t["offsets"].numel() != n + 1
        or t["input_ids"].numel() != t["loss_mask"].numel()
        or int(t["offsets"][-1]) != t["input_ids"].numel()
    ):
        raise DFlashError(f"dataset shard {path} is corrupt (inconsistent sizes)")
    return t


def _shard_entry(path: Path, first: int, count: int, wall_s: float | None, batch_size: int | None) -> dict:
    t = _load_shard(path)
    n = t["prompt_index"].numel()
    return {
        "file": path.name,
        "first_prompt": first,
        "num_prompts": count,
        "samples": n,
        "skipped": count - n,
        "tokens": t["input_ids"].numel(),
        "response_tokens": int(t["loss_mask"].sum()),
        "sampled": int(t["sampled"].sum()),
        "stopped": int(t["stopped"].sum()),
        "wall_s": wall_s,
        "batch_size": batch_size,
    }


def _write_shard(
    path: Path, first: int, count: int, rows: list[tuple], wall_s: float | None, batch_size: int | None
) -> dict:
    """Write one shard atomically; ``rows`` are ``(prompt index, ids, loss mask, sampled,
    stopped)`` in prompt order. Returns its manifest entry."""
    from safetensors.torch import save_file

    flat, mask, offsets = [], [], [0]
    for _, ids, m, _, _ in rows:
        flat += ids
        mask += m
        offsets.append(len(flat))
    tensors = {
        "input_ids": torch.tensor(flat, dtype=torch.int32),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "prompt_index": torch.tensor([r[0] for r in rows], dtype=torch.int64),
        "sampled": torch.tensor([r[3] for r in rows], dtype=torch.uint8),
        "stopped": torch.tensor([r[4] for r in rows], dtype=torch.uint8),
    }
    meta = {"format": FORMAT, "version": str(FORMAT_VERSION), "first_prompt": str(first), "num_prompts": str(count)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
    return {
        "file": path.name,
        "first_prompt": first,
        "num_prompts": count,
        "samples": len(rows),
        "skipped": count - len(rows),
        "tokens": len(flat),
        "response_tokens": sum(mask),
        "sampled": int(tensors["sampled"].sum()),
        "stopped": int(tensors["stopped"].sum()),
        "wall_s": None if wall_s is None else round(wall_s, 3),
        "batch_size": batch_size,
    }


def _totals(entries: list[dict]) -> dict:
    """Sums of the shard entries' counters (the manifest's ``totals``)."""
    return {
        k: sum(e[k] for e in entries) for k in ("samples", "skipped", "tokens", "response_tokens", "sampled", "stopped")
    }


def _request_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1


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
    """Have ``target`` answer ``prompts`` and store prompt + response ids as shards in ``out_dir``.

    Each prompt becomes one user turn in the target's chat template (a message list: that
    conversation; :func:`dflash_trt.prompts.chat_prompt_ids`); the response is generated
    by plain decoding through the in-flight-batching engine
    (:class:`~dflash_trt.runtime.engine.LLMEngine`, block size 1) on the target's own dtype and
    device, up to ``max_new_tokens`` tokens or a stop token (kept): at most ``batch_size``
    sequences decode together and a finished one is replaced by the next prompt at once, so the
    batch stays full (a GPU runs hundreds). A fixed random ``round(sampled_fraction *
    len(prompts))`` of the prompts (chosen with ``seed``) are sampled at ``temperature`` with a
    per-prompt seed derived from ``seed`` and the prompt index; the others are greedy. So the
    data is reproducible run to run (up to the last-bit numerics of batched GEMMs).

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
    from tqdm import tqdm

    from ..prompts import chat_prompt_ids
    from ..runtime.engine import EngineConfig, LLMEngine
    from ..runtime.request import Request
    from ..runtime.sampling import SamplingParams

    if not prompts:
        raise DFlashError("no prompts to generate a dataset from")
    if not all(isinstance(p, (str, list)) for p in prompts):
        raise DFlashError("prompts must be strings or message lists")
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("batch_size", batch_size),
        ("shard_size", shard_size),
        ("max_num_tokens", max_num_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DFlashError(f"{name} must be an integer >= 1, got {value!r}")
    if not 0.0 <= sampled_fraction <= 1.0:
        raise DFlashError(f"sampled_fraction must be in [0, 1], got {sampled_fraction}")
    if sampled_fraction > 0 and not temperature > 0:
        raise DFlashError(f"temperature must be > 0 when sampled_fraction > 0, got {temperature}")
    if max_minutes is not None and not max_minutes > 0:
        raise DFlashError(f"max_minutes must be > 0, got {max_minutes}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DFlashError(f"{out_dir} exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"cannot create {out_dir} ({type(e).__name__}: {e})") from None

    model = target.model
    dtype = str(model.embed.weight.dtype).replace("torch.", "")
    N = len(prompts)
    num_shards = -(-N // shard_size)
    identity = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "target": str(target.path),
        "dtype": dtype,
        "num_prompts": N,
        "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "shard_size": shard_size,
        "num_shards": num_shards,
        "settings": {
            "max_new_tokens": max_new_tokens,
            "sampled_fraction": sampled_fraction,
            "temperature": temperature,
            "seed": seed,
            "block_size": 1,
        },
    }
    if (out_dir / MANIFEST).exists():
        old = _read_manifest(out_dir)
        for key, value in identity.items():
            if old.get(key) != value:
                raise DFlashError(
                    f"{out_dir} holds a dataset made with another {key} "
                    f"({old.get(key)!r} vs {value!r}); use a new directory"
                )
    elif any(out_dir.glob("shard-*.safetensors")):
        raise DFlashError(f"{out_dir} has shards but no {MANIFEST}; use a new directory")

    shard_paths = [out_dir / SHARD_TEMPLATE.format(i) for i in range(num_shards)]
    entries: dict[int, dict] = {}
    old_entries = {}
    if (out_dir / MANIFEST).exists():
        old_entries = {s["file"]: s for s in _read_manifest(out_dir)["shards"]}
    for i, p in enumerate(shard_paths):
        if p.is_file():
            first, count = i * shard_size, min(shard_size, N - i * shard_size)
            e = old_entries.get(p.name)
            entries[i] = e if e is not None else _shard_entry(p, first, count, None, None)

    def write_manifest(complete: bool) -> None:
        shards = [entries[i] for i in sorted(entries)]
        totals = _totals(shards)
        write_json(
            out_dir / MANIFEST,
            {
                **identity,
                "source": source,
                "batch_size": batch_size,
                "max_position_embeddings": model.cfg.max_position_embeddings,
                "stop_token_ids": list(target.stop_token_ids),
                "complete": complete,
                "totals": totals,
                "shards": shards,
            },
        )

    todo = [i for i in range(num_shards) if i not in entries]
    write_manifest(not todo)
    if not todo:
        return out_dir

    k = round(sampled_fraction * N)
    sampled = set(random.Random(seed).sample(range(N), k)) if k else set()
    limit = model.cfg.max_position_embeddings
    done_prompts = sum(entries[i]["num_prompts"] for i in entries)
    bar = tqdm(
        total=N, initial=done_prompts, desc="self-distill", unit="prompt", disable=not progress, dynamic_ncols=True
    )
    engine, engine_len = None, 0  # the engine and the longest sequence its KV pools admit
    gen_tokens, gen_s = 0, 0.0
    t_run = time.perf_counter()
    try:
        for i in todo:
            if max_minutes is not None and time.perf_counter() - t_run > 60 * max_minutes:
                break
            first, count = i * shard_size, min(shard_size, N - i * shard_size)
            t_shard = time.perf_counter()
            ids = {j: chat_prompt_ids(target.tokenizer, prompts[j]) for j in range(first, first + count)}
            keep = [j for j in ids if len(ids[j]) + max_new_tokens <= limit]
            bar.update(count - len(keep))
            need = max((len(ids[j]) for j in keep), default=0) + max_new_tokens + 1  # admission's worst case
            if keep and need > engine_len:
                tpb = 16
                engine_len = -(-need // tpb) * tpb
                engine = LLMEngine(
                    model,
                    None,
                    target.stop_token_ids,
                    EngineConfig(
                        block_size=1,
                        max_batch_size=batch_size,
                        max_num_tokens=max(max_num_tokens, need),
                        tokens_per_block=tpb,
                        kv_capacity_tokens=engine_len * batch_size,
                    ),
                )
            outs: dict[int, tuple[list[int], bool]] = {}
            for j in keep:
                sp = SamplingParams(temperature, seed=_request_seed(seed, j)) if j in sampled else SamplingParams()
                engine.add_request(Request(ids[j], max_new_tokens, sp), seq_id=j)
            t = time.perf_counter()
            while keep and engine.has_unfinished():
                for seq in engine.step():
                    r = engine.result(seq.seq_id)
                    outs[seq.seq_id] = (r.output_ids, r.finish_reason == "stop")
                    gen_tokens += len(r.output_ids)
                    bar.update(1)
                    rate = gen_tokens / max(gen_s + time.perf_counter() - t, 1e-9)
                    bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
            gen_s += time.perf_counter() - t
            rows = [
                (j, ids[j] + outs[j][0], [0] * len(ids[j]) + [1] * len(outs[j][0]), j in sampled, outs[j][1])
                for j in keep
            ]
            entries[i] = _write_shard(shard_paths[i], first, count, rows, time.perf_counter() - t_shard, batch_size)
            write_manifest(len(entries) == num_shards)
    finally:
        bar.close()
    return out_dir


def conversation_ids(
    tokenizer, messages: list[dict], stop_token_ids: tuple[int, ...]
) -> tuple[list[int], list[int]] | None:
    """Token ids of a conversation in the chat template and a loss mask that is 1 on every
    assistant turn's tokens up to and including its first stop token (what the target would
    have generated for that turn); None when the template does not extend a conversation's
    prefix token for token (the masks would be ambiguous)."""
    from ..prompts import chat_ids

    ids = chat_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    stops = set(stop_token_ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
        upto = chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if ids[: len(head)] != head or ids[: len(upto)] != upto:
            return None
        for p in range(len(head), len(upto)):
            mask[p] = 1
            if ids[p] in stops:
                break
    return ids, mask


def write_text_dataset(
    target,
    conversations: list[list[dict]],
    out_dir: Path,
    max_seq_len: int = 2048,
    shard_size: int = 1024,
    source: str | None = None,
    progress: bool = True,
) -> Path:
    """Write conversations written by others (e.g. ShareGPT's) as a training dataset labelled
    by the target: no generation, only tokenizing; the trainer teaches the drafter the target's
    own greedy predictions along this text (``labels: target`` in the manifest, see
    :mod:`dflash_trt.training.feature_cache`: "labels at prefill speed").

    Same directory format as :func:`generate_dataset` (``prompt_index`` = the conversation's
    index, ``sampled`` 0, ``stopped`` 1 when its last assistant turn ends in a stop token);
    the loss mask covers every assistant turn. Conversations are cut to ``max_seq_len`` tokens;
    those the template tokenizes ambiguously or with no assistant token are skipped (counted).

    Args:
        target: a :class:`~dflash_trt.checkpoints.loader.LoadedTarget` (tokenizer and stop ids).
        conversations: message lists (``role`` / ``content``), e.g.
            :func:`dflash_trt.prompts.sharegpt_conversations`.
        out_dir: a new (or empty) directory.

    Raises:
        DFlashError: ``out_dir`` holds files, no conversations, bad ``max_seq_len`` /
            ``shard_size``, a tokenizer without a chat template.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DFlashError(f"{out_dir} exists and is not an empty directory")
    if not conversations:
        raise DFlashError("no conversations to write")
    for name, value in (("max_seq_len", max_seq_len), ("shard_size", shard_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise DFlashError(f"{name} must be an integer >= 2, got {value!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    N = len(conversations)
    num_shards = -(-N // shard_size)
    stops = tuple(target.stop_token_ids)
    entries = []
    for i in tqdm(range(num_shards), desc="tokenize", unit="shard", disable=not progress, dynamic_ncols=True):
        first, count = i * shard_size, min(shard_size, N - i * shard_size)
        rows = []
        for j in range(first, first + count):
            got = conversation_ids(target.tokenizer, conversations[j], stops)
            if got is None:
                continue
            ids, mask = got[0][:max_seq_len], got[1][:max_seq_len]
            if sum(mask) >= 2:
                rows.append((j, ids, mask, False, ids[-1] in stops and mask[-1] == 1))
        entries.append(_write_shard(out_dir / SHARD_TEMPLATE.format(i), first, count, rows, None, None))
    totals = _totals(entries)
    write_json(
        out_dir / MANIFEST,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "labels": "target",
            "target": str(target.path),
            "num_prompts": N,
            "prompts_sha256": hashlib.sha256(json.dumps(conversations).encode()).hexdigest(),
            "shard_size": shard_size,
            "num_shards": num_shards,
            "settings": {"kind": "text", "max_seq_len": max_seq_len},
            "source": source,
            "stop_token_ids": list(stops),
            "complete": True,
            "totals": totals,
            "shards": entries,
        },
    )
    return out_dir


def read_manifest(out_dir: Path) -> dict:
    """The ``manifest.json`` of a dataset directory, checked for format and version.

    Raises:
        DFlashError: missing directory or manifest, corrupt or foreign manifest.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise DFlashError(f"dataset directory {out_dir} does not exist")
    return _read_manifest(out_dir)


def load_dataset(out_dir: Path, allow_incomplete: bool = False) -> list[Sample]:
    """Read a dataset written by :func:`generate_dataset`.

    Args:
        out_dir: the dataset directory.
        allow_incomplete: return the shards written so far of an unfinished dataset instead of
            raising.

    Returns:
        The samples ordered by prompt index (skipped prompts absent).

    Raises:
        DFlashError: missing directory or manifest, corrupt manifest or shard, a listed shard
            missing, or an incomplete dataset without ``allow_incomplete``.
    """
    out_dir = Path(out_dir)
    m = read_manifest(out_dir)
    if not m.get("complete") and not allow_incomplete:
        done = len(m["shards"])
        raise DFlashError(
            f"dataset {out_dir} is incomplete ({done} of {m['num_shards']} shards); "
            "re-run generation with the same directory to finish it"
        )
    samples: list[Sample] = []
    labels = m.get("labels", "text")
    for entry in sorted(m["shards"], key=lambda s: s["file"]):
        t = _load_shard(out_dir / entry["file"])
        ids, mask, off = t["input_ids"].tolist(), t["loss_mask"].tolist(), t["offsets"].tolist()
        for k, (pi, s, st) in enumerate(zip(t["prompt_index"].tolist(), t["sampled"].tolist(), t["stopped"].tolist())):
            a, b = off[k], off[k + 1]
            samples.append(Sample(ids[a:b], mask[a:b], int(pi), bool(s), bool(st), labels))
    samples.sort(key=lambda s: s.prompt_index)
    return samples
