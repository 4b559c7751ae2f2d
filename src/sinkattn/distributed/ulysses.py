"""``method="ulysses"``: trade sequence shards for head shards, attend locally, trade back.

Rank ``p`` of P gets query heads ``[p HQ/P, (p+1) HQ/P)`` (and their sinks) of the full
sequences by one all-to-all, runs one call of the op on them (the call settled already), and an
all-to-all returns each rank its own tokens of every head. KV heads follow their query heads:
``HKV/P`` each when ``P`` divides ``HKV``; when ``HKV < P`` (``HKV`` dividing ``P``) every rank
gets the one KV head of its query heads, each KV head sent to ``P/HKV`` ranks, and its gradients
summed back by autograd (a fixed-order sum over the copies). Other head counts are refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..call import Call
from .group import Group
from .layout import rank_order

__all__ = ["check_heads", "attention"]


def check_heads(HQ: int, HKV: int, P: int) -> None:
    if HQ % P:
        raise ValueError(f"method='ulysses' splits the query heads over the group: HQ={HQ} must be divisible "
                         f"by the group size P={P}; use method='ring' or a group whose size divides HQ")
    if HKV % P and P % HKV:
        raise ValueError(f"method='ulysses' needs the KV heads HKV={HKV} divisible by the group size P={P}, or P "
                         f"divisible by HKV (KV heads shared); use method='ring' for this head count")


class _AllToAll(torch.autograd.Function):
    """``[P, ...]``: block ``s`` goes to rank ``s``; block ``s`` of the result came from rank ``s``.
    Its own adjoint."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group.handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


def _kv_per_rank(x: torch.Tensor, P: int) -> torch.Tensor:
    """``[T, HKV, D]`` -> ``[T, P * H, D]``, block ``p`` of ``H`` heads the KV heads rank ``p`` needs."""
    T, HKV, D = x.shape
    if HKV % P == 0:
        return x
    return x.unsqueeze(2).expand(T, HKV, P // HKV, D).reshape(T, P, D)


def attention(q, k, v, sinks, lengths: list[int], group: Group, layout: str, call: Call):
    """Same contract as ``ring.attention``."""
    P, rank = group.size, group.rank
    T, HQ, D = q.shape
    order = rank_order(lengths, P, layout, q.device)
    inverse = torch.argsort(order)

    def to_heads(x):       # [T, P*H, E] local tokens -> [P*T, H, E] every token of block `rank`'s heads
        blocks = x.reshape(T, P, x.shape[1] // P, x.shape[2]).transpose(0, 1)
        got = _AllToAll.apply(blocks.contiguous(), group)
        return got.reshape(P * T, *got.shape[2:]).index_select(0, inverse)

    def to_tokens(y):      # inverse of to_heads
        got = _AllToAll.apply(y.index_select(0, order).reshape(P, T, *y.shape[1:]), group)
        return got.transpose(0, 1).reshape(T, P * y.shape[1], y.shape[2])

    qh, kh, vh = to_heads(q), to_heads(_kv_per_rank(k, P)), to_heads(_kv_per_rank(v, P))
    heads = slice(rank * HQ // P, (rank + 1) * HQ // P)
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(q.device)
    longest = max(lengths, default=0)
    o, lse, *_ = ops.attention(qh, kh, vh, sinks[heads] if sinks is not None else None, cu, cu, longest, longest,
                               call.softmax_scale, call.window, call.backend, call.needs_grad, check_cu_seqlens=False)
    return to_tokens(o.to(q.dtype)), to_tokens(lse.t().unsqueeze(-1)).squeeze(-1).t()
