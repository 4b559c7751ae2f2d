"""Views and bookkeeping shared by the CPU paths: the call's sequences split between the paths,
heads-first views of the packed layout, and the written span of an axis whose parts arrive in order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Run", "Sequences", "Split", "split", "token_ranges", "group_views", "heads_first", "stat_view", "Span",
           "write", "zero_unwritten"]


@dataclass(frozen=True)
class Run:
    """``n`` consecutive sequences of ``Lq`` queries and ``Lk`` keys: query tokens ``[tq, tq + n*Lq)``,
    key tokens ``[tk, tk + n*Lk)``."""

    tq: int
    tk: int
    n: int
    Lq: int
    Lk: int


@dataclass(frozen=True)
class Sequences:
    """``M`` sequences of a packed batch, as int64 tensors ``[M]``: first query and key token, lengths."""

    tq: torch.Tensor
    tk: torch.Tensor
    Lq: torch.Tensor
    Lk: torch.Tensor

    def __len__(self) -> int:
        return self.tq.numel()


@dataclass
class Split:
    """A call's sequences by the path that takes them.

    ``runs``: for the per-sequence paths, consecutive sequences of equal lengths batched into one
    ``Run`` (a dense batch, whose sequences all share their lengths, is one run whatever they are).
    ``small``: the sequences of the batched small path (``cpu_small``), or None. ``keys_only``:
    sequences without queries, whose keys no row sees (zero gradients). Sequences without queries
    or keys need nothing and are not listed.
    """

    runs: list[Run] = field(default_factory=list)
    small: Sequences | None = None
    keys_only: Sequences | None = None

    @property
    def single(self) -> Run | None:
        """The one run covering the whole call, or None."""
        if len(self.runs) == 1 and self.small is None and self.keys_only is None and self.runs[0].tq == 0:
            return self.runs[0]
        return None


def _dense(cq: list[int], ck: list[int]) -> Run | None:
    """The one run of a batch whose sequences all share their (nonzero) query length and key length."""
    n = len(cq) - 1
    Lq, Lk = (cq[1] - cq[0], ck[1] - ck[0]) if n > 0 else (0, 0)
    if Lq == 0 or cq != list(range(0, n * Lq + 1, Lq)) or ck != [b * Lk for b in range(n + 1)]:
        return None
    return Run(0, 0, n, Lq, Lk)


def split(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, small=None) -> Split:
    """The sequences of ``cu_seqlens_* [N+1]`` split by path. ``small(Lq, Lk)`` (ints, or int64
    tensors elementwise) picks those of the batched small path; None picks none."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    dense = _dense(cq, ck)
    if dense is not None:      # one kernel call takes it, decoding and short sequences too
        return Split(runs=[dense])
    starts_q, starts_k = cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)   # not from the lists: slow
    Lq, Lk = starts_q.diff(), starts_k.diff()
    has_rows = Lq > 0
    chosen = has_rows & small(Lq, Lk) if small is not None else torch.zeros_like(has_rows)
    out = Split()

    def sequences(which: torch.Tensor) -> Sequences | None:
        index = which.nonzero().flatten()
        return Sequences(starts_q[index], starts_k[index], Lq[index], Lk[index]) if index.numel() else None

    out.small, out.keys_only = sequences(chosen), sequences(~has_rows & (Lk > 0))
    for b in (has_rows & ~chosen).nonzero().flatten().tolist():
        Lq_b, Lk_b = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        last = out.runs[-1] if out.runs else None
        if last is not None and (last.Lq, last.Lk) == (Lq_b, Lk_b) and last.tq + last.n * Lq_b == cq[b] and (
                last.tk + last.n * Lk_b == ck[b]):
            out.runs[-1] = Run(last.tq, last.tk, last.n + 1, Lq_b, Lk_b)
        else:
            out.runs.append(Run(cq[b], ck[b], 1, Lq_b, Lk_b))
    return out


def token_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64: the token ranges ``[s, s + l)`` of ``starts``/``lengths [M]``, concatenated."""
    total = int(lengths.sum())
    shift = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
    return shift + torch.arange(total)


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
    if t0 != 0 or n * length != x.shape[0]:
        x = x[t0:t0 + n * length]
    return x.view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)


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
        """The slices of ``[0, n)`` outside ``[lo, hi)`` that hold something (none when every part was written)."""
        if self.lo is None:
            return (slice(0, n),) if n > 0 else ()
        return tuple(s for s in (slice(0, self.lo), slice(self.hi, n)) if s.stop > s.start)


def write(dst: torch.Tensor, part: torch.Tensor, start: int, fresh: slice, seen: slice) -> None:
    """Assign ``part`` (covering ``dst[:, :, start:]``) on ``fresh`` and add it on ``seen``."""
    dst[:, :, fresh] = part[:, :, fresh.start - start:fresh.stop - start]
    dst[:, :, seen] += part[:, :, seen.start - start:seen.stop - start]


def zero_unwritten(span: Span, n: int, *tensors: torch.Tensor, value: float = 0.0) -> None:
    """Fill what no part wrote along axis 2 (rows or keys nothing sees); nothing to do costs no tensor op."""
    for idx in span.unwritten(n):
        for t in tensors:
            t[:, :, idx] = value
