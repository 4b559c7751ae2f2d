"""Views and bookkeeping shared by the CPU paths: the call's sequences split between the paths,
heads-first views of the packed layout, and the written span of an axis whose parts arrive in order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Run", "Split", "split", "group_views", "heads_first", "stat_view", "Span", "write", "zero_unwritten"]


@dataclass(frozen=True)
class Run:
    """``n`` consecutive sequences of ``Lq`` queries and ``Lk`` keys: query tokens ``[tq, tq + n*Lq)``,
    key tokens ``[tk, tk + n*Lk)``."""

    tq: int
    tk: int
    n: int
    Lq: int
    Lk: int


@dataclass
class Split:
    """A call's sequences by the path that takes them.

    ``runs``: for the per-sequence paths, consecutive sequences of equal lengths batched into one
    ``Run``. ``small``: for the batched small path (``cpu_small``), one ``Run`` per sequence, or the
    one ``Run`` of a batch whose sequences all share their lengths. ``keys_only``: ``(tk, Lk)`` of
    sequences without queries, whose keys no row sees (zero gradients). Sequences without queries
    or keys need nothing and are not listed.
    """

    runs: list[Run] = field(default_factory=list)
    small: list[Run] = field(default_factory=list)
    keys_only: list[tuple[int, int]] = field(default_factory=list)

    @property
    def single(self) -> Run | None:
        """The one run covering the whole call, or None."""
        if len(self.runs) == 1 and not self.small and not self.keys_only and self.runs[0].tq == self.runs[0].tk == 0:
            return self.runs[0]
        return None


def split(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, small=None) -> Split:
    """The sequences of ``cu_seqlens_* [N+1]`` split by path; ``small(Lq, Lk) -> bool`` picks those
    of the batched small path (None: no sequence)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    n = len(cq) - 1
    lengths = [(cq[b + 1] - cq[b], ck[b + 1] - ck[b]) for b in range(n)]
    out = Split()
    if n > 0 and lengths.count(lengths[0]) == n and lengths[0][0] > 0:     # a dense batch: one run
        run = Run(0, 0, n, *lengths[0])
        (out.small if small is not None and small(*lengths[0]) else out.runs).append(run)
        return out
    for b, (Lq, Lk) in enumerate(lengths):
        if Lq == 0:
            if Lk > 0:
                out.keys_only.append((ck[b], Lk))
        elif small is not None and small(Lq, Lk):
            out.small.append(Run(cq[b], ck[b], 1, Lq, Lk))
        else:
            last = out.runs[-1] if out.runs else None
            if last is not None and (last.Lq, last.Lk) == (Lq, Lk) and last.tq + last.n * Lq == cq[b] and (
                    last.tk + last.n * Lk == ck[b]):
                out.runs[-1] = Run(last.tq, last.tk, last.n + 1, Lq, Lk)
            else:
                out.runs.append(Run(cq[b], ck[b], 1, Lq, Lk))
    return out


def group_views(runs, queries=(), keys=(), stats=()):
    """Per ``Run``: ``(n, Lq, Lk, query_views, key_views, stat_views)``, the heads-first views
    ``[N, H, L, D]`` of the query-side and key-side ``[T, H, D]`` tensors and ``[N, H, Lq]`` views of
    the ``[H, Tq]`` statistics (None stays None)."""
    for r in runs:
        yield (r.n, r.Lq, r.Lk, [heads_first(x, r.tq, r.n, r.Lq) for x in queries],
               [heads_first(x, r.tk, r.n, r.Lk) for x in keys],
               [None if s is None else stat_view(s, r.tq, r.n, r.Lq) for s in stats])


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
