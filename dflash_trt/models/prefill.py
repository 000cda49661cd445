"""Whole-sequence forwards outside the serving engine: target features for drafter training and
calibration, the target's greedy predictions, and the top-2 logit margin used to tell a
numerical tie from a real divergence between two decoding runs.

:class:`KVCache` is the contiguous cache such a forward writes into (the engine's paged pools
are ``runtime/kv_cache.PagedKVCache``); :func:`prefill` is the one batched causal forward every
user here goes through.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layers import AttentionMetadata
from .target import TargetModel, TargetOutput


class KVCache:
    """Per-layer K/V buffers, each ``[batch, num_kv_heads, capacity + 1, head_dim]``: slot ``p``
    of a row holds the K/V of the token at position ``p``; the last slot is a trash slot that
    padded tokens write into.

    Args:
        num_layers: attention layers (one ``(k, v)`` pair each).
        batch: rows (sequences).
        num_kv_heads, head_dim: K/V head shape.
        capacity: positions per row; position ``capacity`` is the trash slot.
        dtype: storage dtype (the model's compute dtype).

    Memory: ``2 * num_layers * batch * num_kv_heads * (capacity + 1) * head_dim`` elements.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (batch, num_kv_heads, capacity + 1, head_dim)
        self.capacity = capacity
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    @property
    def trash_slot(self) -> int:
        return self.capacity


@torch.inference_mode()
def prefill(
    model: TargetModel,
    seqs: Sequence[torch.Tensor | list[int]],
    capture: Sequence[int] = (),
    features_only: bool = False,
    last_logits_only: bool = False,
) -> TargetOutput:
    """ONE causal forward of ``model`` over ``seqs`` right-padded into a batch (padding is
    harmless under causal attention), in the model's dtype, on its device.

    Args:
        seqs: token ids of each sequence (int64 ``[S_i]`` or a list).
        capture: target layers whose outputs are returned as features (HF
            ``hidden_states[i + 1]``; the last layer's after the final norm).
        features_only: run only the layers up to ``max(capture)``, no LM head.
        last_logits_only: logits of each row's last position only (``[B, 1, vocab]``).

    Returns:
        the :class:`~.target.TargetOutput` of the padded batch ``[B, max S_i, ...]``; row
        ``i``'s positions past ``len(seqs[i])`` are padding.
    """
    cfg = model.cfg
    dev = model.embed.weight.device
    seqs = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
    n, S = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(n, S, dtype=torch.long, device=dev)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s.to(dev)
    pos = torch.arange(S, device=dev).expand(n, S)
    layers = max(capture) + 1 if features_only else cfg.num_layers
    cache = KVCache(layers, n, cfg.num_kv_heads, cfg.head_dim, S, model.embed.weight.dtype, dev)
    index = None
    if last_logits_only:
        index = torch.tensor([len(s) - 1 for s in seqs], device=dev).unsqueeze(1)
    meta = AttentionMetadata.causal(pos, S)
    return model(ids, meta, cache.layers, tuple(capture), logits_index=index, features_only=features_only)


def target_features(model: TargetModel, seqs: list[torch.Tensor], capture: Sequence[int]) -> list[torch.Tensor]:
    """Target features of each sequence, ``[S_i, len(capture) * hidden]`` in the model dtype
    (:func:`prefill` up to the last captured layer, no LM head)."""
    out = prefill(model, seqs, capture, features_only=True).features
    return [out[i, : len(s)].clone() for i, s in enumerate(seqs)]


def features_and_predictions(
    model: TargetModel, seqs: list[torch.Tensor], capture: Sequence[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence ``(features [S_i, len(capture) * hidden] in the model dtype, predictions
    int64 [S_i])``: the target's argmax after every position (one :func:`prefill`)."""
    out = prefill(model, seqs, capture)
    preds = out.logits.argmax(-1)
    return [(out.features[i, : len(s)].clone(), preds[i, : len(s)].clone()) for i, s in enumerate(seqs)]


def top2_margin(model: TargetModel, ids: list[int]) -> float:
    """Gap between the target's two largest logits for the token after ``ids`` (one fresh
    :func:`prefill` in the model's dtype). Used to tell a numerical tie from a real divergence
    when two decoding runs differ."""
    logits = prefill(model, [ids], last_logits_only=True).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
