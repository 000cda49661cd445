"""Load a target + drafter pair into models, ready for the runtime.

``--target`` resolves through :mod:`.sources`; ``--drafter`` is a z-lab drafter directory. With
no ``--drafter`` the default drafter is used: the trained one shipped in the package for the
default target when it exists, otherwise a seeded random drafter written once to the cache.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DFlashError
from ..models.config import TargetConfig
from ..models.drafter import DFlashDrafter
from ..models.target import TargetModel
from ..models.uninitialized import skip_random_init
from ..quantization import INT_WEIGHT_FORMATS, WEIGHT_FORMATS
from ..quantization.mxfp4 import pack_experts
from .mxfp4 import dequantize_mxfp4_experts, has_mxfp4, mxfp4_pairs
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


def auto_dtype(engine: str | None = None, weights: str | None = None, target: str | None = None) -> str:
    """The compute dtype when none is asked for (vLLM's ``--dtype auto`` on its CPU backend):
    an engine directory's build dtype; else ``bf16``, for packed ``--weights`` and dense
    checkpoints alike, except an fp16 checkpoint, which stays fp16 (a GGUF's conversion says
    fp32 because its quantized blocks were widened, not because the model is an fp32 one).

    Raises:
        DFlashError: an unreadable engine manifest or target config.
    """
    if engine:
        from .engine_dir import read_manifest

        return read_manifest(engine).get("dtype", "fp32")
    if weights:
        return "bf16"
    from .sources import read_json, resolve_target

    hf = read_json(resolve_target(target) / "config.json", "target")
    return "fp16" if str(hf.get("torch_dtype", hf.get("dtype"))) in ("float16", "torch.float16") else "bf16"


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


#: int4 group size of the packed path (GGUF Q4_1 / Q4_0 blocks are 32 wide)
DEFAULT_GROUP_SIZE = 32
#: the LM head's format under ``--weights`` (docs/engine-format.md; int8: a quarter of the bf16
#: head's bytes, closer to the Q8_0 embedding it comes from than int4); the embedding lookup
#: stays dense in the compute dtype
DEFAULT_HEAD = {"int4": "int8", "int8": "int8"}


def check_weights(weights: str | None, device: torch.device | str = "cpu") -> None:
    """Validate ``--weights``: None, ``int4`` or ``int8`` on the CPU, or ``mxfp4`` anywhere.

    Raises:
        DFlashError: another name, or int4 / int8 on a non-CPU device (torch's packed int GEMMs
            used here are CPU kernels; a CUDA run takes a dense ``--dtype``).
    """
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise DFlashError(f"unknown --weights {weights!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    if weights in INT_WEIGHT_FORMATS and torch.device(device).type != "cpu":
        raise DFlashError(f"--weights {weights} runs torch's packed CPU GEMMs; use --device cpu")


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
    spec: str | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    weights: str | None = None,
    head: str | None = None,
) -> LoadedTarget:
    """Load ``--target`` (None = the default SmolLM2 model) in ``dtype`` on ``device``.

    Args:
        weights: None (dense ``dtype`` weights), or ``int4`` / ``int8``: every linear becomes a
            packed :class:`~dflash_trt.quantization.packed.PackedLinear` with ``dtype``
            activations. A GGUF target's Q4_1 / Q4_0 blocks load as int4 codes directly
            (:mod:`.gguf_packed`); an HF checkpoint is quantized round-to-nearest (group 32).
        head: the LM head's format with ``weights`` (default :data:`DEFAULT_HEAD`; ``none``
            keeps it dense).

    Raises:
        DFlashError: missing/corrupt checkpoint, unsupported family, weights not matching the
            config (an MXFP4 tensor of the wrong shape included: gpt-oss's ``*_blocks`` /
            ``*_scales`` are dequantized, :mod:`.mxfp4`), an unknown ``weights`` or a non-CPU
            device with it.
    """
    check_weights(weights, device)
    if weights in INT_WEIGHT_FORMATS:
        return _load_packed_target(spec, dtype, weights, DEFAULT_HEAD[weights] if head is None else head)
    path = resolve_target(spec)
    hf = read_json(path / "config.json", "target")
    cfg = TargetConfig.from_hf(hf)
    sd = load_safetensors_dir(path, "target")
    packed = weights == "mxfp4"
    if packed and not has_mxfp4(sd):
        raise DFlashError(f"--weights mxfp4: target {path} has no MXFP4 expert weights (*_blocks / *_scales)")
    if has_mxfp4(sd) and not packed:  # gpt-oss's official expert weights: dequantized exactly (bf16 holds them too)
        sd = dequantize_mxfp4_experts(sd, cfg, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    with skip_random_init():  # every weight is loaded next
        model = TargetModel(cfg)
    if packed:
        mxfp4_pairs(sd, cfg)  # checked (one line for a bad tensor) before it is loaded
        pack_experts(model)
    try:
        model.load_hf_state_dict(sd)
    except KeyError as e:
        raise DFlashError(f"target {path}: missing weight {e.args[0]}") from None
    except ValueError as e:
        raise DFlashError(f"target {path}: {e}") from None
    return with_tokenizer(model.to(dtype).to(device).eval(), path)


def _load_packed_target(spec: str | None, dtype: torch.dtype, weights: str, head: str) -> LoadedTarget:
    """:func:`load_target` with ``weights``: GGUF blocks straight into packed linears, or an HF
    checkpoint quantized after a dense load."""
    from ..quantization.packed import quantize_linears
    from .gguf_packed import load_gguf_packed
    from .sources import default_target_gguf

    gguf = default_target_gguf() if spec is None else Path(spec).expanduser()
    path = resolve_target(spec)  # the cached HF conversion of a GGUF: config + tokenizer
    if gguf.is_file() and gguf.suffix == ".gguf":
        return with_tokenizer(load_gguf_packed(gguf, path, weights, head, dtype), path)
    target = load_target(spec, torch.float32, "cpu")
    quantize_linears(target.model, weights, DEFAULT_GROUP_SIZE, head, dtype)
    target.model.to(dtype)
    return target


def with_tokenizer(model: TargetModel, path: Path) -> LoadedTarget:
    """``model`` with the tokenizer and stop tokens (config, generation config, tokenizer EOS) of
    the HF directory ``path``.

    Raises:
        DFlashError: the tokenizer cannot be loaded.
    """
    files = tuple(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(path.iterdir())
        if f.is_file() and f.suffix != ".safetensors"
    )
    try:
        tok = _tokenizer(str(path), files)
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


#: model types whose directories ``AutoTokenizer`` loads as the generic ``TokenizersBackend``
#: when ``tokenizer_config.json`` names that class (what transformers' ``save_pretrained`` writes
#: for a tokenizer of no specialised class, e.g. every GGUF conversion of the default target):
#: not in transformers' ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` (qwen2 is, so it gets
#: ``Qwen2Tokenizer``) and not Mistral-format; tests/test_models.py checks both tables
GENERIC_TOKENIZER_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss")


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str, files: tuple):
    """``AutoTokenizer.from_pretrained(path)``, once per process for the same files (``files``:
    names, sizes and modification times of the directory's files but the weights, so a changed
    directory loads again): the engines of a process over one target share it (never mutated;
    it took ~0.3 s of each load of the default target).

    Where ``AutoTokenizer`` would pick the generic ``TokenizersBackend`` (the class named in
    ``tokenizer_config.json``, no ``auto_map``, a model type of GENERIC_TOKENIZER_FAMILIES) that
    class loads the directory directly: the same object without ``AutoConfig``, whose import
    chain (model configuration -> activations -> hub kernels -> ``torch.distributed.tensor``)
    cost ~2 s of every process that loads the target."""
    d = Path(path)
    tok_cfg = read_json(d / "tokenizer_config.json", "target") if (d / "tokenizer_config.json").is_file() else {}
    model_type = read_json(d / "config.json", "target").get("model_type") if (d / "config.json").is_file() else None
    if (
        tok_cfg.get("tokenizer_class") == "TokenizersBackend"
        and "auto_map" not in tok_cfg
        and model_type in GENERIC_TOKENIZER_FAMILIES
    ):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


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
    weights: str | None = None,
    drafter_weights: str | None = None,
) -> tuple[LoadedTarget, DFlashDrafter | None]:
    """Load the target and (unless ``need_drafter`` is false) its drafter on ``device``, and
    validate the pair. With ``weights`` (``int4`` / ``int8``, see :func:`load_target`) the
    drafter's linears are packed too (round to nearest from its stored weights, group 32).

    Args:
        drafter_weights: the drafter's own format: ``int4`` / ``int8`` (packed CPU linears as
            above, and the draft vocabulary's rows of a dense target head packed as ``--weights``
            packs the head, :data:`DEFAULT_HEAD`: :attr:`DFlashDrafter.head_format`), ``none``
            (dense, ``dtype``), or None: as ``weights``.

    Raises:
        DFlashError: anything :func:`load_target`, :func:`load_drafter` or :func:`validate_pair`
            raise; a packed ``drafter_weights`` off the CPU.
    """
    target = load_target(target_spec, dtype, device, weights=weights)
    if not need_drafter and drafter_spec is None:
        return target, None
    fmt = weights if drafter_weights is None else drafter_weights
    fmt = fmt if fmt in INT_WEIGHT_FORMATS else None
    if fmt and torch.device(device).type != "cpu":
        raise DFlashError(f"--drafter-weights {fmt} runs packed CPU GEMMs; use --device cpu or --drafter-weights none")
    path = Path(drafter_spec) if drafter_spec else default_drafter_path(target, target_spec is None)
    drafter = load_drafter(path, torch.float32 if fmt else dtype)
    validate_pair(target.model.cfg, drafter.cfg)
    if fmt:
        from ..quantization.packed import quantize_linears

        quantize_linears(drafter, fmt, DEFAULT_GROUP_SIZE, None, dtype)
        drafter.head_format = DEFAULT_HEAD[fmt]
        drafter.to(dtype)
    return target, drafter.to(device)
