"""NaN and inf in ``k`` or ``v``: they reach exactly the rows that see their key (docs/contract.md §1).

The formula sums over visible keys only. A matrix product ``P @ V`` whose ``P`` is 0 on the pairs a
row does not see still carries a NaN or inf of ``V`` there (``0 * NaN = NaN``), and so do ``dS @ K``
and ``dO @ V^T`` in the backward. The CPU paths therefore check each call's keys and values once
(``present``, one fused reduction) and, only when a special value is there, form those products with
``visible_matmul``: the finite part as usual, the special values of the visible terms added by
IEEE's rules, which do not depend on the order of a sum (NaN if a term is NaN or terms of both
infinite signs meet, else the one infinity).
"""

from __future__ import annotations

import math

import torch

from . import scores

__all__ = ["present", "visible_matmul"]

_INF = float("inf")


def present(*tensors: torch.Tensor) -> bool:
    """True when a tensor holds a NaN or an inf: one fused norm over all of them, one read (finite values
    whose squares overflow count too; they only send the call down the exact path)."""
    return not all(math.isfinite(n) for n in scores.norms(*tensors))


def visible_matmul(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``out_id = sum_j a_ij b_jd`` over the visible pairs ``mask_ij`` only, specials of ``b`` included.

    ``a [..., M, K]`` fp32, 0 where ``mask`` is False; ``b [..., K, D]`` fp32, may hold NaN / inf;
    ``mask`` bool broadcastable to ``a``, or None when every pair is visible (then a plain product).
    A term ``a_ij b_jd`` with ``b_jd`` not finite is NaN if ``b_jd`` is NaN or ``a_ij`` is 0, else
    the infinity of sign ``sign(a_ij) * sign(b_jd)``; a NaN ``a_ij`` makes the finite part NaN.
    """
    if mask is None:
        return torch.matmul(a, b)
    finite = torch.isfinite(b)
    out = torch.matmul(a, torch.where(finite, b, 0.0))
    if bool(finite.all()):
        return out
    mask = mask.expand_as(a)
    sees = mask.to(a.dtype)
    a_pos, a_neg, a_zero = ((cond & mask).to(a.dtype) for cond in (a > 0, a < 0, a == 0))
    b_nan, b_pos, b_neg = (x.to(a.dtype) for x in (torch.isnan(b), b == _INF, b == -_INF))
    nan_terms = torch.matmul(sees, b_nan) + torch.matmul(a_zero, b_pos + b_neg)
    plus = torch.matmul(a_pos, b_pos) + torch.matmul(a_neg, b_neg)
    minus = torch.matmul(a_pos, b_neg) + torch.matmul(a_neg, b_pos)
    special = torch.where(plus > 0, _INF, 0.0) + torch.where(minus > 0, -_INF, 0.0)   # +inf and -inf: NaN
    return out + special.masked_fill_(nan_terms > 0, float("nan"))
