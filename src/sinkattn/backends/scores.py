"""When are scores "large"? The one test both fast backends use to pick their exact path.

Past a few hundred, the fp32 rounding of a recomputed score or of ``Delta = <dO, o>``
is no longer small next to the exact cancellation ``dP_ij - Delta_i = 0`` of a row
whose attention is one-hot, and gradients of such rows pick up errors of
``ulp(|dP|) * |k|``. Inputs whose scores may reach that size go through paths that
sum ``Delta`` from the same ``P`` and ``dP`` the gradients use.
"""

from __future__ import annotations

import torch

__all__ = ["LARGE_SCORE", "may_have_large_scores"]

LARGE_SCORE = 256.0


def may_have_large_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> bool:
    """Cauchy-Schwarz: ``|scale <q_i, k_j>| <= |scale| max_i |q_i| max_j |k_j|``; True above
    ``LARGE_SCORE`` (or if a norm is not finite). ``q [Tq, HQ, D]``, ``k [Tk, HKV, D]``."""
    if q.numel() == 0 or k.numel() == 0:
        return False
    bound = abs(softmax_scale) * float(q.float().norm(dim=-1).max()) * float(k.float().norm(dim=-1).max())
    return not bound <= LARGE_SCORE
