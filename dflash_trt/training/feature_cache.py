"""Target features and the target's greedy predictions of training sequences, computed once in
batched prefill forwards and kept on disk, memory-mapped (data larger than RAM trains at full
speed, and every later epoch and run skips the target).

One forward per batch of sequences gives both what the drafter reads and what it is taught:

- features ``[S, len(capture) * hidden]``: outputs of the target layers ``capture`` (HF
  ``hidden_states[i + 1]``, the last layer after the final norm), stored in bf16;
- predictions ``[S]`` int32: ``pred[p]`` = the target's argmax after position ``p``, i.e. its own
  greedy choice for the token at ``p + 1`` given the true prefix (vLLM speculators' "labels at
  prefill speed": exact for draft position 1, and exact for later positions wherever the text
  follows the target's greedy path, which the trainer checks).

Directory::

    meta.json        format, version, the target / capture / dtype the cache belongs to,
                     feature width, and per sequence (sha1 of its int64 token ids) its
                     ``[first row, rows]``
    features.bin     bf16 rows, appended
    predictions.bin  int32 rows, appended

Appends are made durable before ``meta.json`` (rewritten atomically) lists them, so an
interrupted fill leaves a consistent cache that the next run continues.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..atomic import write_json
from ..errors import DFlashError
from ..models.prefill import features_and_predictions
from ..models.target import TargetModel

FORMAT = "dflash-trt-feature-cache"
VERSION = 1


def sequence_key(ids: torch.Tensor) -> str:
    """sha1 of a sequence's int64 token ids (the cache's key)."""
    return hashlib.sha1(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


class FeatureCache:
    """The on-disk cache of one target / capture / dtype (layout in the module docstring).

    Args:
        path: cache directory (created when missing).
        target_id: what identifies the target's weights (e.g. its checkpoint path, which for a
            converted GGUF holds the file's sha256).
        capture: target layer ids of the features.
        dtype: the target's compute dtype (features are stored in bf16 whatever it is).
        hidden: the target's hidden size.

    Raises:
        DFlashError: ``path`` holds a cache of another target, capture or dtype, or a corrupt one.
    """

    def __init__(
        self, path: str | os.PathLike, target_id: str, capture: Sequence[int], dtype: torch.dtype, hidden: int
    ):
        self.path = Path(path).expanduser()
        self.width = len(capture) * hidden
        self.capture = tuple(int(c) for c in capture)
        self.identity = {
            "format": FORMAT,
            "version": VERSION,
            "target": str(target_id),
            "capture": list(self.capture),
            "dtype": str(dtype).removeprefix("torch."),
            "width": self.width,
        }
        self.path.mkdir(parents=True, exist_ok=True)
        meta = self.path / "meta.json"
        self.entries: dict[str, list[int]] = {}
        self.rows = 0
        if meta.is_file():
            try:
                m = json.loads(meta.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise DFlashError(f"feature cache {meta} is unreadable ({type(e).__name__})") from None
            for k, v in self.identity.items():
                if m.get(k) != v:
                    raise DFlashError(
                        f"feature cache {self.path} was made for another {k} ({m.get(k)!r} vs {v!r}); "
                        "use another --feature-cache directory"
                    )
            self.entries, self.rows = dict(m["entries"]), int(m["rows"])
        # rows past what meta.json lists are the tail of an interrupted append: cut them off
        for name, unit in (("features.bin", 2 * self.width), ("predictions.bin", 4)):
            f = self.path / name
            f.touch()
            if f.stat().st_size < self.rows * unit:
                raise DFlashError(f"feature cache {f} is shorter than meta.json says (corrupt; delete the directory)")
            os.truncate(f, self.rows * unit)
        self._maps: tuple[np.memmap, np.memmap] | None = None

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def missing(self, seqs: Sequence[torch.Tensor]) -> list[int]:
        """Indices of ``seqs`` not in the cache."""
        return [i for i, s in enumerate(seqs) if sequence_key(s) not in self.entries]

    def fill(
        self, model: TargetModel, seqs: Sequence[torch.Tensor], batch_tokens: int = 8192, progress: bool = True
    ) -> int:
        """Compute and append every sequence of ``seqs`` not cached yet, in length-sorted batches
        of at most ``batch_tokens`` padded tokens; returns how many were added."""
        from tqdm import tqdm

        todo = sorted(self.missing(seqs), key=lambda i: len(seqs[i]))
        if not todo:
            return 0
        total = sum(len(seqs[i]) for i in todo)
        with tqdm(
            total=total, desc="target features", unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True
        ) as bar:
            c = 0
            while c < len(todo):
                n = 1
                while c + n < len(todo) and (n + 1) * len(seqs[todo[c + n]]) <= batch_tokens:
                    n += 1
                part = [seqs[i] for i in todo[c : c + n]]
                self._append(part, features_and_predictions(model, part, self.capture))
                bar.update(sum(len(s) for s in part))
                c += n
        return len(todo)

    def _append(self, seqs: list[torch.Tensor], results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with open(self.path / "features.bin", "ab") as ff, open(self.path / "predictions.bin", "ab") as fp:
            for s, (f, p) in zip(seqs, results):
                key = sequence_key(s)
                if key in self.entries:  # the same sequence twice in one batch
                    continue
                ff.write(f.to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().tobytes())
                fp.write(p.to(torch.int32).cpu().numpy().tobytes())
                self.entries[key] = [self.rows, len(s)]
                self.rows += len(s)
            for f in (ff, fp):
                f.flush()
                os.fsync(f.fileno())
        write_json(self.path / "meta.json", {**self.identity, "rows": self.rows, "entries": self.entries})
        self._maps = None

    def get(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features bf16 [S, F], predictions int64 [S])`` of a cached sequence (copies in RAM).

        Raises:
            KeyError: the sequence is not cached.
        """
        first, n = self.entries[sequence_key(ids)]
        if self._maps is None:
            shape = (max(self.rows, 1),)
            self._maps = (
                np.memmap(self.path / "features.bin", dtype=np.int16, mode="r", shape=(max(self.rows, 1), self.width)),
                np.memmap(self.path / "predictions.bin", dtype=np.int32, mode="r", shape=shape),
            )
        feats, preds = self._maps
        f = torch.from_numpy(np.array(feats[first : first + n])).view(torch.bfloat16)
        p = torch.from_numpy(np.array(preds[first : first + n])).long()
        return f, p
