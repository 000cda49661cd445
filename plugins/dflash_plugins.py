"""The DFlash drafter kernels as TensorRT plugins (quickly deployable plugins, ``tensorrt.plugin``,
TensorRT >= 10.9; API as in NVIDIA/TensorRT ``samples/python/quickly_deployable_plugins``).

Plugins (namespace ``dflash``), one per kernel of ``dflash_trt.kernels``:

- ``dflash::context_kv``: fused target features' stacked K/V GEMM output ``[T, L*2*Hkv*D]``,
  k_norm ``[L, D]``, RoPE inverse frequencies ``[D/2]`` fp32, positions / slots ``[T]`` int64 and
  the drafter's K / V pools ``[L, P, Hkv, D]``, attribute ``eps`` (k_norm) -> the same pools,
  written in place (aliased);
- ``dflash::block_attention``: queries ``[S*B, Hq, D]``, one layer's K / V pool ``[P, Hkv, D]``,
  block tables ``[S, max_blocks]`` int32, kv lengths ``[S]`` int32 -> ``[S*B, Hq*D]``;
- ``dflash::accept``: drafts ``[S, K]`` int64, target tokens ``[S, K+1]`` int64, draft counts
  ``[S]`` int32 -> accepted drafts ``[S]`` int32.

The AOT implementations return the PTX that ``dflash-trt kernels-aot --out DIR`` wrote for the
GPU's architecture (``DIR`` from ``DFLASH_TRT_KERNELS_DIR``; kernels in plugin argument order,
``dflash_trt.kernels.plugin_abi``), so an engine built with these plugins runs without Triton
installed. The builder names the plugins and the variants a drafter needs in
``trtllm/plugins.json``.

Status: TensorRT cannot be installed on the machines this project is developed on, so this file
has never been imported under TensorRT; what is tested is the kernels themselves (Triton
interpreter vs torch references), their AOT compile to cubins and PTX for sm_90a, sm_100a
and sm_103a, and this file under a stand-in of the ``tensorrt.plugin`` API
(``tests/test_kernels.py``: each AOT implementation picks a compiled variant and passes as many
int32 extras as its kernel declares). Loading it without TensorRT raises ImportError with that message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_trt.kernels.plugin_abi import (
    ACCEPT_VARIANT,
    AOT_TOKENS_PER_BLOCK,
    block_attention_variant,
    context_kv_variant,
)

try:
    import tensorrt as trt
    import tensorrt.plugin as trtp
except ImportError as e:  # pragma: no cover - TensorRT is not installable in development
    raise ImportError(
        "plugins/dflash_plugins.py needs TensorRT >= 10.9 with tensorrt.plugin (pip install tensorrt on a GPU machine)"
    ) from e


def _kernels_dir() -> Path:
    d = os.environ.get("DFLASH_TRT_KERNELS_DIR")
    if not d or not (Path(d) / "manifest.json").is_file():
        raise RuntimeError("set DFLASH_TRT_KERNELS_DIR to a `dflash-trt kernels-aot --out DIR` directory")
    return Path(d)


def _arch() -> str:
    """The PTX target of the GPU this process builds for (sm_90a, sm_100a, sm_103a)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a"


def _variant(name: str) -> tuple[str, str, int, int]:
    """``(entry, ptx, threads per block, shared bytes)`` of a compiled variant for this GPU."""
    root = _kernels_dir()
    arch = _arch()
    for e in json.loads((root / "manifest.json").read_text())["cubins"]:
        if e["variant"] == name and e["arch"] == arch:
            return e["entry"], (root / e["ptx"]).read_text(), 32 * e["num_warps"], e["shared_bytes"]
    raise RuntimeError(f"no AOT kernel {name} for {arch} in {root}; rerun dflash-trt kernels-aot")


def _aot(variant: str, grid: tuple, extras: list):
    """What an ``aot_impl`` returns: the variant's entry and PTX, launch parameters over
    ``grid`` (1 to 3 symbolic sizes) and the int32 extra arguments (kernel order)."""
    entry, ptx, threads, smem = _variant(variant)
    launch = trtp.KernelLaunchParams()
    for axis, size in zip(("grid_x", "grid_y", "grid_z"), grid):
        setattr(launch, axis, size)
    launch.block_x = threads
    launch.shared_mem = smem
    extra = trtp.SymIntExprs(len(extras))
    for j, e in enumerate(extras):
        extra[j] = trtp.SymInt32(e)
    return entry, ptx, launch, extra


# ------------------------------------------------------------------------ dflash::block_attention
@trtp.register("dflash::block_attention")
def block_attention_desc(
    q: trtp.TensorDesc,
    k_pool: trtp.TensorDesc,
    v_pool: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_lens: trtp.TensorDesc,
    block: int,
    tokens_per_block: int,
    window: int,
) -> trtp.TensorDesc:
    """Output ``[S*B, Hq*D]`` in the queries' dtype."""
    return trtp.from_shape_expr((q.shape_expr[0], q.shape_expr[1] * q.shape_expr[2]), dtype=q.dtype)


@trtp.autotune("dflash::block_attention")
def block_attention_autotune(q, k_pool, v_pool, block_tables, kv_lens, block, tokens_per_block, window, outputs):
    return [trtp.AutoTuneCombination("BF16, BF16, BF16, INT32, INT32, BF16", "LINEAR")]


@trtp.aot_impl("dflash::block_attention")
def block_attention_aot(q, k_pool, v_pool, block_tables, kv_lens, block, tokens_per_block, window, outputs, tactic):
    hq, d = q.shape_expr[1].constant_value, q.shape_expr[2].constant_value
    hkv = k_pool.shape_expr[1].constant_value
    if tokens_per_block != AOT_TOKENS_PER_BLOCK:
        raise RuntimeError(
            f"AOT block attention is compiled for {AOT_TOKENS_PER_BLOCK} tokens per KV block, got {tokens_per_block}"
        )
    strides = [hq * d, d, hkv * d, d, block_tables.shape_expr[1]]  # q row, q head, k slot, k head, table
    grid = (kv_lens.shape_expr[0], k_pool.shape_expr[1])
    return _aot(block_attention_variant(d, hq // hkv, block), grid, strides + [window])


# ------------------------------------------------------------------------ dflash::context_kv
@trtp.register("dflash::context_kv")
def context_kv_desc(
    kv: trtp.TensorDesc,
    k_norm: trtp.TensorDesc,
    inv_freq: trtp.TensorDesc,
    positions: trtp.TensorDesc,
    slots: trtp.TensorDesc,
    k_pools: trtp.TensorDesc,
    v_pools: trtp.TensorDesc,
    eps: float,
) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
    """The pools, written in place (outputs alias inputs 5 and 6); ``eps`` is the drafter's
    ``rms_norm_eps`` (it picks the compiled variant: the kernels take it as a constant)."""
    return k_pools.aliased(), v_pools.aliased()


@trtp.autotune("dflash::context_kv")
def context_kv_autotune(kv, k_norm, inv_freq, positions, slots, k_pools, v_pools, eps, outputs):
    return [trtp.AutoTuneCombination("BF16, BF16, FP32, INT64, INT64, BF16, BF16, BF16, BF16", "LINEAR")]


@trtp.aot_impl("dflash::context_kv")
def context_kv_aot(kv, k_norm, inv_freq, positions, slots, k_pools, v_pools, eps, outputs, tactic):
    num_layers, _, hkv, d = (x.constant_value for x in k_pools.shape_expr)
    # strides: kv row, pool layer, pool slot, pool head
    strides = [kv.shape_expr[1], k_pools.shape_expr[1] * hkv * d, hkv * d, d]
    return _aot(context_kv_variant(d, hkv, eps), (kv.shape_expr[0], k_pools.shape_expr[0]), strides)


# ------------------------------------------------------------------------ dflash::accept
@trtp.register("dflash::accept")
def accept_desc(drafts: trtp.TensorDesc, target: trtp.TensorDesc, n_draft: trtp.TensorDesc) -> trtp.TensorDesc:
    """Accepted drafts per sequence, int32 ``[S]``."""
    return trtp.from_shape_expr((drafts.shape_expr[0],), dtype=trt.int32)


@trtp.autotune("dflash::accept")
def accept_autotune(drafts, target, n_draft, outputs):
    return [trtp.AutoTuneCombination("INT64, INT64, INT32, INT32", "LINEAR")]


@trtp.aot_impl("dflash::accept")
def accept_aot(drafts, target, n_draft, outputs, tactic):
    if drafts.shape_expr[1].constant_value > 16:
        raise RuntimeError("the AOT acceptance kernel handles up to 16 draft tokens")
    return _aot(ACCEPT_VARIANT, (drafts.shape_expr[0],), [drafts.shape_expr[1], target.shape_expr[1]])
