"""Where a row's result depends on the rows beside it: per op, the largest difference of the same
row's output between a 1-row call and a K-row call, on the real target's own activations.

    .venv/bin/python bench/batch_invariance.py --dtype bf16 --json out/invariance-bf16.json
    .venv/bin/python bench/batch_invariance.py --weights int4 --rows 2,4,8,16
    .venv/bin/python bench/batch_invariance.py --dtype fp32 --modes off

The activations are captured (forward hooks) from one real forward of a GSM8K prompt through
the default target (SmolLM2-135M-Instruct), all layers. For every op and every K in ``--rows``
(default 2..16), each window of K consecutive rows is run once as a K-row call and each of its
rows once alone; the table gives max |K-row output - 1-row output| over all rows, windows and
layers (0 = bit-identical). The ops, as the runtime calls them:

- linears by kind: ``qkv``, ``o``, ``gate_up``, ``down`` (oneDNN-prepacked bf16 where oneDNN has
  bf16 on this CPU, else ``F.linear``; packed int4 / int8 with ``--weights``) and the LM head;
- ``rmsnorm`` (the layers' input norms), ``rope`` (q and k rotated), ``silu*up``, ``residual``;
- attention over the real K/V, three shapes: ``attn verify`` (K consecutive queries of one
  sequence, causal, as a verify block or a prompt chunk) vs each query alone over exactly the
  keys it sees (a decode step); ``attn in-flight`` (K sequences of different lengths, one query
  each, padded to the longest key count and masked, as an in-flight decode batch) vs each alone;
- ``forward (logits)``: the whole target, a prompt then K tokens verified in ONE forward vs the
  same K tokens decoded one forward each (KV cache included): the end-to-end effect.

``--modes on`` runs the same with the batch-invariant mode (``models/batch_invariant.py``): the
dense linears as ``dflash_cpu::bi_linear``, attention as ``dflash_cpu::bi_attention``; packed
int4 / int8 linears and the row-wise ops are what they are in both modes. ``--device cuda``
measures the GPU path (mode off; ``scripts/gpu_validate.sh``'s ``invariance`` stage).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dflash_trt.checkpoints.loader import load_target, parse_dtype  # noqa: E402
from dflash_trt.models.batch_invariant import set_batch_invariant  # noqa: E402
from dflash_trt.models.cpu_linear import pack_linears, unpack_linears  # noqa: E402
from dflash_trt.models.layers import AttentionMetadata, _sdpa, apply_rope  # noqa: E402
from dflash_trt.models.prefill import KVCache  # noqa: E402
from dflash_trt.prompts import chat_prompt_ids, load_prompts  # noqa: E402

LINEARS = ("qkv", "o", "gate_up", "down")


#: windows of K rows per op (``--windows``)
WINDOWS = 8


def windows(n: int, k: int, limit: int | None = None) -> list[slice]:
    """Up to ``limit`` (default :data:`WINDOWS`) windows of ``k`` consecutive rows out of ``n``, spread evenly."""
    limit = WINDOWS if limit is None else limit
    starts = sorted({round(i * (n - k) / max(limit - 1, 1)) for i in range(limit)}) if n > k else [0]
    return [slice(s, s + k) for s in starts if s + k <= n]


def row_diff(fn, x: torch.Tensor, k: int) -> float:
    """max |fn(rows)[r] - fn(row r alone)| over windows of ``k`` rows of ``x [N, ...]``."""
    worst = 0.0
    for w in windows(x.shape[0], k):
        many = fn(x[w]).float()
        for r in range(k):
            one = fn(x[w][r : r + 1]).float()
            worst = max(worst, (many[r] - one[0]).abs().max().item())
    return worst


@torch.inference_mode()
def capture(model, ids: list[int]) -> dict[str, list[torch.Tensor]]:
    """One forward of ``ids`` with hooks: the inputs of each linear kind, the norms' inputs, the
    MLP's gate|up output, each layer's input and attention output, and every layer's q / k / v
    after RoPE (the attention inputs)."""
    got: dict[str, list[torch.Tensor]] = {k: [] for k in (*LINEARS, "lm_head", "norm", "gate_up_out", "res", "qkv_out")}
    hooks = []
    for layer in model.layers:
        mods = {"qkv": layer.attn.qkv, "o": layer.attn.o, "gate_up": layer.mlp.gate_up, "down": layer.mlp.down}
        for name, mod in mods.items():
            hooks.append(mod.register_forward_pre_hook(lambda _m, a, n=name: got[n].append(a[0][0].clone())))
        hooks.append(layer.attn.qkv.register_forward_hook(lambda _m, _a, out: got["qkv_out"].append(out[0].clone())))
        hooks.append(layer.attn_norm.register_forward_pre_hook(lambda _m, a: got["norm"].append(a[0][0].clone())))
        hooks.append(
            layer.mlp.gate_up.register_forward_hook(lambda _m, _a, out: got["gate_up_out"].append(out[0].clone()))
        )
        hooks.append(layer.attn.o.register_forward_hook(lambda _m, _a, out: got["res"].append(out[0].clone())))
    hooks.append(model.lm_head.register_forward_pre_hook(lambda _m, a: got["lm_head"].append(a[0][0].clone())))
    T = len(ids)
    cfg = model.cfg
    w = model.embed.weight
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, T, w.dtype, w.device)
    pos = torch.arange(T).unsqueeze(0)
    try:
        model(torch.tensor([ids]), AttentionMetadata.causal(pos, T), cache.layers)
    finally:
        for h in hooks:
            h.remove()
    got["kv"] = [(k[0, :, :T], v[0, :, :T]) for k, v in cache.layers]  # [Hkv, T, D] each, after RoPE
    return got


def attention_rows(model, got, k: int, invariant: bool) -> tuple[float, float]:
    """(verify-shape, in-flight-shape) max differences of attention over the captured K/V."""
    cfg = model.cfg
    h, d = cfg.num_heads, cfg.head_dim
    cos, sin = model.rope(torch.arange(got["kv"][0][0].shape[1]).unsqueeze(0), model.embed.weight.dtype)
    verify = inflight = 0.0
    for qkv, (keys, values) in zip(got["qkv_out"], got["kv"]):
        T = qkv.shape[0]
        q = apply_rope(qkv[:, : h * d].view(T, h, d).transpose(0, 1).unsqueeze(0), cos, sin)[0]  # [H, T, D]

        def alone(p: int, q=q, keys=keys, values=values) -> torch.Tensor:  # query p over its p + 1 keys: decode
            m = torch.ones(1, 1, 1, p + 1, dtype=torch.bool)
            kk, vv = keys[None, :, : p + 1], values[None, :, : p + 1]
            return _sdpa(q[None, :, p : p + 1], kk, vv, m, invariant)[0, :, 0].float()

        for w in windows(T, k):
            ps = list(range(w.start, w.stop))
            last = ps[-1] + 1
            mask = (torch.arange(last)[None, :] <= torch.tensor(ps)[:, None]).view(1, 1, k, last)
            out = _sdpa(q[None, :, w], keys[None, :, :last], values[None, :, :last], mask, invariant)[0].float()
            for j, p in enumerate(ps):
                verify = max(verify, (out[:, j] - alone(p)).abs().max().item())
            # in-flight: k "sequences" = this sequence cut at each p, one query each, padded to `last`
            qs = torch.stack([q[:, p : p + 1] for p in ps])  # [k, H, 1, D]
            m = (torch.arange(last)[None, :] <= torch.tensor(ps)[:, None]).view(k, 1, 1, last)
            kk, vv = keys[None, :, :last].expand(k, -1, -1, -1), values[None, :, :last].expand(k, -1, -1, -1)
            out = _sdpa(qs, kk, vv, m, invariant)[:, :, 0].float()
            for j, p in enumerate(ps):
                inflight = max(inflight, (out[j] - alone(p)).abs().max().item())
    return verify, inflight


@torch.inference_mode()
def forward_rows(model, ids: list[int], k: int, starts: int = 4) -> float:
    """Whole-target logits: prompt prefix then ``k`` tokens in one forward vs one forward each."""
    cfg = model.cfg
    dtype = model.embed.weight.dtype
    worst = 0.0
    for cut in windows(len(ids) - k, 1, starts):
        n = max(cut.start, 1)
        dev = model.embed.weight.device
        caches = [KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, n + k, dtype, dev) for _ in range(2)]
        pre = torch.arange(n).unsqueeze(0)
        for c in caches:
            model(torch.tensor([ids[:n]]), AttentionMetadata.causal(pre, n + k), c.layers, logits_index=pre[:, -1:])
        pos = torch.arange(n, n + k).unsqueeze(0)
        many = model(torch.tensor([ids[n : n + k]]), AttentionMetadata.causal(pos, n + k), caches[0].layers).logits
        for j in range(k):
            p = torch.tensor([[n + j]])
            one = model(torch.tensor([[ids[n + j]]]), AttentionMetadata.causal(p, n + k), caches[1].layers).logits
            worst = max(worst, (many[0, j].float() - one[0, 0].float()).abs().max().item())
    return worst


@torch.inference_mode()
def measure(model, ids: list[int], rows: list[int], invariant: bool) -> dict[str, dict[int, float]]:
    """The table for one mode: op -> {K: max difference}."""
    got = capture(model, ids)
    first = model.layers[0]
    table: dict[str, dict[int, float]] = {}
    mods = {n: [getattr(layer.attn if n in ("qkv", "o") else layer.mlp, n) for layer in model.layers] for n in LINEARS}
    for name in LINEARS:
        table[name] = {k: max(row_diff(m, x, k) for m, x in zip(mods[name], got[name])) for k in rows}
    table["lm_head"] = {k: row_diff(model.lm_head, got["lm_head"][0], k) for k in rows}
    table["rmsnorm"] = {
        k: max(row_diff(layer.attn_norm, x, k) for layer, x in zip(model.layers, got["norm"])) for k in rows
    }
    half = first.mlp.intermediate
    table["silu*up"] = {
        k: max(row_diff(lambda t: F.silu(t[:, :half]) * t[:, half:], x, k) for x in got["gate_up_out"]) for k in rows
    }
    table["residual"] = {k: max(row_diff(lambda t: t + t.flip(-1), x, k) for x in got["res"]) for k in rows}
    h, d = model.cfg.num_heads, model.cfg.head_dim

    def rope(t: torch.Tensor) -> torch.Tensor:  # every row at one position: the op, not the tables
        cos, sin = model.rope(torch.full((1, t.shape[0]), 7), t.dtype)
        return apply_rope(t[:, : h * d].view(1, -1, h, d).transpose(1, 2), cos, sin)[0].transpose(0, 1)

    table["rope"] = {k: max(row_diff(rope, x, k) for x in got["qkv_out"]) for k in rows}
    att = {k: attention_rows(model, got, k, invariant) for k in rows}
    table["attn verify"] = {k: v[0] for k, v in att.items()}
    table["attn in-flight"] = {k: v[1] for k, v in att.items()}
    table["forward (logits)"] = {k: forward_rows(model, ids, k) for k in rows}
    return table


def linear_kinds(model) -> str:
    """The classes the linears run as, e.g. ``OneDNNLinear x 120, Linear (lm_head)``."""
    kinds = [
        type(getattr(layer.attn if n in ("qkv", "o") else layer.mlp, n)).__name__
        for layer in model.layers
        for n in LINEARS
    ]
    body = ", ".join(f"{k} x {kinds.count(k)}" for k in dict.fromkeys(kinds))
    return f"{body}; lm_head {type(model.lm_head).__name__}"


def markdown(tables: dict[str, dict[str, dict[int, float]]], rows: list[int]) -> str:
    """One markdown table: op x K, one column block per mode."""
    modes = list(tables)
    head = "| op | " + " | ".join(f"{m} K={k}" for m in modes for k in rows) + " |"
    lines = [head, "|" + "---|" * (1 + len(modes) * len(rows))]
    for op in tables[modes[0]]:
        cells = [f"{tables[m][op][k]:.2g}" if tables[m][op][k] else "0" for m in modes for k in rows]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    global WINDOWS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default=None, help="fp32 | bf16 (default: bf16)")
    ap.add_argument("--weights", choices=("int4", "int8"), default=None)
    ap.add_argument("--rows", default="2,4,8,16", help="comma list of K")
    ap.add_argument("--modes", default="off,on", help="batch-invariant mode off, on, or both")
    ap.add_argument("--prompt", default="gsm8k:0", help="DATASET:INDEX of the prompt whose activations are used")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the mode runs on the CPU only: --modes off there)")
    ap.add_argument("--windows", type=int, default=WINDOWS, help="windows of K rows sampled per op")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(x) for x in args.rows.split(",")]
    WINDOWS = args.windows
    dtype = parse_dtype(args.dtype or "bf16")
    target = load_target(None, dtype, args.device, weights=args.weights)
    torch.set_default_device(args.device)  # the inputs built below live where the model does
    name, index = args.prompt.split(":")
    ids = chat_prompt_ids(target.tokenizer, load_prompts(name, int(index) + 1)[int(index)])
    model = target.model
    tables, kinds = {}, {}
    for mode in args.modes.split(","):
        on = mode == "on"
        set_batch_invariant(model, on)
        if not on:
            unpack_linears(model)
            pack_linears(model)  # the runtime's eager layout
        kinds[mode] = linear_kinds(model)
        print(f"mode {mode}: measuring ({len(ids)}-token prompt) ...", file=sys.stderr, flush=True)
        tables[mode] = measure(model, ids, rows, on)
    what = f"{args.dtype or 'bf16'}{' + ' + args.weights if args.weights else ''}, {torch.get_num_threads()} threads"
    print(f"batch invariance ({what}); max |K-row - 1-row| of the same row, 0 = bit-identical")
    print(markdown(tables, rows))
    for mode, text in kinds.items():
        print(f"linears, mode {mode}: {text}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(
            json.dumps(
                {"dtype": args.dtype or "bf16", "weights": args.weights, "linears": kinds, "tables": tables}, indent=1
            )
        )
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
