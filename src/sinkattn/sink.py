"""Sink algebra shared by the fast backends (the reference spells it out itself).

With ``lse_keys`` the log-sum-exp over visible keys only (``-inf`` for a row
that sees none) and ``sink`` the raw per-head logit:

    lse       = logaddexp(lse_keys, sink)
    o         = exp(lse_keys - lse) * o_keys          # o_keys: softmax over keys only
    Delta     = <dO, o> - dlse
    dsink_h   = - sum_rows exp(sink_h - lse) * Delta

All statistics are fp32 ``[HQ, T]``; the sink vector is ``[HQ]``.
"""

from __future__ import annotations

import torch

__all__ = ["lse_with_sink", "key_mass", "sink_mass", "row_delta", "dsinks_from"]

_LOWEST = torch.finfo(torch.float32).min


def lse_with_sink(lse_keys: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``[HQ, T]`` fp32: the sink's logit added to the denominator."""
    if sinks is None:
        return lse_keys
    return torch.logaddexp(lse_keys, sinks.float().unsqueeze(-1))


def key_mass(lse_keys: torch.Tensor, lse: torch.Tensor, rows_have_keys: bool = False) -> torch.Tensor:
    """``[HQ, T]`` fp32: ``exp(lse_keys - lse)``, the probability mass on real keys.

    0 for a row that sees no key (``lse_keys = -inf``) and for a ``+inf`` sink; ``lse`` is floored at
    the lowest fp32 number so that ``-inf - (-inf)`` (no key, no sink) is never formed, unless the
    caller knows that no ``lse_keys`` is ``-inf`` (``rows_have_keys``; the values are the same).
    """
    return torch.exp(lse_keys - (lse if rows_have_keys else lse.clamp(min=_LOWEST)))


def sink_mass(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``[HQ, T]`` fp32: ``exp(sink - lse)``, the probability taken by the sink.

    0 where ``lse`` is infinite (a ``+inf`` sink, or an empty row without sink).
    """
    return torch.where(torch.isinf(lse), 0.0, torch.exp(sinks.float().unsqueeze(-1) - lse))


def row_delta(do: torch.Tensor, o: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """``[HQ, T]`` fp32: ``Delta = <dO, o> - dlse`` from ``do``/``o`` of shape ``[T, HQ, D]``."""
    delta = torch.linalg.vecdot(do.float(), o.float()).t()
    if dlse is not None:
        delta = delta - dlse.float()
    return delta


def dsinks_from(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``[HQ]`` in the sinks' dtype: ``-sum_rows exp(sink - lse) * Delta``, fp32, one fixed order."""
    return (-(sink_mass(sinks, lse) * delta).sum(-1)).to(sinks.dtype)
