"""Load a target + drafter pair into models, ready for the runtime.

``--target`` resolves through :mod:`.sources`; ``--drafter`` is a z-lab drafter directory. With
no ``--drafter`` the default drafter is used: the trained one shipped in the package for the
default target when it exists, otherwise a seeded random drafter written once to the cache.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DFlashError
from ..models.config import TargetConfig
from ..models.drafter import DFlashDrafter
from ..models.target import TargetModel
from .sources import cache_root, load_safetensors_dir, read_json, resolve_target
from .zlab import init_drafter, load_drafter, save_drafter, validate_pair

#: drafters shipped inside the package; DEFAULT_DRAFTER is the one for the default target
SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
DEFAULT_DRAFTER = "smollm2-135m-instruct-dflash"
RANDOM_DRAFTER_LAYERS = 2
RANDOM_DRAFTER_BLOCK = 16

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` (or the long names) to a torch dtype.

    Raises:
        DFlashError: unknown name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise DFlashError(f"unknown dtype {name!r}; choose from fp32, bf16, fp16") from None


def dtype_name(name: str) -> str:
    """The torch / HF name of a dtype (``bf16`` -> ``bfloat16``), as config files write it.

    Raises:
        DFlashError: unknown name.
    """
    return str(parse_dtype(name)).removeprefix("torch.")


def dtype_bytes(name: str) -> int:
    """Bytes per element of a weight / activation / KV dtype name (``fp8``: 1).

    Raises:
        DFlashError: unknown name.
    """
    return 1 if name == "fp8" else parse_dtype(name).itemsize


def parse_device(name: str | None) -> torch.device:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``; None picks ``cuda`` when a GPU is visible,
    else ``cpu``.

    Raises:
        DFlashError: an unknown device, or a CUDA device this machine does not have.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise DFlashError(f"unknown device {name!r}; choose cpu, cuda or cuda:N")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DFlashError(
                f"device {name}: no CUDA GPU is visible here (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu"
            )
        if (dev.index or 0) >= count:
            raise DFlashError(f"device {name}: only {count} CUDA GPU(s) visible")
    return dev


@dataclass
class LoadedTarget:
    """A target model with its tokenizer.

    Attributes:
        model: the target in eval mode and the requested dtype.
        tokenizer: its HF tokenizer (chat template included when the checkpoint has one).
        path: HF checkpoint directory it came from.
        stop_token_ids: EOS ids from the config, generation config and tokenizer.
    """

    model: TargetModel
    tokenizer: object
    path: Path
    stop_token_ids: tuple[int, ...]


def load_target(
    spec: str | None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LoadedTarget:
    """Load ``--target`` (None = the default SmolLM2 model) in ``dtype`` on ``device``.

    Raises:
        DFlashError: missing/corrupt checkpoint, unsupported family, weights not matching the config.
    """

    path = resolve_target(spec)
    hf = read_json(path / "config.json", "target")
    cfg = TargetConfig.from_hf(hf)
    sd = load_safetensors_dir(path, "target")
    model = TargetModel(cfg)
    try:
        model.load_hf_state_dict(sd)
    except KeyError as e:
        raise DFlashError(f"target {path}: missing weight {e.args[0]}") from None
    except ValueError as e:
        raise DFlashError(f"target {path}: {e}") from None
    return with_tokenizer(model.to(dtype).to(device).eval(), path)


def with_tokenizer(model: TargetModel, path: Path) -> LoadedTarget:
    """``model`` with the tokenizer and stop tokens (config, generation config, tokenizer EOS) of
    the HF directory ``path``.

    Raises:
        DFlashError: the tokenizer cannot be loaded.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise DFlashError(f"target {path}: cannot load tokenizer ({type(e).__name__})") from None
    stops = set(model.cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = read_json(gen, "target").get("eos_token_id")
        stops.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tok.eos_token_id is not None:
        stops.add(tok.eos_token_id)
    return LoadedTarget(model, tok, path, tuple(sorted(stops)))


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """A token id for the drafter's MASK slots: the tokenizer's mask or unk token when it has
    one, else the last vocabulary id."""
    for name in ("mask_token_id", "unk_token_id"):
        tid = getattr(tokenizer, name, None)
        if tid is not None and 0 <= tid < vocab_size:
            return int(tid)
    return vocab_size - 1


def default_drafter_path(target: LoadedTarget, default_target: bool) -> Path:
    """The default drafter for ``target``: the trained one shipped for the default target, or a
    seeded random drafter created once in the cache (with a notice on stderr)."""
    if default_target and (SHIPPED_DRAFTERS / DEFAULT_DRAFTER / "config.json").is_file():
        return SHIPPED_DRAFTERS / DEFAULT_DRAFTER
    out = cache_root() / "drafters" / f"random-{target.path.name}-l{RANDOM_DRAFTER_LAYERS}-b{RANDOM_DRAFTER_BLOCK}"
    if not (out / "config.json").is_file():
        print(f"no trained drafter for this target: using a random one ({out})", file=sys.stderr, flush=True)
        model = init_drafter(
            target.model.cfg,
            RANDOM_DRAFTER_LAYERS,
            RANDOM_DRAFTER_BLOCK,
            default_mask_token_id(target.tokenizer, target.model.cfg.vocab_size),
            seed=0,
        )
        with contextlib.suppress(DFlashError):  # created meanwhile by another process
            save_drafter(model, out)
    return out


def load_pair(
    target_spec: str | None,
    drafter_spec: str | None,
    dtype: torch.dtype = torch.float32,
    need_drafter: bool = True,
    device: torch.device | str = "cpu",
) -> tuple[LoadedTarget, DFlashDrafter | None]:
    """Load the target and (unless ``need_drafter`` is false) its drafter on ``device``, and
    validate the pair.

    Raises:
        DFlashError: anything :func:`load_target`, :func:`load_drafter` or :func:`validate_pair` raise.
    """
    target = load_target(target_spec, dtype, device)
    if not need_drafter and drafter_spec is None:
        return target, None
    path = Path(drafter_spec) if drafter_spec else default_drafter_path(target, target_spec is None)
    drafter = load_drafter(path, dtype)
    validate_pair(target.model.cfg, drafter.cfg)
    return target, drafter.to(device)
