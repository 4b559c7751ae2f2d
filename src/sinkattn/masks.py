"""The mask rule, in one place.

Every backend, the reference and the tests derive visibility from this module.
Rows and keys are aligned bottom-right (``offset = Lk - Lq``), as in flash-attn:

    lo(i) = max(0, i + offset - left)      if left  >= 0 else 0
    hi(i) = min(Lk, i + offset + right + 1) if right >= 0 else Lk
    visible(i, j) = lo(i) <= j < hi(i)

``causal=True`` is ``right = 0``.  Both bounds are non-decreasing in ``i``, so
the keys seen by a block of rows ``[r0, r1)`` are ``[lo(r0), hi(r1 - 1))``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "BEYOND_ANY_LENGTH",
    "Window",
    "row_key_bounds",
    "visible",
    "block_visible",
    "block_key_range",
    "block_fully_visible",
    "row_blocks",
    "sub_block",
]


BEYOND_ANY_LENGTH = 2 ** 62
"""A window side this long reaches past the keys of any sequence a tensor can hold."""


class Window(NamedTuple):
    """The mask's two sides, ``causal`` folded in: ``left``, ``right`` ints, ``-1`` = unbounded.

    ``Window.of(causal, window_size)`` builds it from the public options; ``folded(max_seqlen_q,
    max_seqlen_k)`` makes every side that reaches past every key unbounded: ``left >= max_seqlen_k - 1``
    or ``right >= max_seqlen_q - 1`` (upper bounds of the lengths) select the same keys as ``-1``,
    and folding them keeps huge windows out of the mask arithmetic. A side of ``BEYOND_ANY_LENGTH``
    or more is folded by ``of`` already.

    ``folded`` needs concrete ints: the public functions build the window without lengths (under
    ``torch.compile`` / ``torch.export`` a length is symbolic, and comparing it would tie the
    compiled program to the lengths it was traced with); the ``sinkattn`` ops fold it with theirs,
    where they are plain ints.
    """

    left: int
    right: int

    @classmethod
    def of(cls, causal: bool, window_size) -> "Window":
        left, right = int(window_size[0]), int(window_size[1])
        if causal:
            right = 0
        return cls(-1 if left >= BEYOND_ANY_LENGTH else left, -1 if right >= BEYOND_ANY_LENGTH else right)

    def folded(self, max_seqlen_q: int, max_seqlen_k: int) -> "Window":
        if (self.left < 0 or self.left < max_seqlen_k - 1) and (self.right < 0 or self.right < max_seqlen_q - 1):
            return self                      # nothing to fold: the common case, once per call
        left = -1 if self.left >= max(max_seqlen_k - 1, 0) else self.left
        right = -1 if self.right >= max(max_seqlen_q - 1, 0) else self.right
        return Window(left, right)

    @property
    def unbounded(self) -> bool:
        """Every row sees every key (no causal limit, no window)."""
        return self.left < 0 and self.right < 0


def row_key_bounds(i, Lq, Lk, left: int, right: int):
    """Half-open key range ``[lo, hi)`` visible to row ``i`` (int or int tensor).

    With a tensor ``i``, ``Lq`` and ``Lk`` may be int tensors too, broadcast against it (the rows of
    several sequences at once: ``i [1, R]``, ``Lq``/``Lk [N, 1]`` give bounds ``[N, R]``).
    ``hi <= lo`` means the row sees no key.
    """
    offset = Lk - Lq
    if isinstance(i, torch.Tensor):
        position = i + offset
        lo = (position - left).clamp(min=0) if left >= 0 else torch.zeros_like(position)
        hi = torch.clamp(position + right + 1, max=Lk) if right >= 0 else torch.zeros_like(position) + Lk
        return lo, hi
    lo = max(0, i + offset - left) if left >= 0 else 0
    hi = min(Lk, i + offset + right + 1) if right >= 0 else Lk
    return lo, hi


def visible(rows: torch.Tensor, cols: torch.Tensor, Lq, Lk, left: int, right: int) -> torch.Tensor:
    """Bool ``[len(rows), len(cols)]``: ``visible(i, j)`` for ``i in rows``, ``j in cols``; with
    per-sequence lengths (``row_key_bounds``) ``[..., len(rows), len(cols)]``."""
    lo, hi = row_key_bounds(rows, Lq, Lk, left, right)
    return (cols >= lo.unsqueeze(-1)) & (cols < hi.unsqueeze(-1))


def block_visible(R: int, C: int, shift: int, left: int, right: int) -> torch.Tensor:
    """Bool ``[R, C]``: ``visible`` on rows ``r0 + [0, R)`` against keys ``k0 + [0, C)`` of a block whose
    ``shift = r0 + (Lk - Lq) - k0``, for a block inside its sequence (``k0 >= 0``, ``k0 + C <= Lk``): there
    the length limits do not bind, so every block of one ``(R, C, shift)`` has the same mask."""
    span = R + abs(shift) + C + 1          # a square frame large enough that no limit clips
    return visible(torch.arange(R) + shift, torch.arange(C), span, span, left, right)


def block_key_range(r0: int, r1: int, Lq: int, Lk: int, left: int, right: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` seen by at least one row of ``[r0, r1)`` (``hi <= lo``: none)."""
    lo, _ = row_key_bounds(r0, Lq, Lk, left, right)
    _, hi = row_key_bounds(r1 - 1, Lq, Lk, left, right)
    return lo, hi


def block_fully_visible(r0: int, r1: int, k0: int, k1: int, Lq: int, Lk: int, left: int, right: int) -> bool:
    """True when every row of ``[r0, r1)`` sees every key of ``[k0, k1)``."""
    lo_last, _ = row_key_bounds(r1 - 1, Lq, Lk, left, right)
    _, hi_first = row_key_bounds(r0, Lq, Lk, left, right)
    return lo_last <= k0 and hi_first >= k1


def row_blocks(Lq: int, Lk: int, left: int, right: int, block_rows: int):
    """Yield ``(r0, r1, k0, k1, fully_visible)`` per block of ``block_rows`` query rows that sees
    at least one key: the block's visible key range and whether every row sees all of it."""
    for r0 in range(0, Lq, block_rows):
        r1 = min(r0 + block_rows, Lq)
        k0, k1 = block_key_range(r0, r1, Lq, Lk, left, right)
        if k1 > k0:
            yield r0, r1, k0, k1, block_fully_visible(r0, r1, k0, k1, Lq, Lk, left, right)


def sub_block(a: int, m: int, b: int, n: int, left: int, right: int) -> tuple[int, int, int, int] | None:
    """One tile of self-attention (``Lq = Lk``, offset 0) as a call under this same rule.

    Rows ``[a, a+m)`` against keys ``[b, b+n)`` of one sequence see the pairs with
    ``j - i`` in ``[a-b-left, a-b+right]`` (a side of ``-1`` unbounded), in tile coordinates.
    Returns ``(rows, keys, left', right')``: rows ``[0, rows)`` of the tile against keys
    ``[0, keys)`` under ``visible(.., rows, keys, left', right')`` see exactly the tile's pairs,
    and rows ``>= rows`` see none; ``None`` when the tile sees nothing. The rule needs the band
    to hold the call's bottom-right diagonal ``j - i = keys - rows``; a band wholly above it
    is met by dropping the rows that see nothing, one wholly below it by dropping the keys
    no row sees. The window comes back folded (``Window.folded``).
    """
    if m <= 0 or n <= 0:
        return None
    low = a - b - left if left >= 0 else None
    high = a - b + right if right >= 0 else None
    if (high is not None and high < 1 - m) or (low is not None and low > n - 1):
        return None
    rows, keys = m, n
    if low is not None and n - m < low:
        rows = n - low
    elif high is not None and n - m > high:
        keys = m + high
    diagonal = keys - rows
    window = (diagonal - low if low is not None else -1, high - diagonal if high is not None else -1)
    return (rows, keys, *Window(*window).folded(rows, keys))
