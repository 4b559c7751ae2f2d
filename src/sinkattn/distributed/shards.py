"""``shard`` / ``unshard`` (dense, along one dim) and their packed twins, for a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import group as groups
from .layout import check_layout, check_lengths, lengths_of, rank_order

__all__ = ["shard", "unshard", "shard_varlen", "unshard_varlen"]


def _take(x: torch.Tensor, dim: int, lengths: list[int], g, layout: str) -> torch.Tensor:
    order = rank_order(lengths, g.size, layout, x.device)
    local = order.numel() // g.size
    return x.index_select(dim, order[g.rank * local:(g.rank + 1) * local])


def _gather(x_local: torch.Tensor, dim: int, lengths: list[int], g, layout: str) -> torch.Tensor:
    parts = [torch.empty_like(x_local) for _ in range(g.size)]
    dist.all_gather(parts, x_local.contiguous(), group=g.handle)
    inverse = torch.argsort(rank_order(lengths, g.size, layout, x_local.device))
    return torch.cat(parts, dim).index_select(dim, inverse)


def shard(x: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (a copy): ``contiguous`` chunk ``r`` of P, or
    ``zigzag`` chunks ``r`` and ``2P-1-r`` of 2P. ValueError unless ``x.shape[dim]`` divides."""
    check_layout(layout)
    g = groups.resolve(group)
    dim = dim % x.dim()
    check_lengths([x.shape[dim]], g.size, layout, f"x.shape[{dim}]")
    return _take(x, dim, [x.shape[dim]], g, layout)


def unshard(x_local: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of ``shard``: the full tensor on every rank (one ``all_gather``; not differentiable)."""
    check_layout(layout)
    g = groups.resolve(group)
    dim = dim % x_local.dim()
    check_lengths([x_local.shape[dim] * g.size], g.size, layout, f"P x x_local.shape[{dim}]")
    return _gather(x_local, dim, [x_local.shape[dim] * g.size], g, layout)


def shard_varlen(x: torch.Tensor, cu_seqlens, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of a packed ``x [T, ...]``: ``shard`` applied to every sequence of
    ``cu_seqlens``, in order. Its local packing is ``cu_seqlens // P``."""
    check_layout(layout)
    g = groups.resolve(group)
    lengths = lengths_of(cu_seqlens)
    if sum(lengths) != x.shape[0]:
        raise ValueError(f"cu_seqlens covers {sum(lengths)} tokens but x has {x.shape[0]} (dim 0)")
    check_lengths(lengths, g.size, layout, "cu_seqlens")
    return _take(x, 0, lengths, g, layout)


def unshard_varlen(x_local: torch.Tensor, cu_seqlens, group=None, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of ``shard_varlen`` (``cu_seqlens`` global): the full packed ``[T, ...]`` on every rank."""
    check_layout(layout)
    g = groups.resolve(group)
    lengths = lengths_of(cu_seqlens)
    if sum(lengths) != x_local.shape[0] * g.size:
        raise ValueError(f"cu_seqlens covers {sum(lengths)} tokens but P x x_local.shape[0] = "
                         f"{g.size} x {x_local.shape[0]}")
    check_lengths(lengths, g.size, layout, "cu_seqlens")
    return _gather(x_local, 0, lengths, g, layout)
