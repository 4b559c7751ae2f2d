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
from . import buffers
from .layout import Span, group_views, write, zero_unwritten

__all__ = ["forward", "backward", "SLAB_ELEMENTS"]

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


def _stack_group(x: torch.Tensor, HKV: int) -> torch.Tensor:
    """``[N, HQ, R, D]`` -> ``[N, HKV, G*R, D]``: the group's heads stacked as rows."""
    N, HQ, R, D = x.shape
    return x.reshape(N, HKV, (HQ // HKV) * R, D)


def _unstack_group(x: torch.Tensor, HQ: int) -> torch.Tensor:
    """``[N, HKV, G*R, ...]`` -> ``[N, HQ, R, ...]``."""
    N, HKV, GR = x.shape[:3]
    return x.reshape(N, HQ, GR // (HQ // HKV), *x.shape[3:])


def _scores(qs, kb, vis, G: int, softmax_scale: float) -> torch.Tensor:
    """``S [N, HKV, G*R, K]`` fp32, ``-inf`` where not visible."""
    s = torch.matmul(qs, kb.transpose(-1, -2)).mul_(softmax_scale)
    if vis is not None:
        s.masked_fill_(~vis.repeat(G, 1), _NEG_INF)
    return s


def _exp_shifted(s: torch.Tensor, sink_rows: torch.Tensor | None):
    """``(E, m)`` with ``E = exp(S - m)``, ``m`` the row max joined by the sink, kept finite.

    ``sink_rows [N, HKV, G*R, 1]`` or None. A ``+inf`` sink shifts by the key max instead,
    a row without keys (and sink) by 0, so ``E`` never holds ``inf - inf``.
    """
    row_max = s.amax(-1, keepdim=True)
    m = row_max if sink_rows is None else torch.maximum(row_max, sink_rows)
    m = torch.where(torch.isfinite(m), m, row_max.masked_fill(~torch.isfinite(row_max), 0.0))
    return torch.exp(s - m), m


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right):
    """Same contract as ``cpu_fused.forward``: ``(o_keys [Tq, HQ, D], lse_keys [HQ, Tq])`` fp32."""
    Tq, HQ, D = q.shape
    HKV = k.shape[1]
    out = buffers.new((Tq, HQ, D), torch.float32, q.device)
    lse_keys = buffers.new((HQ, Tq), torch.float32, q.device)
    for n, Lq, Lk, (qg, og), (kg, vg), (lg,) in group_views(cu_seqlens_q, cu_seqlens_k, (q, out), (k, v),
                                                             (lse_keys,)):
        rows = Span()
        for r0, r1, k0, k1, vis in _blocks(n, HQ, Lq, Lk, left, right):
            s = _scores(_stack_group(qg[:, :, r0:r1], HKV), kg[:, :, k0:k1], vis, HQ // HKV, softmax_scale)
            e, m = _exp_shifted(s, None)
            z = e.sum(-1, keepdim=True)                           # 0 on rows without keys
            o = torch.matmul(e, vg[:, :, k0:k1]) / z
            o = o.masked_fill(z == 0, 0.0)
            fresh, _ = rows.take(r0, r1)
            og[:, :, fresh] = _unstack_group(o, HQ)
            lg[:, :, fresh] = _unstack_group((m + torch.log(z)).squeeze(-1), HQ)
        zero_unwritten(rows, Lq, og)
        zero_unwritten(rows, Lq, lg, value=_NEG_INF)
    return out, lse_keys


def backward(do, dlse, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right):
    """fp32 ``(dq, dk, dv)`` from fp32 ``do [Tq, HQ, D]``, ``dlse [HQ, Tq]`` or None, ``sinks [HQ]`` or None."""
    HQ, HKV = q.shape[1], k.shape[1]
    G = HQ // HKV
    sink_rows = None
    if sinks is not None:   # [HQ] -> [1, HKV, G, 1, 1], broadcast over the R rows of a block
        sink_rows = sinks.float().view(1, HKV, G, 1, 1)
    dq = buffers.new(q.shape, torch.float32, q.device)
    dk = buffers.new(k.shape, torch.float32, q.device)
    dv = buffers.new(v.shape, torch.float32, q.device)
    dlse = dlse.float() if dlse is not None else None
    for n, Lq, Lk, (qg, dog, dqg), (kg, vg, dkg, dvg), (dlg,) in group_views(
            cu_seqlens_q, cu_seqlens_k, (q, do, dq), (k, v, dk, dv), (dlse,)):
        rows_done, keys_done = Span(), Span()
        for r0, r1, k0, k1, vis in _blocks(n, HQ, Lq, Lk, left, right):
            qs = _stack_group(qg[:, :, r0:r1], HKV)
            kb, vb = kg[:, :, k0:k1], vg[:, :, k0:k1]
            s = _scores(qs, kb, vis, G, softmax_scale)                         # [N, HKV, G*R, K]
            sink_b = None
            if sink_rows is not None:
                sink_b = sink_rows.expand(n, HKV, G, r1 - r0, 1).reshape(n, HKV, G * (r1 - r0), 1)
            e, m = _exp_shifted(s, sink_b)
            z = e.sum(-1, keepdim=True)
            if sink_b is not None:
                z = z + torch.exp(sink_b - m)
            p = (e / z).masked_fill_(z == 0, 0.0)
            dos = _stack_group(dog[:, :, r0:r1], HKV)
            dp = torch.matmul(dos, vb.transpose(-1, -2))
            delta = (p * dp).sum(-1, keepdim=True)
            if dlg is not None:
                delta = delta - _stack_group(dlg[:, :, r0:r1, None], HKV)
            ds = p * (dp - delta)
            fresh, _ = rows_done.take(r0, r1)
            dqg[:, :, fresh] = _unstack_group(torch.matmul(ds, kb).mul_(softmax_scale), HQ)
            fresh, seen = keys_done.take(k0, k1)
            write(dkg, torch.matmul(ds.transpose(-1, -2), qs).mul_(softmax_scale), k0, fresh, seen)
            write(dvg, torch.matmul(p.transpose(-1, -2), dos), k0, fresh, seen)
        zero_unwritten(rows_done, Lq, dqg)
        zero_unwritten(keys_done, Lk, dkg, dvg)
    return dq, dk, dv
