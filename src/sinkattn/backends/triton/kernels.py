"""Triton kernels of the GPU backend (launched from ``sinkattn.backends.triton``).

Layouts (packed): ``Q/O/dO [Tq, HQ, D]``, ``K/V [Tk, HKV, D]``, statistics
``[HQ, Tq]`` fp32, ``CU_Q/CU_K int32 [N+1]``. Query head ``h`` reads KV head
``h // G``. Scores run in base 2 (``scale_log2 = softmax_scale * log2(e)``,
sinks and lse converted at the edges); all statistics and accumulators fp32.

The mask rule is ``sinkattn.masks`` transcribed: row ``i`` sees keys
``lo(i) <= j < hi(i)``, and key ``j`` is seen by rows ``i_lo(j) <= i < i_hi(j)``.
"""

import triton
import triton.language as tl

LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(LN2)        # the same constants, as kernels may read globals
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _row_key_bounds(i, Lq, Lk, left, right):
    """Keys ``[lo, hi)`` visible to row(s) ``i`` (``sinkattn.masks.row_key_bounds``)."""
    offset = Lk - Lq
    lo = tl.where(left >= 0, tl.maximum(i + offset - left, 0), 0)
    hi = tl.where(right >= 0, tl.minimum(i + offset + right + 1, Lk), Lk)
    return lo, hi


@triton.jit
def _key_row_bounds(j, Lq, Lk, left, right):
    """Rows ``[i_lo, i_hi)`` that see key(s) ``j``: the inverse of ``_row_key_bounds``."""
    offset = Lk - Lq
    i_lo = tl.where(right >= 0, tl.maximum(j - offset - right, 0), 0)
    i_hi = tl.where(left >= 0, tl.minimum(j - offset + left + 1, Lq), Lq)
    return i_lo, i_hi


@triton.jit
def _block_key_range(m_start, BM, Lq, Lk, left, right):
    """Keys seen by any row of ``[m_start, m_start + BM)`` (``sinkattn.masks.block_key_range``)."""
    lo, _ = _row_key_bounds(m_start, Lq, Lk, left, right)
    _, hi = _row_key_bounds(tl.minimum(m_start + BM, Lq) - 1, Lq, Lk, left, right)
    return lo, hi


@triton.jit
def _block_row_range(n_start, BN, Lq, Lk, left, right):
    """Rows that see any key of ``[n_start, n_start + BN)``."""
    lo, _ = _key_row_bounds(n_start, Lq, Lk, left, right)
    _, hi = _key_row_bounds(tl.minimum(n_start + BN, Lk) - 1, Lq, Lk, left, right)
    return lo, hi


@triton.jit
def _sequence(CU_Q, CU_K, seq):
    """``(q0, Lq, k0, Lk)``: first token and length of sequence ``seq`` in the packed Q and K."""
    q0 = tl.load(CU_Q + seq)
    k0 = tl.load(CU_K + seq)
    return q0, tl.load(CU_Q + seq + 1) - q0, k0, tl.load(CU_K + seq + 1) - k0


@triton.jit
def _load_rows(ptr, t0, rows, L, stride_t, head, stride_h, d, D):
    """``[len(rows), BLOCK_D]`` tile of tokens ``t0 + rows`` of one head, 0 outside ``L`` / ``D``."""
    offs = (t0 + rows).to(tl.int64)[:, None] * stride_t + head * stride_h + d[None, :]
    return tl.load(ptr + offs, mask=(rows < L)[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _store_rows(ptr, value, t0, rows, L, stride_t, head, stride_h, d, D):
    offs = (t0 + rows).to(tl.int64)[:, None] * stride_t + head * stride_h + d[None, :]
    tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=(rows < L)[:, None] & (d < D)[None, :])


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. ``UPCAST`` (the interpreter with bf16, whose numpy dot cannot take
    bf16) multiplies the same bf16 values in fp32: products of bf16 are exact in fp32, as on the GPU."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _mma(a, b, acc, COMPENSATED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with ``a`` fp32 and ``b`` in the input dtype. ``a`` is rounded to ``b``'s
    dtype; with ``COMPENSATED`` its rounding error ``a - hi`` goes through a second product."""
    hi = a.to(b.dtype)
    acc = _dot(hi, b, acc, PRECISION, UPCAST)
    if COMPENSATED:
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        acc = _dot(lo, b, acc, PRECISION, UPCAST)
    return acc


@triton.jit
def fwd_kernel(Q, K, V, SINKS, O, LSE, M2, L2, CU_Q, CU_K,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
               stride_lh, scale_log2, left, right, D,
               G: tl.constexpr, BLOCK_D: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr, COMPENSATED: tl.constexpr,
               UPCAST: tl.constexpr):
    """One program: a block of ``BM`` query rows of one sequence, for the ``G`` query heads of one
    KV head in turn. Online softmax with the sink as the starting maximum:

        m = sink,  l = 1  (m = -inf, l = 0 without a finite sink)
        per key block: m' = max(m, rowmax S), l = l 2^(m - m') + sum 2^(S - m'), acc likewise
        o = acc / l,   lse = (m + log2 l) ln 2

    ``M2 = m`` and ``L2 = log2 l`` (``[HQ, Tq]`` fp32) are kept for the backward, which forms
    ``P = 2^((S - m) - log2 l)``: ``S - m`` is exact for the row's maximum, so a one-hot row
    keeps ``P = 1`` however large its scores, which ``2^(S - lse log2 e)`` would not.
    """
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, seq)
    m_start = pid_m * BM
    if m_start >= Lq:
        return
    rows = m_start + tl.arange(0, BM)
    d = tl.arange(0, BLOCK_D)
    lo_r, hi_r = _row_key_bounds(rows, Lq, Lk, left, right)
    row_has_key = lo_r < hi_r
    blk_lo, blk_hi = _block_key_range(m_start, BM, Lq, Lk, left, right)
    n_first = (blk_lo // BN) * BN
    for g in range(G):
        h = kvh * G + g
        q = _load_rows(Q, q0, rows, Lq, stride_qt, h, stride_qh, d, D)
        sink = tl.load(SINKS + h).to(tl.float32)       # -inf when the call has no sinks
        finite = (sink == sink) & (sink != float("inf")) & (sink != float("-inf"))
        m_i = tl.zeros([BM], tl.float32) + tl.where(finite, sink * _LOG2E, float("-inf"))
        l_i = tl.zeros([BM], tl.float32) + tl.where(finite, 1.0, 0.0)
        acc = tl.zeros([BM, BLOCK_D], tl.float32)
        for n in range(n_first, blk_hi, BN):
            cols = n + tl.arange(0, BN)
            k = _load_rows(K, k0, cols, Lk, stride_kt, kvh, stride_kh, d, D)
            v = _load_rows(V, k0, cols, Lk, stride_vt, kvh, stride_vh, d, D)
            s = _dot(q, tl.trans(k), tl.zeros([BM, BN], tl.float32), PRECISION, UPCAST) * scale_log2
            vis = (cols[None, :] >= lo_r[:, None]) & (cols[None, :] < hi_r[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = _mma(p, v, acc * alpha[:, None], COMPENSATED, PRECISION, UPCAST)
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = (m_i + tl.log2(l_i)) * _LN2
        # special sinks: +inf takes all the mass; NaN poisons the rows that have keys
        log2_l = tl.log2(l_i)
        o = tl.where(sink == float("inf"), 0.0, o)
        lse = tl.where(sink == float("inf"), float("inf"), lse)
        log2_l = tl.where(sink == float("inf"), float("inf"), log2_l)     # backward: P = 0
        o = tl.where(row_has_key[:, None], tl.where(sink != sink, float("nan"), o), o)
        lse = tl.where(sink != sink, float("nan"), lse)
        log2_l = tl.where(sink != sink, float("nan"), log2_l)
        _store_rows(O, o, q0, rows, Lq, stride_ot, h, stride_oh, d, D)
        stat = h.to(tl.int64) * stride_lh + q0 + rows
        tl.store(LSE + stat, lse, mask=rows < Lq)
        tl.store(M2 + stat, m_i, mask=rows < Lq)
        tl.store(L2 + stat, log2_l, mask=rows < Lq)


@triton.jit
def delta_kernel(O, DO, DLSE, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh, stride_lh, D,
                 HAS_DLSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``Delta[h, t] = <dO[t, h], O[t, h]> - dlse[h, t]`` in fp32."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    o = _load_rows(O, 0, t, T, stride_ot, h, stride_oh, d, D).to(tl.float32)
    do = _load_rows(DO, 0, t, T, stride_dot, h, stride_doh, d, D).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + h.to(tl.int64) * stride_lh + t, mask=t < T, other=0.0)
    tl.store(DELTA + h.to(tl.int64) * stride_lh + t, delta, mask=t < T)


@triton.jit
def _probabilities(q, k, m2, log2_l, rows, cols, Lq, Lk, left, right, scale_log2, BM: tl.constexpr,
                   BN: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``P = 2^((S - m) - log2 l)`` on visible pairs, 0 elsewhere (``[BM, BN]`` fp32). The exponent
    is capped at 0 (P <= 1 exactly; a positive exponent can only be rounding), NaN kept."""
    s = _dot(q, tl.trans(k), tl.zeros([BM, BN], tl.float32), PRECISION, UPCAST) * scale_log2
    lo_r, hi_r = _row_key_bounds(rows, Lq, Lk, left, right)
    vis = (cols[None, :] >= lo_r[:, None]) & (cols[None, :] < hi_r[:, None]) & (rows < Lq)[:, None]
    e = (s - m2[:, None]) - log2_l[:, None]
    e = tl.where(e > 0.0, 0.0, e)
    return tl.where(vis, tl.exp2(e), 0.0)


@triton.jit
def dkdv_kernel(Q, K, V, DO, M2, L2, DELTA, DK, DV, CU_Q, CU_K,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, scale_log2, softmax_scale,
                left, right, D,
                G: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                PRECISION: tl.constexpr, COMPENSATED: tl.constexpr, UPCAST: tl.constexpr):
    """One program: a block of ``BN`` keys of one KV head. Loops over the group's ``G`` query heads
    and, for each, over the query blocks that see the keys; sums in registers, in that fixed order:

        dv += P^T dO,   dk += scale * dS^T Q,   dS = P (dO V^T - Delta)
    """
    pid_n = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, seq)
    n_start = pid_n * BN
    if n_start >= Lk:
        return
    cols = n_start + tl.arange(0, BN)
    d = tl.arange(0, BLOCK_D)
    k = _load_rows(K, k0, cols, Lk, stride_kt, kvh, stride_kh, d, D)
    v = _load_rows(V, k0, cols, Lk, stride_vt, kvh, stride_vh, d, D)
    dk = tl.zeros([BN, BLOCK_D], tl.float32)
    dv = tl.zeros([BN, BLOCK_D], tl.float32)
    blk_lo, blk_hi = _block_row_range(n_start, BN, Lq, Lk, left, right)
    m_first = (blk_lo // BM) * BM
    for g in range(G):
        h = kvh * G + g
        for m in range(m_first, blk_hi, BM):
            rows = m + tl.arange(0, BM)
            q = _load_rows(Q, q0, rows, Lq, stride_qt, h, stride_qh, d, D)
            do = _load_rows(DO, q0, rows, Lq, stride_dot, h, stride_doh, d, D)
            m2 = tl.load(M2 + h.to(tl.int64) * stride_lh + q0 + rows, mask=rows < Lq, other=0.0)
            log2_l = tl.load(L2 + h.to(tl.int64) * stride_lh + q0 + rows, mask=rows < Lq, other=float("inf"))
            delta = tl.load(DELTA + h.to(tl.int64) * stride_lh + q0 + rows, mask=rows < Lq, other=0.0)
            p = _probabilities(q, k, m2, log2_l, rows, cols, Lq, Lk, left, right, scale_log2, BM, BN,
                               PRECISION, UPCAST)
            dv = _mma(tl.trans(p), do, dv, COMPENSATED, PRECISION, UPCAST)
            dp = _dot(do, tl.trans(v), tl.zeros([BM, BN], tl.float32), PRECISION, UPCAST)
            ds = p * (dp - delta[:, None])
            dk = _mma(tl.trans(ds), q, dk, COMPENSATED, PRECISION, UPCAST)
    _store_rows(DK, dk * softmax_scale, k0, cols, Lk, stride_dkt, kvh, stride_dkh, d, D)
    _store_rows(DV, dv, k0, cols, Lk, stride_dvt, kvh, stride_dvh, d, D)


@triton.jit
def dq_kernel(Q, K, V, DO, M2, L2, DLSE, DELTA, DQ, CU_Q, CU_K,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
              stride_lh, stride_dqt, stride_dqh, scale_log2, softmax_scale, left, right, D,
              G: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              PRECISION: tl.constexpr, COMPENSATED: tl.constexpr, UPCAST: tl.constexpr,
              EXACT_DELTA: tl.constexpr, HAS_DLSE: tl.constexpr):
    """One program: a block of ``BM`` rows of one query head; ``dq = scale * sum_j dS_ij k_j`` over
    the visible key blocks in order.

    With ``EXACT_DELTA`` a first pass over the same key blocks sums ``Delta = sum_j P dP - dlse``
    from the very products the gradients use, and stores it for the dK/dV kernel (launched after):
    one-hot rows then cancel exactly, at the cost of two more products per block.
    """
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, seq)
    m_start = pid_m * BM
    if m_start >= Lq:
        return
    rows = m_start + tl.arange(0, BM)
    d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q, q0, rows, Lq, stride_qt, h, stride_qh, d, D)
    do = _load_rows(DO, q0, rows, Lq, stride_dot, h, stride_doh, d, D)
    m2 = tl.load(M2 + h.to(tl.int64) * stride_lh + q0 + rows, mask=rows < Lq, other=0.0)
    log2_l = tl.load(L2 + h.to(tl.int64) * stride_lh + q0 + rows, mask=rows < Lq, other=float("inf"))
    blk_lo, blk_hi = _block_key_range(m_start, BM, Lq, Lk, left, right)
    if EXACT_DELTA:
        delta = tl.zeros([BM], tl.float32)
        for n in range((blk_lo // BN) * BN, blk_hi, BN):
            cols = n + tl.arange(0, BN)
            k = _load_rows(K, k0, cols, Lk, stride_kt, kvh, stride_kh, d, D)
            v = _load_rows(V, k0, cols, Lk, stride_vt, kvh, stride_vh, d, D)
            p = _probabilities(q, k, m2, log2_l, rows, cols, Lq, Lk, left, right, scale_log2, BM, BN,
                               PRECISION, UPCAST)
            delta += tl.sum(p * _dot(do, tl.trans(v), tl.zeros([BM, BN], tl.float32), PRECISION, UPCAST), 1)
        if HAS_DLSE:
            delta -= tl.load(DLSE + h.to(tl.int64) * stride_lh + q0 + rows, mask=rows < Lq, other=0.0)
        tl.store(DELTA + h.to(tl.int64) * stride_lh + q0 + rows, delta, mask=rows < Lq)
    else:
        delta = tl.load(DELTA + h.to(tl.int64) * stride_lh + q0 + rows, mask=rows < Lq, other=0.0)
    dq = tl.zeros([BM, BLOCK_D], tl.float32)
    for n in range((blk_lo // BN) * BN, blk_hi, BN):
        cols = n + tl.arange(0, BN)
        k = _load_rows(K, k0, cols, Lk, stride_kt, kvh, stride_kh, d, D)
        v = _load_rows(V, k0, cols, Lk, stride_vt, kvh, stride_vh, d, D)
        p = _probabilities(q, k, m2, log2_l, rows, cols, Lq, Lk, left, right, scale_log2, BM, BN,
                               PRECISION, UPCAST)
        dp = _dot(do, tl.trans(v), tl.zeros([BM, BN], tl.float32), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq = _mma(ds, k, dq, COMPENSATED, PRECISION, UPCAST)
    _store_rows(DQ, dq * softmax_scale, q0, rows, Lq, stride_dqt, h, stride_dqh, d, D)
