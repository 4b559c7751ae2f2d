"""CPU backend: PyTorch's fused flash-attention CPU kernel, driven tile by tile, plus the sink.

The fused kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) streams
keys in tiles with an online softmax, handles GQA without copying K/V, returns
the log-sum-exp over keys and has a matching backward that takes that
log-sum-exp as input. Sinks enter around it (see ``sinkattn.sink``):

* forward: ``lse = logaddexp(lse_keys, sink)``, ``o = exp(lse_keys - lse) * o_keys``;
* backward: the kernel's backward fed ``out = o`` and ``logsumexp = lse`` (both
  with the sink) recomputes ``P = exp(S - lse)``, the sink probabilities, and
  ``Delta = <dO, o>``, which is exactly the sink attention backward. A ``dlse``
  term is carried by one extra head-dim column: ``q, k += [0]``, ``v += [1]``,
  ``dO += [dlse]``, ``o += [0]`` adds ``dlse_i`` to every ``dP_ij``, i.e.
  ``Delta_i -> <dO_i, o_i> - dlse_i``.

Masks are mapped onto the kernel per sequence (``_plan``): full attention is one
call; causal attention is one top-left-causal call on the square diagonal part
plus, when ``Lk > Lq``, one unmasked call on the keys every row sees; anything
else (sliding windows, right windows) is cut into blocks of ``BM`` query rows,
each given only its visible key range and a small additive mask where the block
is partly visible. Blocks outside the limits are never computed. Partial results
over the same rows are merged by their log-sum-exp.

Every input dtype is computed in fp32 (fp16/bf16 are cast up once: the fp32
kernel is also far faster on CPUs without bf16 matrix units); dK/dV partial
sums are added in fp32 in a fixed order, so results are bitwise reproducible.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import masks, sink
from .capabilities import Capabilities

__all__ = ["CAPABILITIES", "forward", "backward", "BLOCK_M"]

CAPABILITIES = Capabilities(
    name="cpu",
    device_types=frozenset({"cpu"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_dim=256,
)

BLOCK_M = 128
"""Query rows per block on the tiled (windowed) path."""

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class _Part:
    """Rows ``[r0, r1)`` against keys ``[k0, k1)`` of one sequence."""

    r0: int
    r1: int
    k0: int
    k1: int
    causal: bool = False               # top-left causal on a square part
    mask: torch.Tensor | None = None   # additive fp32 [r1 - r0, k1 - k0], 0 or -inf
    has_key: torch.Tensor | None = None  # bool [r1 - r0]: row sees a key in this part
    merge: bool = False                # rows already hold a partial result


@functools.lru_cache(maxsize=512)
def _plan(Lq: int, Lk: int, left: int, right: int, block_m: int) -> tuple[_Part, ...]:
    """The kernel calls that cover exactly the visible (i, j) pairs of one sequence."""
    if Lq == 0 or Lk == 0:
        return ()
    if left < 0 and right < 0:
        return (_Part(0, Lq, 0, Lk),)
    offset = Lk - Lq
    if left < 0 and right == 0:
        if offset < 0:                 # rows [0, -offset) see no key
            return (_Part(-offset, Lq, 0, Lk, causal=True),)
        diagonal = _Part(0, Lq, offset, Lk, causal=True, merge=offset > 0)
        return ((_Part(0, Lq, 0, offset),) if offset > 0 else ()) + (diagonal,)
    parts = []
    for r0 in range(0, Lq, block_m):
        r1 = min(r0 + block_m, Lq)
        k0, k1 = masks.block_key_range(r0, r1, Lq, Lk, left, right)
        if k1 <= k0:
            continue
        if masks.block_fully_visible(r0, r1, k0, k1, Lq, Lk, left, right):
            parts.append(_Part(r0, r1, k0, k1))
            continue
        vis = masks.visible(torch.arange(r0, r1), torch.arange(k0, k1), Lq, Lk, left, right)
        mask = torch.zeros(vis.shape).masked_fill_(~vis, _NEG_INF)
        parts.append(_Part(r0, r1, k0, k1, mask=mask, has_key=vis.any(1)))
    return tuple(parts)


def _groups(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """Yield ``(t_q, t_k, N, Lq, Lk)``: runs of N sequences that share their lengths.

    A dense batch is one run; other packed batches go one sequence at a time.
    """
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    n = len(cq) - 1
    lq = {cq[b + 1] - cq[b] for b in range(n)}
    lk = {ck[b + 1] - ck[b] for b in range(n)}
    if n > 0 and len(lq) == 1 and len(lk) == 1:
        yield 0, 0, n, lq.pop(), lk.pop()
        return
    for b in range(n):
        yield cq[b], ck[b], 1, cq[b + 1] - cq[b], ck[b + 1] - ck[b]


def _heads_first(x: torch.Tensor, t0: int, n: int, length: int) -> torch.Tensor:
    """``x [T, H, D]`` -> view ``[N, H, L, D]`` of tokens ``[t0, t0 + N*L)``."""
    return x[t0:t0 + n * length].view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)


def _stat_view(stat: torch.Tensor, t0: int, n: int, length: int) -> torch.Tensor:
    """``stat [H, T]`` -> view ``[N, H, L]`` of tokens ``[t0, t0 + N*L)``."""
    return stat[:, t0:t0 + n * length].view(stat.shape[0], n, length).transpose(0, 1)


def forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right):
    """Sink attention forward.

    Args: ``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]`` (one float dtype),
    ``sinks [HQ]`` or None, ``cu_seqlens_* int32 [N+1]``.
    Returns ``(out [Tq, HQ, D] fp32, lse [HQ, Tq] fp32)``; the caller casts ``out``.
    """
    q32, k32, v32 = q.float(), k.float(), v.float()
    Tq, HQ, D = q.shape
    out = torch.zeros(Tq, HQ, D, dtype=torch.float32)
    lse_keys = torch.full((HQ, Tq), _NEG_INF, dtype=torch.float32)
    for tq, tk, n, Lq, Lk in _groups(cu_seqlens_q, cu_seqlens_k):
        qg, kg, vg = _heads_first(q32, tq, n, Lq), _heads_first(k32, tk, n, Lk), _heads_first(v32, tk, n, Lk)
        og, lg = _heads_first(out, tq, n, Lq), _stat_view(lse_keys, tq, n, Lq)
        for part in _plan(Lq, Lk, left, right, BLOCK_M):
            rows, keys = slice(part.r0, part.r1), slice(part.k0, part.k1)
            o_p, lse_p = _FWD(qg[:, :, rows], kg[:, :, keys], vg[:, :, keys], 0.0, part.causal,
                              attn_mask=part.mask, scale=softmax_scale)      # [N, HQ, r, D], [N, HQ, r]
            if part.has_key is not None:   # the kernel reports lse 0 for fully masked rows
                lse_p = lse_p.masked_fill(~part.has_key, _NEG_INF)
            if part.merge:
                lse_new = torch.logaddexp(lg[:, :, rows], lse_p)
                og[:, :, rows] = (og[:, :, rows] * sink.key_mass(lg[:, :, rows], lse_new)[..., None]
                                  + o_p * sink.key_mass(lse_p, lse_new)[..., None])
                lse_p = lse_new
            else:
                og[:, :, rows] = o_p
            lg[:, :, rows] = lse_p
    lse = sink.lse_with_sink(lse_keys, sinks)
    out *= sink.key_mass(lse_keys, lse).t()[..., None]
    return out, lse


def backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right):
    """Sink attention backward.

    Args: ``do [Tq, HQ, D]``, ``dlse [HQ, Tq]`` or None, the forward's inputs,
    ``out [Tq, HQ, D]`` and ``lse [HQ, Tq]`` fp32 from ``forward``.
    Returns ``(dq, dk, dv)`` fp32 shaped like ``q, k, v`` and ``dsinks [HQ]``
    (sinks' dtype) or None.
    """
    q32, k32, v32, do32, o32 = q.float(), k.float(), v.float(), do.float(), out.float()
    delta = sink.row_delta(do32, o32, dlse) if sinks is not None else None
    if dlse is not None:
        q32, k32, o32 = F.pad(q32, (0, 1)), F.pad(k32, (0, 1)), F.pad(o32, (0, 1))
        v32 = F.pad(v32, (0, 1), value=1.0)
        do32 = torch.cat([do32, dlse.float().t()[..., None]], dim=-1)
    # exp(S - lse) must be 0 on rows that see nothing; -inf - (-inf) would give NaN.
    lse_kernel = lse.masked_fill(lse == _NEG_INF, float("inf"))
    dq = torch.zeros(q32.shape, dtype=torch.float32)
    dk = torch.zeros(k32.shape, dtype=torch.float32)
    dv = torch.zeros(v32.shape, dtype=torch.float32)
    for tq, tk, n, Lq, Lk in _groups(cu_seqlens_q, cu_seqlens_k):
        qg, kg, vg = _heads_first(q32, tq, n, Lq), _heads_first(k32, tk, n, Lk), _heads_first(v32, tk, n, Lk)
        dog, og = _heads_first(do32, tq, n, Lq), _heads_first(o32, tq, n, Lq)
        lg = _stat_view(lse_kernel, tq, n, Lq)
        dqg, dkg, dvg = _heads_first(dq, tq, n, Lq), _heads_first(dk, tk, n, Lk), _heads_first(dv, tk, n, Lk)
        for part in _plan(Lq, Lk, left, right, BLOCK_M):
            rows, keys = slice(part.r0, part.r1), slice(part.k0, part.k1)
            dq_p, dk_p, dv_p = _BWD(dog[:, :, rows], qg[:, :, rows], kg[:, :, keys], vg[:, :, keys],
                                    og[:, :, rows], lg[:, :, rows].contiguous(), 0.0, part.causal,
                                    attn_mask=part.mask, scale=softmax_scale)
            dqg[:, :, rows] += dq_p
            dkg[:, :, keys] += dk_p
            dvg[:, :, keys] += dv_p
    if dlse is not None:
        dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
    dsinks = sink.dsinks_from(sinks, lse, delta) if sinks is not None else None
    return dq, dk, dv, dsinks
