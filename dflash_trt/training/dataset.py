"""The training-data directory format (written by :mod:`.distill` and :mod:`.text_data`, read
by the trainer): a manifest and shards of token ids.

Directory layout (``out_dir``)::

    manifest.json                 format, version, target, prompt count, settings, shard list, totals
    shard-00000.safetensors       one shard per ``shard_size`` consecutive prompts
    shard-00001.safetensors       ...

Each shard holds, for its ``n`` samples (ordered by prompt index):

- ``input_ids``   int32 ``[T]``   prompt (chat template applied) + response ids, all samples
  concatenated; the response ends with the stop token when one ended it;
- ``offsets``     int64 ``[n+1]`` sample ``i`` is ``input_ids[offsets[i]:offsets[i+1]]``;
- ``loss_mask``   uint8 ``[T]``   1 on response tokens, 0 on prompt tokens;
- ``prompt_index`` int64 ``[n]``  index into the prompt list the data was made from;
- ``sampled``     uint8 ``[n]``   1 when the response was sampled (temperature > 0), 0 when greedy;
- ``stopped``     uint8 ``[n]``   1 when a stop token ended the response, 0 when it hit the length limit.

The manifest's ``labels`` is ``target`` for text written by others (train on the target's own
predictions along it, :mod:`.feature_cache`), absent or ``text`` otherwise. Shards and the
manifest are written atomically (temporary file, then rename), so an interrupted run leaves
only complete shards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import atomic_write, write_json
from ..errors import DFlashError

FORMAT = "dflash-trt-selfdistill"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_TEMPLATE = "shard-{:05d}.safetensors"
COUNTERS = ("samples", "skipped", "tokens", "response_tokens", "sampled", "stopped")


@dataclass(frozen=True)
class Sample:
    """One training sample.

    Attributes:
        input_ids: prompt (chat template applied) followed by the target's response.
        loss_mask: same length; 1 on response tokens (stop token included), 0 on prompt tokens.
        prompt_index: index of its prompt in the list the data was made from.
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


def read_data_manifest(out_dir: str | Path) -> dict:
    """The ``manifest.json`` of a training-data directory, checked for format, version and the
    fields every reader needs (``num_prompts``, ``shard_size``, ``num_shards``, ``settings``,
    ``shards``).

    Raises:
        DFlashError: missing directory or manifest, corrupt or foreign manifest.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise DFlashError(f"dataset directory {out_dir} does not exist")
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


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one shard (see the module docstring), checked for consistent sizes.

    Raises:
        DFlashError: a missing or corrupt shard, missing tensors, inconsistent sizes.
    """
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


def shard_entry(
    path: Path,
    first: int,
    count: int,
    wall_s: float | None = None,
    batch_size: int | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> dict:
    """The manifest entry of the shard at ``path`` (written for prompts ``first .. first +
    count - 1``; those without a sample were skipped), counted from its ``tensors`` (None: read
    from ``path``). ``wall_s`` (rounded to ms) and ``batch_size`` are recorded as given (None:
    not generated here).

    Raises:
        DFlashError: see :func:`load_shard`.
    """
    t = load_shard(path) if tensors is None else tensors
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
        "wall_s": None if wall_s is None else round(wall_s, 3),
        "batch_size": batch_size,
    }


def write_shard(
    path: Path, first: int, count: int, rows: list[tuple], wall_s: float | None, batch_size: int | None
) -> dict:
    """Write one shard atomically; ``rows`` are ``(prompt index, ids, loss mask, sampled,
    stopped)`` in prompt order. Returns its manifest entry (:func:`shard_entry`)."""
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
    return shard_entry(path, first, count, wall_s, batch_size, tensors)


def write_data_manifest(out_dir: Path, fields: dict, shards: list[dict], complete: bool) -> Path:
    """Write ``out_dir/manifest.json`` atomically: format and version, ``fields`` (the target,
    prompt count, settings, ...), ``complete``, the sums of the shard entries' counters
    (``totals``) and the entries themselves (``shards``)."""
    totals = {k: sum(e[k] for e in shards) for k in COUNTERS}
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, **fields}
    return write_json(out_dir / MANIFEST, {**manifest, "complete": complete, "totals": totals, "shards": shards})


def load_dataset(out_dir: Path, allow_incomplete: bool = False) -> list[Sample]:
    """Read a training-data directory (written by :func:`~.distill.generate_dataset` or
    :func:`~.text_data.write_text_dataset`).

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
    m = read_data_manifest(out_dir)
    if not m.get("complete") and not allow_incomplete:
        done = len(m["shards"])
        raise DFlashError(
            f"dataset {out_dir} is incomplete ({done} of {m['num_shards']} shards); "
            "re-run generation with the same directory to finish it"
        )
    samples: list[Sample] = []
    labels = m.get("labels", "text")
    for entry in sorted(m["shards"], key=lambda s: s["file"]):
        t = load_shard(out_dir / entry["file"])
        ids, mask, off = t["input_ids"].tolist(), t["loss_mask"].tolist(), t["offsets"].tolist()
        for k, (pi, s, st) in enumerate(zip(t["prompt_index"].tolist(), t["sampled"].tolist(), t["stopped"].tolist())):
            a, b = off[k], off[k + 1]
            samples.append(Sample(ids[a:b], mask[a:b], int(pi), bool(s), bool(st), labels))
    samples.sort(key=lambda s: s.prompt_index)
    return samples
