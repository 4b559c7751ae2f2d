"""The defaults of the public options, in one place."""

from __future__ import annotations

import math

__all__ = ["softmax_scale"]


def softmax_scale(head_dim: int, given: float | None = None) -> float:
    """``given`` as a float, or the default ``1 / sqrt(D)``."""
    return float(given) if given is not None else 1.0 / math.sqrt(head_dim)
