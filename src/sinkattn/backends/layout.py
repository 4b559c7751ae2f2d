"""Views and bookkeeping shared by the CPU paths: sequences grouped by length, heads-first views
of the packed layout, and the written span of an axis whose parts arrive in order."""

from __future__ import annotations

import torch

__all__ = ["groups", "group_views", "heads_first", "stat_view", "Span", "write", "zero_unwritten"]


def groups(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """Yield ``(t_q, t_k, N, Lq, Lk)``: runs of N sequences that share their lengths.

    A dense batch is one run; other packed batches go one sequence at a time.
    """
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    n = len(cq) - 1
    lq = {cq[b + 1] - cq[b] for b in range(n)}
    lk = {ck[b + 1] - ck[b] for b in range(n)}
    if n > 0 and len(lq) == 1 and len(lk) == 1:
        yield 0, 0, n, lq.pop(), lk.pop()
        return
    for b in range(n):
        yield cq[b], ck[b], 1, cq[b + 1] - cq[b], ck[b + 1] - ck[b]


def group_views(cu_seqlens_q, cu_seqlens_k, queries=(), keys=(), stats=()):
    """Per run of ``groups``: ``(n, Lq, Lk, query_views, key_views, stat_views)``, the heads-first
    views ``[N, H, L, D]`` of the query-side and key-side ``[T, H, D]`` tensors and ``[N, H, Lq]``
    views of the ``[H, Tq]`` statistics (None stays None)."""
    for tq, tk, n, Lq, Lk in groups(cu_seqlens_q, cu_seqlens_k):
        yield (n, Lq, Lk, [heads_first(x, tq, n, Lq) for x in queries], [heads_first(x, tk, n, Lk) for x in keys],
               [None if s is None else stat_view(s, tq, n, Lq) for s in stats])


def heads_first(x: torch.Tensor, t0: int, n: int, length: int) -> torch.Tensor:
    """``x [T, H, D]`` -> view ``[N, H, L, D]`` of tokens ``[t0, t0 + N*L)``."""
    return x[t0:t0 + n * length].view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)


def stat_view(stat: torch.Tensor, t0: int, n: int, length: int) -> torch.Tensor:
    """``stat [H, T]`` -> view ``[N, H, L]`` of tokens ``[t0, t0 + N*L)``."""
    return stat[:, t0:t0 + n * length].view(stat.shape[0], n, length).transpose(0, 1)


class Span:
    """The written span ``[lo, hi)`` of one axis whose parts arrive in non-decreasing order.

    ``take(a, b)`` splits a new part into the slice seen for the first time
    (to assign) and the slice already written (to accumulate into).
    """

    def __init__(self) -> None:
        self.lo: int | None = None
        self.hi = 0

    def take(self, a: int, b: int) -> tuple[slice, slice]:
        if self.lo is None:
            self.lo = a
        seen = slice(a, max(a, min(b, self.hi)))
        fresh = slice(max(a, self.hi), b)
        self.hi = max(self.hi, b)
        return fresh, seen

    def unwritten(self, n: int) -> tuple[slice, ...]:
        if self.lo is None:
            return (slice(0, n),)
        return slice(0, self.lo), slice(self.hi, n)


def write(dst: torch.Tensor, part: torch.Tensor, start: int, fresh: slice, seen: slice) -> None:
    """Assign ``part`` (covering ``dst[:, :, start:]``) on ``fresh`` and add it on ``seen``."""
    dst[:, :, fresh] = part[:, :, fresh.start - start:fresh.stop - start]
    dst[:, :, seen] += part[:, :, seen.start - start:seen.stop - start]


def zero_unwritten(span: Span, n: int, *tensors: torch.Tensor, value: float = 0.0) -> None:
    """Fill what no part wrote along axis 2 (rows or keys nothing sees)."""
    for idx in span.unwritten(n):
        for t in tensors:
            t[:, :, idx] = value
