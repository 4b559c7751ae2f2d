"""CPU inference path on PyTorch's fused flash-attention kernel (forward only).

The kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) streams keys with an online
softmax, takes GQA without copying K/V and returns the log-sum-exp over keys: the partial result of
the backend protocol (``sinkattn.sink``) with ``Stats(m = lse, log_l = 0)``. It is the fastest forward
PyTorch has on a CPU; calls that need gradients take ``cpu_tiles`` instead, whose forward and backward
share their tiles (the fused backward rebuilds ``P`` from an ``lse`` rounded at ``ulp(|lse|)``).

Masks map onto the kernel per sequence (``plan``), each row in exactly one kernel call: full
attention is one call, square causal one top-left-causal call (the rows of ``Lq > Lk`` that see no
key left out), anything else (windows, causal ``Lq < Lk``) is cut into blocks of ``BLOCK_M`` rows,
each given only its visible key range and an additive mask where the block is partly visible. Blocks
outside the limits are never computed.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from ..masks import Window
from .layout import Run, Span, heads_first, stat_view, zero_unwritten

__all__ = ["forward", "single_call", "single_part", "forward_heads_first", "plan", "BLOCK_M"]

BLOCK_M = 64
"""Query rows per block on the windowed path."""

_FWD = torch._scaled_dot_product_flash_attention_for_cpu     # the same op as torch.ops.aten's, 2 us cheaper to call
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


def plan(Lq: int, Lk: int, window: Window, block_m: int = BLOCK_M) -> tuple[Part, ...]:
    """The kernel calls that cover exactly the visible (i, j) pairs of one sequence, each row in one call.

    Not cached across calls: a plan is a walk over ``Lq / block_m`` blocks, and its band masks
    cost a small fraction of the attention over them, while a cache keyed by lengths would
    keep a mask per length for good in packed training, whose lengths change every step."""
    if Lq == 0 or Lk == 0:
        return ()
    if window.unbounded:
        return (Part(0, Lq, 0, Lk),)
    offset = Lk - Lq
    if window == (-1, 0) and offset <= 0:      # causal alone: rows [0, -offset) see no key
        return (Part(-offset, Lq, 0, Lk, causal=True),)
    parts, band_masks = [], {}
    for r0, r1, k0, k1, full in window.row_blocks(Lq, Lk, block_m):
        if full:
            parts.append(Part(r0, r1, k0, k1))
            continue
        geometry = (r1 - r0, k1 - k0, r0 + (Lk - Lq) - k0)
        if geometry not in band_masks:
            band_masks[geometry] = _band_mask(*geometry, window)
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


def _band_mask(R: int, K: int, shift: int, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive mask ``[R, K]`` and row-has-key ``[R]`` of a block whose row ``a`` sits ``shift`` past
    key 0 of its range. Inside ``[k0, k1)`` the length limits never bind, so every block of the same
    geometry shares one mask (a long sliding-window sequence builds a handful, not one per block)."""
    vis = window.block_visible(R, K, shift)
    return torch.zeros(vis.shape).masked_fill_(~vis, _NEG_INF), vis.any(1)


def single_call(split, window: Window, all_keys: bool = False) -> tuple[Run, Part] | None:
    """``(run, part)`` when one kernel call covers the whole batch (``split.single``: a dense batch or
    one sequence) without a mask: every row against the keys ``[part.k0, part.k1)`` (full or square
    causal attention, or a window that every row sees whole, as in decoding), else None.
    ``all_keys``: only a call that also covers every key."""
    run = split.single
    part = None if run is None else single_part(run.Lq, run.Lk, window)
    if part is None or (all_keys and (part.k0, part.k1) != (0, run.Lk)):
        return None
    return run, part


@functools.lru_cache(maxsize=64)
def single_part(Lq: int, Lk: int, window: Window) -> Part | None:
    """The one unmasked part that covers every row of a sequence, or None when the plan needs more."""
    parts = plan(Lq, Lk, window)
    if len(parts) != 1 or parts[0].mask is not None or (parts[0].r0, parts[0].r1) != (0, Lq):
        return None
    return parts[0]


def forward_heads_first(qh, kh, vh, part, softmax_scale):
    """One kernel call on heads-first views (any strides): ``qh [N, HQ, Lq, D]``, ``kh``/``vh [N, HKV, Lk, D]``
    under ``single_call``'s ``part`` -> ``(o_keys [N, HQ, Lq, D], lse_keys [N, HQ, Lq])``; ``o_keys`` is laid
    out as ``qh`` is (tokens first for a view of a tokens-first tensor), ``lse_keys`` as ``[N, Lq, HQ]``."""
    if (part.k0, part.k1) != (0, kh.shape[2]):
        kh, vh = kh[:, :, part.k0:part.k1], vh[:, :, part.k0:part.k1]
    return _FWD(qh, kh, vh, 0.0, part.causal, scale=softmax_scale)


def _run_call(part, qg, kg, vg, og, lg, i, softmax_scale) -> None:
    """A run of ``count`` same-geometry blocks of batch item ``i`` in one kernel call, into ``og``/``lg``."""
    c, R, K = part.count, part.block_rows, part.block_keys
    o, lse = _FWD(_windows(qg, i, part.r0, c, R, R), _windows(kg, i, part.k0, c, K, R),
                  _windows(vg, i, part.k0, c, K, R), 0.0, part.causal, attn_mask=part.mask,
                  scale=softmax_scale)                               # [c, HQ, R, D], [c, HQ, R]
    _windows(og, i, part.r0, c, R, R).copy_(o)
    if part.has_key is not None:   # the kernel reports lse 0 on fully masked rows
        lse = lse.masked_fill(~part.has_key, _NEG_INF)
    _stat_windows(lg, i, part).copy_(lse)


def forward(q, k, v, runs, out, lse_keys, softmax_scale, window: Window):
    """Fill fp32 ``out [Tq, HQ, D]`` and ``lse_keys [HQ, Tq]`` on the rows of ``runs`` from fp32
    ``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``: the softmax over visible keys only (``lse_keys = -inf``,
    ``o = 0`` on rows that see none)."""
    for run in runs:
        qg, og = heads_first(q, run.tq, run.n, run.Lq), heads_first(out, run.tq, run.n, run.Lq)
        kg, vg = heads_first(k, run.tk, run.n, run.Lk), heads_first(v, run.tk, run.n, run.Lk)
        lg = stat_view(lse_keys, run.tq, run.n, run.Lq)
        rows = Span()
        for part in plan(run.Lq, run.Lk, window):
            rows.take(part.r0, part.r1)
            if part.count > 1:           # a run of same-geometry blocks: one call per batch item
                for i in range(run.n):
                    _run_call(part, qg, kg, vg, og, lg, i, softmax_scale)
                continue
            keys = slice(part.k0, part.k1)
            o_p, lse_p = _FWD(qg[:, :, part.r0:part.r1], kg[:, :, keys], vg[:, :, keys], 0.0, part.causal,
                              attn_mask=part.mask, scale=softmax_scale)    # [N, HQ, r, D], [N, HQ, r]
            if part.has_key is not None:   # the kernel reports lse 0 on fully masked rows
                lse_p = lse_p.masked_fill(~part.has_key, _NEG_INF)
            og[:, :, part.r0:part.r1] = o_p
            lg[:, :, part.r0:part.r1] = lse_p
        zero_unwritten(rows, run.Lq, og)
        zero_unwritten(rows, run.Lq, lg, value=_NEG_INF)
