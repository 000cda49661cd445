"""A GGUF target loaded straight into packed int4 / int8 linears
(:class:`~dflash_trt.quantization.packed.PackedLinear`), without dequantizing its weights to fp32.

Q4_1 / Q4_0 linears load as int4 group 32 codes as they are (the block layouts and the mapping
are :mod:`dflash_trt.quantization.int4`'s). Every other type (Q8_0, K-quants, F16, ...) and every
tensor of an int8 load is dequantized by ``gguf.quants.dequantize`` and requantized round to
nearest, with one line on stderr per type; a type the ``gguf`` package cannot dequantize is a
DFlashError.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of ``llama`` models for its
RoPE layout (``convert_hf_to_gguf.py`` ``LlamaModel.permute``); the inverse permutation
(transformers' ``reverse_permute_weights``) is applied to the rows of the codes and scales. The
model config and tokenizer come from the cached HF conversion of the same file
(:func:`.sources.convert_gguf`), whose fp32 weights are never read here.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import DFlashError
from ..models.config import TargetConfig
from ..models.layers import RotaryEmbedding
from ..models.target import TargetModel
from ..quantization.packed import PackedLinear, packed_class

#: families whose GGUF q/k rows carry llama.cpp's RoPE permutation
PERMUTED_QK = ("llama",)
GGUF_GROUP = 32


def dequantize_tensor(t) -> torch.Tensor:
    """Any GGUF tensor as fp32 ``[out, in]`` (or ``[n]``) through ``gguf.quants.dequantize``.

    Raises:
        DFlashError: a type the installed ``gguf`` package cannot dequantize.
    """
    from gguf import quants

    try:
        w = quants.dequantize(np.asarray(t.data), t.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise DFlashError(f"GGUF tensor {t.name}: type {t.tensor_type.name} is not supported ({e})") from None
    shape = [int(s) for s in reversed(t.shape)]
    return torch.from_numpy(np.array(w, dtype=np.float32)).reshape(shape)


def _qk_inverse_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row index undoing llama.cpp's q/k permutation: ``hf[i] = gguf[idx[i]]``."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


@functools.lru_cache(maxsize=2)
def _tensor_table(path: str, size: int, mtime_ns: int) -> dict:
    """The ``gguf.ReaderTensor`` s of the GGUF file ``path`` by name (views of the file, mapped
    read-only), read once per process while the file is unchanged: ``gguf.GGUFReader`` parses
    every metadata field, the tokenizer's ~100k strings one by one (~4 s for the default target).

    Raises:
        DFlashError: not a readable GGUF file.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError / struct errors on a bad file
        raise DFlashError(f"cannot read GGUF {path}: {type(e).__name__}: {e}") from None
    return {t.name: t for t in reader.tensors}


class _GgufFile:
    """The tensors of one GGUF file, read into dense tensors or packed linears of one format
    (one stderr line per GGUF type that is requantized instead of loaded as it is)."""

    def __init__(self, path: Path, fmt: str, dtype: torch.dtype) -> None:
        file = Path(path).resolve()
        self.path, self.dtype = path, dtype
        self.linear_class = packed_class(fmt)
        self.byname = _tensor_table(str(file), file.stat().st_size, file.stat().st_mtime_ns)
        self.seen: set[tuple[str, str]] = set()

    def get(self, name: str):
        """The ``gguf.ReaderTensor`` called ``name``.

        Raises:
            DFlashError: the file lacks it.
        """
        if name not in self.byname:
            raise DFlashError(f"GGUF {self.path.name}: tensor {name} missing")
        return self.byname[name]

    def dense(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized, in the load dtype."""
        return dequantize_tensor(self.get(name)).to(self.dtype)

    def note(self, tname: str, cls: type[PackedLinear]) -> None:
        """Say once per (GGUF type, format) that such tensors are requantized."""
        if (tname, cls.fmt) not in self.seen:
            self.seen.add((tname, cls.fmt))
            print(
                f"GGUF {tname} tensors: dequantized and requantized to {cls.describe(GGUF_GROUP)} (round to nearest)",
                file=sys.stderr,
                flush=True,
            )

    def linear(
        self, names: list[str], rows: list[torch.Tensor | None], bias: torch.Tensor | None = None
    ) -> PackedLinear:
        """One packed linear whose members are the GGUF tensors ``names`` (q|k|v or gate|up, rows
        one after another), each optionally row-permuted by ``rows``: codes as stored where the
        format maps the block type (Q4_1 / Q4_0 as int4), else requantized round to nearest."""
        cls = self.linear_class
        parts = []
        for name, idx in zip(names, rows):
            t = self.get(name)
            part = cls.gguf_codes(t)
            if part is None:
                self.note(t.tensor_type.name, cls)
                part = cls.quantize_codes(dequantize_tensor(t), GGUF_GROUP)
            if idx is not None:
                part = tuple(p[idx] for p in part)
            parts.append(part)
        return cls.from_codes(tuple(torch.cat(x) for x in zip(*parts)), GGUF_GROUP, bias, self.dtype)


def _pack_layer(f: _GgufFile, cfg: TargetConfig, i: int, layer, sd: dict[str, torch.Tensor]) -> None:
    """Layer ``i``: its norms into ``sd``, its linears packed into ``layer`` (llama.cpp's q/k row
    permutation undone for :data:`PERMUTED_QK` families)."""
    p = f"blk.{i}."
    sd[f"layers.{i}.attn_norm.weight"] = f.dense(p + "attn_norm.weight")
    sd[f"layers.{i}.mlp_norm.weight"] = f.dense(p + "ffn_norm.weight")
    if cfg.qk_norm:
        sd[f"layers.{i}.attn.q_norm.weight"] = f.dense(p + "attn_q_norm.weight")
        sd[f"layers.{i}.attn.k_norm.weight"] = f.dense(p + "attn_k_norm.weight")
    qrows = krows = None
    if cfg.family in PERMUTED_QK:
        qrows = _qk_inverse_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
        krows = _qk_inverse_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    bias = None
    if cfg.attention_bias:
        qb = f.dense(p + "attn_q.bias")
        bias = torch.cat(
            [qb[qrows] if qrows is not None else qb, f.dense(p + "attn_k.bias"), f.dense(p + "attn_v.bias")]
        )
    qkv = [p + n + ".weight" for n in ("attn_q", "attn_k", "attn_v")]
    layer.attn.qkv = f.linear(qkv, [qrows, krows, None], bias)
    layer.attn.o = f.linear([p + "attn_output.weight"], [None])
    layer.mlp.gate_up = f.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None])
    layer.mlp.down = f.linear([p + "ffn_down.weight"], [None])


def _lm_head(f: _GgufFile, model: TargetModel, head: str | None, sd: dict[str, torch.Tensor]) -> bool:
    """The LM head: packed as ``head`` (requantized from the fp32 dequantized ``output`` or, tied,
    ``token_embd`` tensor, not the dtype-rounded embedding) into ``model``, or dense into ``sd``.
    Returns whether a dense head is tied to the embedding."""
    tied = model.cfg.tie_word_embeddings or "output.weight" not in f.byname
    if head in (None, "none"):
        if not tied:
            sd["lm_head.weight"] = f.dense("output.weight")
        return tied
    cls = packed_class(head)
    t = f.get("token_embd.weight" if tied else "output.weight")
    f.note(t.tensor_type.name + " (LM head)", cls)
    model.lm_head = cls.from_weight(dequantize_tensor(t), GGUF_GROUP, None, f.dtype)
    return False


def load_gguf_packed(
    gguf_path: Path, hf_dir: Path, fmt: str = "int4", head: str | None = "int8", dtype: torch.dtype = torch.bfloat16
) -> TargetModel:
    """Build the target of ``gguf_path`` with packed linears read from its blocks.

    Args:
        gguf_path: the ``.gguf`` file (Llama / Qwen2 / Qwen3 architectures).
        hf_dir: its cached HF conversion (``config.json`` is read; the weights are not).
        fmt: ``int4`` (Q4_1 / Q4_0 blocks as they are) or ``int8`` (requantized per row).
        head: the LM head's format: ``int4`` / ``int8`` (requantized from the GGUF ``output`` or,
            tied, ``token_embd`` tensor), or None / ``"none"``: dense in ``dtype`` (tied heads then
            share the embedding).
        dtype: activation, scale, embedding and norm dtype.

    Returns:
        The target in eval mode on the CPU.

    Raises:
        DFlashError: unknown format, a tensor missing from the file, a type ``gguf`` cannot
            dequantize, a shape int4 cannot pack.
    """
    from .sources import read_json

    packed_class(fmt)  # an unknown format before the file is read
    cfg = TargetConfig.from_hf(read_json(hf_dir / "config.json", "target"))
    f = _GgufFile(gguf_path, fmt, dtype)
    with torch.device("meta"):
        model = TargetModel(cfg)
    sd: dict[str, torch.Tensor] = {
        "embed.weight": f.dense("token_embd.weight"),
        "norm.weight": f.dense("output_norm.weight"),
    }
    for i, layer in enumerate(model.layers):
        _pack_layer(f, cfg, i, layer, sd)
    tied_dense = _lm_head(f, model, head, sd)
    model.load_state_dict(sd, strict=False, assign=True)
    if tied_dense:
        model.lm_head.weight = model.embed.weight
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise DFlashError(f"GGUF {gguf_path.name}: no weights for {', '.join(left[:3])}")
    return model.eval()
