"""Which blocks the kernels visit, and which of them run the mask: the host-side mirror of the
kernels' loops (``kernels._block_split``), for the reports and for the tests that hold the split
to the mask rule of ``sinkattn.masks.Window``.

A forward or dQ tile holds ``PM = BM // GH`` positions; it visits key blocks ``[b0, b1)`` of ``BN``
keys, the interior ones ``[i0, i1)`` (every position sees every key of the block) without the mask.
A dK/dV program holds ``BN`` keys and visits row blocks of ``BM`` rows, once per query head of its
group; rows past the sequence's end count as seeing every key there (their ``P`` is 0 unmasked).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...masks import Window
from .config import Blocks, pack_heads

__all__ = ["split", "Counts", "count_blocks"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split(lo_any: int, hi_any: int, lo_all: int, hi_all: int, B: int) -> tuple[int, int, int, int]:
    """``(b0, b1, i0, i1)`` in block indices: blocks ``[b0, b1)`` meet ``[lo_any, hi_any)``, the
    interior ``[i0, i1)`` lies within ``[lo_all, hi_all)`` (``kernels._block_split``)."""
    b0 = max(lo_any, 0) // B
    b1 = max(_cdiv(max(hi_any, 0), B), b0)
    i0 = min(max(_cdiv(max(lo_all, 0), B), b0), b1)
    i1 = min(max(max(hi_all, 0) // B, i0), b1)
    return b0, b1, i0, i1


def query_tile_blocks(p0: int, p1: int, Lq: int, Lk: int, window: Window, BN: int):
    """``(b0, b1, i0, i1)`` of the positions ``[p0, p1)`` (``p1 <= Lq``) of a forward / dQ tile."""
    lo_any, hi_all = window.key_bounds(p0, Lq, Lk)
    lo_all, hi_any = window.key_bounds(p1 - 1, Lq, Lk)
    return split(lo_any, hi_any, lo_all, hi_all, BN)


def key_block_rows(n0: int, n1: int, Lq: int, Lk: int, window: Window, BM: int):
    """``(b0, b1, i0, i1)`` in row blocks of ``BM`` for the keys ``[n0, n1)`` (``n1 <= Lk``) of a dK/dV program."""
    lo_any, hi_all = window.row_bounds(n0, Lq, Lk)
    lo_all, hi_any = window.row_bounds(n1 - 1, Lq, Lk)
    if hi_all >= Lq:
        hi_all = _cdiv(Lq, BM) * BM
    return split(lo_any, hi_any, lo_all, hi_all, BM)


@dataclass
class Counts:
    """(tile, block) pairs a kernel visits over a batch: ``interior`` unmasked, ``cut`` masked."""

    interior: int = 0
    cut: int = 0

    @property
    def interior_share(self) -> float:
        total = self.interior + self.cut
        return self.interior / total if total else 0.0

    def add(self, b0: int, b1: int, i0: int, i1: int, times: int) -> None:
        self.interior += times * (i1 - i0)
        self.cut += times * ((i0 - b0) + (b1 - i1))


def count_blocks(kernel: str, q_lens, k_lens, window: Window, blocks: Blocks, HQ: int, HKV: int) -> Counts:
    """The pairs ``kernel`` (``fwd``, ``dq`` or ``dkdv``) visits on a batch of sequences."""
    G = HQ // HKV
    counts = Counts()
    for Lq, Lk in zip(q_lens, k_lens):
        if kernel == "dkdv":
            for n0 in range(0, Lk, blocks.BN):
                counts.add(*key_block_rows(n0, min(n0 + blocks.BN, Lk), Lq, Lk, window, blocks.BM), times=HQ)
            continue
        GH = pack_heads(G, blocks.BM)
        PM = blocks.BM // GH
        for p0 in range(0, Lq, PM):
            counts.add(*query_tile_blocks(p0, min(p0 + PM, Lq), Lq, Lk, window, blocks.BN), times=HQ // GH)
    return counts
