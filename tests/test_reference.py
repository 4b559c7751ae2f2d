"""The float64 golden against a second, independent formulation: the sink appended as one
more logit column, a plain softmax, the column dropped, gradients by torch autograd."""

import math

import pytest
import torch

from sinkattn import reference
from sinkattn.masks import Window

pytestmark = pytest.mark.floor   # also run on the oldest supported torch (.ci/floor)


def _concat_column_attention(q, k, v, sinks, cu_q, cu_k, scale, causal, window):
    """Per sequence, written from docs/contract.md §1 without sharing code with the library."""
    outs, lses = [], []
    HQ, HKV = q.shape[1], k.shape[1]
    left, right = window
    if causal:
        right = 0
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        kb = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        vb = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        Lq, Lk = qb.shape[1], kb.shape[1]
        i = torch.arange(Lq)[:, None] + (Lk - Lq)
        j = torch.arange(Lk)[None, :]
        ok = torch.ones(Lq, Lk, dtype=torch.bool)
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        logits = (qb @ kb.transpose(1, 2) * scale).masked_fill(~ok, -math.inf)
        col = sinks.reshape(HQ, 1, 1).expand(HQ, Lq, 1)
        full = torch.cat([logits, col], dim=-1)
        probs = torch.softmax(full, dim=-1)[..., :Lk]
        outs.append((probs @ vb).transpose(0, 1))
        lses.append(torch.logsumexp(full, dim=-1))
    return torch.cat(outs, 0), torch.cat(lses, 1)


CASES = [
    # (q_lens, k_lens, HQ, HKV, D, causal, window)
    ([33], [33], 4, 2, 16, True, (-1, -1)),
    ([40, 7, 19], [40, 30, 5], 6, 3, 8, True, (-1, -1)),
    ([25], [50], 4, 1, 8, False, (-1, -1)),
    ([50], [25], 2, 2, 8, True, (-1, -1)),
    ([64], [64], 4, 2, 8, True, (9, 0)),
    ([45, 12], [30, 12], 4, 4, 8, False, (4, 6)),
    ([30], [30], 8, 2, 4, False, (-1, 3)),
]


@pytest.mark.parametrize("q_lens,k_lens,HQ,HKV,D,causal,window", CASES)
@pytest.mark.parametrize("with_lse_grad", [False, True])
def test_reference_matches_concatenated_column(q_lens, k_lens, HQ, HKV, D, causal, window, with_lse_grad):
    g = torch.Generator().manual_seed(len(q_lens) * 100 + HQ + D)
    Tq, Tk = sum(q_lens), sum(k_lens)
    q = torch.randn(Tq, HQ, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(Tk, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(Tk, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = (2 * torch.randn(HQ, generator=g, dtype=torch.float64)).requires_grad_()
    do = torch.randn(Tq, HQ, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(HQ, Tq, generator=g, dtype=torch.float64) if with_lse_grad else None
    cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    scale = 1 / math.sqrt(D)

    out2, lse2 = _concat_column_attention(q, k, v, sinks, cu_q, cu_k, scale, causal, window)
    loss = (out2 * do).sum() + ((lse2 * dlse).sum() if dlse is not None else 0)
    grads2 = torch.autograd.grad(loss, (q, k, v, sinks))

    args = (q.detach(), k.detach(), v.detach(), sinks.detach(), torch.tensor(cu_q, dtype=torch.int32),
            torch.tensor(cu_k, dtype=torch.int32), scale, Window.of(causal, window))
    out, lse = reference.forward(*args)
    grads = reference.backward(do, dlse, *args)
    torch.testing.assert_close(out, out2.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse2.detach(), rtol=0, atol=1e-12)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, grads2):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


def test_reference_special_rows_follow_the_contract():
    """Rows with no key: o = 0, lse = sink (or -inf); +inf sink: o = 0, lse = +inf, zero grads."""
    q = torch.randn(6, 2, 4, dtype=torch.float64)
    k = torch.randn(2, 1, 4, dtype=torch.float64)
    v = torch.randn(2, 1, 4, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    sinks = torch.tensor([0.5, float("inf")], dtype=torch.float64)
    out, lse = reference.forward(q, k, v, sinks, cu_q, cu_k, 0.5, Window(-1, 0))  # causal, Lq > Lk: rows 0..3 empty
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    assert torch.equal(lse[0, :4], torch.full((4,), 0.5, dtype=torch.float64))
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1])) and bool((lse[1] == math.inf).all())
    dq, dk, dv, ds = reference.backward(torch.randn(6, 2, 4, dtype=torch.float64), None, q, k, v, sinks,
                                        cu_q, cu_k, 0.5, Window(-1, 0))
    assert torch.equal(dq[:4], torch.zeros_like(dq[:4])) and torch.equal(dq[:, 1], torch.zeros_like(dq[:, 1]))
    assert ds[1] == 0
    assert not any(torch.isnan(t).any() for t in (out, lse, dq, dk, dv, ds))
    out_n, lse_n = reference.forward(q, k, v, None, cu_q, cu_k, 0.5, Window(-1, 0))
    assert bool((lse_n[:, :4] == -math.inf).all()) and torch.equal(out_n[:4], torch.zeros_like(out_n[:4]))
