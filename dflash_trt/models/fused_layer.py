"""A dense target layer in one C++ call on the CPU (``dflash_cpu::dense_layer``).

In the batch-invariant mode (``models/batch_invariant.py``) a decode step of the default
30-layer fp32 target spent ~24 ms in its 121 GEMMs and ~2 ms in attention of a ~45 ms step at
batch 1 (2-core AMD EPYC, 2 threads): most of the rest was Python, ~60 module calls, views and
small ATen ops a layer. :func:`plan_dense_layers` gives the op everything a
:class:`~.target.TargetLayer` reads (packed weights, norms, head counts), once, so that
:meth:`TargetModel.forward <.target.TargetModel.forward>` runs each eligible layer as one call
when the forward's attention is one group over the paged pools: uniform (every sequence the same
number of queries, in order: the decode steps of plain decoding and the verify steps of DFlash
whose blocks have one size, attended as views), or ragged (decode steps beside verify blocks of
the adaptive draft length's probes, through the same query gathers as the Python layer). The op
runs the same kernels and ATen ops on the same views in the same order as the Python layer, so
the bits are the same (``tests/test_batch_invariant.py``) and a forward may mix the two paths.
Anything else (prefill chunks beside decode steps in two attention groups, MoE layers,
tensor parallelism, oneDNN / FP8 / MXFP4 weights, ``torch.compile``, CUDA) runs the Python
layer. The linears may be batch-invariant (fp32 / bf16) or the packed int4 / int8 weights of
``--weights int4`` / ``int8`` targets.
"""

from __future__ import annotations

import math

import torch

from ..errors import DFlashError
from .batch_invariant import BatchInvariantLinear, weight_identity
from .layers import AttentionMetadata, GatedMLP, uniform_queries


def fused_forward_wanted(x: torch.Tensor, meta: AttentionMetadata, kv_cache) -> bool:
    """Whether this forward (``x [B, T, hidden]``) can run its layers through
    ``dflash_cpu::dense_layer``: eager, on the CPU, one packed row of paged tokens in one
    attention group (no groups), uniform (:func:`~.layers.uniform_queries`) or with its query
    gathers (``query_index`` / ``query_rows``, which the planner sets together, and only for a
    group that is not uniform), or in several groups with theirs (a prompt chunk beside decode
    steps or verify blocks: in the load benchmark's DFlash lanes, where sequences end at
    different steps and each waiting prompt joins the next step, such a step ran the Python
    layers, ~60 calls a layer), and KV pools in ``x``'s dtype."""
    if meta.groups:  # several attention groups, each with its query gathers and output rows
        paged = all(g.read_slots is not None and g.query_rows is not None for g in meta.groups)
    else:
        paged = meta.read_slots is not None and (uniform_queries(meta, x.shape[1]) or meta.query_rows is not None)
    return (
        x.device.type == "cpu"
        and x.shape[0] == 1
        and paged
        and kv_cache[0][0].dtype == x.dtype
        and not torch.compiler.is_compiling()
    )


def plan_dense_layers(model) -> list[tuple | None] | None:
    """Per layer of ``model`` (a :class:`~.target.TargetModel`), the arguments of
    ``dflash_cpu::dense_layer`` that come from the layer (:func:`dense_layer_args`) or None for
    a layer that runs in Python; None when no layer qualifies. Made once the weights are laid
    out (``runtime/model_runner.cpu_weight_layout`` keeps it as ``model.dense_layers``; making
    it per forward took ~1.8 ms of a ~31 ms step); :func:`set_batch_invariant
    <.batch_invariant.set_batch_invariant>` and :func:`set_cpu_norm_kernel
    <.layers.set_cpu_norm_kernel>` drop it, as they change what a layer runs."""
    dtype = model.embed.weight.dtype
    plan = [dense_layer_args(layer, dtype) for layer in model.layers]
    return plan if any(a is not None for a in plan) else None


def _linear_args(lin) -> tuple | None:
    """``(weight, scales, bias, kind)`` of one linear as ``dflash_cpu::dense_layer`` takes it:
    kind 0 a :class:`BatchInvariantLinear` (its packed panels, packed again first if the weight
    changed since they were made; the plan keeps these tensors, so a weight changed after
    planning needs a new plan, which ``cpu_weight_layout`` makes), the group size of an
    :class:`~dflash_trt.quantization.int4.Int4Linear`, -1 an
    :class:`~dflash_trt.quantization.int8.Int8Linear`; None for any other module."""
    from ..quantization.int4 import Int4Linear
    from ..quantization.int8 import Int8Linear

    if isinstance(lin, BatchInvariantLinear) and lin.weight.device.type == "cpu":
        if lin._packed_from != weight_identity(lin.weight):
            lin._pack()
        return lin.packed, None, lin.bias, 0
    if type(lin) in (Int4Linear, Int8Linear) and lin.packed.device.type == "cpu":
        return lin.packed, lin.scales, lin.bias, lin.group_size if lin.fmt == "int4" else -1
    return None


def dense_layer_args(layer, dtype: torch.dtype) -> tuple | None:
    """The arguments of ``dflash_cpu::dense_layer`` that come from ``layer`` (a
    :class:`~.target.TargetLayer`): ``(attn_norm, mlp_norm, eps, weights, scales, biases,
    kinds, q_norm, k_norm, sinks, dims)``, the four linears (qkv, o, gate_up, down) as lists
    (:func:`_linear_args`) and ``dims`` = ``(heads, KV heads, head dim, hidden,
    intermediate)``; None when the layer does not run through the op: attention not in the
    batch-invariant mode, norms not on the CPU kernel or not in ``dtype``, a mixture-of-experts
    or tensor-parallel layer, or a linear of another kind (oneDNN, FP8, MXFP4)."""
    attn, mlp = layer.attn, layer.mlp
    if layer.tp is not None or type(mlp) is not GatedMLP or not attn.batch_invariant:
        return None
    norms = [layer.attn_norm, layer.mlp_norm] + ([attn.q_norm, attn.k_norm] if attn.q_norm is not None else [])
    if not all(n.cpu_kernel and n.weight.dtype == dtype and n.eps == layer.attn_norm.eps for n in norms):
        return None
    linears = [_linear_args(lin) for lin in (attn.qkv, attn.o, mlp.gate_up, mlp.down)]
    if any(a is None for a in linears):
        return None
    weights, scales, biases, kinds = (list(x) for x in zip(*linears))
    hidden = layer.attn_norm.weight.shape[0]
    return (
        layer.attn_norm.weight,
        layer.mlp_norm.weight,
        layer.attn_norm.eps,
        weights,
        scales,
        biases,
        kinds,
        attn.q_norm.weight if attn.q_norm is not None else None,
        attn.k_norm.weight if attn.k_norm is not None else None,
        attn.sinks,
        (attn.h, attn.hkv, attn.d, hidden, mlp.intermediate),
    )


def stacked_linear(mods: list) -> torch.nn.Module | None:
    """The linears ``mods`` (their output rows one after another) as ONE linear that
    ``dflash_cpu::dense_layer`` takes (:func:`_linear_args`): packed int4 / int8 linears stacked
    on their codes (:func:`~dflash_trt.quantization.packed.packed_stack`), dense ones
    (``nn.Linear``, batch-invariant or oneDNN-prepacked, fp32 / bf16 on the CPU) as one new
    :class:`~.batch_invariant.BatchInvariantLinear` over their stacked weights (the kernel is
    the fastest CPU GEMM here at draft sizes); None for a mix or another kind."""
    from ..quantization.packed import PackedLinear, packed_stack
    from .cpu_linear import OneDNNLinear

    if all(isinstance(m, PackedLinear) for m in mods):
        try:
            return packed_stack(mods) if len(mods) > 1 else mods[0]
        except DFlashError:  # mixed formats or group sizes
            return None
    if len(mods) == 1 and isinstance(mods[0], BatchInvariantLinear):
        return mods[0]
    if not all(type(m) in (torch.nn.Linear, BatchInvariantLinear, OneDNNLinear) for m in mods):
        return None
    ws = [m.dense_weight() if isinstance(m, OneDNNLinear) else m.weight for m in mods]
    if ws[0].device.type != "cpu" or ws[0].dtype not in (torch.float32, torch.bfloat16):
        return None
    bias = torch.cat([m.bias for m in mods]).detach() if mods[0].bias is not None else None
    return BatchInvariantLinear(torch.nn.Parameter(torch.cat(ws).detach(), requires_grad=False), bias)


def plan_drafter_layers(drafter, dtype: torch.dtype) -> tuple[list[tuple], tuple] | None:
    """Per layer of ``drafter`` (a :class:`~.drafter.DFlashDrafter`), the arguments of
    ``dflash_cpu::dense_layer`` (as :func:`dense_layer_args` gives a target layer's): its
    q / k / v projections stacked into one linear, gate / up into one, the norms (``dtype``,
    the activations'); and the KV injection's ``(fc, stacked k/v)`` linears in the same kinds
    (:meth:`~.drafter.DFlashDrafter.write_context_kv`'s ``linears``). None when a layer cannot
    run through the op (a linear of another kind, norms in another dtype). The drafter's
    block then runs a layer in one C++ call, its context K/V written beforehand for every
    layer at once: the same arithmetic as the Python layer up to the order of float sums
    (drafts only decide speed, never the output)."""
    kv = [p for layer in drafter.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
    context = (stacked_linear([drafter.fc]), stacked_linear(kv))
    if any(m is None for m in context):
        return None
    plan = []
    for layer in drafter.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
        if any(n.weight.dtype != dtype or n.eps != norms[0].eps for n in norms):
            return None
        groups = ([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj])
        linears = [stacked_linear(g) for g in groups]
        if any(m is None for m in linears):
            return None
        weights, scales, biases, kinds = (list(x) for x in zip(*map(_linear_args, linears)))
        dims = (attn.h, attn.hkv, attn.d, drafter.cfg.hidden_size, drafter.cfg.intermediate_size)
        head_norms = (attn.q_norm.weight, attn.k_norm.weight, None)  # (no attention sinks)
        plan.append((norms[0].weight, norms[1].weight, norms[0].eps, weights, scales, biases, kinds, *head_norms, dims))
    return plan, context


def dense_layer_attention(meta: AttentionMetadata, window=None) -> tuple[tuple, tuple]:
    """The attention arguments of ``dflash_cpu::dense_layer`` for the layers of one forward under
    ``meta`` that attend with ``window`` (None: full attention): ``(write slots, read slots,
    mask)`` and ``(query index, query rows, each attention group's read slots, mask, query
    gathers and output rows)``. Built once per forward and window, not per layer (its Python,
    ~30 us a layer, was ~1 ms of a 30-layer step)."""
    gs = meta.groups or []
    groups = (
        [g.read_slots for g in gs],
        [g.mask_for(window) for g in gs],
        [g.query_index for g in gs],
        [g.query_rows for g in gs],
        [g.query_out for g in gs],
    )
    own = gs[0] if gs else meta  # (with groups the op reads theirs alone: the first stands in)
    return (meta.write_slots, own.read_slots, own.mask_for(window)), (meta.query_index, meta.query_rows, *groups)


def run_dense_layer(
    args: tuple, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, attention: tuple[tuple, tuple]
) -> torch.Tensor:
    """A layer through ``dflash_cpu::dense_layer`` (``args``: its entry of
    :func:`plan_dense_layers` or :func:`plan_drafter_layers`): ``x [1, N, hidden]`` ->
    ``[1, N, hidden]``, the layer's K/V written into the pools ``kv``; ``attention``: the
    forward's :func:`dense_layer_attention` for the layer's sliding window."""
    scale = 1.0 / math.sqrt(args[-1][2])  # dims: (heads, KV heads, head dim, hidden, intermediate)
    pre, post = attention
    return torch.ops.dflash_cpu.dense_layer(x, *args, cos, sin, kv[0], kv[1], *pre, scale, *post)
