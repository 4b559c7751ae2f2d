"""``backend="triton"``: fused Triton kernels for CUDA tensors (and CPU tensors under
``TRITON_INTERPRET=1``, which is how CI runs them).

Forward: one program per (query block, sequence, KV head) serving the group's
query heads, sink as the starting maximum of the online softmax, lse out.
Backward: a Delta kernel; a dK/dV kernel per (key block, sequence, KV head)
looping over the group's query heads and the query blocks that see the keys;
a dQ kernel per (query block, sequence, query head); dsinks reduced per head
on the host in one fixed order. When scores may be large
(``scores.may_have_large_scores``) the dQ kernel sums Delta itself from the
products the gradients use (``EXACT_DELTA``). No atomics: results are bitwise reproducible.

Head dims 1-256 run (padded inside the kernels to the next power of two, at
least 16). fp32 inputs use IEEE fp32 dot products; fp16 / bf16 inputs split each
fp32 ``P`` / ``dS`` tile that meets them in a product into ``hi`` and ``lo`` parts
(``COMPENSATED``, docs/contract.md §3 "Compensated products").
"""

from __future__ import annotations

import math
import os

import torch
import triton

from ... import sink
from .. import buffers
from ..capabilities import Capabilities, Saved
from ..scores import check_fp32_range, may_have_large_scores, score_bound
from . import kernels
from .config import blocks_for

__all__ = ["CAPABILITIES", "forward", "backward", "COMPENSATED", "interpreting"]

COMPENSATED: bool = True
"""Compensated products for fp16 / bf16 inputs (ignored for fp32). Where an fp32 tile ``P`` / ``dS``
meets a low-precision operand (the forward's ``P V``, the backward's ``P^T dO``, ``dS^T Q``, ``dS K``)
it is split into ``hi = round(P)`` and ``lo = round(P - hi)`` and both are multiplied.

Why on by default for both: rounding ``P`` to the input dtype errs by its unit (2^-11 fp16, 2^-8 bf16)
relative to each term, not to the sum, so where terms cancel the product misses Gate A's rtol (2^-9,
2^-6); ``dsinks`` inherits the forward's error through ``Delta = <dO, o>``. Measured through the
interpreter on the tests' random packed batches (``benchmarks/compensated.py --seeds 128``):
``False`` fails Gate A on 68 of 128 fp16 batches (worst ratio dk 0.898) and 52 of 128 bf16 ones
(o, dq, dk, dv; dsinks down to ratio 0.0); ``True`` on none (docs/backends.md, "Compensated (hi/lo) products").

Cost, in matrix products per visited (query block, key block) pair, all of the same size
``2 BM BN D`` flops: forward 2 -> 3; backward 7 -> 10 (dK/dV kernel 4 -> 6, dQ kernel 3 -> 4), or
9 -> 12 when ``EXACT_DELTA`` adds two; plus a cast and a subtraction per element of each split tile.
``False`` (set before the call) is the faster opt-out, with the errors stated in docs/backends.md."""


def _compensated(dtype: torch.dtype) -> bool:
    if not isinstance(COMPENSATED, bool):
        raise TypeError(f"sinkattn.backends.triton.COMPENSATED must be True or False, got {COMPENSATED!r}")
    return COMPENSATED and dtype != torch.float32


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


CAPABILITIES = Capabilities(
    name="triton",
    device_types=frozenset({"cuda", "cpu"} if interpreting() else {"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_dim=256,
    device_hint="set TRITON_INTERPRET=1 before importing sinkattn to run its kernels on CPU tensors (slowly)",
    saved=(Saved("m2", ("HQ", "Tq"), torch.float32), Saved("log2_l", ("HQ", "Tq"), torch.float32)),
)


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def _upcast(dtype: torch.dtype) -> bool:
    """The interpreter's numpy dot has no bf16: multiply the bf16 values in fp32 there."""
    return interpreting() and dtype == torch.bfloat16


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _sinks_or_minus_inf(sinks, HQ, device):
    if sinks is None:
        return torch.full((HQ,), float("-inf"), dtype=torch.float32, device=device)
    return sinks.float().contiguous()


def _max_lens(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
              max_seqlen) -> tuple[int, int]:
    """Bounds of the longest query and key sequence, which size the launch grids: from ``max_seqlen``
    when given (a loose bound is capped at the token count, so the grid never outgrows the batch),
    else read from ``cu_seqlens`` (a copy to the host); at least 1."""
    if max_seqlen is None:
        max_seqlen = [int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0 for cu in (cu_seqlens_q, cu_seqlens_k)]
    return max(min(int(max_seqlen[0]), q.shape[0]), 1), max(min(int(max_seqlen[1]), k.shape[0]), 1)


def forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, max_seqlen=None):
    """``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]`` -> ``(out [Tq, HQ, D] fp32, lse [HQ, Tq] fp32,
    (m2, log2_l))``, the last two the row maximum and log2 of the denominator, base 2, for the backward."""
    q, k, v, sinks, cu_seqlens_q, cu_seqlens_k = buffers.contiguous(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k)
    check_fp32_range(score_bound(q, k, softmax_scale), q, k)       # the kernels' scores are fp32
    Tq, HQ, D = q.shape
    HKV = k.shape[1]
    N = cu_seqlens_q.numel() - 1
    out = buffers.new((Tq, HQ, D), torch.float32, q.device)
    lse = buffers.new((HQ, Tq), torch.float32, q.device)
    m2 = buffers.new((HQ, Tq), torch.float32, q.device)
    log2_l = buffers.new((HQ, Tq), torch.float32, q.device)
    b = blocks_for(q.device, D, backward=False)
    grid = (triton.cdiv(_max_lens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen)[0], b.BM), N, HKV)
    if N > 0 and Tq > 0:
        kernels.fwd_kernel[grid](
            q, k, v, _sinks_or_minus_inf(sinks, HQ, q.device), out, lse, m2, log2_l, cu_seqlens_q, cu_seqlens_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            softmax_scale * kernels.LOG2E, left, right, D,
            G=HQ // HKV, BLOCK_D=_block_d(D), BM=b.BM, BN=b.BN, PRECISION=_precision(q.dtype),
            COMPENSATED=_compensated(q.dtype), UPCAST=_upcast(q.dtype), num_warps=b.num_warps,
            num_stages=b.num_stages)
    return out, lse, (m2, log2_l)


def backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right,
             extra, max_seqlen=None):
    """``(dq, dk, dv)`` fp32 shaped like ``q, k, v`` and ``dsinks [HQ]`` in the sinks' dtype (or None)."""
    do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k = buffers.contiguous(
        do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k)
    extra = buffers.contiguous(*extra)
    Tq, HQ, D = q.shape
    HKV = k.shape[1]
    N = cu_seqlens_q.numel() - 1
    dq = buffers.new(q.shape, torch.float32, q.device)
    dk = buffers.new(k.shape, torch.float32, q.device)
    dv = buffers.new(v.shape, torch.float32, q.device)
    delta = buffers.new((HQ, Tq), torch.float32, q.device)
    if dlse is not None:
        dlse = dlse.float()
    exact_delta = may_have_large_scores(q, k, softmax_scale)
    if Tq > 0 and not exact_delta:
        block_t = 16 if interpreting() else 64
        kernels.delta_kernel[(triton.cdiv(Tq, block_t), HQ)](
            out, do, dlse if dlse is not None else delta, delta, Tq, out.stride(0), out.stride(1),
            do.stride(0), do.stride(1), delta.stride(0), D,
            HAS_DLSE=dlse is not None, BLOCK_T=block_t, BLOCK_D=_block_d(D))
    m2, log2_l = extra
    b = blocks_for(q.device, D, backward=True)
    common = dict(G=HQ // HKV, BLOCK_D=_block_d(D), BM=b.BM, BN=b.BN, PRECISION=_precision(q.dtype),
                  COMPENSATED=_compensated(q.dtype), UPCAST=_upcast(q.dtype), num_warps=b.num_warps,
                  num_stages=b.num_stages)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               do.stride(0), do.stride(1), delta.stride(0))
    scales = (softmax_scale * kernels.LOG2E, softmax_scale, left, right, D)
    Tk = k.shape[0]
    max_q, max_k = _max_lens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen)
    if N > 0 and Tq > 0:     # first: with exact_delta it writes the Delta that dK/dV reads
        kernels.dq_kernel[(triton.cdiv(max_q, b.BM), N, HQ)](
            q, k, v, do, m2, log2_l, dlse if dlse is not None else delta, delta, dq, cu_seqlens_q, cu_seqlens_k,
            *strides, dq.stride(0), dq.stride(1), *scales, EXACT_DELTA=exact_delta, HAS_DLSE=dlse is not None,
            **common)
    if N > 0 and Tk > 0:
        kernels.dkdv_kernel[(triton.cdiv(max_k, b.BN), N, HKV)](
            q, k, v, do, m2, log2_l, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, *strides,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *scales, **common)
    dsinks = sink.dsinks_from(sinks, lse, delta) if sinks is not None else None
    return dq, dk, dv, dsinks


del math
