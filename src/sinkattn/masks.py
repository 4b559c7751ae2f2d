"""The mask rule, in one place: the ``Window`` value and its methods.

Every backend, the reference and the tests derive visibility from ``Window``. Rows and keys are
aligned bottom-right (``offset = Lk - Lq``), as in flash-attn; with ``left``, ``right`` the window's
sides (``-1`` = unbounded):

    lo(i) = max(0, i + offset - left)       if left  >= 0 else 0
    hi(i) = min(Lk, i + offset + right + 1) if right >= 0 else Lk
    visible(i, j) = lo(i) <= j < hi(i)

``causal=True`` is ``right = 0``.  Both bounds are non-decreasing in ``i``, so the keys seen by a block
of rows ``[r0, r1)`` are ``[lo(r0), hi(r1 - 1))``.

Outside Python the rule is transcribed, not imported: the Triton kernels take ``left``, ``right`` as
ints (``kernels._row_key_bounds``, held to ``Window`` by a test), the compiled CPU kernel takes each
row's ``[lo, hi)`` computed here, and the custom ops' schemas carry the two ints.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["BEYOND_ANY_LENGTH", "Window"]


BEYOND_ANY_LENGTH = 2 ** 62
"""A window side this long reaches past the keys of any sequence a tensor can hold."""


class Window(NamedTuple):
    """The mask's two sides, ``causal`` folded in: ``left``, ``right`` ints, ``-1`` = unbounded.

    ``Window.of(causal, window_size)`` builds it from the public options; ``folded(max_seqlen_q,
    max_seqlen_k)`` makes every side that reaches past every key unbounded: ``left >= max_seqlen_k - 1``
    or ``right >= max_seqlen_q - 1`` (upper bounds of the lengths) select the same keys as ``-1``,
    and folding them keeps huge windows out of the mask arithmetic. A side of ``BEYOND_ANY_LENGTH``
    or more is folded by ``of`` already. These two are the only places a side is folded.

    ``folded`` needs concrete ints: the public functions build the window without lengths (under
    ``torch.compile`` / ``torch.export`` a length is symbolic, and comparing it would tie the
    compiled program to the lengths it was traced with); the ``sinkattn`` ops fold it with theirs,
    where they are plain ints.

    The rule's methods (module doc): ``key_bounds`` / ``row_bounds`` per row / key, ``visible`` as a
    bool matrix, and the block helpers the backends tile with (``block_key_range``,
    ``block_fully_visible``, ``row_blocks``, ``block_visible``, ``sub_block``).
    """

    left: int
    right: int

    @classmethod
    def of(cls, causal: bool, window_size) -> "Window":
        """``window_size = (left, right)`` with ``right = 0`` under ``causal``; a side of
        ``BEYOND_ANY_LENGTH`` or more becomes ``-1``."""
        left, right = int(window_size[0]), int(window_size[1])
        if causal:
            right = 0
        return cls(-1 if left >= BEYOND_ANY_LENGTH else left, -1 if right >= BEYOND_ANY_LENGTH else right)

    def folded(self, max_seqlen_q: int, max_seqlen_k: int) -> "Window":
        """This window with ``left = -1`` where ``left >= max_seqlen_k - 1`` and ``right = -1`` where
        ``right >= max_seqlen_q - 1`` (ints, upper bounds of the lengths): the same visible pairs."""
        if (self.left < 0 or self.left < max_seqlen_k - 1) and (self.right < 0 or self.right < max_seqlen_q - 1):
            return self                      # nothing to fold: the common case, once per call
        left = -1 if self.left >= max(max_seqlen_k - 1, 0) else self.left
        right = -1 if self.right >= max(max_seqlen_q - 1, 0) else self.right
        return Window(left, right)

    @property
    def unbounded(self) -> bool:
        """Every row sees every key (no causal limit, no window)."""
        return self.left < 0 and self.right < 0

    def key_bounds(self, i, Lq, Lk):
        """Half-open key range ``[lo(i), hi(i))`` visible to row ``i`` (an int, or an int tensor):

            lo(i) = max(0, i + Lk - Lq - left)        (0 when left < 0)
            hi(i) = min(Lk, i + Lk - Lq + right + 1)  (Lk when right < 0)

        With a tensor ``i``, ``Lq`` and ``Lk`` may be int tensors too, broadcast against it (the rows of
        several sequences at once: ``i [1, R]``, ``Lq``/``Lk [N, 1]`` give bounds ``[N, R]``).
        ``hi <= lo`` means the row sees no key.
        """
        left, right = self
        position = i + (Lk - Lq)
        if isinstance(position, torch.Tensor):
            lo = (position - left).clamp(min=0) if left >= 0 else torch.zeros_like(position)
            hi = torch.clamp(position + right + 1, max=Lk) if right >= 0 else torch.zeros_like(position) + Lk
            return lo, hi
        lo = max(0, position - left) if left >= 0 else 0
        hi = min(Lk, position + right + 1) if right >= 0 else Lk
        return lo, hi

    def row_bounds(self, j: int, Lq: int, Lk: int) -> tuple[int, int]:
        """Half-open row range ``[i_lo(j), i_hi(j))`` that sees key ``j`` (ints), the inverse of ``key_bounds``:

            i_lo(j) = max(0, j - (Lk - Lq) - right)       (0 when right < 0)
            i_hi(j) = min(Lq, j - (Lk - Lq) + left + 1)   (Lq when left < 0)

        for ``0 <= j < Lk``; ``i_hi <= i_lo`` means no row sees the key."""
        left, right = self
        position = j - (Lk - Lq)
        i_lo = max(0, position - right) if right >= 0 else 0
        i_hi = min(Lq, position + left + 1) if left >= 0 else Lq
        return i_lo, i_hi

    def visible(self, rows: torch.Tensor, cols: torch.Tensor, Lq, Lk) -> torch.Tensor:
        """Bool ``[len(rows), len(cols)]``: ``visible(i, j) = lo(i) <= j < hi(i)`` for ``i in rows``,
        ``j in cols`` (int tensors); with per-sequence lengths (``key_bounds``) ``[..., len(rows), len(cols)]``."""
        lo, hi = self.key_bounds(rows, Lq, Lk)
        return (cols >= lo.unsqueeze(-1)) & (cols < hi.unsqueeze(-1))

    def block_key_range(self, r0: int, r1: int, Lq: int, Lk: int) -> tuple[int, int]:
        """Keys ``[lo(r0), hi(r1 - 1))`` seen by at least one row of ``[r0, r1)`` (``hi <= lo``: none)."""
        lo, _ = self.key_bounds(r0, Lq, Lk)
        _, hi = self.key_bounds(r1 - 1, Lq, Lk)
        return lo, hi

    def block_fully_visible(self, r0: int, r1: int, k0: int, k1: int, Lq: int, Lk: int) -> bool:
        """True when every row of ``[r0, r1)`` sees every key of ``[k0, k1)``:
        ``lo(r1 - 1) <= k0`` and ``hi(r0) >= k1``."""
        lo_last, _ = self.key_bounds(r1 - 1, Lq, Lk)
        _, hi_first = self.key_bounds(r0, Lq, Lk)
        return lo_last <= k0 and hi_first >= k1

    def row_blocks(self, Lq: int, Lk: int, block_rows: int):
        """Yield ``(r0, r1, k0, k1, fully_visible)`` per block of ``block_rows`` query rows that sees
        at least one key: the block's visible key range (``block_key_range``) and whether every row
        sees all of it (``block_fully_visible``)."""
        for r0 in range(0, Lq, block_rows):
            r1 = min(r0 + block_rows, Lq)
            k0, k1 = self.block_key_range(r0, r1, Lq, Lk)
            if k1 > k0:
                yield r0, r1, k0, k1, self.block_fully_visible(r0, r1, k0, k1, Lq, Lk)

    def block_visible(self, R: int, C: int, shift: int) -> torch.Tensor:
        """Bool ``[R, C]``: ``visible`` on rows ``r0 + [0, R)`` against keys ``k0 + [0, C)`` of a block whose
        ``shift = r0 + (Lk - Lq) - k0``, for a block inside its sequence (``k0 >= 0``, ``k0 + C <= Lk``): there
        the length limits do not bind, so every block of one ``(R, C, shift)`` has the same mask: entry
        ``(a, c)`` is ``c - a - shift`` in ``[-left, right]`` (a side of ``-1`` unbounded)."""
        span = R + abs(shift) + C + 1          # a square frame large enough that no limit clips
        return self.visible(torch.arange(R) + shift, torch.arange(C), span, span)

    def sub_block(self, a: int, m: int, b: int, n: int) -> tuple[int, int, "Window"] | None:
        """One tile of self-attention (``Lq = Lk``, offset 0) as a call under this same rule.

        Rows ``[a, a+m)`` against keys ``[b, b+n)`` of one sequence see the pairs with
        ``j - i`` in ``[a-b-left, a-b+right]`` (a side of ``-1`` unbounded), in tile coordinates.
        Returns ``(rows, keys, window)``: rows ``[0, rows)`` of the tile against keys ``[0, keys)``
        under ``window.visible(.., rows, keys)`` see exactly the tile's pairs, and rows ``>= rows``
        see none; ``None`` when the tile sees nothing. The rule needs the band to hold the call's
        bottom-right diagonal ``j - i = keys - rows``; a band wholly above it is met by dropping the
        rows that see nothing, one wholly below it by dropping the keys no row sees. The window
        comes back folded (``folded(rows, keys)``).
        """
        if m <= 0 or n <= 0:
            return None
        left, right = self
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
        window = Window(diagonal - low if low is not None else -1, high - diagonal if high is not None else -1)
        return rows, keys, window.folded(rows, keys)
