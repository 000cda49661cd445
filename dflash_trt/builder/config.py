"""Build configurations: one YAML file per deployment target (``build_configs/*.yaml``).

A build config says what ``dflash-trt build`` makes for a deployment target: compute dtype,
quantization of the target and of the drafter, KV-cache dtype, tensor parallelism, the
runtime limits TensorRT-LLM bakes into an engine (``max_batch_size``, ``max_seq_len``,
``max_num_tokens``, ``tokens_per_block``), the DFlash block size, the GPU whose memory the
plan is made for, and the calibration data. Every key of every YAML is listed in
:class:`BuildConfig`; an unknown key is an error (a typo must not silently fall back to a
default).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..errors import DFlashError

#: quantization formats of weights (ModelOpt names in parentheses): none, FP8 per-tensor
#: (``FP8``), NVFP4 16-element blocks with e4m3 scales and an fp32 global scale (``NVFP4``);
#: weight-only packed-integer CPU formats: int4 group-wise asymmetric (``W4A16_GPTQ`` layout
#: names) and int8 per output row (``W8A16``), see ``quantization/int4.py`` / ``quantization/int8.py``
QUANT_FORMATS = ("none", "fp8", "nvfp4", "int4", "int8")
#: formats of a mixture-of-experts target's expert weights: ``auto`` (= ``target_quant``), the
#: GPU formats above, or ``mxfp4`` (OCP MX: e2m1 codes with one e8m0 scale per 32 elements, the
#: layout gpt-oss ships; TensorRT-LLM runs it as is): planned, not written by ``build``
EXPERT_QUANT_FORMATS = ("auto", "none", "fp8", "nvfp4", "mxfp4")
#: weight-only formats: no activation scales, no calibration, run by torch's packed CPU GEMMs
INT_QUANT_FORMATS = ("int4", "int8")
INT4_GROUP_SIZES = (32, 64, 128, 256)
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class GPU:
    """A deployment device for the memory plan.

    Attributes:
        name: marketing name.
        memory_gb: memory per device in GB (1e9 bytes), as NVIDIA lists it.
        arch: CUDA architecture TensorRT-LLM builds for (``sm_90a`` ...); empty for the CPU.
    """

    name: str
    memory_gb: float
    arch: str


GPUS: dict[str, GPU] = {
    "cpu": GPU("CPU (host memory)", 24.0, ""),
    "h100": GPU("H100 SXM 80GB", 80.0, "sm_90a"),
    "h200": GPU("H200 141GB", 141.0, "sm_90a"),
    "b200": GPU("B200 180GB", 180.0, "sm_100a"),
    "b300": GPU("B300 288GB", 288.0, "sm_103a"),
}


@dataclass(frozen=True)
class CalibrationConfig:
    """Calibration data for activation scales (FP8 / NVFP4).

    Attributes:
        dataset: prompt set the activations are measured on (``sharegpt``: first-turn
            ShareGPT prompts, never the evaluation sets).
        num_samples: prompts run through the target (and the drafter).
        max_seq_len: tokens per calibration prompt (longer ones are cut).
        batch_size: prompts per forward.
    """

    dataset: str = "sharegpt"
    num_samples: int = 64
    max_seq_len: int = 256
    batch_size: int = 8


@dataclass(frozen=True)
class BuildConfig:
    """One deployment target. Field comments in ``build_configs/*.yaml`` explain each knob.

    Attributes:
        name: config name (the YAML's stem by default).
        description: one line for humans.
        gpu: device key of :data:`GPUS` the memory plan is made for.
        gpu_memory_gb: memory per device in GB; None: the device's listed memory.
        gpu_memory_fraction: share of that memory the engine may use (weights, KV cache,
            workspace); the rest is left to CUDA context, NCCL buffers and fragmentation.
        dtype: compute dtype of activations and unquantized weights.
        target_quant, drafter_quant: weight quantization (``none | fp8 | nvfp4 | int4 | int8``;
            int4 / int8 are weight-only CPU formats, single rank, no calibration).
        group_size: int4 inputs per (scale, zero) pair: 32, 64, 128 or 256.
        head_quant: the target's LM head with int4 / int8 target weights: ``none`` (dense in
            ``dtype``), ``int8`` or ``int4``.
        kv_cache_dtype: target and drafter-context KV cache dtype (``auto`` = ``dtype``).
        expert_quant: a mixture-of-experts target's expert weights (:data:`EXPERT_QUANT_FORMATS`);
            attention, dense MLPs and the router follow ``target_quant`` / stay unquantized as
            TensorRT-LLM keeps them (see ``builder/moe_plan.py``).
        tp_size: tensor-parallel ranks (one GPU each).
        moe_tp_size, moe_ep_size: how a mixture-of-experts target's experts use the ``tp_size``
            ranks (TensorRT-LLM ``Mapping``): MoE-TP slices every expert's intermediate width
            ``moe_tp_size`` ways, expert parallelism (EP) gives each rank ``E / moe_ep_size``
            whole experts; ``moe_tp_size x moe_ep_size == tp_size``. None: the other one fills
            ``tp_size`` (both None: ``moe_tp_size = tp_size``, ``moe_ep_size = 1``, TensorRT-LLM's default).
        max_batch_size: concurrent sequences.
        max_seq_len: prompt + output tokens per sequence.
        max_num_tokens: tokens in one forward (chunked prefill + verify blocks).
        tokens_per_block: KV-cache page size in tokens.
        block_size: DFlash block size B (B-1 draft tokens per round); at most the drafter's.
        calibration: see :class:`CalibrationConfig`.
    """

    name: str = "custom"
    description: str = ""
    gpu: str = "cpu"
    gpu_memory_gb: float | None = None
    gpu_memory_fraction: float = 0.9
    dtype: str = "fp32"
    target_quant: str = "none"
    drafter_quant: str = "none"
    group_size: int = 32
    head_quant: str = "none"
    kv_cache_dtype: str = "auto"
    expert_quant: str = "auto"
    tp_size: int = 1
    moe_tp_size: int | None = None
    moe_ep_size: int | None = None
    max_batch_size: int = 16
    max_seq_len: int = 4096
    max_num_tokens: int = 8192
    tokens_per_block: int = 32
    block_size: int = 16
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    # ---------------------------------------------------------------- derived values

    @property
    def device(self) -> GPU:
        return GPUS[self.gpu]

    @property
    def memory_bytes(self) -> float:
        """Usable bytes per device: listed (or configured) memory x ``gpu_memory_fraction``."""
        gb = self.gpu_memory_gb if self.gpu_memory_gb is not None else self.device.memory_gb
        return gb * 1e9 * self.gpu_memory_fraction

    @property
    def kv_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def expert_format(self) -> str:
        """Format of expert weights: ``expert_quant``, or ``target_quant`` when it is ``auto``."""
        return self.target_quant if self.expert_quant == "auto" else self.expert_quant

    @property
    def moe_split(self) -> tuple[int, int]:
        """``(moe_tp_size, moe_ep_size)`` with the unset one filled in (see :class:`BuildConfig`)."""
        tp, mtp, mep = self.tp_size, self.moe_tp_size, self.moe_ep_size
        if mtp is None and mep is None:
            return tp, 1
        if mtp is None:
            return max(1, tp // max(1, mep)), mep
        if mep is None:
            return mtp, max(1, tp // max(1, mtp))
        return mtp, mep

    # ---------------------------------------------------------------- validation

    def validate(self) -> BuildConfig:
        """Check every knob; returns self.

        Raises:
            DFlashError: the first impossible setting, in one line.
        """
        c = self.calibration
        checks = [
            (self.gpu in GPUS, f"gpu must be one of {', '.join(GPUS)}, got {self.gpu!r}"),
            (
                self.gpu_memory_gb is None or self.gpu_memory_gb > 0,
                f"gpu_memory_gb must be > 0, got {self.gpu_memory_gb}",
            ),
            (
                0 < self.gpu_memory_fraction <= 1,
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}",
            ),
            (self.dtype in COMPUTE_DTYPES, f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.dtype!r}"),
            (
                self.target_quant in QUANT_FORMATS,
                f"target_quant must be one of {', '.join(QUANT_FORMATS)}, got {self.target_quant!r}",
            ),
            (
                self.drafter_quant in QUANT_FORMATS,
                f"drafter_quant must be one of {', '.join(QUANT_FORMATS)}, got {self.drafter_quant!r}",
            ),
            (
                self.group_size in INT4_GROUP_SIZES,
                f"group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {self.group_size}",
            ),
            (
                self.head_quant == "none" or self.head_quant in INT_QUANT_FORMATS,
                f"head_quant must be none, int4 or int8, got {self.head_quant!r}",
            ),
            (
                self.head_quant == "none" or self.target_quant in INT_QUANT_FORMATS,
                f"head_quant {self.head_quant} needs target_quant int4 or int8, got {self.target_quant!r}",
            ),
            (
                self.tp_size == 1
                or (self.target_quant not in INT_QUANT_FORMATS and self.drafter_quant not in INT_QUANT_FORMATS),
                f"int4 / int8 engines are single-rank CPU engines: tp_size must be 1, got {self.tp_size}",
            ),
            (
                self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
            ),
            (self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}"),
            (
                self.expert_quant in EXPERT_QUANT_FORMATS,
                f"expert_quant must be one of {', '.join(EXPERT_QUANT_FORMATS)}, got {self.expert_quant!r}",
            ),
            (
                self.expert_quant in ("auto", "none") or self.target_quant not in INT_QUANT_FORMATS,
                f"expert_quant {self.expert_quant} cannot go with the CPU target_quant {self.target_quant}",
            ),
            (
                all(x is None or x >= 1 for x in (self.moe_tp_size, self.moe_ep_size)),
                f"moe_tp_size and moe_ep_size must be >= 1, got {self.moe_tp_size} and {self.moe_ep_size}",
            ),
            (
                self.moe_split[0] * self.moe_split[1] == self.tp_size,
                f"moe_tp_size {self.moe_split[0]} x moe_ep_size {self.moe_split[1]} must equal tp_size "
                f"{self.tp_size} (TensorRT-LLM Mapping)",
            ),
            (self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}"),
            (self.max_seq_len >= 2, f"max_seq_len must be >= 2, got {self.max_seq_len}"),
            (
                self.max_num_tokens >= self.block_size,
                f"max_num_tokens ({self.max_num_tokens}) must hold one block ({self.block_size})",
            ),
            (
                self.tokens_per_block >= 1 and self.tokens_per_block & (self.tokens_per_block - 1) == 0,
                f"tokens_per_block must be a power of two, got {self.tokens_per_block}",
            ),
            (1 <= self.block_size <= 64, f"block_size must be in 1..64, got {self.block_size}"),
            (c.num_samples >= 1, f"calibration.num_samples must be >= 1, got {c.num_samples}"),
            (c.max_seq_len >= 8, f"calibration.max_seq_len must be >= 8, got {c.max_seq_len}"),
            (c.batch_size >= 1, f"calibration.batch_size must be >= 1, got {c.batch_size}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise DFlashError(f"build config {self.name!r}: {msg}")
        return self

    # ---------------------------------------------------------------- I/O

    @classmethod
    def from_dict(cls, data: dict, name: str = "custom") -> BuildConfig:
        """Build from a YAML mapping.

        Raises:
            DFlashError: not a mapping, an unknown key (top level or in ``calibration``),
                a value of the wrong type, or an impossible setting.
        """
        if not isinstance(data, dict):
            raise DFlashError(f"build config {name!r}: expected a mapping of knobs, got {type(data).__name__}")
        data = dict(data)
        calib = data.pop("calibration", None) or {}
        if not isinstance(calib, dict):
            raise DFlashError(f"build config {name!r}: calibration must be a mapping")
        _check_keys(data, cls, name, "")
        _check_keys(calib, CalibrationConfig, name, "calibration.")
        kw = {k: _coerce(cls, k, v, name) for k, v in data.items()}
        ckw = {k: _coerce(CalibrationConfig, k, v, name) for k, v in calib.items()}
        kw.setdefault("name", name)
        return cls(**kw, calibration=CalibrationConfig(**ckw)).validate()

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: dict | None = None) -> BuildConfig:
        """Read ``path`` (YAML) and apply ``overrides`` (``{"tp_size": 2, "calibration.num_samples": 8}``).

        Raises:
            DFlashError: missing or unreadable file, malformed YAML, unknown keys, bad values.
        """
        import yaml

        p = Path(path)
        if not p.is_file():
            raise DFlashError(f"build config not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise DFlashError(f"build config {p}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise DFlashError(f"build config {p}: expected a mapping of knobs")
        for key, value in (overrides or {}).items():
            if key.startswith("calibration."):
                data.setdefault("calibration", {})
                data["calibration"] = dict(data["calibration"] or {}) | {key.split(".", 1)[1]: value}
            else:
                data[key] = value
        return cls.from_dict(data, name=data.get("name") or p.stem)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_override(text: str) -> tuple[str, object]:
    """``"key=value"`` from ``--set`` (value parsed as YAML: ``8``, ``fp8``, ``null``).

    Raises:
        DFlashError: no ``=`` in ``text``.
    """
    import yaml

    if "=" not in text:
        raise DFlashError(f"--set takes key=value, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def _check_keys(data: dict, cls, name: str, prefix: str) -> None:
    known = {f.name for f in fields(cls)} - {"calibration"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise DFlashError(
            f"build config {name!r}: unknown key {prefix}{unknown[0]} "
            f"(known: {', '.join(sorted(prefix + k for k in known))})"
        )


def _coerce(cls, key: str, value, name: str):
    """Type-check one YAML value against the dataclass field's annotation."""
    ann = {f.name: f.type for f in fields(cls)}[key]
    ann = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    if value is None and "None" in ann:
        return None
    if ann.startswith("float"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif ann.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif ann.startswith("bool"):
        if isinstance(value, bool):
            return value
    elif ann.startswith("str"):
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - every field is one of the above
        return value
    raise DFlashError(f"build config {name!r}: {key} must be {ann.split(' ')[0]}, got {value!r}")
