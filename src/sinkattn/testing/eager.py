"""Eager sink attention as Hugging Face's gpt-oss model computes it, for comparisons.

Per sequence, in the input dtype: scores ``[HQ, Lq, Lk]`` materialized with K/V
repeated over the group, masked, the sink appended as one more logit column,
max-subtracted softmax, the sink column dropped, then ``P @ V``. This is the
O(L^2)-memory baseline of the benchmarks and of Gate B; it is not a backend.
"""

from __future__ import annotations

import torch

from .. import defaults, masks

__all__ = ["sink_attention_dense", "sink_attention_varlen"]


def sink_attention_dense(q, k, v, sinks=None, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """``q [B, Sq, HQ, D]``, ``k``/``v [B, Sk, HKV, D]`` -> ``(out [B, Sq, HQ, D], lse [B, HQ, Sq])``.

    Differentiable through torch autograd; everything stays in q's dtype.
    """
    B, Sq, HQ, D = q.shape
    Sk, HKV = k.shape[1], k.shape[2]
    scale = defaults.softmax_scale(D, softmax_scale)
    window = masks.Window.of(causal, window_size)
    qh = q.transpose(1, 2)                                                     # [B, HQ, Sq, D]
    kh = k.transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)                 # [B, HQ, Sk, D]
    vh = v.transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
    scores = torch.matmul(qh, kh.transpose(2, 3)) * scale                      # [B, HQ, Sq, Sk]
    vis = window.visible(torch.arange(Sq, device=q.device), torch.arange(Sk, device=q.device), Sq, Sk)
    scores = scores.masked_fill(~vis, float("-inf"))
    sink_col = (sinks.to(q.dtype) if sinks is not None else torch.full((HQ,), float("-inf"), dtype=q.dtype,
                                                                      device=q.device))
    logits = torch.cat([scores, sink_col.reshape(1, HQ, 1, 1).expand(B, HQ, Sq, 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    out = torch.matmul(probs, vh).transpose(1, 2)
    return out, lse


def sink_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks=None, softmax_scale=None,
                          causal=False, window_size=(-1, -1)):
    """Packed layout: ``q [Tq, HQ, D]`` -> ``(out [Tq, HQ, D], lse [HQ, Tq])``, one sequence at a time."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        o, lse = sink_attention_dense(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                                      sinks, softmax_scale, causal, window_size)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)
