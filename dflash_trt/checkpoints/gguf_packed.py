"""A GGUF target loaded straight into packed int4 / int8 linears (:mod:`..models.quant_linear`),
without dequantizing its weights to fp32.

Block formats (llama.cpp ``ggml/src/ggml-common.h`` / ``ggml-quants.c``; each block covers 32
consecutive input elements of one output row, rows stored one after another):

* ``Q4_1``: ``{fp16 d; fp16 m; uint8 qs[16]}`` (20 bytes), ``w[j] = d * q[j] + m`` with
  ``q[j] = qs[j] & 0xF`` and ``q[j + 16] = qs[j] >> 4`` for ``j < 16``. Maps onto one int4 group of
  32 exactly (scale ``d``, zero ``m``).
* ``Q4_0``: ``{fp16 d; uint8 qs[16]}`` (18 bytes), ``w = d * (q - 8)``: int4 with zero ``-8 d``.
* ``Q8_0``: ``{fp16 d; int8 qs[32]}`` (34 bytes), ``w = d * q``.

Q4_1 / Q4_0 linears load as int4 group 32 codes as they are. Every other type (Q8_0, K-quants,
F16, ...) is dequantized by ``gguf.quants.dequantize`` and requantized round-to-nearest, with one
line on stderr per type; a type the ``gguf`` package cannot dequantize is a DFlashError.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of ``llama`` models for its
RoPE layout (``convert_hf_to_gguf.py`` ``LlamaModel.permute``); the inverse permutation
(transformers' ``reverse_permute_weights``) is applied to the rows of the codes and scales. The
model config and tokenizer come from the cached HF conversion of the same file
(:func:`.sources.convert_gguf`), whose fp32 weights are never read here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import DFlashError
from ..models.config import TargetConfig
from ..models.layers import RotaryEmbedding
from ..models.quant_linear import INT_FORMATS, PackedLinear, quantize_int4, quantize_int8
from ..models.target import TargetModel

#: GGUF block types loaded into int4 codes without requantization
DIRECT_INT4 = ("Q4_1", "Q4_0")
#: families whose GGUF q/k rows carry llama.cpp's RoPE permutation
PERMUTED_QK = ("llama",)
GGUF_GROUP = 32


def _blocks(t, block_bytes: int) -> np.ndarray:
    """Raw bytes of a block-quantized GGUF tensor as ``[out, in / 32, block_bytes]`` uint8."""
    data = np.asarray(t.data)
    n = int(t.shape[1]) if len(t.shape) > 1 else 1
    return data.reshape(n, -1, block_bytes)


def q4_1_codes(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF ``Q4_1`` tensor as int4 codes.

    Args:
        t: a ``gguf.ReaderTensor`` of type Q4_1, logical shape ``[out, in]`` (GGUF ``ne`` =
            ``[in, out]``).

    Returns:
        ``(q uint8 [out, in] 0..15, d fp16 [out, in / 32], m fp16 [out, in / 32])`` with
        ``w = d * q + m`` per block (ggml ``dequantize_row_q4_1``).
    """
    b = _blocks(t, 20)
    d = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0])
    m = torch.from_numpy(np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0])
    return _nibbles(b[..., 4:20]), d, m


def q4_0_codes(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF ``Q4_0`` tensor as int4 codes: ``(q, d, -8 d)`` (``w = d * (q - 8)``; ggml
    ``dequantize_row_q4_0``), shapes as :func:`q4_1_codes`; the zero is fp32."""
    b = _blocks(t, 18)
    d = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0])
    return _nibbles(b[..., 2:18]), d, -8 * d.float()


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """``[out, nb, 16]`` packed bytes -> uint8 ``[out, nb * 32]``: low nibbles are elements
    0..15 of the block, high nibbles 16..31."""
    n, nb, _ = qs.shape
    q = np.empty((n, nb, 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[..., :16])
    np.right_shift(qs, 4, out=q[..., 16:])
    return torch.from_numpy(q.reshape(n, nb * 32))


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


class _Notes:
    """One stderr line per GGUF type that is requantized instead of loaded as it is."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def note(self, tname: str, fmt: str, group_size: int) -> None:
        if (tname, fmt) not in self.seen:
            self.seen.add((tname, fmt))
            how = f"int4 group {group_size}" if fmt == "int4" else "int8 per output row"
            print(
                f"GGUF {tname} tensors: dequantized and requantized to {how} (round to nearest)",
                file=sys.stderr,
                flush=True,
            )


def _linear_parts(tensors, fmt: str, rows: list[torch.Tensor | None], notes: _Notes):
    """Codes of one fused linear whose members are ``tensors`` (GGUF q|k|v or gate|up), each
    optionally row-permuted by ``rows``: int4 ``(q, scale, zero)``, int8 ``(q, scale)``."""
    parts = []
    for t, idx in zip(tensors, rows):
        tname = t.tensor_type.name
        if fmt == "int4" and tname in DIRECT_INT4:
            q, s, z = q4_1_codes(t) if tname == "Q4_1" else q4_0_codes(t)
            part = (q, s.float(), z.float())
        else:
            notes.note(tname, fmt, GGUF_GROUP)
            w = dequantize_tensor(t)
            part = quantize_int4(w, GGUF_GROUP) if fmt == "int4" else quantize_int8(w)
        if idx is not None:
            part = tuple(p[idx] for p in part)
        parts.append(part)
    return tuple(torch.cat(x) for x in zip(*parts))


def _packed(parts, fmt: str, bias: torch.Tensor | None, dtype: torch.dtype) -> PackedLinear:
    if fmt == "int4":
        return PackedLinear.from_int4(*parts, GGUF_GROUP, bias, dtype)
    return PackedLinear.from_int8(*parts, bias, dtype)


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
    import gguf

    from .sources import read_json

    if fmt not in INT_FORMATS:
        raise DFlashError(f"unknown weight format {fmt!r}; choose from {', '.join(INT_FORMATS)}")
    cfg = TargetConfig.from_hf(read_json(hf_dir / "config.json", "target"))
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # gguf raises ValueError / struct errors on a bad file
        raise DFlashError(f"cannot read GGUF {gguf_path}: {type(e).__name__}: {e}") from None
    byname = {t.name: t for t in reader.tensors}

    def get(name: str):
        if name not in byname:
            raise DFlashError(f"GGUF {gguf_path.name}: tensor {name} missing")
        return byname[name]

    def dense(name: str) -> torch.Tensor:
        return dequantize_tensor(get(name)).to(dtype)

    notes = _Notes()
    with torch.device("meta"):
        model = TargetModel(cfg)
    permute = cfg.family in PERMUTED_QK
    qrows = _qk_inverse_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads) if permute else None
    krows = _qk_inverse_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads) if permute else None
    sd: dict[str, torch.Tensor] = {
        "embed.weight": dense("token_embd.weight"),
        "norm.weight": dense("output_norm.weight"),
    }
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        sd[f"layers.{i}.attn_norm.weight"] = dense(p + "attn_norm.weight")
        sd[f"layers.{i}.mlp_norm.weight"] = dense(p + "ffn_norm.weight")
        if cfg.qk_norm:
            sd[f"layers.{i}.attn.q_norm.weight"] = dense(p + "attn_q_norm.weight")
            sd[f"layers.{i}.attn.k_norm.weight"] = dense(p + "attn_k_norm.weight")
        bias = None
        if cfg.attention_bias:
            bias = torch.cat(
                [dense(p + "attn_q.bias")[qrows] if permute else dense(p + "attn_q.bias"), dense(p + "attn_k.bias")]
                + [dense(p + "attn_v.bias")]
            )
        qkv = [get(p + n + ".weight") for n in ("attn_q", "attn_k", "attn_v")]
        layer.attn.qkv = _packed(_linear_parts(qkv, fmt, [qrows, krows, None], notes), fmt, bias, dtype)
        layer.attn.o = _packed(_linear_parts([get(p + "attn_output.weight")], fmt, [None], notes), fmt, None, dtype)
        gu = [get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")]
        layer.mlp.gate_up = _packed(_linear_parts(gu, fmt, [None, None], notes), fmt, None, dtype)
        layer.mlp.down = _packed(_linear_parts([get(p + "ffn_down.weight")], fmt, [None], notes), fmt, None, dtype)
    tied = cfg.tie_word_embeddings or "output.weight" not in byname
    if head in (None, "none"):
        if not tied:
            sd["lm_head.weight"] = dense("output.weight")
    else:  # from the fp32 dequantized tensor, not the dtype-rounded embedding
        hw = dequantize_tensor(get("token_embd.weight" if tied else "output.weight"))
        if head == "int4" or head == "int8":
            notes.note(
                get("token_embd.weight" if tied else "output.weight").tensor_type.name + " (LM head)", head, GGUF_GROUP
            )
        model.lm_head = PackedLinear.quantize(hw, head, GGUF_GROUP, None, dtype)
        del hw
    model.load_state_dict(sd, strict=False, assign=True)
    if head in (None, "none") and tied:
        model.lm_head.weight = model.embed.weight
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise DFlashError(f"GGUF {gguf_path.name}: no weights for {', '.join(left[:3])}")
    return model.eval()
