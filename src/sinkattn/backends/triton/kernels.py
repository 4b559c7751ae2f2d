"""Triton kernels of the GPU backend (launched from ``sinkattn.backends.triton``).

Layouts (packed): ``Q/O/dO [Tq, HQ, BLOCK_D]``, ``K/V [Tk, HKV, BLOCK_D]`` (the head dim padded
with zeros to ``BLOCK_D``, a power of two, by the launchers), statistics
``[HQ, Tq]`` fp32, ``CU_Q/CU_K int32 [N+1]``. Query head ``h`` reads KV head
``h // G``. Scores run in base 2 (``scale_log2 = softmax_scale * log2(e)``, formed by the
launchers); the statistics stay in base 2 (``sinkattn.sink`` converts them, and joins the sink,
outside the kernels); all statistics and accumulators fp32.

The mask rule is ``sinkattn.masks`` transcribed: row ``i`` sees keys
``lo(i) <= j < hi(i)``, and key ``j`` is seen by rows ``i_lo(j) <= i < i_hi(j)``.

Three habits of fused-attention kernels shape every kernel here:

* Interior blocks run unmasked. A (row block, key block) pair that every row of the block sees
  whole (``masks.block_fully_visible``) skips the mask; only the blocks the mask can cut (the
  causal diagonal, window edges, a sequence's last key block) pay for it. Interior blocks come
  first, then the cut ones, in a fixed order.
* GQA packing (the forward and dQ kernels). A program's ``BM`` rows are ``BM // GH`` positions
  of ``GH`` query heads of one KV head (position-major: row ``r`` is position ``r // GH``, head
  ``r % GH``), so one load of a K/V tile serves all of them.
* Longest-processing-time launch order. Programs are numbered so that the costliest blocks
  start first: the query blocks nearest a sequence's end (causal: they see the most keys), the
  key blocks nearest its start, across all sequences at once (``_lpt_program``).
"""

import triton
import triton.language as tl

NO_SPECIALIZE = ("left", "right", "G", "GH", "N", "HT", "NB", "chunk", "T", "stride_qt", "stride_qh",
                 "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh", "stride_dot",
                 "stride_doh", "stride_dqt", "stride_dqh", "stride_dkt", "stride_dkh", "stride_dvt", "stride_dvh",
                 "stride_lh")
"""Integer arguments Triton must not specialize on (value 1, multiples of 16): each specialization
would be another compile, and another configuration for the resource audit to cover. What the
loads need instead is stated once: the launchers pad the head dim to ``BLOCK_D`` (a power of two,
at least 16), so every row stride is a multiple of 16 elements (``_offsets``)."""


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
def _block_split(lo_any, hi_any, lo_all, hi_all, B):
    """Blocks of ``B`` along one axis, as block indices: ``[b0, b1)`` meets ``[lo_any, hi_any)``
    (what some row, or key, of the tile sees); ``[i0, i1)`` inside it lies within
    ``[lo_all, hi_all)`` (what every one sees): the interior, run unmasked. The blocks
    ``[b0, i0)`` and ``[i1, b1)`` are the cut ones."""
    b0 = tl.maximum(lo_any, 0) // B                   # (no negative operand: // truncates on the GPU)
    b1 = tl.maximum(tl.cdiv(tl.maximum(hi_any, 0), B), b0)
    i0 = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(lo_all, 0), B), b0), b1)
    i1 = tl.minimum(tl.maximum(tl.maximum(hi_all, 0) // B, i0), b1)
    return b0, b1, i0, i1


@triton.jit
def _cut_block(t, b0, i0, i1):
    """The ``t``-th cut block: ``b0, b0 + 1, .., i0 - 1``, then ``i1, i1 + 1, ..``."""
    return tl.where(t < i0 - b0, b0 + t, i1 + t - (i0 - b0))


CHUNK = 2**30
"""Programs per launch (constexpr ``CHUNK``): grids of more programs launch in chunks, each told its
number (``chunk``)."""


@triton.jit
def _lpt_program(chunk, N, HT, NB, CHUNK: tl.constexpr):
    """``(block, seq, head_tile)`` of this program, number ``pid`` of ``NB * N * HT`` (counting
    the earlier chunks' programs): head tiles vary fastest,
    then sequences, then blocks, from the last block (``NB - 1``) down. A causal query block ``b``
    sees about ``(b + 1) BM`` keys in every sequence long enough to have it, so this is
    longest-processing-time order; the blocks of the longest sequences start first."""
    pid = chunk.to(tl.int64) * CHUNK + tl.program_id(0)
    ht = pid % HT
    rest = pid // HT
    return (NB - 1 - rest // N).to(tl.int32), (rest % N).to(tl.int32), ht.to(tl.int32)


@triton.jit
def _sequence(CU_Q, CU_K, seq):
    """``(q0, Lq, k0, Lk)``: first token and length of sequence ``seq`` in the packed Q and K."""
    q0 = tl.load(CU_Q + seq)
    k0 = tl.load(CU_K + seq)
    return q0, tl.load(CU_Q + seq + 1) - q0, k0, tl.load(CU_K + seq + 1) - k0


@triton.jit
def _packed_rows(block, ht, G, GH, Lq, BM: tl.constexpr):
    """Rows of a GQA-packed tile: ``(pos [BM], h [BM], kvh, p0, PM)``. Head tile ``ht`` holds
    ``GH`` (a divisor of ``G``) of the ``G`` query heads of KV head ``kvh``; the tile's rows are its
    ``PM = BM // GH`` positions ``p0 .. p0 + PM - 1`` times those heads, position-major. Rows past
    ``PM * GH`` (when ``GH`` does not divide ``BM``) get position ``Lq``, past the sequence: idle."""
    r = tl.arange(0, BM)
    tiles = G // GH
    kvh = ht // tiles
    PM = BM // GH
    p0 = block * PM
    pos = tl.where(r < PM * GH, p0 + r // GH, Lq)
    return pos, kvh * G + (ht % tiles) * GH + r % GH, kvh, p0, PM


@triton.jit
def _offsets(t0, rows, stride_t, head, stride_h, d):
    """``[len(rows), BLOCK_D]`` element offsets of tokens ``t0 + rows`` of ``head`` (one, or one per row);
    each row starts at a multiple of 16 elements (strides are multiples of the padded head dim)."""
    start = tl.multiple_of((t0 + rows).to(tl.int64) * stride_t + head * stride_h, 16)
    return start[:, None] + d[None, :]


@triton.jit
def _tile_mask(rows, L, d):
    """Rows below ``L``, every column: the launchers pad the head dim to ``BLOCK_D`` (no column mask,
    so every load is whole 16-byte vectors and can be a pipelined asynchronous copy)."""
    return (rows < L)[:, None] & (d < d.shape[0])[None, :]


@triton.jit
def _load_rows(ptr, t0, rows, L, stride_t, head, stride_h, d):
    """``[len(rows), BLOCK_D]`` tile of tokens ``t0 + rows``, 0 past ``L``."""
    return tl.load(ptr + _offsets(t0, rows, stride_t, head, stride_h, d), mask=_tile_mask(rows, L, d), other=0.0)


@triton.jit
def _store_rows(ptr, value, t0, rows, L, stride_t, head, stride_h, d):
    tl.store(ptr + _offsets(t0, rows, stride_t, head, stride_h, d), value.to(ptr.dtype.element_ty),
             mask=_tile_mask(rows, L, d))


@triton.jit
def _stat_offsets(head, stride_lh, t0, rows):
    """Offsets of rows ``t0 + rows`` of ``head`` (one, or one per row) in a ``[HQ, Tq]`` statistic."""
    return head.to(tl.int64) * stride_lh + t0 + rows


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
def _fwd_block(acc, m_i, l_i, q, K, V, k0, Lk, n, kvh, stride_kt, stride_kh, stride_vt, stride_vh, d,
               lo_r, hi_r, scale_log2, BN: tl.constexpr, PRECISION: tl.constexpr, COMPENSATED: tl.constexpr,
               UPCAST: tl.constexpr, MASKED: tl.constexpr):
    """One key block ``[n, n + BN)`` of the online softmax; ``MASKED`` applies the row bounds."""
    cols = n + tl.arange(0, BN)
    k = _load_rows(K, k0, cols, Lk, stride_kt, kvh, stride_kh, d)          # [BN, BLOCK_D]
    v = _load_rows(V, k0, cols, Lk, stride_vt, kvh, stride_vh, d)          # [BN, BLOCK_D]
    s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BN], tl.float32), PRECISION, UPCAST) * scale_log2
    if MASKED:
        s = tl.where((cols[None, :] >= lo_r[:, None]) & (cols[None, :] < hi_r[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])                                              # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mma(p, v, acc * alpha[:, None], COMPENSATED, PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def fwd_kernel(Q, K, V, O, M2, L2, CU_Q, CU_K,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
               stride_lh, scale_log2, left, right, G, GH, N, HT, NB, chunk, CHUNK: tl.constexpr,
               BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
               COMPENSATED: tl.constexpr, UPCAST: tl.constexpr):
    """One program: a GQA-packed tile of ``BM`` rows (``BM // GH`` positions of one sequence times
    ``GH`` query heads sharing a KV head). The online softmax over the row's visible keys, without
    the sink (it joins afterwards, ``sinkattn.sink``), ``S = scale_log2 <q, k>`` in base 2:

        m = -inf,  l = 0
        per key block: m' = max(m, rowmax S), l = l 2^(m - m') + sum 2^(S - m'), acc likewise
        o = acc / l   (0 for a row that sees no key: l = 0)

    Writes ``O [Tq, HQ, BLOCK_D]`` fp32 and the statistics ``M2 = m``, ``L2 = log2 l`` (``[HQ, Tq]``
    fp32): a row that sees no key has ``o = 0``, ``log2 l = -inf`` (and ``m = -inf``); a ``+inf`` score
    leaves ``l`` NaN, written ``log2 l = +inf`` (the row's ``lse`` is ``+inf``). The backward forms
    ``P = 2^((S - m) - log2 l)`` from the final statistics: ``S - m`` is exact for the row's maximum,
    so a one-hot row keeps ``P = 1`` however large its scores, which ``2^(S - lse log2 e)`` would not.
    """
    block, seq, ht = _lpt_program(chunk, N, HT, NB, CHUNK)
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, seq)
    pos, h, kvh, p0, PM = _packed_rows(block, ht, G, GH, Lq, BM)
    if p0 >= Lq:
        return
    d = tl.arange(0, BLOCK_D)
    lo_r, hi_r = _row_key_bounds(pos, Lq, Lk, left, right)                       # [BM]
    p_last = tl.minimum(p0 + PM, Lq) - 1
    lo_any, hi_all = _row_key_bounds(p0, Lq, Lk, left, right)
    lo_all, hi_any = _row_key_bounds(p_last, Lq, Lk, left, right)
    b0, b1, i0, i1 = _block_split(lo_any, hi_any, lo_all, hi_all, BN)

    q = _load_rows(Q, q0, pos, Lq, stride_qt, h, stride_qh, d)               # [BM, BLOCK_D]
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_D], tl.float32)
    for n in range(i0 * BN, i1 * BN, BN):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, k0, Lk, n, kvh, stride_kt, stride_kh, stride_vt,
                                   stride_vh, d, lo_r, hi_r, scale_log2, BN, PRECISION, COMPENSATED, UPCAST,
                                   MASKED=False)
    for t in range(0, (i0 - b0) + (b1 - i1)):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, k0, Lk, _cut_block(t, b0, i0, i1) * BN, kvh,
                                   stride_kt, stride_kh, stride_vt, stride_vh, d, lo_r, hi_r, scale_log2, BN,
                                   PRECISION, COMPENSATED, UPCAST, MASKED=True)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]                           # no key: o = 0
    log2_l = tl.log2(l_i)                                                        # no key: -inf
    log2_l = tl.where(m_i == float("inf"), float("inf"), log2_l)   # a +inf score: l is NaN, lse is +inf
    _store_rows(O, o, q0, pos, Lq, stride_ot, h, stride_oh, d)
    stat = _stat_offsets(h, stride_lh, q0, pos)
    tl.store(M2 + stat, m_i, mask=pos < Lq)
    tl.store(L2 + stat, log2_l, mask=pos < Lq)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def delta_kernel(O, DO, DLSE, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh, stride_lh,
                 HAS_DLSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``Delta[h, t] = <dO[t, h], O[t, h]> - dlse[h, t]`` in fp32."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    o = _load_rows(O, 0, t, T, stride_ot, h, stride_oh, d).to(tl.float32)
    do = _load_rows(DO, 0, t, T, stride_dot, h, stride_doh, d).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + _stat_offsets(h, stride_lh, 0, t), mask=t < T, other=0.0)
    tl.store(DELTA + _stat_offsets(h, stride_lh, 0, t), delta, mask=t < T)


@triton.jit
def _probabilities(q, k, m2, log2_l, rows, cols, Lq, Lk, left, right, scale_log2, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, MASKED: tl.constexpr):
    """``P = 2^((S - m) - log2 l)`` (``[len(rows), len(cols)]`` fp32), 0 off the mask when ``MASKED``.
    The exponent is capped at 0 (P <= 1 exactly; a positive exponent can only be rounding), NaN kept.
    Rows past ``Lq`` need no mask: their statistics load as ``m = 0, log2 l = inf``, so ``P = 0``."""
    s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], tl.float32), PRECISION, UPCAST) * scale_log2
    e = (s - m2[:, None]) - log2_l[:, None]
    p = tl.exp2(tl.where(e > 0.0, 0.0, e))
    if MASKED:
        lo_r, hi_r = _row_key_bounds(rows, Lq, Lk, left, right)
        vis = (cols[None, :] >= lo_r[:, None]) & (cols[None, :] < hi_r[:, None]) & (rows < Lq)[:, None]
        p = tl.where(vis, p, 0.0)
    return p


@triton.jit
def _dkdv_block(dk, dv, k, v, Q, DO, M2, L2, DELTA, q0, Lq, Lk, m, h, cols, stride_qt, stride_qh, stride_dot,
                stride_doh, stride_lh, d, left, right, scale_log2, BM: tl.constexpr, PRECISION: tl.constexpr,
                COMPENSATED: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr):
    """Rows ``[m, m + BM)`` of query head ``h`` against the program's keys. (Forming ``S^T = K Q^T``
    instead would spare the transposes, but makes K and V register operands: more registers.)"""
    rows = m + tl.arange(0, BM)
    q = _load_rows(Q, q0, rows, Lq, stride_qt, h, stride_qh, d)             # [BM, BLOCK_D]
    do = _load_rows(DO, q0, rows, Lq, stride_dot, h, stride_doh, d)         # [BM, BLOCK_D]
    stat = _stat_offsets(h, stride_lh, q0, rows)
    m2 = tl.load(M2 + stat, mask=rows < Lq, other=0.0)
    log2_l = tl.load(L2 + stat, mask=rows < Lq, other=float("inf"))
    delta = tl.load(DELTA + stat, mask=rows < Lq, other=0.0)
    p = _probabilities(q, k, m2, log2_l, rows, cols, Lq, Lk, left, right, scale_log2, PRECISION, UPCAST,
                       MASKED)                                                  # [BM, BN]
    dv = _mma(tl.trans(p), do, dv, COMPENSATED, PRECISION, UPCAST)
    dp = _dot(do, tl.trans(v), tl.zeros([BM, k.shape[0]], tl.float32), PRECISION, UPCAST)
    ds = p * (dp - delta[:, None])
    dk = _mma(tl.trans(ds), q, dk, COMPENSATED, PRECISION, UPCAST)
    return dk, dv


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def dkdv_kernel(Q, K, V, DO, M2, L2, DELTA, DK, DV, CU_Q, CU_K,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, scale_log2, softmax_scale,
                left, right, G, N, HT, NB, chunk, CHUNK: tl.constexpr,
                BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                PRECISION: tl.constexpr, COMPENSATED: tl.constexpr, UPCAST: tl.constexpr):
    """One program: a block of ``BN`` keys of one KV head. Loops over the group's ``G`` query heads
    and, for each, over the query blocks that see the keys (interior blocks first); sums in
    registers, in that fixed order:

        dv += P^T dO,   dk += scale * dS^T Q,   dS = P (dO V^T - Delta)

    Program order: the key block ``NB - 1 - b`` counted from each sequence's end, so the first
    key blocks of the longest sequences (causal: seen by the most rows) start first.
    """
    from_end, seq, kvh = _lpt_program(chunk, N, HT, NB, CHUNK)
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, seq)
    n_start = (tl.cdiv(Lk, BN) - 1 - from_end) * BN
    if n_start < 0:
        return
    cols = n_start + tl.arange(0, BN)
    d = tl.arange(0, BLOCK_D)
    k = _load_rows(K, k0, cols, Lk, stride_kt, kvh, stride_kh, d)             # [BN, BLOCK_D]
    v = _load_rows(V, k0, cols, Lk, stride_vt, kvh, stride_vh, d)             # [BN, BLOCK_D]
    dk = tl.zeros([BN, BLOCK_D], tl.float32)
    dv = tl.zeros([BN, BLOCK_D], tl.float32)
    # Rows past Lq give P = 0 unmasked (see _probabilities): a block reaching Lq can be interior.
    lo_any, hi_all = _key_row_bounds(n_start, Lq, Lk, left, right)
    lo_all, hi_any = _key_row_bounds(tl.minimum(n_start + BN, Lk) - 1, Lq, Lk, left, right)
    hi_all = tl.where(hi_all >= Lq, tl.cdiv(Lq, BM) * BM, hi_all)
    b0, b1, i0, i1 = _block_split(lo_any, hi_any, lo_all, hi_all, BM)
    for g in range(G):
        h = kvh * G + g
        for m in range(i0 * BM, i1 * BM, BM):
            dk, dv = _dkdv_block(dk, dv, k, v, Q, DO, M2, L2, DELTA, q0, Lq, Lk, m, h, cols, stride_qt, stride_qh,
                                 stride_dot, stride_doh, stride_lh, d, left, right, scale_log2, BM, PRECISION,
                                 COMPENSATED, UPCAST, MASKED=False)
        for t in range(0, (i0 - b0) + (b1 - i1)):
            dk, dv = _dkdv_block(dk, dv, k, v, Q, DO, M2, L2, DELTA, q0, Lq, Lk, _cut_block(t, b0, i0, i1) * BM, h,
                                 cols, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, d, left, right,
                                 scale_log2, BM, PRECISION, COMPENSATED, UPCAST, MASKED=True)
    _store_rows(DK, dk * softmax_scale, k0, cols, Lk, stride_dkt, kvh, stride_dkh, d)
    _store_rows(DV, dv, k0, cols, Lk, stride_dvt, kvh, stride_dvh, d)


@triton.jit
def _dq_block(dq, delta, q, do, m2, log2_l, K, V, k0, n, pos, Lq, Lk, kvh, stride_kt, stride_kh, stride_vt,
              stride_vh, d, left, right, scale_log2, BN: tl.constexpr, PRECISION: tl.constexpr,
              COMPENSATED: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr, DELTA_PASS: tl.constexpr):
    """Key block ``[n, n + BN)`` for the tile's rows: the ``Delta = sum_j P dP`` pass adds to
    ``delta``, the gradient pass adds ``dS K`` to ``dq``."""
    cols = n + tl.arange(0, BN)
    k = _load_rows(K, k0, cols, Lk, stride_kt, kvh, stride_kh, d)             # [BN, BLOCK_D]
    v = _load_rows(V, k0, cols, Lk, stride_vt, kvh, stride_vh, d)             # [BN, BLOCK_D]
    p = _probabilities(q, k, m2, log2_l, pos, cols, Lq, Lk, left, right, scale_log2, PRECISION, UPCAST,
                       MASKED)                                                  # [BM, BN]
    dp = _dot(do, tl.trans(v), tl.zeros([q.shape[0], BN], tl.float32), PRECISION, UPCAST)
    if DELTA_PASS:
        delta += tl.sum(p * dp, 1)
    else:
        dq = _mma(p * (dp - delta[:, None]), k, dq, COMPENSATED, PRECISION, UPCAST)
    return dq, delta


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def dq_kernel(Q, K, V, DO, M2, L2, DLSE, DELTA, EXACT, DQ, CU_Q, CU_K,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
              stride_lh, stride_dqt, stride_dqh, scale_log2, softmax_scale, left, right, G, GH, N, HT, NB,
              chunk, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              PRECISION: tl.constexpr, COMPENSATED: tl.constexpr, UPCAST: tl.constexpr,
              EXACT_DELTA: tl.constexpr, HAS_DLSE: tl.constexpr):
    """One program: a GQA-packed tile of ``BM`` rows (as in the forward); ``dq = scale * sum_j dS_ij k_j``
    over the visible key blocks, interior blocks first.

    With ``EXACT_DELTA`` a first pass over the same key blocks sums ``Delta = sum_j P dP - dlse``
    from the very products the gradients use, and stores it over the Delta kernel's for the dK/dV
    kernel (launched after) and dsinks: one-hot rows then cancel exactly, at the cost of two more
    products per block. Without, the tile reads the Delta kernel's ``Delta = <dO, o> - dlse``.

    Which of the two does the work is decided on the device: both are launched, and each program
    first reads ``EXACT`` (int32 ``[1]``, 1 when scores may be large: ``scores.large_scores_flag``)
    and returns at once unless it equals ``EXACT_DELTA``. (One kernel holding both ways, branching on
    the flag or giving the first pass's loops trip counts by it, spilled fp16 tiles: docs/backends.md.)
    """
    if EXACT_DELTA:
        if tl.load(EXACT) == 0:
            return
    elif tl.load(EXACT) != 0:
        return
    block, seq, ht = _lpt_program(chunk, N, HT, NB, CHUNK)
    q0, Lq, k0, Lk = _sequence(CU_Q, CU_K, seq)
    pos, h, kvh, p0, PM = _packed_rows(block, ht, G, GH, Lq, BM)
    if p0 >= Lq:
        return
    d = tl.arange(0, BLOCK_D)
    p_last = tl.minimum(p0 + PM, Lq) - 1
    lo_any, hi_all = _row_key_bounds(p0, Lq, Lk, left, right)
    lo_all, hi_any = _row_key_bounds(p_last, Lq, Lk, left, right)
    b0, b1, i0, i1 = _block_split(lo_any, hi_any, lo_all, hi_all, BN)
    n_cut = (i0 - b0) + (b1 - i1)

    q = _load_rows(Q, q0, pos, Lq, stride_qt, h, stride_qh, d)               # [BM, BLOCK_D]
    do = _load_rows(DO, q0, pos, Lq, stride_dot, h, stride_doh, d)           # [BM, BLOCK_D]
    stat = _stat_offsets(h, stride_lh, q0, pos)
    m2 = tl.load(M2 + stat, mask=pos < Lq, other=0.0)
    log2_l = tl.load(L2 + stat, mask=pos < Lq, other=float("inf"))
    dq = tl.zeros([BM, BLOCK_D], tl.float32)
    if EXACT_DELTA:
        delta = tl.zeros([BM], tl.float32)
        for n in range(i0 * BN, i1 * BN, BN):
            dq, delta = _dq_block(dq, delta, q, do, m2, log2_l, K, V, k0, n, pos, Lq, Lk, kvh, stride_kt, stride_kh,
                                  stride_vt, stride_vh, d, left, right, scale_log2, BN, PRECISION, COMPENSATED,
                                  UPCAST, MASKED=False, DELTA_PASS=True)
        for t in range(0, n_cut):
            dq, delta = _dq_block(dq, delta, q, do, m2, log2_l, K, V, k0, _cut_block(t, b0, i0, i1) * BN, pos, Lq,
                                  Lk, kvh, stride_kt, stride_kh, stride_vt, stride_vh, d, left, right, scale_log2,
                                  BN, PRECISION, COMPENSATED, UPCAST, MASKED=True, DELTA_PASS=True)
        if HAS_DLSE:
            delta -= tl.load(DLSE + stat, mask=pos < Lq, other=0.0)
        tl.store(DELTA + stat, delta, mask=pos < Lq)
    else:
        delta = tl.load(DELTA + stat, mask=pos < Lq, other=0.0)
    for n in range(i0 * BN, i1 * BN, BN):
        dq, delta = _dq_block(dq, delta, q, do, m2, log2_l, K, V, k0, n, pos, Lq, Lk, kvh, stride_kt, stride_kh,
                              stride_vt, stride_vh, d, left, right, scale_log2, BN, PRECISION, COMPENSATED, UPCAST,
                              MASKED=False, DELTA_PASS=False)
    for t in range(0, n_cut):
        dq, delta = _dq_block(dq, delta, q, do, m2, log2_l, K, V, k0, _cut_block(t, b0, i0, i1) * BN, pos, Lq, Lk,
                              kvh, stride_kt, stride_kh, stride_vt, stride_vh, d, left, right, scale_log2, BN,
                              PRECISION, COMPENSATED, UPCAST, MASKED=True, DELTA_PASS=False)
    _store_rows(DQ, dq * softmax_scale, q0, pos, Lq, stride_dqt, h, stride_dqh, d)
