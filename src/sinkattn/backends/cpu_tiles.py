"""CPU path in tiles: blocks of query rows against chunks of their visible keys, the same tiles for
the forward and the backward.

A tile is ``R`` query positions of one run of equal-length sequences, with all ``G`` query heads of
each KV head stacked as rows (``stack_group``: K/V chunks serve the whole group), against a chunk of
at most ``BN`` of the keys those rows see. Per row block, over its chunks in order:

    S  = scale (Q_blk K_c^T)                     [N, HKV, G*R, C]   (-inf where not visible)
    forward (online):  m = max(m, max_j S),  l = l e^(m_old - m) + sum_j e^(S - m),
                       acc = acc e^(m_old - m) + e^(S - m) V_c
                       -> o_keys = acc / l, Stats(m, log l)           (the softmax over keys, no sink)
    backward, with the final statistics (sink and every key of the row included) and Delta:
                       P = e^(S - m) / l,  dP = dO V_c^T,  dS = P (dP - Delta)
                       dq += dS K_c,  dk_c += dS^T (scale Q),  dv_c += P^T dO

Scores are rounded as eager attention rounds them, the products and then the scale: ``Q`` is scaled
before its products only where that is exact (a power-of-two scale, e.g. ``1/8`` at ``D = 64``), which
saves a pass over the scores. A query whose products cancel to a small score carries their rounding
(``eps |q_d k_d|``, far above ``ulp(S)``) into its softmax; rounding ``scale Q`` first would add as
much again, with other bits than the eager computation that Gate B compares against.

Exponentials (``_exp_shifted_``) take ``S - m`` floored at ``EXP_FLOOR``: below it ``exp`` underflows
through fp32's subnormals, where PyTorch's CPU kernel takes a path ten times slower (most of a row
of sharp attention, and every masked ``-inf``); the floor's value ``e^-87`` is subtracted again, so
that what lies below it is 0 (fp32 holds less than 1.6e-38 there anyway, as a subnormal).
``exp`` and not ``exp2``: PyTorch's ``exp`` gives the same bits in its vector and scalar loops,
``exp2`` does not (its last elements and the elements at thread boundaries would change with the
tensor's size and the thread count).

The backward recomputes ``S`` with the very products of the forward, so ``S - m`` is exactly what
the forward exponentiated: a row whose attention is one-hot gets ``P = 1/l`` from its own maximum,
and scores of any size keep the precision of eager attention (there is no ``lse`` of magnitude
``|s|`` to subtract). ``Delta = <dO, o> - dlse`` is given per row, so a tile need not hold every key
of its rows (context parallelism calls tiles of a row's keys one at a time). dK/dV chunks are summed
over row blocks in a fixed order. Only the tiles that a row block's visible key range meets are
computed; a tile that every row sees whole skips the mask, and tiles of one geometry share theirs
(``TileMask``, added to finite scores as a 0 / ``-inf`` bias).

Per row block, the backward keeps ``P`` and ``dP`` of the first pass when they fit (``KEPT_ELEMENTS``):
then every ``dS`` is formed before its products and the dominant key's correction is folded into it
(``Dominant.fold``); otherwise it is added after them (``Dominant.apply``). A block none of whose rows
can hold a key of ``P >= 1/2`` (``1/l < 1/2``) skips the search for one.

Non-finite inputs (``literal``): products of a masked tile then keep a NaN or inf of ``q``, ``k`` or
``v`` to the pairs that are visible (``nonfinite.visible_matmul``); a whole visible tile needs nothing.
The dominant-key correction (``Dominant``) is left out there: each gradient keeps the formula's own terms.

The compiled kernel (``cpu_native``, ``csrc/cpu_attention.cpp``) computes these tiles and rules for
finite inputs in one call per batch; this module is the path for NaN / inf and where it is not built.
"""

from __future__ import annotations

import functools
import math
from functools import cached_property

import torch

from ..masks import Window
from .layout import Span, heads_first, stat_view, zero_unwritten
from .nonfinite import visible_matmul

__all__ = ["forward", "backward", "TileMask", "stack_group", "stacked_rows", "unstack_group", "row_scale",
           "score_scale", "block_forward", "block_probabilities", "row_sums", "block_ds", "block_products", "Dominant",
           "DOMINANT_FROM", "EVERY_ROW", "rows_per_block", "BN", "TILE_ELEMENTS"]

BN = 256
"""Keys per chunk."""
TILE_ELEMENTS = 1 << 18
"""Scores per tile (fp32: 1 MiB, a core's L2 on current x86 server parts), which sets the rows per block."""

KEPT_ELEMENTS = 1 << 21
"""Scores per row block over all its chunks: its ``P`` and ``dP`` are kept between the exact-Delta pass and
the gradient pass (fp32: 8 MiB each); a row block that cannot be this small (16 rows against more keys)
computes them twice."""

_NEG_INF = float("-inf")


def rows_per_block(n: int, HQ: int, keys: int) -> int:
    """Query positions per row block, 16 to 128, a multiple of 16: a tile holds at most ``TILE_ELEMENTS``
    scores (``n * HQ * R * min(keys, BN)``) and a row block at most ``KEPT_ELEMENTS`` (``n * HQ * R * keys``)."""
    keys = max(keys, 1)
    fit = min(TILE_ELEMENTS // max(1, n * HQ * min(keys, BN)), KEPT_ELEMENTS // max(1, n * HQ * keys))
    return max(16, min(128, fit // 16 * 16))


def stack_group(x: torch.Tensor, HKV: int) -> torch.Tensor:
    """``[N, HQ, R, ...]`` -> ``[N, HKV, G*R, ...]``: the group's heads stacked as rows (a copy unless contiguous)."""
    N, HQ, R = x.shape[:3]
    return x.reshape(N, HKV, (HQ // HKV) * R, *x.shape[3:])


def stacked_rows(x: torch.Tensor, HKV: int, scale: float | None = None) -> torch.Tensor:
    """A new contiguous ``[N, HKV, G*R, D]`` tensor of ``x [N, HQ, R, D]`` (any strides), times ``scale``
    if given, in one pass."""
    N, HQ, R, D = x.shape
    out = x.new_empty(N, HKV, (HQ // HKV) * R, D)
    if scale is None:
        out.view(N, HQ, R, D).copy_(x)
    else:
        torch.mul(x, scale, out=out.view(N, HQ, R, D))
    return out


def row_scale(scale: float) -> float | None:
    """The factor applied to ``Q`` before its products: ``scale`` where that is exact (a power of two), else None."""
    return scale if math.frexp(abs(scale))[0] == 0.5 else None


def score_scale(scale: float) -> float | None:
    """The factor applied to the products ``Q K^T`` (and to ``dK``): ``scale`` unless ``row_scale`` took it."""
    return None if row_scale(scale) is not None else scale


def unstack_group(x: torch.Tensor, HQ: int) -> torch.Tensor:
    """``[N, HKV, G*R, ...]`` -> ``[N, HQ, R, ...]``."""
    N, HKV, GR = x.shape[:3]
    return x.reshape(N, HQ, GR // (HQ // HKV), *x.shape[3:])


class TileMask:
    """The visible pairs of a tile: ``keep``, bool broadcastable to its scores ``[N, HKV, M, C]``, and two
    forms made on first use: ``bias`` (fp32, 0 where visible, ``-inf`` elsewhere) and ``drop`` (``~keep``).

    Finite scores take the mask as ``S + bias``, a tenth of the time of a broadcast ``masked_fill`` on
    current CPUs; scores that may hold NaN (``literal``) take ``masked_fill``, which replaces them."""

    def __init__(self, keep: torch.Tensor):
        self.keep = keep

    @cached_property
    def bias(self) -> torch.Tensor:
        return torch.zeros(self.keep.shape).masked_fill_(self.drop, _NEG_INF)

    @cached_property
    def drop(self) -> torch.Tensor:
        return ~self.keep


def _scores(qs: torch.Tensor, kb: torch.Tensor, mask: TileMask | None, scale: float | None,
            literal: bool) -> torch.Tensor:
    """``S [N, HKV, M, C]`` fp32 from the rows ``qs [N, HKV, M, D]`` (scaled by ``row_scale``) and keys
    ``kb [N, HKV, C, D]``, times ``scale`` (``score_scale``) if not None; ``-inf`` off ``mask``."""
    s = torch.matmul(qs, kb.transpose(-1, -2))
    if scale is not None:
        s.mul_(scale)
    if mask is not None:
        if literal:
            s.masked_fill_(mask.drop, _NEG_INF)
        else:
            s.add_(mask.bias)
    return s


def _finite(m: torch.Tensor) -> torch.Tensor:
    """The shift subtracted from a row's scores: its maximum, or 0 where that is not finite (no key,
    an infinite or NaN score), so that ``-inf - -inf`` and ``inf - inf`` are never formed."""
    return torch.where(torch.isfinite(m), m, 0.0)


EXP_FLOOR = -87.0
"""The least exponent taken (``e^-87``, a normal fp32 number): see the module doc."""
_AT_FLOOR = float(torch.tensor(EXP_FLOOR).exp())     # fp32's e^-87, as ``exp`` computes it


def _exp_shifted_(s: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``e^(S - c) - e^EXP_FLOOR`` in place, the exponent floored at ``EXP_FLOOR``: exactly 0 at and below the
    floor (a masked ``-inf`` with a finite ``c``), and the subtraction is lost in the rounding of anything
    above ``1e-30`` (NaN stays NaN)."""
    return s.sub_(c).clamp_(min=EXP_FLOOR).exp_().sub_(_AT_FLOOR)


def _pv(p, vb, mask, literal):
    return visible_matmul(p, vb, mask.keep) if literal and mask is not None else torch.matmul(p, vb)


class _Online:
    """The running softmax of one row block over its chunks: true maximum ``m``, the shift ``c`` in
    use, denominator ``l`` and unnormalised ``acc`` (all ``[N, HKV, M, 1]`` but ``acc``)."""

    def __init__(self, s: torch.Tensor, vb, mask, literal: bool):
        self.m = s.amax(-1, keepdim=True)
        self.c = _finite(self.m)
        p = _exp_shifted_(s, self.c)
        self.l = p.sum(-1, keepdim=True)
        self.acc = _pv(p, vb, mask, literal)

    def add(self, s: torch.Tensor, vb, mask, literal: bool) -> None:
        m = torch.maximum(self.m, s.amax(-1, keepdim=True))
        c = _finite(m)
        alpha = torch.where(self.m == _NEG_INF, 0.0, torch.exp(self.c - c))   # nothing to rescale before a key
        p = _exp_shifted_(s, c)
        self.l = self.l.mul_(alpha).add_(p.sum(-1, keepdim=True))
        self.acc = self.acc.mul_(alpha).add_(_pv(p, vb, mask, literal))
        self.m, self.c = m, c

    def result(self):
        """``(o_keys, m, log_l)``: ``o = 0``, ``log_l = -inf`` on rows without keys (``l = 0``); a finite
        maximum gives ``l >= 1``."""
        return self.acc.div_(self.l.clamp(min=1.0)), self.c, torch.log(self.l)


def block_forward(qs, chunks, scale: float | None = None):
    """The softmax of rows ``qs [N, HKV, M, D]`` (scaled by ``row_scale``; ``scale``: ``score_scale``) over
    the chunks ``(kb, vb, mask, literal)`` in order
    -> ``(o_keys [N, HKV, M, D], m [N, HKV, M, 1], log_l [N, HKV, M, 1])``."""
    state = None
    for kb, vb, mask, literal in chunks:
        s = _scores(qs, kb, mask, scale, literal)
        if state is None:
            state = _Online(s, vb, mask, literal)
        else:
            state.add(s, vb, mask, literal)
    return state.result()


def block_probabilities(qs, kb, vb, dos, m, inv_l, mask, literal: bool = False, scale: float | None = None):
    """One tile's ``(P, dP)`` ``[N, HKV, M, C]`` from the final statistics: ``P = e^(S - m) / l``, ``dP = dO V^T``.

    ``qs``/``dos [N, HKV, M, D]`` (``qs`` and ``scale`` as in ``block_forward``), ``kb``/``vb [N, HKV, C, D]``,
    ``m``/``inv_l [N, HKV, M, 1]`` (``inv_l = 1 / l``; ``m`` finite), ``mask`` a ``TileMask`` or None. ``P`` is
    0 off the visible pairs (``e^-inf``, and a NaN ``1/l`` of a NaN sink kept off them); ``literal``: ``dP``
    too, so that a NaN or inf there reaches no sum."""
    p = _exp_shifted_(_scores(qs, kb, mask, scale, literal), m).mul_(inv_l)
    if mask is None:
        return p, torch.matmul(dos, vb.transpose(-1, -2))
    if literal or bool(torch.isnan(inv_l).any()):
        p.masked_fill_(mask.drop, 0.0)
    dp = torch.matmul(dos, vb.transpose(-1, -2))
    if literal:
        dp.masked_fill_(mask.drop, 0.0)
    return p, dp


def row_sums(p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    """``[N, HKV, M, 1]``: ``sum_j P_ij dP_ij`` over one tile's keys (``Delta`` from the products themselves)."""
    return (p * dp).sum(-1, keepdim=True)


def block_ds(p, dp, delta, mask, literal: bool = False):
    """One tile's ``dS = P (dP - Delta)``, written over ``dp`` (0 off the visible pairs when ``literal``)."""
    ds = dp.sub_(delta).mul_(p)
    return ds.masked_fill_(mask.drop, 0.0) if literal and mask is not None else ds


def block_products(p, ds, qs, kb, dos, mask, literal: bool = False):
    """One tile's gradient terms ``(dq_part, dk_part, dv_part)``: ``dq_part = dS K`` (unscaled),
    ``dk_part = dS^T qs`` (unscaled by ``score_scale``), ``dv_part = P^T dO``."""
    if literal and mask is not None:
        mask_t = mask.keep.transpose(-1, -2)
        return (visible_matmul(ds, kb, mask.keep), visible_matmul(ds.transpose(-1, -2), qs, mask_t),
                visible_matmul(p.transpose(-1, -2), dos, mask_t))
    return torch.matmul(ds, kb), torch.matmul(ds.transpose(-1, -2), qs), torch.matmul(p.transpose(-1, -2), dos)


DOMINANT_FROM = 0.5
"""The least ``P`` of a row's largest key at which ``Dominant`` takes that key's ``dS`` from the identity, on
rows of any length (``cpu_small``'s rows, of at most 16 keys, take it on every row: ``Dominant(EVERY_ROW)``)."""

EVERY_ROW = float(torch.finfo(torch.float32).tiny)
"""A ``Dominant`` threshold that takes the identity on every row that sees a key (``P > 0``), as eager
attention does through the gradient of its max subtraction."""


class Dominant:
    """Per row of a block: its key of largest ``P`` (the first on ties) and ``sum_j dS_ij``, to form that
    key's ``dS`` from the others' (``correction``).

    ``sum_j dS_ij + dS_sink = dlse_i`` holds exactly (the softmax's terms sum to one; the sink's
    ``dS = -P_sink Delta``). A row whose attention sits all but ``1 - P < 2^-24`` on one key has that key's
    ``P = 1`` in fp32 and ``dS = P (dP - Delta)`` rounded to noise, while the truth ``P (1 - P) dP`` is
    carried by the other keys and the sink; eager attention recovers it through the gradient of its
    max subtraction. Here the dominant key's ``dS`` is set to what the identity leaves for it, on rows where
    it holds at least ``DOMINANT_FROM`` of the mass: the direct ``dS`` loses ``eps / (1 - P)`` to the
    cancellation in ``dP - Delta``, the identity about ``eps`` of the other terms. Below it, on a long row
    whose mass is spread over many keys, the direct form is the better one (the identity's error grows with
    the number of terms); on a short row the identity is (``EVERY_ROW``): where two keys of opposite sign
    share the mass, the direct ``dS`` errors do not cancel in ``dQ`` and leave it several times eager's
    error, which sums through the identity."""

    def __init__(self, threshold: float = DOMINANT_FROM):
        self.threshold = threshold
        self.best = self.key = self.ds_sum = None

    @classmethod
    def for_rows(cls, inv_l: torch.Tensor, threshold: float = DOMINANT_FROM) -> "Dominant | None":
        """A search for rows of ``inv_l = 1 / l``, or None where no row may have a key of ``P >= threshold``
        (a row's largest ``P`` is ``e^(max_j s_ij - m) / l <= 1 / l``): such a block skips the correction."""
        return cls(threshold) if bool((inv_l >= threshold).any()) else None

    def see(self, p: torch.Tensor, first_key: int) -> None:
        """One chunk's ``P [..., M, C]`` of keys ``first_key + [0, C)``."""
        best, key = p.max(-1, keepdim=True)
        key += first_key
        if self.best is None:
            self.best, self.key = best, key
        else:
            better = best > self.best
            self.best, self.key = torch.where(better, best, self.best), torch.where(better, key, self.key)

    def add(self, ds: torch.Tensor) -> None:
        """One chunk's ``dS``, summed in fp64."""
        rows = ds.sum(-1, keepdim=True, dtype=torch.float64)
        self.ds_sum = rows if self.ds_sum is None else self.ds_sum.add_(rows)

    def correction(self, sink_mass: torch.Tensor | None, delta: torch.Tensor, dlse: torch.Tensor | None):
        """``[..., M, 1]`` fp32: what to add to the dominant key's ``dS`` (0 on a row without keys).

        The sum and the target are taken in fp64: the row's ``dS`` are each rounded once, as the direct form's
        are, and the correction adds one rounding more (an fp32 sum would add one per partial sum, of the size
        of the largest ``dS``, where the dominant key holds little more than half the mass)."""
        delta = delta.double()
        target = torch.zeros_like(delta) if sink_mass is None else sink_mass.double() * delta
        if dlse is not None:
            target = target + dlse.double()
        return torch.where(self.best >= self.threshold, target - self.ds_sum, 0.0).float()

    def fold(self, fix: torch.Tensor, chunks) -> None:
        """Add ``fix`` to the dominant keys' ``dS`` before the products: ``chunks`` are ``(ds [..., M, C],
        first_key)``, every chunk of the rows' keys."""
        for ds, first_key in chunks:
            local = self.key - first_key
            inside = (local >= 0) & (local < ds.shape[-1])
            ds.scatter_add_(-1, local.clamp_(0, ds.shape[-1] - 1), torch.where(inside, fix, 0.0))

    def apply(self, fix: torch.Tensor, qs: torch.Tensor, keys: torch.Tensor, dq_s: torch.Tensor,
              dk: torch.Tensor) -> None:
        """Add ``fix`` at the dominant keys after the products, for a row block whose ``dS`` are not all kept:
        ``dq_s += fix K[key]``, ``dk[key] += fix qs`` (in row order)."""
        index = self.key.expand(*self.key.shape[:-1], keys.shape[-1])
        dq_s.add_(fix * keys.gather(-2, index))
        dk.scatter_add_(-2, index, fix * qs)


def _tiles(n: int, HQ: int, G: int, Lq: int, Lk: int, window: Window):
    """Per row block ``(r0, r1, [(c0, c1, mask), ...])``: its chunks of visible keys, each with its
    ``TileMask`` (``[G*R, C]``, stacked rows) or None when every row sees the whole chunk."""
    R = rows_per_block(n, HQ, Lk)
    for r0, r1, k0, k1, _ in window.row_blocks(Lq, Lk, R):
        chunks = []
        for c0 in range(k0, k1, BN):
            c1 = min(c0 + BN, k1)
            mask = None
            if not window.block_fully_visible(r0, r1, c0, c1, Lq, Lk):
                mask = _tile_mask(r1 - r0, c1 - c0, r0 + Lk - Lq - c0, window, G)
            chunks.append((c0, c1, mask))
        yield r0, r1, chunks


@functools.lru_cache(maxsize=64)
def _tile_mask(R: int, C: int, shift: int, window: Window, G: int) -> TileMask:
    """``Window.block_visible`` for the stacked rows of a tile, shared by the tiles of one geometry across calls
    (the diagonal tiles of a causal sequence have a handful of geometries)."""
    return TileMask(window.block_visible(R, C, shift).repeat(G, 1))


def _run_views(q, k, v, run):
    """One run heads first: a view of ``q`` and contiguous copies of ``k``, ``v`` (``[n, H, L, D]``)."""
    qh = heads_first(q, run.tq, run.n, run.Lq)
    return qh, heads_first(k, run.tk, run.n, run.Lk).contiguous(), heads_first(v, run.tk, run.n, run.Lk).contiguous()


def forward(q, k, v, runs, out, m, log_l, softmax_scale: float, window: Window, literal: bool = False):
    """Fill fp32 ``out [Tq, HQ, D]`` (softmax over keys), ``m``/``log_l [HQ, Tq]`` on the rows of ``runs``
    from fp32 ``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``; rows without keys get ``o = 0``, ``log_l = -inf``."""
    HQ, HKV = q.shape[1], k.shape[1]
    G = HQ // HKV
    for run in runs:
        qh, kh, vh = _run_views(q, k, v, run)
        og = heads_first(out, run.tq, run.n, run.Lq)
        mg, lg = stat_view(m, run.tq, run.n, run.Lq), stat_view(log_l, run.tq, run.n, run.Lq)
        rows = Span()
        for r0, r1, chunks in _tiles(run.n, HQ, G, run.Lq, run.Lk, window):
            qs = stacked_rows(qh[:, :, r0:r1], HKV, row_scale(softmax_scale))
            o, mb, lb = block_forward(qs, ((kh[:, :, c0:c1], vh[:, :, c0:c1], mask, literal)
                                           for c0, c1, mask in chunks), score_scale(softmax_scale))
            rows.take(r0, r1)
            og[:, :, r0:r1] = unstack_group(o, HQ)
            mg[:, :, r0:r1] = unstack_group(mb.squeeze(-1), HQ)
            lg[:, :, r0:r1] = unstack_group(lb.squeeze(-1), HQ)
        zero_unwritten(rows, run.Lq, og, mg)
        zero_unwritten(rows, run.Lq, lg, value=_NEG_INF)


def backward(do, q, k, v, m, inv_l, delta, dlse, sink_mass, runs, dq, dk, dv, softmax_scale: float, window: Window,
             literal: bool = False, exact: bool = False):
    """Fill fp32 ``dq``, ``dk``, ``dv`` on the tokens of ``runs`` from fp32 ``do [Tq, HQ, D]``, the final
    statistics ``m``, ``inv_l = 1 / l`` and ``delta = <dO, o> - dlse``, all ``[HQ, Tq]``.

    ``exact`` (the call holds every key of its rows): ``Delta = sum_j P dP - dlse`` instead, summed from the
    very products the gradients use (a first pass over the chunks, whose ``P``, ``dP`` the gradient pass
    reuses when the row block holds at most ``KEPT_ELEMENTS``), and written into ``delta``. ``dS`` then sums
    to exactly what the products give, as eager attention's softmax backward does: the rounding of
    ``<dO, o>`` against ``dP`` would otherwise reach ``dq`` and ``dk`` times the norm of the keys (with
    sharp attention it is all of ``dS``). With it each row's dominant key takes its ``dS`` from the others'
    (``Dominant``; ``sink_mass [HQ, Tq]``, the sink's probability per row, or None without sinks)."""
    HQ, HKV = q.shape[1], k.shape[1]
    G = HQ // HKV
    post = score_scale(softmax_scale)
    for run in runs:
        qh, kh, vh = _run_views(q, k, v, run)
        doh, dqg = heads_first(do, run.tq, run.n, run.Lq), heads_first(dq, run.tq, run.n, run.Lq)
        m_r, inv_l_r, delta_r = (stat_view(s, run.tq, run.n, run.Lq) for s in (m, inv_l, delta))
        dlse_r, sink_r = (stat_view(s, run.tq, run.n, run.Lq) if s is not None else None for s in (dlse, sink_mass))
        dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
        rows = Span()
        for r0, r1, chunks in _tiles(run.n, HQ, G, run.Lq, run.Lk, window):
            qs = stacked_rows(qh[:, :, r0:r1], HKV, row_scale(softmax_scale))
            dos = stacked_rows(doh[:, :, r0:r1], HKV)
            mb, lb = (stack_group(s[:, :, r0:r1, None], HKV) for s in (m_r, inv_l_r))
            tiles = [(kh[:, :, c0:c1], vh[:, :, c0:c1], mask, c0, c1) for c0, c1, mask in chunks]
            kept = dominant = None
            cache = exact and qs.shape[:3].numel() * sum(t[0].shape[2] for t in tiles) <= KEPT_ELEMENTS
            if exact:
                kept, sums, dominant = [], None, (None if literal else Dominant.for_rows(lb))
                for kb, vb, mask, c0, _ in tiles:
                    pdp = block_probabilities(qs, kb, vb, dos, mb, lb, mask, literal, post)
                    sums = row_sums(*pdp) if sums is None else sums.add_(row_sums(*pdp))
                    if dominant is not None:
                        dominant.see(pdp[0], c0)
                    kept.append(pdp if cache else None)
                db = sums if dlse_r is None else sums.sub_(stack_group(dlse_r[:, :, r0:r1, None], HKV))
                delta_r[:, :, r0:r1] = unstack_group(db.squeeze(-1), HQ)
            else:
                db = stack_group(delta_r[:, :, r0:r1, None], HKV)
            dl = stack_group(dlse_r[:, :, r0:r1, None], HKV) if exact and dlse_r is not None else None
            sink_b = (stack_group(sink_r[:, :, r0:r1, None], HKV)
                      if dominant is not None and sink_r is not None else None)
            folded = dominant is not None and cache
            if folded:                  # every dS first, the dominant key's taken from the others', then products
                for (p, dp), (_, _, mask, _, _) in zip(kept, tiles):
                    dominant.add(block_ds(p, dp, db, mask, literal))
                dominant.fold(dominant.correction(sink_b, db, dl), [(dp, t[3]) for (_, dp), t in zip(kept, tiles)])
            dq_s = None
            for i, (kb, vb, mask, c0, c1) in enumerate(tiles):
                cached = kept is not None and kept[i] is not None
                p, dp = kept[i] if cached else block_probabilities(qs, kb, vb, dos, mb, lb, mask, literal, post)
                ds = dp if folded else block_ds(p, dp, db, mask, literal)
                if dominant is not None and not folded:
                    dominant.add(ds)
                dq_c, dk_c, dv_c = block_products(p, ds, qs, kb, dos, mask, literal)
                dq_s = dq_c if dq_s is None else dq_s.add_(dq_c)
                dkh[:, :, c0:c1] += dk_c
                dvh[:, :, c0:c1] += dv_c
            if dominant is not None and not folded:
                dominant.apply(dominant.correction(sink_b, db, dl), qs, kh, dq_s, dkh)
            rows.take(r0, r1)
            dqg[:, :, r0:r1] = unstack_group(dq_s.mul_(softmax_scale), HQ)
        zero_unwritten(rows, run.Lq, dqg)
        heads_first(dk, run.tk, run.n, run.Lk).copy_(dkh if post is None else dkh.mul_(post))
        heads_first(dv, run.tk, run.n, run.Lk).copy_(dvh)
