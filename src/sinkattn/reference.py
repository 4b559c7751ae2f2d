"""The float64 golden: docs/contract.md §1 implemented literally, one sequence at a time.

It materializes the ``[HQ, Lq, Lk]`` score matrix of each sequence, so it is for
checking, not for speed. Inputs of any float dtype are cast up to float64
first, so the golden sees exactly the low-precision values the backend saw.
Every sum runs over visible pairs only, so a NaN or inf in ``k`` or ``v`` reaches
exactly the rows that see its key (§1, "Non-finite keys and values").
"""

from __future__ import annotations

import torch

from .masks import Window

__all__ = ["forward", "backward", "gradients"]

_NEG_INF = float("-inf")


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        yield cq[b], cq[b + 1], ck[b], ck[b + 1]


def _visible_sum(p, x, vis):
    """``out[h, i] = sum over visible j of p[h, i, j] * x[h, j]``: ``p [HQ, Lq, Lk]`` (0 off ``vis [Lq, Lk]``),
    ``x [HQ, Lk, D]``. A NaN or inf of ``x`` enters only the sums of the rows that see its key: the
    product takes ``x`` with them zeroed, and each key holding one adds its terms on those rows alone."""
    bad = ~torch.isfinite(x)
    out = p @ torch.where(bad, 0.0, x)
    for j in bad.any(-1).any(0).nonzero().flatten().tolist():
        terms = p[:, :, j, None] * torch.where(bad[:, j], x[:, j], 0.0)[:, None, :]           # [HQ, Lq, D]
        out = out + torch.where(vis[None, :, j, None], terms, 0.0)
    return out


def _sequence_grads(p, delta, dob, qb, kb, vb, vis, softmax_scale, HKV):
    """One sequence's ``dq [Lq, HQ, D]``, ``dk [Lk, HKV, D]``, ``dv [Lk, HKV, Dv]`` from ``P [HQ, Lq, Lk]`` and
    ``Delta [HQ, Lq]``: ``dS = P (dP - Delta)``, every sum over visible pairs only (a NaN or inf of
    ``q``, ``k``, ``v`` or ``dO`` reaches the sums of the pairs that hold it), dk/dv summed over the group."""
    HQ, Lk = p.shape[0], p.shape[2]
    G = HQ // HKV
    ds = torch.where(vis, p * (dob @ vb.transpose(1, 2) - delta[..., None]), 0.0)          # [HQ, Lq, Lk]
    dq = softmax_scale * _visible_sum(ds, kb, vis)
    dk = softmax_scale * _visible_sum(ds.transpose(1, 2), qb, vis.t())
    dv = _visible_sum(p.transpose(1, 2), dob, vis.t())
    return dq.transpose(0, 1), *(x.view(HKV, G, Lk, x.shape[-1]).sum(1).transpose(0, 1) for x in (dk, dv))


def _probabilities(qb, kb, sink, scale, window: Window):
    """Per sequence: ``P [HQ, Lq, Lk]``, ``lse [HQ, Lq]`` in float64 and ``visible [Lq, Lk]``.

    ``qb [HQ, Lq, D]``, ``kb [HQ, Lk, D]`` (already expanded over the group),
    ``sink [HQ]`` float64 (``-inf`` for no sink).
    """
    HQ, Lq, _ = qb.shape
    Lk = kb.shape[1]
    dev = qb.device
    vis = window.visible(torch.arange(Lq, device=dev), torch.arange(Lk, device=dev), Lq, Lk)
    s = torch.where(vis, scale * qb @ kb.transpose(1, 2), _NEG_INF)           # [HQ, Lq, Lk]
    row_max = s.amax(-1) if Lk > 0 else torch.full((HQ, Lq), _NEG_INF, dtype=torch.float64, device=dev)
    m = torch.maximum(sink[:, None], row_max)                                  # sink joins the max
    # A +inf sink makes m infinite; shifting by the key max instead keeps exp finite.
    m_safe = torch.where(torch.isfinite(m), m, torch.where(torch.isfinite(row_max), row_max, 0.0))
    e = torch.exp(s - m_safe[..., None])
    z = torch.exp(sink[:, None] - m_safe) + e.sum(-1)                          # [HQ, Lq]
    p = torch.where(vis, e / z[..., None], 0.0)                                # no key -> 0
    lse = m_safe + torch.log(z)
    return p, lse, vis


def _per_sequence_inputs(q, k, v, sinks, s0, s1, t0, t1):
    HQ, HKV = q.shape[1], k.shape[1]
    G = HQ // HKV
    qb = q[s0:s1].double().transpose(0, 1)                                     # [HQ, Lq, D]
    kb = k[t0:t1].double().transpose(0, 1).repeat_interleave(G, 0)             # [HQ, Lk, D]
    vb = v[t0:t1].double().transpose(0, 1).repeat_interleave(G, 0)
    sink = sinks.double() if sinks is not None else torch.full((HQ,), _NEG_INF, dtype=torch.float64, device=q.device)
    return qb, kb, vb, sink


def forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, window: Window):
    """``out [Tq, HQ, D]`` and ``lse [HQ, Tq]``, both float64.

    ``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``, ``sinks [HQ]`` or None, ``window`` the mask.
    """
    Tq, HQ, D = q.shape
    out = torch.zeros(Tq, HQ, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((HQ, Tq), _NEG_INF, dtype=torch.float64, device=q.device)
    for s0, s1, t0, t1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        qb, kb, vb, sink = _per_sequence_inputs(q, k, v, sinks, s0, s1, t0, t1)
        p, lse_b, vis = _probabilities(qb, kb, sink, softmax_scale, window)
        out[s0:s1] = _visible_sum(p, vb, vis).transpose(0, 1)
        lse[:, s0:s1] = lse_b
    return out, lse


def backward(do, dlse, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, window: Window):
    """``(dq, dk, dv, dsinks)`` in float64, from ``do [Tq, HQ, D]`` and ``dlse [HQ, Tq]`` or None.

        dP = dO V^T,  Delta = <dO, o> - dlse,  dS = P (dP - Delta)
        dq = scale dS K,  dk = scale sum_group dS^T Q,  dv = sum_group P^T dO
        dsink_h = -sum_i exp(sink_h - lse_i) Delta_i   (0 where lse_i is infinite)
    """
    HQ, HKV = q.shape[1], k.shape[1]
    f64 = dict(dtype=torch.float64, device=q.device)
    dq, dk, dv = torch.zeros(q.shape, **f64), torch.zeros(k.shape, **f64), torch.zeros(v.shape, **f64)
    dsinks = torch.zeros(HQ, **f64)
    for s0, s1, t0, t1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        qb, kb, vb, sink = _per_sequence_inputs(q, k, v, sinks, s0, s1, t0, t1)
        p, lse_b, vis = _probabilities(qb, kb, sink, softmax_scale, window)
        dob = do[s0:s1].double().transpose(0, 1)                               # [HQ, Lq, D]
        ob = _visible_sum(p, vb, vis)
        delta = (dob * ob).sum(-1)
        if dlse is not None:
            delta = delta - dlse[:, s0:s1].double()
        dq[s0:s1], dk[t0:t1], dv[t0:t1] = _sequence_grads(p, delta, dob, qb, kb, vb, vis, softmax_scale, HKV)
        p_sink = torch.where(torch.isinf(lse_b), 0.0, torch.exp(sink[:, None] - lse_b))
        dsinks -= (p_sink * delta).sum(-1)
    return dq, dk, dv, dsinks


def gradients(do, delta, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window: Window):
    """``(dq, dk, dv)`` in float64 from given row statistics: ``delta`` and ``lse`` ``[HQ, Tq]`` (the final
    ones of each row, which may see keys outside this call), ``P = exp(S - lse)`` over the visible keys."""
    HKV = k.shape[1]
    f64 = dict(dtype=torch.float64, device=q.device)
    dq, dk, dv = torch.zeros(q.shape, **f64), torch.zeros(k.shape, **f64), torch.zeros(v.shape, **f64)
    for s0, s1, t0, t1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        qb, kb, vb, _ = _per_sequence_inputs(q, k, v, None, s0, s1, t0, t1)
        Lq, Lk = s1 - s0, t1 - t0
        vis = window.visible(torch.arange(Lq, device=q.device), torch.arange(Lk, device=q.device), Lq, Lk)
        s = softmax_scale * qb @ kb.transpose(1, 2)
        p = torch.where(vis, torch.exp(s - lse[:, s0:s1, None].double()), 0.0)
        dob = do[s0:s1].double().transpose(0, 1)
        dq[s0:s1], dk[t0:t1], dv[t0:t1] = _sequence_grads(p, delta[:, s0:s1].double(), dob, qb, kb, vb, vis,
                                                          softmax_scale, HKV)
    return dq, dk, dv
