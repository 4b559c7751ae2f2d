"""Softmax statistics, their merge, and the sink: the one place that combines partial results.

A backend's forward computes, for each row, the softmax over its visible keys only, without the
sink (``sinkattn.backends``)::

    m     = max_j s_ij                       any value for a row that sees no key
    log_l = log sum_j exp(s_ij - m)          -inf for such a row: this is what marks it
    o     = sum_j exp(s_ij - m) v_j / l      0 for such a row

``Stats(m, log_l)`` holds the two statistics, fp32 ``[HQ, T]``, in the backend's log base
(``base2``: kernels that exponentiate with ``exp2`` keep ``m`` in base-2 units, so that the
backward can rebuild ``P = 2^(s2 - m - log_l)`` from the very maximum it subtracted). The pair
stands for ``lse = m + log_l``, but is never rounded into one number: a row whose attention is
one-hot has ``m`` equal to its largest score and ``log_l`` tiny, and ``s - m`` stays exact where
``s - lse`` would lose ``ulp(|lse|)``.

Two results over disjoint key sets of the same rows merge by the log-sum-exp rule (``merge``):
context parallelism folds one tile after another, and the sink joins every call exactly once, at
the end, as one more "key" of logit ``sink_h`` and no value (``with_sink``):

    c     = max(m_a, m_b) over the parts that hold keys (a finite stand-in where neither has a finite m)
    Z     = exp(m_a - c + log_l_a) + exp(m_b - c + log_l_b)
    o     = exp(m_a - c + log_l_a) / Z * o_a + exp(m_b - c + log_l_b) / Z * o_b
    Stats = (c, log Z)

A part without keys (``log_l = -inf``) adds nothing to ``o`` and takes no part in the shift ``c``,
whatever its ``m`` holds (the backends leave their own shift there): a row that sees no key has
``o = 0`` and ``lse = sink_h`` exactly, for any finite sink (NaN for a NaN sink); a ``+inf`` sink takes all
the mass (``o = 0``, ``lse = +inf``); a NaN sink makes ``o`` NaN on every row of its head that sees a
key. The backward uses the final statistics and, per row, ``Delta = <dO, o> - dlse`` (``row_delta``);
``sink_mass`` is the sink's probability per row and ``dsinks_from`` the sink's gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["Stats", "merge", "with_sink", "stats_of_lse", "lse_without_keys", "lse_of", "row_delta", "sink_mass",
           "dsinks_from", "LOG2E", "LN2"]

LOG2E = 1.4426950408889634
"""log2(e): a natural-log value times it is the same value in base 2."""
LN2 = 0.6931471805599453
"""ln(2): a base-2 value times it is the same value in natural units."""


class Stats(NamedTuple):
    """Per-row softmax statistics ``m``, ``log_l`` (fp32 ``[HQ, T]``, or any matching shape), in one base."""

    m: torch.Tensor
    log_l: torch.Tensor


def _exp(x: torch.Tensor, base2: bool) -> torch.Tensor:
    return torch.exp2(x) if base2 else torch.exp(x)


def _log(x: torch.Tensor, base2: bool) -> torch.Tensor:
    return torch.log2(x) if base2 else torch.log(x)


def _top(part: Stats) -> torch.Tensor:
    """A part's maximum where it counts in the shift: ``m`` where it is finite and the part holds keys
    (``log_l > -inf``), else ``-inf``."""
    return torch.where(torch.isfinite(part.m) & (part.log_l != -math.inf), part.m, -math.inf)


def _shift(a: Stats, b: Stats) -> torch.Tensor:
    """The larger of the parts' ``_top``; 0 where neither has one (so no ``-inf - -inf`` or ``inf - inf`` is
    formed, and a keyless part's ``m`` never decides the shift)."""
    return torch.nan_to_num(torch.maximum(_top(a), _top(b)), neginf=0.0)


def _masses(a: Stats, b: Stats, base2: bool):
    """``(mass_a, mass_b, c)``: each part's denominator relative to the shift ``c`` (``_shift``)."""
    c = _shift(a, b)
    return _exp(a.m - c + a.log_l, base2), _exp(b.m - c + b.log_l, base2), c


def _weight(mass: torch.Tensor, z: torch.Tensor, part: Stats) -> torch.Tensor:
    """A part's share of the merged row; 0 for a part without keys (its ``o`` is 0, nothing to add). ``z = 0``
    (no keys and no sink anywhere) divides by 1 instead, so that autograd through a merge never forms
    ``0 / 0``."""
    return torch.where(part.log_l == -math.inf, 0.0, mass / torch.where(z == 0, 1.0, z))


def _per_row(w: torch.Tensor) -> torch.Tensor:
    """``[HQ, *T]`` -> ``[*T, HQ, 1]``, to scale the rows of a tokens-first ``[*T, HQ, D]`` tensor."""
    return w.movedim(0, -1).unsqueeze(-1)


def merge(o_a: torch.Tensor, a: Stats, o_b: torch.Tensor, b: Stats, base2: bool = False):
    """Two partial results over disjoint keys of the same rows -> ``(o, Stats)`` over their union.

    ``o_a``, ``o_b``: tokens first, ``[*T, HQ, D]`` (e.g. ``[T, HQ, D]``, or ``[n, R, HQ, D]``);
    ``a``, ``b``: their statistics ``[HQ, *T]``. ``o`` is a new tensor in ``o_a``'s dtype."""
    mass_a, mass_b, c = _masses(a, b, base2)
    z = mass_a + mass_b
    o = o_a * _per_row(_weight(mass_a, z, a)).to(o_a.dtype) + o_b * _per_row(_weight(mass_b, z, b)).to(o_a.dtype)
    return o, Stats(c, _log(z, base2))


def with_sink(o: torch.Tensor, stats: Stats, sinks: torch.Tensor | None, base2: bool = False):
    """The sink joins the softmax, once per call: ``o [*T, HQ, D]`` and ``stats [HQ, *T]`` over the keys
    -> ``(o, Stats)`` final, ``o`` scaled in place. ``sinks [HQ]``: raw logits (natural units), or None."""
    if sinks is None:
        return o, stats
    sink = sinks.float().view(-1, *([1] * (stats.m.dim() - 1)))
    sink = sink * LOG2E if base2 else sink
    c = _shift(stats, Stats(sink, torch.zeros_like(sink)))     # the sink is one key: its log_l is 0
    mass_keys = _exp(stats.m - c + stats.log_l, base2)
    z = mass_keys + _exp(sink - c, base2)
    return o.mul_(_per_row(_weight(mass_keys, z, stats)).to(o.dtype)), Stats(c, _log(z, base2))


def stats_of_lse(lse: torch.Tensor) -> Stats:
    """A result known by its ``lse`` alone (natural units, any shape) as ``Stats``: ``(lse, 0)``, and
    ``log_l = -inf`` where ``lse = -inf`` (no key)."""
    return Stats(lse, torch.where(lse == -math.inf, -math.inf, 0.0))


def lse_without_keys(sinks: torch.Tensor | None, shape, device) -> torch.Tensor:
    """fp32 ``shape [..., HQ]``: the ``lse`` of rows that see no key, their sink's logit (``with_sink`` of a
    keyless row), or ``-inf`` without sinks."""
    if sinks is None:
        return torch.full(shape, -math.inf, device=device)
    return sinks.float().expand(shape)


def lse_of(stats: Stats, base2: bool = False, sinks: torch.Tensor | None = None, keys: Stats | None = None
           ) -> torch.Tensor:
    """``lse = m + log_l`` in natural units (the public ``lse``), fp32. In base 2, the rows that saw no key
    (``keys``: the statistics ``with_sink`` joined, ``sinks`` its sinks) get their sink's logit itself: the
    base-2 round trip ``sink * log2(e) * ln(2)`` would miss it by a unit in the last place."""
    lse = stats.m + stats.log_l
    if not base2:
        return lse
    lse = lse * LN2
    if sinks is not None and keys is not None:
        lse = torch.where(keys.log_l == -math.inf, sinks.float().view(-1, *([1] * (lse.dim() - 1))), lse)
    return lse


def row_delta(do: torch.Tensor, o: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """``[HQ, T]`` fp32: ``Delta = <dO, o> - dlse`` from ``do``/``o`` of shape ``[T, HQ, D]``."""
    delta = torch.linalg.vecdot(do.float(), o.float()).t()
    if dlse is not None:
        delta = delta - dlse.float()
    return delta


def sink_mass(sinks: torch.Tensor, stats: Stats, base2: bool = False) -> torch.Tensor:
    """``[HQ, T]`` fp32: ``exp(sink - lse)``, the sink's probability in each row, formed from the final
    ``stats`` (``(sink - m) - log_l``: no ``lse`` rounded at ``ulp(|lse|)``); 0 where ``lse`` is infinite
    (a ``+inf`` sink, or no key and no sink)."""
    sink = sinks.float().unsqueeze(-1)
    sink = sink * LOG2E if base2 else sink
    return torch.where(torch.isinf(stats.m + stats.log_l), 0.0, _exp(sink - stats.m - stats.log_l, base2))


def dsinks_from(sinks: torch.Tensor, mass: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``[HQ]`` in the sinks' dtype: ``-sum_rows mass * Delta`` (``mass = sink_mass(...)``), fp32, summed in
    blocks of ``SUM_BLOCK`` rows, then over the blocks: one order whatever the thread count (a single long
    sum is split between threads, and its rounding with it)."""
    terms = mass * delta                                                        # [HQ, T]
    if terms.shape[-1] <= SUM_BLOCK:                                            # one block
        return (-terms.sum(-1)).to(sinks.dtype)
    pad = -terms.shape[-1] % SUM_BLOCK
    blocks = torch.nn.functional.pad(terms, (0, pad)).view(terms.shape[0], -1, SUM_BLOCK)
    return (-blocks.sum(-1).sum(-1)).to(sinks.dtype)


SUM_BLOCK = 4096
"""Rows per partial sum of ``dsinks_from``."""
