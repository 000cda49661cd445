"""The drafter kernels' TensorRT plugin interface: the variants compiled ahead of time and,
for each, its arguments as the TensorRT plugins (``plugins/dflash_plugins.py``) pass them.

A TensorRT quickly deployable plugin (``tensorrt.plugin``, TensorRT >= 10.9; NVIDIA/TensorRT
``samples/python/quickly_deployable_plugins``) launches an AOT kernel with its arguments in the
order: input pointers, the extra int32 scalars its ``aot_impl`` returns (``trtp.SymIntExprs``),
output pointers. The kernels of :mod:`.block_attention`, :mod:`.context_kv` and
:mod:`.acceptance` take their arguments in that order, so the same kernel serves the torch
custom ops and the plugins; float attributes (softmax scale, RMSNorm eps) are compile-time
constants, since the extra scalars are int32 only.

Each spec lists the plugin's inputs, extra scalars and outputs with their Triton types, and how
the launch grid follows from the shapes: :func:`specs` is the single source for the AOT
compile and for the plugins' ``aot_impl``.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant: ``name`` (file stem), the kernel, its argument types in
    plugin order (inputs, int32 extras, outputs) and its compile-time constants; ``grid`` says
    in words which shape dimensions make the launch grid (the plugin computes it)."""

    name: str
    kernel: object
    inputs: dict[str, str]
    extras: dict[str, str]
    outputs: dict[str, str]
    constexprs: dict
    grid: str

    @property
    def signature(self) -> dict[str, str]:
        """Triton ``ASTSource`` signature: every argument in launch order, constants last."""
        return self.inputs | self.extras | self.outputs | dict.fromkeys(self.constexprs, "constexpr")


def block_attention_variant(head_dim: int, group: int, block: int) -> str:
    """Name of the block-attention variant for ``head_dim``, ``group`` query heads per KV head and block size."""
    return f"block_attention_d{head_dim}_g{group}_b{block}"


def context_kv_variant(head_dim: int, kv_heads: int, eps: float) -> str:
    """Name of the context-K/V variant for ``head_dim``, ``kv_heads`` and the k_norm RMSNorm
    ``eps`` (compiled in as a constant; written to one significant digit, so a config's fp32
    round trip of 1e-5, 9.9999997e-06, names the same variant)."""
    return f"context_kv_d{head_dim}_h{kv_heads}_eps{eps:.0e}"


#: the acceptance variant (up to 16 draft tokens)
ACCEPT_VARIANT = "accept_k16"


#: the shapes compiled ahead of time: (head dim, KV heads, query heads per KV head)
AOT_SHAPES = ((64, 3, 3), (128, 8, 4))
#: block sizes, KV-cache tokens per block and k_norm epsilons compiled ahead of time
AOT_BLOCKS, AOT_TOKENS_PER_BLOCK, AOT_EPS = (4, 8, 16), 32, (1e-5, 1e-6)


def variant_names() -> set[str]:
    """Names of every variant :func:`specs` compiles (needs no triton)."""
    names = {ACCEPT_VARIANT}
    for d, hkv, g in AOT_SHAPES:
        names |= {block_attention_variant(d, g, b) for b in AOT_BLOCKS}
        names |= {context_kv_variant(d, hkv, eps) for eps in AOT_EPS}
    return names


def specs() -> list[KernelSpec]:
    """Every variant compiled ahead of time (:data:`AOT_SHAPES` ...): head dim 64 with 3 KV heads
    and 9 query heads (SmolLM2-135M) and head dim 128 with 8 KV heads and 32 query heads
    (Llama-3.1-8B, Qwen3-8B); block sizes 4, 8, 16; 32 tokens per KV block; k_norm eps 1e-5 and
    1e-6; bf16 activations, fp32 accumulation. Names as :func:`variant_names`."""
    if triton is None:
        raise ImportError("the drafter kernels need triton")
    from .acceptance import _accept_kernel
    from .block_attention import _block_attention_kernel
    from .context_kv import _context_kv_kernel

    out = []
    for d, hkv, g in AOT_SHAPES:
        for b in AOT_BLOCKS:
            rows = max(16, 1 << (g * b - 1).bit_length())
            const = {
                "SCALE": d**-0.5,
                "B": b,
                "G": g,
                "D": d,
                "TPB": AOT_TOKENS_PER_BLOCK,
                "ROWS": rows,
                "BLOCK_N": 32,
                "PREC": "tf32",
            }
            out.append(
                KernelSpec(
                    block_attention_variant(d, g, b),
                    _block_attention_kernel,
                    {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Tables": "*i32", "Lens": "*i32"},
                    dict.fromkeys(
                        ["stride_q_row", "stride_q_head", "stride_k_slot", "stride_k_head", "stride_t", "window"], "i32"
                    ),
                    {"Out": "*bf16"},
                    const,
                    "(num sequences, num KV heads)",
                )
            )
        for eps in AOT_EPS:
            const = {"EPS": eps, "L": 1, "HKV": hkv, "HKV_P": 1 << (hkv - 1).bit_length(), "D": d}
            out.append(
                KernelSpec(
                    context_kv_variant(d, hkv, eps),
                    _context_kv_kernel,
                    {
                        "KV": "*bf16",
                        "KNorm": "*bf16",
                        "InvFreq": "*fp32",
                        "Pos": "*i64",
                        "Slots": "*i64",
                        "KPin": "*bf16",
                        "VPin": "*bf16",
                    },
                    dict.fromkeys(
                        ["stride_kv_row", "stride_pool_layer", "stride_pool_slot", "stride_pool_head"], "i32"
                    ),
                    {"KP": "*bf16", "VP": "*bf16"},
                    const,
                    "(num tokens, drafter layers)",
                )
            )
    out.append(
        KernelSpec(
            ACCEPT_VARIANT,
            _accept_kernel,
            {"Drafts": "*i64", "Target": "*i64", "N": "*i32"},
            {"stride_d": "i32", "stride_t": "i32"},
            {"Out": "*i32"},
            {"K_P": 16},
            "(num sequences,)",
        )
    )
    return out
