"""How a sequence is cut among the P ranks of a context-parallel group (pure functions).

``contiguous``: P equal chunks, rank ``r`` holds chunk ``r``.
``zigzag``:     2P equal chunks, rank ``r`` holds chunks ``r`` and ``2P-1-r`` (in that order), so
                every rank gets the same share of a causal mask's work.

A packed batch (``cu_seqlens``) is cut sequence by sequence: rank ``r``'s local packing holds,
for each sequence ``n`` in order, its chunks of that sequence, so its local ``cu_seqlens`` is the
global one divided by P.
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "check_layout", "chunk_ids", "chunks_per_sequence", "rank_order", "lengths_of"]

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_sequence(P: int, layout: str) -> int:
    return 2 * P if layout == "zigzag" else P


def chunk_ids(rank: int, P: int, layout: str) -> tuple[int, ...]:
    """The chunks of every sequence that ``rank`` holds, in local order."""
    return (rank, 2 * P - 1 - rank) if layout == "zigzag" else (rank,)


def check_lengths(lengths: list[int], P: int, layout: str, what: str) -> None:
    parts = chunks_per_sequence(P, layout)
    for n, length in enumerate(lengths):
        if length % parts:
            where = "" if len(lengths) == 1 else f" (sequence {n})"
            raise ValueError(f"{what}{where} has length {length}, not divisible by {parts} = "
                             f"{'2P' if layout == 'zigzag' else 'P'} for layout={layout!r} over P={P} ranks; "
                             f"pad the sequences to a multiple of {parts}")


def lengths_of(cu_seqlens) -> list[int]:
    """Sequence lengths from an int32 ``cu_seqlens [N+1]`` tensor or list."""
    values = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return [b - a for a, b in zip(values, values[1:])]


def rank_order(lengths: list[int], P: int, layout: str, device=None) -> torch.Tensor:
    """int64 ``[T]``: the global token indices of rank 0's local packing, then rank 1's, ...

    ``x.index_select(0, order)`` lists every rank's shard in turn; its inverse permutation
    reassembles the full packing from the shards.
    """
    parts = chunks_per_sequence(P, layout)
    starts = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)[:-1].tolist()
    pieces = []
    for rank in range(P):
        for start, length in zip(starts, lengths):
            c = length // parts
            pieces += [torch.arange(start + i * c, start + (i + 1) * c) for i in chunk_ids(rank, P, layout)]
    order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return order.to(device) if device is not None else order
