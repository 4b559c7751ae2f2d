"""``shard`` / ``unshard`` (dense, along one dim) and their packed twins, for a process group."""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from .. import validation
from . import group as groups
from .layout import LAYOUTS, check_layout, check_lengths, lengths_of, rank_order

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


def _agreed(x: torch.Tensor, dim: int | None, group, layout: str, lengths_fn, packed: bool):
    """The group and the sequence lengths of a (un)shard call, checked on this rank by
    ``lengths_fn(x, dim, P)`` and agreed by every rank (``groups.agree``): a rank whose input is
    wrong, or that differs from the others in layout, shape or packing, raises the same error on
    every rank instead of leaving them in a collective it never joins."""
    g = groups.resolve(group)
    facts, error, lengths = None, None, None
    try:
        check_layout(layout)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if dim is not None:
            if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
                raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
            if not -x.dim() <= dim < x.dim():
                raise ValueError(f"dim {dim} is out of range for x of shape {tuple(x.shape)}")
            dim %= x.dim()
        lengths = lengths_fn(x, dim, g.size)
        facts = {"the layout": LAYOUTS.index(layout), "the dim": -1 if dim is None else dim,
                 "the dtype": _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1, "x.dim()": x.dim(),
                 **{f"x.shape[{i}]": n for i, n in enumerate(x.shape)}}
    except Exception as exc:      # noqa: BLE001 - every rank learns why this one cannot go on
        error = exc
    groups.agree(g, facts, error, _shown, packing=lengths if packed else None)
    return g, dim, lengths


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def _shown(name: str, value: float) -> str:
    """A fact of ``_agreed`` in words."""
    if name == "the layout":
        return repr(LAYOUTS[int(value)])
    if name == "the dtype":
        return str(_DTYPES[int(value)]).removeprefix("torch.") if value >= 0 else "another dtype"
    return f"{value:g}"


def shard(x: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (a copy): ``contiguous`` chunk ``r`` of P, or
    ``zigzag`` chunks ``r`` and ``2P-1-r`` of 2P. ValueError unless ``x.shape[dim]`` divides.
    Called by every rank of the group (it checks that they agree, in one small collective)."""
    def lengths_fn(x, dim, P):
        check_lengths([x.shape[dim]], P, layout, f"x.shape[{dim}]")
        return [x.shape[dim]]

    g, dim, lengths = _agreed(x, dim, group, layout, lengths_fn, packed=False)
    return _take(x, dim, lengths, g, layout)


def unshard(x_local: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of ``shard``: the full tensor on every rank (one ``all_gather``; not differentiable)."""
    def lengths_fn(x, dim, P):
        check_lengths([x.shape[dim] * P], P, layout, f"P x x_local.shape[{dim}]")
        return [x.shape[dim] * P]

    g, dim, lengths = _agreed(x_local, dim, group, layout, lengths_fn, packed=False)
    return _gather(x_local, dim, lengths, g, layout)


def _packing(cu_seqlens, tokens: int, what: str, P: int, layout: str) -> list[int]:
    """The lengths of ``cu_seqlens`` (a 1-D tensor or list of int offsets), checked: from 0,
    non-decreasing, ``tokens`` in all (else ``what`` says what holds them), each cut into whole chunks."""
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    if not isinstance(offsets, (list, tuple)) or not offsets or not all(
            isinstance(o, numbers.Integral) for o in offsets):
        raise TypeError(f"cu_seqlens must be a 1-D int32 tensor (or a list) of N+1 >= 1 offsets, got "
                        f"{cu_seqlens if isinstance(cu_seqlens, (list, tuple)) else type(cu_seqlens).__name__}")
    offsets = [int(o) for o in offsets]
    validation.check_offsets("cu_seqlens", offsets, None)
    lengths = lengths_of(offsets)
    check_lengths(lengths, P, layout, "cu_seqlens")
    if offsets[-1] != tokens:
        raise ValueError(f"cu_seqlens covers {offsets[-1]} tokens but {what}")
    return lengths


def _tokens(x: torch.Tensor) -> int:
    if x.dim() == 0:
        raise ValueError("x must have a token dim 0, got a 0-dim tensor")
    return x.shape[0]


def shard_varlen(x: torch.Tensor, cu_seqlens, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of a packed ``x [T, ...]``: ``shard`` applied to every sequence of
    ``cu_seqlens`` (int32 ``[N+1]``), in order. Its local packing is ``cu_seqlens // P``. Called by
    every rank of the group, with the same packing (checked in two small collectives)."""
    def lengths_fn(x, dim, P):
        return _packing(cu_seqlens, _tokens(x), f"x has {_tokens(x)} (dim 0)", P, layout)

    g, _, lengths = _agreed(x, None, group, layout, lengths_fn, packed=True)
    return _take(x, 0, lengths, g, layout)


def unshard_varlen(x_local: torch.Tensor, cu_seqlens, group=None, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of ``shard_varlen`` (``cu_seqlens`` global): the full packed ``[T, ...]`` on every rank."""
    def lengths_fn(x, dim, P):
        return _packing(cu_seqlens, _tokens(x) * P, f"P x x_local.shape[0] = {P} x {_tokens(x)}", P, layout)

    g, _, lengths = _agreed(x_local, None, group, layout, lengths_fn, packed=True)
    return _gather(x_local, 0, lengths, g, layout)
