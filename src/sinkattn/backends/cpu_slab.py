"""CPU path that computes each block of query rows against all of its visible keys at once.

Per block of ``R`` rows (all ``G`` heads of a KV head stacked, K/V not copied):

    S  = scale * Q_blk K_vis^T                      [N, HKV, G*R, K]  (masked: -inf)
    m  = max(sink, max_j S),  E = exp(S - m),  Z = exp(sink - m) + sum_j E
    forward:  lse_keys = m + log sum_j E,  o_keys = E V / sum_j E
    backward: P = E / Z,  dP = dO V^T,  Delta = sum_j P dP - dlse,
              dS = P (dP - Delta),  dq = scale dS K,  dk = scale dS^T Q,  dv = P^T dO

The backward rebuilds ``P`` from the row maximum, as the forward did, rather
than from a stored ``lse`` (whose fp32 rounding, ``ulp(|lse|)``, would turn a
one-hot ``P = 1`` into ``1 - 3e-5`` once scores reach the hundreds), and sums
``Delta`` from the very ``P`` and ``dP`` the gradients use. Rows whose
attention is nearly one-hot then keep their exact zeros (``dP_ij - Delta_i``
cancels), and scores of any magnitude never give ``P > 1``. The fused kernel's
``P = exp(S - lse)`` and ``Delta = <dO, o>`` lose both properties at such
scores; ``sinkattn.backends.cpu`` sends those inputs here. Blocks hold ``N*HQ*R*K <= SLAB_ELEMENTS`` scores, never
a whole ``Lq x Lk`` matrix.
"""

from __future__ import annotations

import torch

from .. import masks
from .layout import Span, group_views, write, zero_unwritten
from .nonfinite import visible_matmul

__all__ = ["forward", "backward", "block_forward", "block_backward", "stack_group", "unstack_group", "sink_rows",
           "SLAB_ELEMENTS"]

SLAB_ELEMENTS = 1 << 22
"""Scores per block (fp32: 16 MiB), which sets the number of rows per block."""

_NEG_INF = float("-inf")


def _blocks(n: int, HQ: int, Lq: int, Lk: int, left: int, right: int):
    """Yield ``(r0, r1, k0, k1, vis)`` per block of rows; ``vis`` bool ``[R, K]`` or None if all visible."""
    span = Lk if left < 0 or right < 0 else min(Lk, left + right + 1)
    rows = max(16, SLAB_ELEMENTS // max(1, n * HQ * span))
    for r0, r1, k0, k1, full in masks.row_blocks(Lq, Lk, left, right, rows):
        vis = None if full else masks.visible(torch.arange(r0, r1), torch.arange(k0, k1), Lq, Lk, left, right)
        yield r0, r1, k0, k1, vis


def stack_group(x: torch.Tensor, HKV: int) -> torch.Tensor:
    """``[N, HQ, R, ...]`` -> ``[N, HKV, G*R, ...]``: the group's heads stacked as rows."""
    N, HQ, R = x.shape[:3]
    return x.reshape(N, HKV, (HQ // HKV) * R, *x.shape[3:])


def unstack_group(x: torch.Tensor, HQ: int) -> torch.Tensor:
    """``[N, HKV, G*R, ...]`` -> ``[N, HQ, R, ...]``."""
    N, HKV, GR = x.shape[:3]
    return x.reshape(N, HQ, GR // (HQ // HKV), *x.shape[3:])


def _scores(qs, kb, mask, softmax_scale: float) -> torch.Tensor:
    """``S [N, HKV, G*R, K]`` fp32, ``-inf`` where ``mask`` (broadcastable, or None) is False."""
    s = torch.matmul(qs, kb.transpose(-1, -2)).mul_(softmax_scale)
    if mask is not None:
        s.masked_fill_(~mask, _NEG_INF)
    return s


def _exp_shifted(s: torch.Tensor, sink_rows: torch.Tensor | None):
    """``(E, m)`` with ``E = exp(S - m)``, ``m`` the row max joined by the sink, kept finite.

    ``sink_rows [N, HKV, G*R, 1]`` or None. A ``+inf`` sink does not join the max (it shifts by the
    key max), and a non-finite ``m`` (a row without keys or finite sink, a NaN) becomes 0, so ``E``
    never holds ``inf - inf``.
    """
    m = s.amax(-1, keepdim=True)
    if sink_rows is not None:
        m = torch.maximum(m, sink_rows.masked_fill(sink_rows == float("inf"), _NEG_INF))
    m = torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.exp(s - m), m


def sink_rows(sinks: torch.Tensor | None, HKV: int, R: int) -> torch.Tensor | None:
    """``sinks [HQ]`` -> fp32 ``[1, HKV, G*R, 1]``: each stacked row's sink (``stack_group`` order)."""
    if sinks is None:
        return None
    G = sinks.shape[0] // HKV
    rows = sinks.float().view(1, HKV, G, 1)
    return rows if R == 1 else rows[..., None].expand(1, HKV, G, R, 1).reshape(1, HKV, G * R, 1)


def _denominator(e: torch.Tensor, m: torch.Tensor, sink_rows: torch.Tensor | None) -> torch.Tensor:
    """``Z = exp(sink - m) + sum_j E`` (no sink term without sinks): 0 for a row without keys or sink,
    else at least 1 (the row's maximum, key or sink, contributes ``exp(0)``), or inf / NaN."""
    z = e.sum(-1, keepdim=True)
    return z if sink_rows is None else z + torch.exp(sink_rows - m)


def block_forward(qs, kb, vb, mask, softmax_scale: float, literal: bool = False, sink_rows=None):
    """Rows against their keys, scores materialized: ``(o [N, HKV, G*R, D], lse [N, HKV, G*R])``.

    ``qs [N, HKV, G*R, D]`` (the group's heads stacked, ``stack_group``), ``kb``/``vb [N, HKV, K, D]``,
    ``mask`` bool broadcastable to ``[N, HKV, G*R, K]`` or None (all visible). Without ``sink_rows``
    the softmax over the visible keys only (``lse_keys = -inf``, ``o = 0`` on rows that see none);
    with them (``sink_rows``) the sink joins it and ``o``, ``lse`` are final. ``literal``: ``vb`` may
    hold NaN / inf, which then reach the rows that see their key only (``nonfinite``).
    """
    s = _scores(qs, kb, mask, softmax_scale)
    e, m = _exp_shifted(s, sink_rows)
    z = _denominator(e, m, sink_rows)
    o = (visible_matmul(e, vb, mask) if literal else torch.matmul(e, vb)).div_(z.clamp(min=1.0))   # 0 / 1: no key
    return o, (m + torch.log(z)).squeeze(-1)


def block_backward(qs, kb, vb, dos, dl, sink_rows, mask, softmax_scale: float, literal: bool = False):
    """Gradients of one block, ``P`` rebuilt from the row maximum: ``(dq_s, dk, dv)``.

    ``qs``/``dos [N, HKV, G*R, D]`` stacked, ``kb``/``vb [N, HKV, K, D]``, ``dl [N, HKV, G*R, 1]`` or
    None (the stacked ``dlse``), ``sink_rows [N, HKV, G*R, 1]`` or None, ``mask`` as in
    ``block_forward``. Returns ``dq_s [N, HKV, G*R, D]`` (stacked) and ``dk``/``dv [N, HKV, K, D]``
    summed over the group, all fp32. ``literal``: ``kb``/``vb`` may hold NaN / inf; every term of a
    pair a row does not see is then held at 0, so they reach the sums of the visible pairs only.
    """
    s = _scores(qs, kb, mask, softmax_scale)                              # [N, HKV, G*R, K]
    e, m = _exp_shifted(s, sink_rows)
    p = e / _denominator(e, m, sink_rows).clamp(min=1.0)                  # 0 / 1 on rows without keys
    dp = torch.matmul(dos, vb.transpose(-1, -2))
    guard = literal and mask is not None
    if guard:
        p, dp = p.masked_fill(~mask, 0.0), dp.masked_fill(~mask, 0.0)
    delta = (p * dp).sum(-1, keepdim=True)
    if dl is not None:
        delta = delta - dl
    ds = p * (dp - delta)
    if guard:
        ds = ds.masked_fill_(~mask, 0.0)
    dq = (visible_matmul(ds, kb, mask) if literal else torch.matmul(ds, kb)).mul_(softmax_scale)
    dk = torch.matmul(ds.transpose(-1, -2), qs).mul_(softmax_scale)
    dv = torch.matmul(p.transpose(-1, -2), dos)
    return dq, dk, dv


def forward(q, k, v, runs, out, lse_keys, softmax_scale, left, right, literal=False):
    """Fill ``out [Tq, HQ, D]`` and ``lse_keys [HQ, Tq]`` (fp32) on the rows of ``runs``
    (``layout.Run``), as ``cpu_fused.forward`` does; ``literal`` as in ``block_forward``."""
    HQ, HKV = q.shape[1], k.shape[1]
    for n, Lq, Lk, (qg, og), (kg, vg), (lg,) in group_views(runs, (q, out), (k, v), (lse_keys,)):
        rows = Span()
        for r0, r1, k0, k1, vis in _blocks(n, HQ, Lq, Lk, left, right):
            mask = None if vis is None else vis.repeat(HQ // HKV, 1)
            o, lse = block_forward(stack_group(qg[:, :, r0:r1], HKV), kg[:, :, k0:k1], vg[:, :, k0:k1], mask,
                                   softmax_scale, literal)
            fresh, _ = rows.take(r0, r1)
            og[:, :, fresh] = unstack_group(o, HQ)
            lg[:, :, fresh] = unstack_group(lse, HQ)
        zero_unwritten(rows, Lq, og)
        zero_unwritten(rows, Lq, lg, value=_NEG_INF)


def backward(do, dlse, q, k, v, sinks, runs, dq, dk, dv, softmax_scale, left, right, literal=False):
    """Fill fp32 ``dq``, ``dk``, ``dv`` on the tokens of ``runs`` from fp32 ``do [Tq, HQ, D]``,
    ``dlse [HQ, Tq]`` or None, ``sinks [HQ]`` or None."""
    HQ, HKV = q.shape[1], k.shape[1]
    G = HQ // HKV
    dlse = dlse.float() if dlse is not None else None
    for n, Lq, Lk, (qg, dog, dqg), (kg, vg, dkg, dvg), (dlg,) in group_views(
            runs, (q, do, dq), (k, v, dk, dv), (dlse,)):
        rows_done, keys_done = Span(), Span()
        for r0, r1, k0, k1, vis in _blocks(n, HQ, Lq, Lk, left, right):
            dl = stack_group(dlg[:, :, r0:r1, None], HKV) if dlg is not None else None
            mask = None if vis is None else vis.repeat(G, 1)
            dq_s, dk_b, dv_b = block_backward(stack_group(qg[:, :, r0:r1], HKV), kg[:, :, k0:k1], vg[:, :, k0:k1],
                                              stack_group(dog[:, :, r0:r1], HKV), dl, sink_rows(sinks, HKV, r1 - r0),
                                              mask, softmax_scale, literal)
            fresh, _ = rows_done.take(r0, r1)
            dqg[:, :, fresh] = unstack_group(dq_s, HQ)
            fresh, seen = keys_done.take(k0, k1)
            write(dkg, dk_b, k0, fresh, seen)
            write(dvg, dv_b, k0, fresh, seen)
        zero_unwritten(rows_done, Lq, dqg)
        zero_unwritten(keys_done, Lk, dkg, dvg)
