"""The drafter kernels with TensorRT's plugin argument order, the form that the AOT cubins / PTX
take and that the TensorRT plugins (``plugins/dflash_plugins.py``) launch.

A TensorRT quickly deployable plugin (``tensorrt.plugin``, TensorRT >= 10.9; NVIDIA/TensorRT
``samples/python/quickly_deployable_plugins``) launches an AOT kernel with its arguments in the
order: input pointers, the extra int32 scalars its ``aot_impl`` returns (``trtp.SymIntExprs``),
output pointers. These wrappers take that order and call the kernels of
:mod:`.block_attention`, :mod:`.context_kv` and :mod:`.acceptance` (inlined by Triton: one kernel,
same code). Float attributes (softmax scale, RMSNorm eps) become compile-time constants, since
the extra scalars are int32 only.

Each spec lists the plugin's inputs, extra scalars and outputs with their Triton types, and how
the launch grid follows from the shapes: :func:`specs` is the single source for the AOT
compile and for the plugins' ``aot_impl``.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant: ``name`` (file stem), the wrapper kernel, its argument types in
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


if triton is not None:
    from .acceptance import _accept_kernel
    from .block_attention import _block_attention_kernel
    from .context_kv import _context_kv_kernel

    @triton.jit
    def block_attention_plugin(
        Q,
        K,
        V,
        Tables,
        Lens,
        stride_q_row,
        stride_q_head,
        stride_k_slot,
        stride_k_head,
        stride_t,
        window,
        Out,
        SCALE: tl.constexpr,
        B: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        TPB: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """Grid ``(S, Hkv)``; ``Out`` is ``[S * B, Hq * D]`` (its row stride ``Hq * D`` = G*Hkv*D)."""
        _block_attention_kernel(
            Q,
            K,
            V,
            Out,
            Tables,
            Lens,
            stride_q_row,
            stride_q_head,
            stride_k_slot,
            stride_k_head,
            stride_q_row,
            stride_t,
            SCALE,
            window,
            B,
            G,
            D,
            TPB,
            ROWS,
            BLOCK_N,
            PREC,
        )

    @triton.jit
    def context_kv_plugin(
        KV,
        KNorm,
        InvFreq,
        Pos,
        Slots,
        KPin,
        VPin,
        stride_kv_row,
        stride_pool_layer,
        stride_pool_slot,
        stride_pool_head,
        KP,
        VP,
        EPS: tl.constexpr,
        L: tl.constexpr,
        HKV: tl.constexpr,
        HKV_P: tl.constexpr,
        D: tl.constexpr,
    ):
        """Grid ``(T, L)``; ``KP`` / ``VP`` alias ``KPin`` / ``VPin`` (written in place)."""
        _context_kv_kernel(
            KV,
            KNorm,
            InvFreq,
            Pos,
            Slots,
            KP,
            VP,
            stride_kv_row,
            stride_pool_layer,
            stride_pool_slot,
            stride_pool_head,
            EPS,
            L,
            HKV,
            HKV_P,
            D,
        )

    @triton.jit
    def accept_plugin(Drafts, Target, N, stride_d, stride_t, Out, K_P: tl.constexpr):
        """Grid ``(S,)``."""
        _accept_kernel(Drafts, Target, N, Out, stride_d, stride_t, K_P)


def specs() -> list[KernelSpec]:
    """Every variant compiled ahead of time: head dim 64 with 3 KV heads and 9 query heads
    (SmolLM2-135M) and head dim 128 with 8 KV heads and 32 query heads (Llama-3.1-8B, Qwen3-8B);
    block sizes 4, 8, 16; 32 tokens per KV block; bf16 activations, fp32 accumulation."""
    if triton is None:
        raise ImportError("the drafter kernels need triton")
    out = []
    for d, hkv, g in ((64, 3, 3), (128, 8, 4)):
        for b in (4, 8, 16):
            rows = max(16, 1 << (g * b - 1).bit_length())
            const = {
                "SCALE": d**-0.5,
                "B": b,
                "G": g,
                "D": d,
                "TPB": 32,
                "ROWS": rows,
                "BLOCK_N": 32,
                "PREC": "tf32",
            }
            out.append(
                KernelSpec(
                    f"block_attention_d{d}_g{g}_b{b}",
                    block_attention_plugin,
                    {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Tables": "*i32", "Lens": "*i32"},
                    dict.fromkeys(
                        ["stride_q_row", "stride_q_head", "stride_k_slot", "stride_k_head", "stride_t", "window"], "i32"
                    ),
                    {"Out": "*bf16"},
                    const,
                    "(num sequences, num KV heads)",
                )
            )
        const = {"EPS": 1e-6, "L": 1, "HKV": hkv, "HKV_P": 1 << (hkv - 1).bit_length(), "D": d}
        out.append(
            KernelSpec(
                f"context_kv_d{d}_h{hkv}",
                context_kv_plugin,
                {
                    "KV": "*bf16",
                    "KNorm": "*bf16",
                    "InvFreq": "*fp32",
                    "Pos": "*i64",
                    "Slots": "*i64",
                    "KPin": "*bf16",
                    "VPin": "*bf16",
                },
                dict.fromkeys(["stride_kv_row", "stride_pool_layer", "stride_pool_slot", "stride_pool_head"], "i32"),
                {"KP": "*bf16", "VP": "*bf16"},
                const,
                "(num tokens, drafter layers)",
            )
        )
    out.append(
        KernelSpec(
            "accept_k16",
            accept_plugin,
            {"Drafts": "*i64", "Target": "*i64", "N": "*i32"},
            {"stride_d": "i32", "stride_t": "i32"},
            {"Out": "*i32"},
            {"K_P": 16},
            "(num sequences,)",
        )
    )
    return out
