"""CPU path on PyTorch's fused flash-attention kernel, tile by tile.

The kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) streams keys
with an online softmax, takes GQA without copying K/V, returns the log-sum-exp
over keys, and has a backward that takes a log-sum-exp as input. Fed ``out = o``
and ``logsumexp = lse`` *with* the sink, that backward recomputes
``P = exp(S - lse)`` (the sink's probabilities) and ``Delta = <dO, o>``: exactly
the sink attention backward. A ``dlse`` term rides on one extra head-dim column:
``q, k, o += [0]``, ``v += [1]``, ``dO += [dlse]`` adds ``dlse_i`` to every
``dP_ij``, i.e. ``Delta_i -> <dO_i, o_i> - dlse_i``.

Masks map onto the kernel per sequence (``plan``): full attention is one call;
causal is one top-left-causal call on the square diagonal part plus, when
``Lk > Lq``, one unmasked call on the keys every row sees; anything else
(windows) is cut into blocks of ``BLOCK_M`` rows, each given only its visible key
range and a small additive mask where the block is partly visible. Blocks
outside the limits are never computed; partial results over the same rows are
merged by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import masks, sink
from .layout import Run, Span, group_views, heads_first, stat_view, write, zero_unwritten

__all__ = ["forward", "backward", "single_call", "single_part", "forward_single", "forward_heads_first",
           "backward_single", "plan", "BLOCK_M"]

BLOCK_M = 64
"""Query rows per block on the windowed path."""

_FWD = torch._scaled_dot_product_flash_attention_for_cpu     # the same op as torch.ops.aten's, 2 us cheaper to call
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Part:
    """Rows ``[r0, r1)`` against keys ``[k0, k1)`` of one sequence: one kernel call.

    With ``count > 1`` it is a run of ``count`` blocks of one geometry, batched into that one call:
    block ``b`` takes rows ``r0 + b*R + [0, R)`` and keys ``k0 + b*R + [0, K)`` (``R = block_rows``,
    ``K = block_keys``; the key windows overlap) and they all share ``mask`` / ``has_key``.
    """

    r0: int
    r1: int
    k0: int
    k1: int
    causal: bool = False                 # top-left causal on a square part
    mask: torch.Tensor | None = None     # additive fp32 [R, K], 0 or -inf
    has_key: torch.Tensor | None = None  # bool [R]: the row sees a key of this part
    count: int = 1

    @property
    def block_rows(self) -> int:
        return (self.r1 - self.r0) // self.count

    @property
    def block_keys(self) -> int:
        return (self.k1 - self.k0) - (self.count - 1) * self.block_rows

    def blocks(self):
        """``(r0, r1, k0, k1)`` of each block of the run."""
        R, K = self.block_rows, self.block_keys
        for b in range(self.count):
            yield self.r0 + b * R, self.r0 + (b + 1) * R, self.k0 + b * R, self.k0 + b * R + K

    def extended_by(self, other: "Part") -> "Part | None":
        """This run with ``other`` appended, if ``other`` is its next block (same geometry, one step on)."""
        R, K = self.block_rows, self.block_keys
        same = (other.count == 1 and other.r1 - other.r0 == R and other.k1 - other.k0 == K
                and other.mask is self.mask and not self.causal and not other.causal)
        if same and other.r0 == self.r1 and other.k0 == self.k0 + self.count * R:
            return Part(self.r0, other.r1, self.k0, other.k1, mask=self.mask, has_key=self.has_key,
                        count=self.count + 1)
        return None


def plan(Lq: int, Lk: int, left: int, right: int, block_m: int = BLOCK_M) -> tuple[Part, ...]:
    """The kernel calls that cover exactly the visible (i, j) pairs of one sequence.

    Not cached across calls: a plan is a walk over ``Lq / block_m`` blocks, and its band masks
    cost a small fraction of the attention over them, while a cache keyed by lengths would
    keep a mask per length for good in packed training, whose lengths change every step."""
    if Lq == 0 or Lk == 0:
        return ()
    if left < 0 and right < 0:
        return (Part(0, Lq, 0, Lk),)
    offset = Lk - Lq
    if left < 0 and right == 0:
        if offset < 0:                   # rows [0, -offset) see no key
            return (Part(-offset, Lq, 0, Lk, causal=True),)
        diagonal = Part(0, Lq, offset, Lk, causal=True)
        return ((Part(0, Lq, 0, offset),) if offset > 0 else ()) + (diagonal,)
    parts, band_masks = [], {}
    for r0, r1, k0, k1, full in masks.row_blocks(Lq, Lk, left, right, block_m):
        if full:
            parts.append(Part(r0, r1, k0, k1))
            continue
        geometry = (r1 - r0, k1 - k0, r0 + (Lk - Lq) - k0)
        if geometry not in band_masks:
            band_masks[geometry] = _band_mask(*geometry, left, right)
        mask, has_key = band_masks[geometry]
        parts.append(Part(r0, r1, k0, k1, mask=mask, has_key=has_key))
    return tuple(_runs(parts))


def _runs(parts: list[Part]) -> list[Part]:
    """Consecutive blocks of one geometry fused into runs (one batched kernel call each)."""
    out: list[Part] = []
    for part in parts:
        run = out[-1].extended_by(part) if out else None
        if run is not None:
            out[-1] = run
        else:
            out.append(part)
    return out


def _windows(x: torch.Tensor, i: int, start: int, count: int, length: int, step: int) -> torch.Tensor:
    """``[count, H, length, D]`` view of batch item ``i`` of ``x [N, H, L, D]``: window ``b`` is
    tokens ``start + b*step + [0, length)``. Windows may overlap (read-only use then)."""
    xi = x[i]
    s_h, s_l, s_d = xi.stride()
    return torch.as_strided(xi, (count, xi.shape[0], length, xi.shape[2]), (step * s_l, s_h, s_l, s_d),
                            xi.storage_offset() + start * s_l)


def _stat_windows(stat: torch.Tensor, i: int, part: Part) -> torch.Tensor:
    """``[count, H, R]`` view of the rows of ``part`` in batch item ``i`` of ``stat [N, H, Lq]``."""
    return stat[i, :, part.r0:part.r1].unflatten(1, (part.count, part.block_rows)).transpose(0, 1)


def _band_mask(R: int, K: int, shift: int, left: int, right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask ``[R, K]`` and row-has-key ``[R]`` of a block whose row ``a`` sits ``shift`` past
    key 0 of its range. Inside ``[k0, k1)`` the length limits never bind, so every block of the same
    geometry shares one mask (a long sliding-window sequence builds a handful, not one per block)."""
    span = R + abs(shift) + K + 1          # a square frame large enough that no limit clips
    vis = masks.visible(torch.arange(R) + shift, torch.arange(K), span, span, left, right)
    return torch.zeros(vis.shape).masked_fill_(~vis, _NEG_INF), vis.any(1)


def _merge(og, lg, o_p, lse_p, start: int, fresh: slice, seen: slice) -> None:
    """Combine a part's ``(o_p, lse_p)`` over rows ``start:`` into the accumulators ``og``/``lg``.

    Fresh rows are assigned; rows already holding a result over other keys are merged:
    ``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``.
    """
    f = slice(fresh.start - start, fresh.stop - start)
    og[:, :, fresh] = o_p[:, :, f]
    lg[:, :, fresh] = lse_p[:, :, f]
    if seen.stop > seen.start:
        s = slice(seen.start - start, seen.stop - start)
        lse_a, lse_b = lg[:, :, seen], lse_p[:, :, s]
        lse_new = torch.logaddexp(lse_a, lse_b)
        og[:, :, seen] = (og[:, :, seen] * sink.key_mass(lse_a, lse_new)[..., None]
                          + o_p[:, :, s] * sink.key_mass(lse_b, lse_new)[..., None])
        lg[:, :, seen] = lse_new


def single_call(split, left: int, right: int, all_keys: bool = False) -> tuple[Run, Part] | None:
    """``(run, part)`` when one kernel call covers the whole batch (``split.single``: a dense batch or
    one sequence) without a mask: every row against the keys ``[part.k0, part.k1)`` (full or square
    causal attention, or a window that every row sees whole, as in decoding), else None.
    ``all_keys``: only a call that also covers every key."""
    run = split.single
    part = None if run is None else single_part(run.Lq, run.Lk, left, right)
    if part is None or (all_keys and (part.k0, part.k1) != (0, run.Lk)):
        return None
    return run, part


def single_part(Lq: int, Lk: int, left: int, right: int) -> Part | None:
    """The one unmasked part that covers every row of a sequence, or None when the plan needs more."""
    parts = plan(Lq, Lk, left, right)
    if len(parts) != 1 or parts[0].mask is not None or (parts[0].r0, parts[0].r1) != (0, Lq):
        return None
    return parts[0]


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """Kernel result ``[N, H, L, D]`` (laid out as ``[N, L, H, D]``, like its inputs) -> ``[N*L, H, D]``."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _forward_run(part, qg, kg, vg, og, lg, rows: Span, softmax_scale) -> None:
    """A run of same-geometry blocks in one kernel call per batch item; rows are disjoint."""
    fresh, seen = rows.take(part.r0, part.r1)
    assert seen.stop == seen.start, "runs only cover rows seen for the first time"
    c, R, K = part.count, part.block_rows, part.block_keys
    for i in range(qg.shape[0]):
        o, lse = _FWD(_windows(qg, i, part.r0, c, R, R), _windows(kg, i, part.k0, c, K, R),
                      _windows(vg, i, part.k0, c, K, R), 0.0, False, attn_mask=part.mask,
                      scale=softmax_scale)                               # [c, HQ, R, D], [c, HQ, R]
        _windows(og, i, part.r0, c, R, R).copy_(o)
        if part.has_key is not None:   # the kernel reports lse 0 on fully masked rows
            lse = lse.masked_fill(~part.has_key, _NEG_INF)
        _stat_windows(lg, i, part).copy_(lse)


def _backward_run(part, qg, kg, vg, dog, og, lg, dqg, dkg, dvg, rows: Span, keys: Span, softmax_scale) -> None:
    """Backward of a run: dQ per block; dK/dV of the overlapping key windows added in a fixed order."""
    rows.take(part.r0, part.r1)
    fresh, _ = keys.take(part.k0, part.k1)
    dkg[:, :, fresh] = 0.0
    dvg[:, :, fresh] = 0.0
    c, R, K = part.count, part.block_rows, part.block_keys
    D = dqg.shape[-1]                      # without the dlse column
    for i in range(qg.shape[0]):
        dq, dk, dv = _BWD(_windows(dog, i, part.r0, c, R, R), _windows(qg, i, part.r0, c, R, R),
                          _windows(kg, i, part.k0, c, K, R), _windows(vg, i, part.k0, c, K, R),
                          _windows(og, i, part.r0, c, R, R), _stat_windows(lg, i, part).contiguous(), 0.0, False,
                          attn_mask=part.mask, scale=softmax_scale)      # dk, dv: [c, HKV, K, D]
        _windows(dqg, i, part.r0, c, R, R).copy_(dq[..., :D])
        for j in range(0, K, R):           # chunk j of every window: disjoint targets, one add each
            w = min(R, K - j)
            _windows(dkg, i, part.k0 + j, c, w, R).add_(dk[:, :, j:j + w, :D])
            _windows(dvg, i, part.k0 + j, c, w, R).add_(dv[:, :, j:j + w, :D])


def forward_heads_first(qh, kh, vh, part, softmax_scale):
    """One kernel call on heads-first views (any strides): ``qh [N, HQ, Lq, D]``, ``kh``/``vh [N, HKV, Lk, D]``
    under ``single_call``'s ``part`` -> ``(o_keys [N, HQ, Lq, D], lse_keys [N, HQ, Lq])``; ``o_keys`` is laid
    out as ``qh`` is (tokens first for a view of a tokens-first tensor), ``lse_keys`` as ``[N, Lq, HQ]``."""
    if (part.k0, part.k1) != (0, kh.shape[2]):
        kh, vh = kh[:, :, part.k0:part.k1], vh[:, :, part.k0:part.k1]
    return _FWD(qh, kh, vh, 0.0, part.causal, scale=softmax_scale)


def forward_single(q, k, v, single, softmax_scale):
    """The whole batch in one kernel call (``single_call``): ``(o_keys [Tq, HQ, D], lse_keys [HQ, Tq])``
    in the kernel's own result buffers, no copy."""
    (run, part), (Tq, HQ) = single, q.shape[:2]
    o, lse = forward_heads_first(heads_first(q, 0, run.n, run.Lq), heads_first(k, 0, run.n, run.Lk),
                                 heads_first(v, 0, run.n, run.Lk), part, softmax_scale)
    return _tokens_first(o), lse.transpose(0, 1).reshape(HQ, Tq)


def forward(q, k, v, runs, out, lse_keys, softmax_scale, left, right):
    """Fill fp32 ``out [Tq, HQ, D]`` and ``lse_keys [HQ, Tq]`` on the rows of ``runs`` from fp32
    ``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``: the softmax over visible keys only (``lse_keys = -inf``,
    ``o = 0`` on rows that see none)."""
    for _, Lq, Lk, (qg, og), (kg, vg), (lg,) in group_views(runs, (q, out), (k, v), (lse_keys,)):
        rows = Span()
        for part in plan(Lq, Lk, left, right):
            if part.count > 1:
                _forward_run(part, qg, kg, vg, og, lg, rows, softmax_scale)
                continue
            keys = slice(part.k0, part.k1)
            o_p, lse_p = _FWD(qg[:, :, part.r0:part.r1], kg[:, :, keys], vg[:, :, keys], 0.0, part.causal,
                              attn_mask=part.mask, scale=softmax_scale)    # [N, HQ, r, D], [N, HQ, r]
            if part.has_key is not None:   # the kernel reports lse 0 on fully masked rows
                lse_p = lse_p.masked_fill(~part.has_key, _NEG_INF)
            _merge(og, lg, o_p, lse_p, part.r0, *rows.take(part.r0, part.r1))
        zero_unwritten(rows, Lq, og)
        zero_unwritten(rows, Lq, lg, value=_NEG_INF)


def _with_dlse(do, dlse, q, k, v, out):
    """The ``dlse`` term on one extra head-dim column (module doc); ``lse = -inf`` rows made ``+inf``."""
    if dlse is None:
        return do, q, k, v, out
    do = torch.cat([do, dlse.float().t()[..., None]], dim=-1)
    return do, F.pad(q, (0, 1)), F.pad(k, (0, 1)), F.pad(v, (0, 1), value=1.0), F.pad(out, (0, 1))


def backward_single(do, dlse, q, k, v, out, lse, single, softmax_scale):
    """fp32 ``(dq, dk, dv)`` of the whole batch in one kernel call (``single_call``)."""
    (run, part), D = single, q.shape[-1]
    n, Lq, Lk = run.n, run.Lq, run.Lk
    do, q, k, v, out = _with_dlse(do, dlse, q, k, v, out)
    lse = lse.masked_fill(lse == _NEG_INF, float("inf"))   # exp(S - lse) = 0 on rows that see nothing
    grads = _BWD(heads_first(do, 0, n, Lq), heads_first(q, 0, n, Lq), heads_first(k, 0, n, Lk),
                 heads_first(v, 0, n, Lk), heads_first(out, 0, n, Lq), stat_view(lse, 0, n, Lq).contiguous(),
                 0.0, part.causal, scale=softmax_scale)
    return tuple(_tokens_first(g)[..., :D] for g in grads)


def backward(do, dlse, q, k, v, out, lse, runs, dq, dk, dv, softmax_scale, left, right):
    """Fill fp32 ``dq``, ``dk``, ``dv`` on the tokens of ``runs`` from fp32 ``do``, ``out`` (with sink)
    and ``lse [HQ, Tq]`` (with sink)."""
    D = q.shape[-1]
    do, q, k, v, out = _with_dlse(do, dlse, q, k, v, out)
    lse = lse.masked_fill(lse == _NEG_INF, float("inf"))   # exp(S - lse) = 0 on rows that see nothing
    for _, Lq, Lk, (qg, dog, og, dqg), (kg, vg, dkg, dvg), (lg,) in group_views(
            runs, (q, do, out, dq), (k, v, dk, dv), (lse,)):
        rows_done, keys_done = Span(), Span()
        for part in plan(Lq, Lk, left, right):
            if part.count > 1:
                _backward_run(part, qg, kg, vg, dog, og, lg, dqg, dkg, dvg, rows_done, keys_done, softmax_scale)
                continue
            rows, keys = slice(part.r0, part.r1), slice(part.k0, part.k1)
            dq_p, dk_p, dv_p = _BWD(dog[:, :, rows], qg[:, :, rows], kg[:, :, keys], vg[:, :, keys],
                                    og[:, :, rows], lg[:, :, rows].contiguous(), 0.0, part.causal,
                                    attn_mask=part.mask, scale=softmax_scale)
            write(dqg, dq_p[..., :D], part.r0, *rows_done.take(part.r0, part.r1))
            fresh, seen = keys_done.take(part.k0, part.k1)
            write(dkg, dk_p[..., :D], part.k0, fresh, seen)
            write(dvg, dv_p[..., :D], part.k0, fresh, seen)
        zero_unwritten(rows_done, Lq, dqg)
        zero_unwritten(keys_done, Lk, dkg, dvg)
