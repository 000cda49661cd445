"""Target features of whole sequences (prefill only), for drafter training and calibration."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.layers import AttentionMetadata
from ..models.target import TargetModel
from .kv_cache import KVCache


@torch.inference_mode()
def target_features(model: TargetModel, seqs: list[torch.Tensor], capture: Sequence[int]) -> list[torch.Tensor]:
    """Target features of each sequence, ``[S_i, len(capture) * hidden]`` in the model dtype.

    One ``TargetModel.forward(..., features_only=True)`` (layers up to ``max(capture)``, no LM
    head) over the sequences (int64 ``[S_i]``) right-padded into one batch (causal attention:
    padding is harmless). ``capture`` follows HF ``hidden_states[i + 1]``; the last layer's
    output is taken after the final norm.
    """
    cfg = model.cfg
    dev = model.embed.weight.device
    n, S = len(seqs), max(len(s) for s in seqs)
    upto = max(capture) + 1
    ids = torch.zeros(n, S, dtype=torch.long, device=dev)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s.to(dev)
    pos = torch.arange(S, device=dev).expand(n, S)
    cache = KVCache(upto, n, cfg.num_kv_heads, cfg.head_dim, S, model.embed.weight.dtype, dev)
    feats = model(ids, AttentionMetadata.causal(pos, S), cache.layers, tuple(capture), features_only=True).features
    return [feats[i, : len(s)].clone() for i, s in enumerate(seqs)]
