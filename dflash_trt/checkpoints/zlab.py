"""The z-lab DFlash drafter checkpoint format (``z-lab/dflash``; paper arXiv:2602.06036).

A drafter directory holds:
  * ``config.json``: ``architectures: ["DFlashDraftModel"]``, Qwen3 keys (hidden_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
    rms_norm_eps, rope_theta, vocab_size, ...), ``block_size``, ``num_target_layers`` and
    ``dflash_config: {mask_token_id, target_layer_ids}`` (newer files also put ``block_size``
    inside ``dflash_config``; both are read, ``dflash_config`` wins). z-lab's gpt-oss drafters
    say ``model_type: gpt_oss`` and may leave out ``num_target_layers``: their keys then mean
    what transformers' ``GptOssConfig`` makes of them (YaRN RoPE, ``attention_bias``,
    ``layer_types`` and ``sliding_window`` defaults: ``models.config.gpt_oss_config_defaults``);
    ``model_type`` is written back as it was read;
  * ``model.safetensors``: ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
    ``layers.N.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj,
    input_layernorm, post_attention_layernorm}.weight``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..atomic import atomic_dir, write_json
from ..errors import DFlashError
from ..models.config import (
    DrafterConfig,
    TargetConfig,
    default_target_layer_ids,
    gpt_oss_config_defaults,
    rope_scaling_from_hf,
)
from ..models.drafter import DFlashDrafter
from ..models.uninitialized import skip_random_init
from ..quantization.packed import dense_state_dict
from .sources import load_safetensors_dir, read_json

#: config keys that become DrafterConfig fields (the rest is kept in ``extra`` and written back)
_PARSED_KEYS = ("dflash_config", "layer_types", "sliding_window", "use_sliding_window", "is_causal", "draft_vocab_size")


def _attention_layers(cfg: dict, d: dict) -> tuple[int | None, tuple[str, ...], tuple[bool, ...]]:
    """Refuse z-lab variants our drafter does not implement (they would draft badly, silently)
    and return its attention layout: the sliding window W (None: no sliding layer), the
    per-layer ``layer_types`` and the per-layer causal flags, as z-lab's ``DFlashDraftModel``
    reads them (``dflash/model.py``: a layer is causal when ``is_causal`` says so, or, with
    ``is_causal`` unset, when it is a ``sliding_attention`` layer).

    The window is read the way z-lab's torch model sees it through transformers' ``Qwen3Config``:
    it exists only with ``use_sliding_window: true`` (otherwise the layers attend to everything);
    through ``GptOssConfig`` it always does (and ``layer_types`` defaults there to sliding and
    full layers in turn: ``models.config.gpt_oss_config_defaults``).
    """
    arch = cfg.get("architectures") or []
    if any("DFlash2" in a for a in arch):
        raise DFlashError(f"drafter architecture {arch} (DFlash2) is not supported; only DFlashDraftModel")
    value = lambda k: d.get(k, cfg.get(k))  # noqa: E731  (z-lab reads dflash_config first)
    n = int(cfg["num_hidden_layers"])
    types = tuple(value("layer_types") or ["full_attention"] * n)
    if len(types) != n:
        raise DFlashError(f"drafter layer_types lists {len(types)} layers for its num_hidden_layers {n}")
    if set(types) - {"full_attention", "sliding_attention"}:
        raise DFlashError(f"drafter layer_types {sorted(set(types))} are not supported")
    # transformers' Qwen3Config keeps sliding_window only with use_sliding_window; GptOssConfig always does
    use = cfg.get("use_sliding_window", cfg.get("model_type") == "gpt_oss")
    window = value("sliding_window") if use else None
    if not use or window in (None, 0):
        if use and "sliding_attention" in types:
            raise DFlashError("drafter has sliding_attention layers but no sliding_window")
        types, window = ("full_attention",) * n, None  # z-lab's layers then see everything
    if "sliding_attention" not in types:
        window = None  # the full layers ignore it
    is_causal = value("is_causal")
    causal = tuple(t == "sliding_attention" if is_causal is None else bool(is_causal) for t in types)
    for key in ("input_embedding_scale", "output_multiplier"):
        if value(key) not in (None, 1, 1.0):
            raise DFlashError(f"drafter sets {key}={value(key)}, which is not supported")
    if value("final_logit_softcapping") not in (None, 0, 0.0):
        raise DFlashError("drafter sets final_logit_softcapping, which is not supported")
    # variants vLLM / TRT-LLM read for other DFlash drafters (sliding-window or sink attention,
    # causal drafting, a target width other than the drafter's)
    for key in ("use_swa", "swa_window_size", "attention_sink_bias", "causal"):
        if d.get(key) not in (None, False, 0):
            raise DFlashError(f"drafter sets dflash_config.{key}={d[key]!r}, which is not supported")
    width = value("target_hidden_size")
    if width not in (None, cfg.get("hidden_size")):
        raise DFlashError(f"drafter target_hidden_size {width} differs from its hidden_size, which is not supported")
    return (None if window is None else int(window)), types, causal


def drafter_config_from_json(cfg: dict) -> DrafterConfig:
    """Parse a z-lab ``config.json`` dict.

    Raises:
        DFlashError: not a DFlash drafter config, or a required key is missing.
    """
    arch = cfg.get("architectures") or []
    if not any("DFlash" in a for a in arch):
        raise DFlashError(f"not a DFlash drafter config (architectures={arch})")
    d = cfg.get("dflash_config") or {}
    if cfg.get("model_type") == "gpt_oss":
        cfg = gpt_oss_config_defaults(cfg)

    def get(name, default=None):
        value = d.get(name, cfg.get(name, default))
        if value is None:
            raise DFlashError(f"drafter config.json lacks {name!r}")
        return value

    window, types, causal = _attention_layers(cfg, d)
    try:
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        scaling = rope_scaling_from_hf(rope, max_pos)
        n_target = d.get("num_target_layers", cfg.get("num_target_layers"))
        n_target = None if n_target is None else int(n_target)
        ids = d.get("target_layer_ids", cfg.get("target_layer_ids"))
        if not ids:
            if n_target is None:
                raise DFlashError("drafter config.json has neither 'target_layer_ids' nor 'num_target_layers'")
            ids = default_target_layer_ids(n_target, layers)
        return DrafterConfig(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            vocab_size=int(cfg["vocab_size"]),
            block_size=int(get("block_size", 16)),
            mask_token_id=int(get("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=n_target,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            attention_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=window,
            layer_types=types,
            causal_layers=causal,
            draft_vocab_size=int(cfg["draft_vocab_size"]) if cfg.get("draft_vocab_size") is not None else None,
            extra={k: v for k, v in cfg.items() if k not in _PARSED_KEYS},
        )
    except KeyError as e:
        raise DFlashError(f"drafter config.json lacks required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise DFlashError(f"drafter config.json has a bad value: {e}") from None


def drafter_config_to_json(cfg: DrafterConfig) -> dict:
    """The z-lab ``config.json`` dict for ``cfg`` (Qwen3 keys + ``dflash_config``)."""
    out = dict(cfg.extra)
    out.update(
        {
            "architectures": ["DFlashDraftModel"],
            "model_type": cfg.extra.get("model_type", "qwen3"),  # gpt_oss keeps its meaning (module docstring)
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings,
            "attention_bias": cfg.attention_bias,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "block_size": cfg.block_size,
            "dflash_config": {
                "block_size": cfg.block_size,
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": list(cfg.target_layer_ids),
            },
        }
    )
    if cfg.num_target_layers is not None:
        out["num_target_layers"] = cfg.num_target_layers
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.draft_vocab_size is not None:
        out["draft_vocab_size"] = cfg.draft_vocab_size
    types = cfg.layer_type_names
    if cfg.sliding_window is not None or out["model_type"] == "gpt_oss":
        out["layer_types"] = types  # else GptOssConfig's default would mix the kinds
    causal = list(cfg.causal_layers) or [False] * cfg.num_layers
    if all(causal):
        out["is_causal"] = True
    elif any(causal):  # z-lab's is_causal default: exactly the sliding layers are causal
        if causal != [t == "sliding_attention" for t in types]:
            raise DFlashError("drafter causal_layers other than all, none or the sliding layers have no z-lab form")
    elif cfg.sliding_window is not None:
        out["is_causal"] = False
    if cfg.sliding_window is not None:
        out["use_sliding_window"] = True  # transformers' Qwen3Config drops sliding_window without it
        out["sliding_window"] = cfg.sliding_window
    return out


def validate_pair(target: TargetConfig, drafter: DrafterConfig) -> None:
    """Check that a drafter fits a target.

    Raises:
        DFlashError: hidden size, vocabulary, target layer count, target_layer_ids,
            mask_token_id, head shape or block size do not fit.
    """
    problems = []
    if drafter.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {drafter.hidden_size} != target's {target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {drafter.vocab_size} != target's {target.vocab_size}")
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_layers:
        problems.append(f"made for a {drafter.num_target_layers}-layer target, this one has {target.num_layers}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside 0..{target.num_layers - 1}")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} outside the vocabulary (0..{target.vocab_size - 1})")
    if drafter.num_heads % drafter.num_kv_heads:
        problems.append(f"{drafter.num_heads} heads not a multiple of {drafter.num_kv_heads} KV heads")
    if drafter.head_dim % 2:
        problems.append(f"head_dim {drafter.head_dim} is odd (RoPE needs it even)")
    if drafter.block_size < 2:
        problems.append(f"block_size {drafter.block_size} < 2")
    if drafter.draft_vocab_size is not None and drafter.draft_vocab_size > target.vocab_size:
        problems.append(f"draft_vocab_size {drafter.draft_vocab_size} > the target's vocabulary {target.vocab_size}")
    if problems:
        raise DFlashError("drafter does not match target: " + "; ".join(problems))


def load_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Load a z-lab drafter directory.

    Raises:
        DFlashError: missing directory, bad config, corrupt or mismatched weights.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise DFlashError(f"drafter not found: {path}")
    cfg = drafter_config_from_json(read_json(path / "config.json", "drafter"))
    sd = load_safetensors_dir(path, "drafter")
    with skip_random_init():  # every weight is loaded below
        model = DFlashDrafter(cfg)
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    if missing:
        raise DFlashError(f"drafter {path}: missing weights {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    for k, t in sd.items():
        if k in own and own[k].shape != t.shape:
            raise DFlashError(f"drafter {path}: {k} has shape {tuple(t.shape)}, config wants {tuple(own[k].shape)}")
    if model.d2t is not None:  # checked as stored: a float d2t would be cast silently by the load
        check_d2t(sd["d2t"], cfg.vocab_size, f"drafter {path}")
    model.load_state_dict({k: sd[k] for k in own}, strict=True)
    return model.to(dtype).eval()


def check_d2t(d2t: torch.Tensor, vocab_size: int, what: str) -> None:
    """Raises DFlashError unless ``d2t`` is a 1-D integer tensor and ``arange(N) + d2t`` are
    strictly increasing target ids in ``0 .. vocab_size - 1`` (the EAGLE-3 / speculators
    draft-vocabulary mapping). A floating-point ``d2t`` is refused, not cast: bf16 holds integers
    exactly only up to 256, so a bf16 copy maps most draft ids to the wrong target tokens while
    still looking sorted and distinct."""
    if d2t.dtype not in (torch.int64, torch.int32) or d2t.dim() != 1:
        lost = " (a float d2t has lost its offsets; rebuild it from the draft vocabulary)"
        raise DFlashError(
            f"{what}: d2t must be a 1-D int64 tensor, got {d2t.dtype} {tuple(d2t.shape)}"
            + (lost if d2t.is_floating_point() else "")
        )
    ids = torch.arange(d2t.numel()) + d2t.cpu().long()
    if d2t.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= vocab_size or bool((ids[1:] <= ids[:-1]).any())):
        raise DFlashError(f"{what}: d2t does not map draft ids to distinct, sorted target ids below {vocab_size}")


def save_drafter(
    model: DFlashDrafter,
    out: str | os.PathLike,
    dtype: torch.dtype | None = None,
    replace: bool = False,
    extra: dict[str, Callable[[Path], None]] | None = None,
    lm_head: torch.Tensor | None = None,
) -> Path:
    """Write ``model`` as a z-lab drafter directory, atomically (:func:`~dflash_trt.atomic.atomic_dir`).

    Args:
        dtype: dtype of the saved floating-point weights (None: as they are; packed int4 / int8
            linears are written as the weights they multiply by, fp32:
            :func:`~dflash_trt.quantization.packed.dense_state_dict`); integer buffers (``d2t``)
            keep their dtype.
        replace: replace an existing ``out`` (else that is an error).
        extra: more files for the same directory, ``{name: write(path)}`` (a training
            checkpoint's optimizer state), written before it appears.
        lm_head: the target's LM head weight ``[vocab, hidden]``: with a draft vocabulary
            (``d2t``) its rows ``i + d2t[i]`` are written as ``lm_head.weight``
            ``[draft_vocab_size, hidden]``, which vLLM's DFlash model (``qwen3_dflash.py``) needs
            (without it vLLM shares the target's head and keeps its first rows: wrong drafts,
            no error); our loader ignores it (the drafter uses the target's head).

    Raises:
        DFlashError: ``out`` already exists and ``replace`` is false.
    """
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    if out.exists() and not replace:
        raise DFlashError(f"output {out} already exists")
    with atomic_dir(out, replace=replace) as tmp:
        sd = {
            k: (v.to(dtype) if dtype and v.is_floating_point() else v).contiguous()
            for k, v in dense_state_dict(model).items()
        }
        if lm_head is not None and model.d2t is not None:
            rows = lm_head.detach()[model.draft_token_ids().to(lm_head.device)].cpu()
            sd["lm_head.weight"] = rows.to(dtype or rows.dtype).contiguous()
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", drafter_config_to_json(model.cfg))
        for name, write in (extra or {}).items():
            write(tmp / name)
    return out


def drafter_config_for(
    target: TargetConfig,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    sliding_window: int | None = None,
) -> DrafterConfig:
    """The shape of a new drafter for ``target``: the target's hidden size, heads, intermediate
    size and RoPE; ``target_layer_ids`` default to the z-lab spread.

    Raises:
        DFlashError: ``num_layers`` < 1, or the result would not fit the target (:func:`validate_pair`).
    """
    if num_layers < 1:
        raise DFlashError(f"--layers must be >= 1, got {num_layers}")
    cfg = DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_layers=num_layers,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        vocab_size=target.vocab_size,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)),
        num_target_layers=target.num_layers,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
        sliding_window=sliding_window,
    )
    validate_pair(target, cfg)
    return cfg


def init_drafter(
    target: TargetConfig,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    seed: int = 0,
    target_layer_ids: list[int] | None = None,
    sliding_window: int | None = None,
    draft_token_ids: torch.Tensor | None = None,
) -> DFlashDrafter:
    """A randomly initialised drafter of :func:`drafter_config_for`'s shape (Qwen3 init:
    normal(0, 0.02) linears, unit norms).

    Args:
        draft_token_ids: sorted distinct target ids of a draft vocabulary (sets
            ``draft_vocab_size`` and ``d2t``); None: the whole vocabulary.

    Raises:
        DFlashError: see :func:`drafter_config_for`; a draft vocabulary that is not sorted,
            distinct target ids.
    """
    cfg = drafter_config_for(target, num_layers, block_size, mask_token_id, target_layer_ids, sliding_window)
    if draft_token_ids is not None:
        cfg = dataclasses.replace(cfg, draft_vocab_size=int(draft_token_ids.numel()))
    g = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        if draft_token_ids is not None:
            model.d2t.copy_(draft_token_ids.long() - torch.arange(draft_token_ids.numel()))
            check_d2t(model.d2t, cfg.vocab_size, "draft vocabulary")
    return model.eval()
