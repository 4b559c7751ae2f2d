"""How large can scores get? The bound both fast backends use to pick their exact path, and to
refuse inputs whose scores fp32 cannot hold.

Past a few hundred, the fp32 rounding of a recomputed score or of ``Delta = <dO, o>``
is no longer small next to the exact cancellation ``dP_ij - Delta_i = 0`` of a row
whose attention is one-hot, and gradients of such rows pick up errors of
``ulp(|dP|) * |k|``. Inputs whose scores may reach that size go through paths that
sum ``Delta`` from the same ``P`` and ``dP`` the gradients use.

``score_bound`` reads the bound back to the host (the cpu backend, where that costs no
synchronisation); ``large_scores_flag`` keeps it on the tensors' device, for the Triton kernels to
read there.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LARGE_SCORE", "MAX_SCORE", "score_bound", "may_have_large_scores", "large_scores_flag", "check_fp32_range",
           "loose_bound", "norms"]

LARGE_SCORE = 256.0
MAX_SCORE = torch.finfo(torch.float32).max / (2 * math.log2(math.e))
"""Largest bound taken: base-2 scores, and their difference from a row maximum, stay finite in fp32."""


def _bound_on_device(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """``|scale| max_i |q_i| max_j |k_j|`` as a float64 0-dim tensor on q's device, computed there (the fp32
    norms multiplied in float64, in that order: the value ``score_bound`` returns); NaN if a norm is NaN.
    Needs tokens in both."""
    norms = [torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).max().double() for x in (q, k)]
    return abs(softmax_scale) * norms[0] * norms[1]


def score_bound(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> float:
    """Cauchy-Schwarz: ``|scale <q_i, k_j>| <= |scale| max_i |q_i| max_j |k_j|`` (``inf`` if a norm is
    not finite, 0 without tokens). ``q [Tq, HQ, D]``, ``k [Tk, HKV, D]``. One read back to the host."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    bound = float(_bound_on_device(q, k, softmax_scale))
    return bound if bound == bound else math.inf


def may_have_large_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> bool:
    """True when scores may exceed ``LARGE_SCORE`` in magnitude (or a norm is not finite)."""
    return score_bound(q, k, softmax_scale) > LARGE_SCORE


def large_scores_flag(q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """``may_have_large_scores`` without reading anything back: int32 ``[1]`` on q's device, 1 where it is
    True, else 0. Computed there by a few reductions queued with the kernels, for them to read."""
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=q.device)
    return (_bound_on_device(q, k, softmax_scale) <= LARGE_SCORE).logical_not().to(torch.int32).reshape(1)


def check_fp32_range(bound: float, q: torch.Tensor, k: torch.Tensor) -> None:
    """ValueError when finite inputs may give scores beyond fp32 (where scores are computed).
    Inputs holding inf or NaN pass: they give NaN where they reach, as in any attention."""
    if bound <= MAX_SCORE or not (torch.isfinite(q).all() and torch.isfinite(k).all()):
        return
    raise ValueError(f"scores softmax_scale * <q_i, k_j> may reach {bound:.3g}, beyond what fp32 holds "
                     f"({MAX_SCORE:.3g}); lower softmax_scale or the magnitude of q and k")



def norms(*tensors: torch.Tensor) -> list[float]:
    """Each tensor's Frobenius norm (0 for an empty one; inf or NaN where it holds inf or NaN, or its squares
    overflow): one fused reduction over all of them, one read."""
    return torch.stack(torch._foreach_norm(list(tensors))).tolist()


def loose_bound(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, norm_q: float | None = None,
                norm_k: float | None = None) -> float:
    """``|scale| ||q||_F ||k||_F``, at least ``score_bound`` (a row's norm is at most its tensor's) and cheap:
    one fused reduction over both tensors, one read (none when the caller has the ``norms``). ``inf`` when
    an input is not finite (or the norm overflows); 0 without tokens."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    if norm_q is None or norm_k is None:
        norm_q, norm_k = norms(q, k)
    bound = abs(softmax_scale) * norm_q * norm_k
    return bound if bound == bound else math.inf
