"""Atomic writes: a file or a whole directory appears complete under its final name or not at
all (written next to it under a temporary name, then renamed; removed on any error). Used for
engine directories, drafters, training checkpoints, dataset shards and manifests, packs, the
GGUF conversion cache and JSON results.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(final: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a new temporary directory beside ``final``; when the block ends without an error it
    is renamed to ``final`` (mode 0755), otherwise removed.

    Args:
        final: the directory to create (its parent is created when missing).
        replace: remove an existing ``final`` just before the rename (a checkpoint re-saved at
            the same step, a re-exported drafter); otherwise an existing ``final`` makes the
            rename fail with ``OSError`` and the temporary directory is removed.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.partial-"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if replace and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it to ``path``
    (mode 0644; an existing file is replaced). On any error the temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | os.PathLike, obj) -> Path:
    """Write ``obj`` as indented JSON (UTF-8, trailing newline) with :func:`atomic_write`."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")

    return atomic_write(path, write)
