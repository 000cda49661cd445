"""Everything a drafter-training run needs on an offline GPU machine, packed into one folder.

The GPU machines this project borrows (one H100/H200 class GPU, torch + CUDA, transformers,
safetensors; no network, no model weights, no data packages) receive at most ~64 MiB per
transfer. :func:`write_pack` writes, under ``out``::

    pack.json                 what is inside: model file name, size, sha256, parts; prompt sets
    model-00/, model-01/ ...  the target file (default: the SmolLM2 GGUF, 98 MB) cut into parts
                              of at most ``part_mib`` MiB (32: three parts; a part beside the
                              checked-out code, ~24 MiB, fits one 64 MiB transfer), one part per
                              folder so each travels alone
    prompts/sharegpt.jsonl    training prompts ({"prompt": ...} per line): ShareGPT first turns,
                              deduplicated and decontaminated against the evaluation sets
    prompts/gsm8k.jsonl, humaneval.jsonl, mtbench.jsonl
                              the evaluation prompts, for ``bench --prompts-file`` there

:func:`join_model` puts the parts back together on the other side and checks the sha256.
``scripts/gpu_train.sh`` is the GPU-side procedure that uses the pack (README: "Training a
drafter on a GPU").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..atomic import atomic_dir, atomic_write, write_json
from ..checkpoints.sources import sha256_file
from ..errors import DFlashError

PACK_FORMAT = "dflash-trt-offline-pack"
PACK_VERSION = 1
_COPY = 1 << 22


def _write_jsonl(path: Path, prompts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")


def write_pack(
    out: str | os.PathLike,
    model_file: str | os.PathLike | None = None,
    part_mib: int = 32,
    num_train_prompts: int | None = None,
    progress: bool = True,
) -> dict:
    """Write the pack for an offline GPU training run (layout in the module docstring).

    Args:
        out: folder to create; it must not exist (the pack is built in a temporary sibling
            and renamed into place, so an interrupted run leaves nothing half-written).
        model_file: the target as ONE file (a ``.gguf``); None: the default SmolLM2 GGUF.
        part_mib: largest part in MiB (1..1024).
        num_train_prompts: the first this many ShareGPT prompts (None: all of them).
        progress: show a tqdm bar while copying the model.

    Returns:
        the ``pack.json`` contents.

    Raises:
        DFlashError: ``out`` exists, the model file is missing or not a file, ``part_mib``
            outside 1..1024, or a prompt source is missing (data packages not installed).
    """
    from tqdm import tqdm

    from ..checkpoints.sources import default_target_gguf
    from ..prompts import DATASETS, dataset_size, load_prompts, sharegpt_prompts

    out = Path(out).expanduser()
    if out.exists():
        raise DFlashError(f"{out} already exists; choose a new folder for the pack")
    if isinstance(part_mib, bool) or not isinstance(part_mib, int) or not 1 <= part_mib <= 1024:
        raise DFlashError(f"part size must be 1..1024 MiB, got {part_mib!r}")
    src = Path(model_file).expanduser() if model_file is not None else default_target_gguf()
    if not src.is_file():
        raise DFlashError(f"model file not found: {src} (the pack carries a target as one file, e.g. a .gguf)")
    train = sharegpt_prompts(num_train_prompts)
    evals = {name: load_prompts(name, dataset_size(name)) for name in DATASETS}

    with atomic_dir(out) as tmp:
        size, part_bytes = src.stat().st_size, part_mib << 20
        h = hashlib.sha256()
        parts = []
        with (
            open(src, "rb") as f,
            tqdm(total=size, unit="B", unit_scale=True, desc="pack model", disable=not progress) as bar,
        ):
            for i in range(max(1, -(-size // part_bytes))):
                d = tmp / f"model-{i:02d}"
                d.mkdir()
                name = f"{src.name}.part{i:02d}"
                left = min(part_bytes, size - i * part_bytes)
                with open(d / name, "wb") as g:
                    while left > 0:
                        chunk = f.read(min(_COPY, left))
                        if not chunk:
                            raise DFlashError(f"{src} shrank while it was being packed")
                        g.write(chunk)
                        h.update(chunk)
                        left -= len(chunk)
                        bar.update(len(chunk))
                parts.append(f"{d.name}/{name}")
        (tmp / "prompts").mkdir()
        _write_jsonl(tmp / "prompts" / "sharegpt.jsonl", train)
        for name, prompts in evals.items():
            _write_jsonl(tmp / "prompts" / f"{name}.jsonl", prompts)
        manifest = {
            "format": PACK_FORMAT,
            "version": PACK_VERSION,
            "model": {"file": src.name, "bytes": size, "sha256": h.hexdigest(), "parts": parts},
            "prompts": {
                "train": "prompts/sharegpt.jsonl",
                "train_count": len(train),
                **{name: f"prompts/{name}.jsonl" for name in evals},
            },
        }
        write_json(tmp / "pack.json", manifest)
    return manifest


def join_model(pack: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Join the model parts of ``pack`` into ``dest`` (a folder) and check size and sha256.

    Returns:
        the joined file, ``dest / <model file name>`` (reused when it is already there and
        checks out).

    Raises:
        DFlashError: no ``pack.json`` or not a pack, a part missing (each part travels on its
            own; say which), or a size / sha256 mismatch (nothing is left at the destination).
    """
    pack = Path(pack).expanduser()
    try:
        manifest = json.loads((pack / "pack.json").read_text())
    except FileNotFoundError:
        raise DFlashError(f"{pack} has no pack.json: not an offline pack") from None
    except (OSError, json.JSONDecodeError) as e:
        raise DFlashError(f"{pack}/pack.json is unreadable ({type(e).__name__})") from None
    if manifest.get("format") != PACK_FORMAT or manifest.get("version") != PACK_VERSION:
        raise DFlashError(f"{pack}/pack.json is not a version-{PACK_VERSION} {PACK_FORMAT}")
    m = manifest["model"]
    dest = Path(dest).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    final = dest / m["file"]
    if final.is_file() and final.stat().st_size == m["bytes"] and sha256_file(final) == m["sha256"]:
        return final
    missing = [p for p in m["parts"] if not (pack / p).is_file()]
    if missing:
        raise DFlashError(f"model part(s) missing from {pack}: {', '.join(missing)} (each part travels separately)")

    def join(tmp: str) -> None:
        with open(tmp, "wb") as g:
            for p in m["parts"]:
                with open(pack / p, "rb") as f:
                    shutil.copyfileobj(f, g, _COPY)
        if Path(tmp).stat().st_size != m["bytes"] or sha256_file(Path(tmp)) != m["sha256"]:
            raise DFlashError("joined model does not match pack.json (size or sha256): a part is corrupt")

    return atomic_write(final, join)
