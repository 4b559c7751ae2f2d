"""``method="ulysses"``: trade sequence shards for head shards, attend locally, trade back.

Rank ``p`` of P gets query heads ``[p HQ/P, (p+1) HQ/P)`` (and their sinks) of the full
sequences by one all-to-all, runs one call of the op on them (the call settled already), and an
all-to-all returns each rank its own tokens of every head. KV heads follow their query heads:
``HKV/P`` each when ``P`` divides ``HKV``; when ``HKV < P`` (``HKV`` dividing ``P``) every rank
gets the one KV head of its query heads, each KV head sent to ``P/HKV`` ranks. Other head counts
are refused.

Backward: every query head lives on one rank, so its dq is complete there and goes home in q's
dtype; so do dk/dv when ``P`` divides ``HKV``. A KV head shared by ``P/HKV`` ranks has a partial
dk/dv on each (its query heads on that rank only): the op returns them in fp32 (``fp32_grads``), an
fp32 all-to-all brings them home (for fp16 / bf16 inputs, twice the bytes of the exchange in the
input dtype), and each head's copies are summed in fp32 in rank order and rounded once (``_Local``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import autodiff, ops
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


def _sum_copies(g: torch.Tensor, HKV: int) -> torch.Tensor:
    """Inverse of ``_kv_per_rank`` for gradients: ``[T, P, D]`` (block ``p`` from rank ``p``) -> ``[T, HKV, D]``,
    each KV head's ``P/HKV`` copies summed in rank order."""
    T, P, D = g.shape
    copies = g.view(T, HKV, P // HKV, D)
    total = copies[:, :, 0]
    for c in range(1, P // HKV):
        total = total + copies[:, :, c]
    return total


class _Local(torch.autograd.Function):
    """This rank's call of the op on its query heads: ``qh [P*T, HQ/P, D]`` (every token), ``k``, ``v
    [T, HKV, D]`` this rank's tokens of every KV head, sent to the ranks of their query heads here by
    ``to_heads`` (``_kv_per_rank``). Returns the op's ``(o, lse)`` on the head shard.

    Its backward runs the op's, with fp32 gradients where a KV head is shared (``HKV < P``), and brings
    dk/dv home by ``to_tokens``: in fp32 and summed over the copies there (``_sum_copies``), rounded once to
    k's and v's dtypes. (Autograd would cast the op's dk/dv to the dtype of its inputs, so the partial sums
    cannot reach the copies' sum in fp32 through the op's own autograd and ``expand``.)"""

    @staticmethod
    def forward(ctx, qh, k, v, sinks, to_heads, to_tokens, P: int, cu, longest: int, call: Call):
        kh, vh = to_heads(_kv_per_rank(k, P)), to_heads(_kv_per_rank(v, P))
        o, lse, m, log_l = ops.attention(qh, kh, vh, sinks, cu, cu, longest, longest, call.softmax_scale,
                                         call.window, call.backend, needs_grad=False, check_cu_seqlens=False,
                                         for_backward=call.needs_grad)
        ctx.save_for_backward(qh, kh, vh, sinks, o, m, log_l, cu)
        ctx.setup = (to_tokens, P, k.shape[1], longest, call, k.dtype, v.dtype)
        ctx.set_materialize_grads(False)      # an unused lse hands None, not zeros to read
        return o, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        autodiff.refuse_double_backward()       # the same on every rank: before any communication
        qh, kh, vh, sinks, o, m, log_l, cu = ctx.saved_tensors
        to_tokens, P, HKV, longest, call, k_dtype, v_dtype = ctx.setup
        shared = HKV % P != 0
        # dout holds q-dtype values (the public output is o cast to q's dtype): cast back exactly
        dout = torch.zeros_like(o, dtype=qh.dtype) if dout is None else dout.to(qh.dtype).contiguous()
        dq, dkh, dvh, dsinks = ops.backward(dout, dlse, qh, kh, vh, sinks, o, m, log_l, cu, cu, longest, longest,
                                            call.softmax_scale, call.window.left, call.window.right, call.backend,
                                            False, shared)
        dk, dv = to_tokens(dkh), to_tokens(dvh)
        if shared:
            dk, dv = _sum_copies(dk, HKV).to(k_dtype), _sum_copies(dv, HKV).to(v_dtype)
        return dq.to(qh.dtype), dk, dv, dsinks if sinks is not None else None, *(None,) * 6


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

    heads = slice(rank * HQ // P, (rank + 1) * HQ // P)
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(q.device)
    o, lse = _Local.apply(to_heads(q), k, v, sinks[heads] if sinks is not None else None, to_heads, to_tokens, P,
                          cu, max(lengths, default=0), call)
    return to_tokens(o.to(q.dtype)), to_tokens(lse.t().unsqueeze(-1)).squeeze(-1).t()
