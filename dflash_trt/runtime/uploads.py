"""Moving an iteration's inputs to the device: every host tensor of an iteration in ONE
host-to-device copy (never a synchronisation), and the positions / pool slots a step writes."""

from __future__ import annotations

import torch

from .attention_meta import MetaPlan
from .block_manager import slots_of


def written_slots(
    tables: list[list[int]], starts: list[int], lengths: list[int], tpb: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and pool slots of ``lengths[i]`` tokens from ``starts[i]`` of each sequence,
    concatenated in sequence order (int64 ``[N]`` each; empty when nothing is written).

    Up to :data:`_LISTED` tokens a sequence (a drafter's blocks and the context it ingests in a
    decode step) in Python lists, longer runs (a prompt's) as tensor ops: ~6 tensor ops a
    sequence cost ~0.2 ms of a ~4 ms drafter forward at 4 sequences (2-core CPU), the lists ~0.02.

    Raises:
        IndexError: a position past the end of its sequence's block table.
    """
    if max(lengths, default=0) > _LISTED:
        pos_t = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
        empty = [torch.zeros(0, dtype=torch.long)]
        return torch.cat(pos_t + empty), torch.cat([slots_of(t, p, tpb) for t, p in zip(tables, pos_t)] + empty)
    pos: list[int] = []
    slots: list[int] = []
    for table, s, n in zip(tables, starts, lengths):
        for p in range(s, s + n):
            pos.append(p)
            slots.append(int(slots_of(table, p, tpb)))
    return torch.tensor(pos, dtype=torch.long), torch.tensor(slots, dtype=torch.long)


#: most tokens a sequence for which :func:`written_slots` works in Python lists
_LISTED = 64


def upload(device: torch.device, *host: torch.Tensor, pack: bool | None = None) -> list[torch.Tensor]:
    """Host tensors on ``device`` with ONE host-to-device copy, never a synchronisation.

    A plain ``.to("cuda")`` of a pageable CPU tensor waits for the device (PyTorch copies and
    then synchronises the stream), so an iteration that moved its metadata tensor by tensor
    waited on the GPU ~20 times. Here every tensor is flattened into one int64 buffer (bool and
    int32 values are exact in int64; fp32 travels as its int32 bit pattern), pinned, copied
    ``non_blocking``, and split back into views of the original shapes and dtypes on the device
    (the dtype casts are device kernels).

    Args:
        device: the target device; on the CPU the tensors are returned as they are unless
            ``pack`` is True (which runs the packing on the CPU, for tests).
        host: CPU tensors of integer, bool or fp32 dtype, any shapes.

    Returns:
        The tensors in the same order, shapes and dtypes, on ``device``.
    """
    if not host or not _packs(device, pack):
        return list(host)
    flat = torch.cat([_bits(t).reshape(-1).to(torch.long) for t in host])
    if device.type == "cuda":
        flat = flat.pin_memory()  # the caching host allocator keeps it until the copy is done
    flat = flat.to(device, non_blocking=True)
    out, at = [], 0
    for t in host:
        x = flat[at : at + t.numel()].view(t.shape)
        out.append(x.to(torch.int32).view(torch.float32) if t.dtype == torch.float32 else x.to(t.dtype))
        at += t.numel()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as exact integers: fp32 as its int32 bit pattern, integer and bool as they are."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"upload carries integer, bool and fp32 tensors, got {t.dtype}")
    return t


def _packs(device: torch.device, pack: bool | None) -> bool:
    """Whether :func:`upload` packs and copies (off the CPU, or when a test forces it)."""
    return device.type != "cpu" if pack is None else pack


def upload_meta(device: torch.device, plan: MetaPlan, *host: torch.Tensor, pack: bool | None = None) -> tuple:
    """:func:`upload` of the tensors of ``plan`` (:mod:`~.attention_meta`: a few integers per
    sequence and the block tables) together with ``host``, one copy for the whole iteration's
    inputs; the attention metadata is then built from the plan on ``device``.

    Returns:
        ``(AttentionMetadata on device, *host on device)``; on the CPU (nothing to copy) the
        metadata built on the host and ``host`` as they are.
    """
    if not _packs(device, pack):
        return (plan.build(), *host)
    ts = plan.tensors()
    flat = upload(device, *ts, *host, pack=pack)
    return (plan.with_tensors(flat[: len(ts)]).build(), *flat[len(ts) :])
