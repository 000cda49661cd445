"""Training data from text written by others (e.g. ShareGPT conversations), labelled by the
target: no generation, only tokenizing; the trainer teaches the drafter the target's own greedy
predictions along the text (:mod:`.feature_cache`: "labels at prefill speed"). Written in the
training-data directory format of :mod:`.dataset`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import DFlashError
from .dataset import SHARD_TEMPLATE, write_data_manifest, write_shard


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

    The directory format of :mod:`.dataset` (``prompt_index`` = the conversation's index,
    ``sampled`` 0, ``stopped`` 1 when its last assistant turn ends in a stop token); the loss
    mask covers every assistant turn. Conversations are cut to ``max_seq_len`` tokens;
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
        entries.append(write_shard(out_dir / SHARD_TEMPLATE.format(i), first, count, rows, None, None))
    fields = {
        "labels": "target",
        "target": str(target.path),
        "num_prompts": N,
        "prompts_sha256": hashlib.sha256(json.dumps(conversations).encode()).hexdigest(),
        "shard_size": shard_size,
        "num_shards": num_shards,
        "settings": {"kind": "text", "max_seq_len": max_seq_len},
        "source": source,
        "stop_token_ids": list(stops),
    }
    write_data_manifest(out_dir, fields, entries, complete=True)
    return out_dir
