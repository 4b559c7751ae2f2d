"""FLOP counts that follow the mask: only visible (i, j) pairs are work.

Per visible pair and query head: forward ``QK^T`` and ``PV`` = 2 products of
``D`` multiply-adds = ``4 D`` FLOPs; backward recomputes ``QK^T`` and forms
``dV``, ``dP``, ``dQ``, ``dK`` = 5 products = ``10 D`` FLOPs (flash-attn's
convention, so figures compare).
"""

from __future__ import annotations

import torch

from ..masks import Window

__all__ = ["visible_pairs", "attention_flops"]

_PER_PAIR = {"fwd": 4, "bwd": 10, "fwdbwd": 14}


def visible_pairs(q_lens, k_lens, window: Window) -> int:
    """Number of visible ``(i, j)`` pairs summed over sequences (one head)."""
    total = 0
    for Lq, Lk in zip(q_lens, k_lens):
        if Lq == 0 or Lk == 0:
            continue
        lo, hi = window.key_bounds(torch.arange(Lq), Lq, Lk)
        total += int((hi - lo).clamp(min=0).sum())
    return total


def attention_flops(q_lens, k_lens, HQ: int, D: int, window: Window, mode: str) -> float:
    """FLOPs of ``mode`` in ``fwd`` / ``bwd`` / ``fwdbwd`` for a packed batch."""
    return float(_PER_PAIR[mode] * visible_pairs(q_lens, k_lens, window) * HQ * D)
