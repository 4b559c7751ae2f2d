"""CPU path for sequences with few scores, many at a time: decoding and short sequences.

A sequence is small (``takes``) when its queries are few (``Lq <= DECODE_ROWS``: KV-cache
decoding, any number of keys) or it is short (``Lq, Lk <= SHORT_LENGTH``). Its ``[Lq, K]`` scores
against the ``K`` keys its rows can see (``masks.block_key_range``) are then materialized, with
``cpu_slab``'s block algebra (exact at any score size), for many sequences in one batch:

* a batch whose sequences all share their lengths (a dense batch) is viewed in place, no copy;
* packed sequences are gathered into buckets of one padded shape ``(Pq, Pk) = (padded_length(Lq),
  padded_length(K))``, zero-filled and masked past each sequence's own lengths; results are
  scattered back to the token layout.

Padded shapes depend on a sequence's own lengths only, and a batch holds at most
``SLAB_ELEMENTS`` scores. Per sequence and head the scores are at most
``max(DECODE_ROWS * Lk, SHORT_LENGTH**2)``, so memory stays O(tokens x heads); a Python loop
runs per bucket, not per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import masks
from .cpu_slab import SLAB_ELEMENTS, block_backward, block_forward, stack_group, unstack_group
from .layout import Run, heads_first, stat_view

__all__ = ["takes", "padded_length", "forward", "backward", "DECODE_ROWS", "SHORT_LENGTH"]

DECODE_ROWS = 16
"""Sequences with at most this many queries are small whatever their number of keys."""
SHORT_LENGTH = 64
"""Sequences with at most this many queries and keys are small."""

_NEG_INF = float("-inf")


def padded_length(L: int) -> int:
    """``L`` rounded up to the next bucket size: exact to 16, then 8 sizes per octave (at most 1/8 padding)."""
    if L <= 16:
        return max(L, 1)
    step = 1 << ((L - 1).bit_length() - 4)
    return -(-L // step) * step


def takes(Lq: int, Lk: int, HQ: int) -> bool:
    """True when this path computes a sequence of ``Lq`` queries and ``Lk`` keys (``Lq >= 1``)."""
    if Lq > DECODE_ROWS and max(Lq, Lk) > SHORT_LENGTH:
        return False
    return HQ * padded_length(Lq) * padded_length(Lk) <= SLAB_ELEMENTS


@dataclass
class _Dense:
    """Sequences ``[b0, b1)`` of a run of equal lengths, viewed in place; keys ``[k0, k1)`` are the ones
    its rows see, ``mask [Lq, K]`` which of them each row sees (None: all)."""

    run: Run
    b0: int
    b1: int
    k0: int
    k1: int
    mask: torch.Tensor | None

    def queries(self, x):        # [T, H, D] -> [n, H, Lq, D]
        return heads_first(x, self.run.tq + self.b0 * self.run.Lq, self.b1 - self.b0, self.run.Lq)

    def keys(self, x, seen=True):     # [T, H, D] -> [n, H, K, D] (all Lk keys with seen=False)
        view = heads_first(x, self.run.tk + self.b0 * self.run.Lk, self.b1 - self.b0, self.run.Lk)
        return view[:, :, self.k0:self.k1] if seen else view

    def stat(self, s):           # [H, T] -> [n, H, Lq]
        return stat_view(s, self.run.tq + self.b0 * self.run.Lq, self.b1 - self.b0, self.run.Lq)

    def put_queries(self, dst, value):
        self.queries(dst).copy_(value)

    def put_stat(self, dst, value):
        self.stat(dst).copy_(value)

    def put_keys(self, dst, value):     # keys no row sees get 0
        view = self.keys(dst, seen=False)
        view[:, :, :self.k0] = 0.0
        view[:, :, self.k0:self.k1] = value
        view[:, :, self.k1:] = 0.0


def _dense_batches(run: Run, HQ: int, left: int, right: int):
    k0, k1 = masks.block_key_range(0, run.Lq, run.Lq, run.Lk, left, right)
    k0, k1 = k0, max(k0, k1)
    mask = None
    if not masks.block_fully_visible(0, run.Lq, k0, k1, run.Lq, run.Lk, left, right):
        mask = masks.visible(torch.arange(run.Lq), torch.arange(k0, k1), run.Lq, run.Lk, left, right)
    step = max(1, SLAB_ELEMENTS // max(1, HQ * run.Lq * (k1 - k0)))
    for b0 in range(0, run.n, step):
        yield _Dense(run, b0, min(b0 + step, run.n), k0, k1, mask)


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenated token ranges ``[s, s + l)``."""
    total = int(lengths.sum())
    shift = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
    return shift + torch.arange(total)


@dataclass
class _Gathered:
    """``n`` packed sequences copied into one padded shape: row ``i`` of sequence ``b`` is query token
    ``tq[b] + i`` (``i < Lq[b]``), key slot ``j`` is key token ``tk[b] + k0[b] + j`` (``j < K[b]``);
    ``unseen`` lists the keys of these sequences that no row sees."""

    rows: torch.Tensor        # int64 [n, Pq], row_ok bool [n, Pq]
    row_ok: torch.Tensor
    slots: torch.Tensor       # int64 [n, Pk], slot_ok bool [n, Pk]
    slot_ok: torch.Tensor
    mask: torch.Tensor        # bool [n, Pq, Pk]
    unseen: torch.Tensor      # int64 [U]

    @staticmethod
    def _take(x, index, ok):      # [T, H, D] -> [n, H, P, D], 0 where not ok
        g = x.index_select(0, index.flatten()).view(*index.shape, *x.shape[1:])
        return g.masked_fill_(~ok[..., None, None], 0.0).transpose(1, 2)

    def queries(self, x):
        return self._take(x, self.rows, self.row_ok)

    def keys(self, x):
        return self._take(x, self.slots, self.slot_ok)

    def stat(self, s):            # [H, T] -> [n, H, Pq]
        return s[:, self.rows].masked_fill_(~self.row_ok, 0.0).transpose(0, 1)

    @staticmethod
    def _put(dst, index, ok, value):     # value [n, H, P, D]
        dst.index_copy_(0, index[ok], value.transpose(1, 2)[ok])

    def put_queries(self, dst, value):
        self._put(dst, self.rows, self.row_ok, value)

    def put_stat(self, dst, value):
        dst[:, self.rows[self.row_ok]] = value.transpose(0, 1)[:, self.row_ok]

    def put_keys(self, dst, value):
        self._put(dst, self.slots, self.slot_ok, value)
        if self.unseen.numel():
            dst.index_fill_(0, self.unseen, 0.0)


def _gathered(seqs: list[tuple[Run, int, int]], Pq: int, Pk: int, left: int, right: int) -> _Gathered:
    """One bucket: ``seqs`` are ``(run, k0, k1)`` with ``n = 1`` and the keys ``[k0, k1)`` its rows see."""
    tq, tk, Lq, Lk, k0, k1 = (torch.tensor(c, dtype=torch.int64) for c in zip(
        *[(r.tq, r.tk, r.Lq, r.Lk, a, b) for r, a, b in seqs]))
    i, j = torch.arange(Pq), torch.arange(Pk)
    row_ok = i < Lq[:, None]
    slot_ok = j < (k1 - k0)[:, None]
    rows = torch.where(row_ok, tq[:, None] + i, tq[:, None])
    slots = torch.where(slot_ok, (tk + k0)[:, None] + j, tk[:, None])
    seen = masks.visible(i, (k0[:, None] + j)[:, None, :], Lq[:, None], Lk[:, None], left, right)
    mask = seen & row_ok[:, :, None] & slot_ok[:, None, :]
    unseen = torch.cat([_ranges(tk, k0), _ranges(tk + k1, Lk - k1)])
    return _Gathered(rows, row_ok, slots, slot_ok, mask, unseen)


def _gathered_batches(runs: list[Run], HQ: int, left: int, right: int):
    buckets: dict[tuple[int, int], list] = {}
    for r in runs:
        k0, k1 = masks.block_key_range(0, r.Lq, r.Lq, r.Lk, left, right)
        k1 = max(k0, k1)
        buckets.setdefault((padded_length(r.Lq), padded_length(k1 - k0)), []).append((r, k0, k1))
    for (Pq, Pk), seqs in sorted(buckets.items()):
        step = max(1, SLAB_ELEMENTS // (HQ * Pq * Pk))
        for b0 in range(0, len(seqs), step):
            yield _gathered(seqs[b0:b0 + step], Pq, Pk, left, right)


def _batches(runs: list[Run], HQ: int, left: int, right: int):
    """The batches of the small path: the views of a dense batch, or gathered buckets."""
    if len(runs) == 1 and runs[0].n > 1:
        return _dense_batches(runs[0], HQ, left, right)
    return _gathered_batches(runs, HQ, left, right)


def _group_mask(mask: torch.Tensor | None, G: int) -> torch.Tensor | None:
    """``[R, K]`` or ``[n, R, K]`` -> broadcastable to the stacked scores ``[n, HKV, G*R, K]``."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask.repeat(G, 1)
    return mask.repeat(1, G, 1)[:, None]


def forward(q, k, v, runs, out, lse_keys, softmax_scale, left, right, literal=False):
    """Fill fp32 ``out [Tq, HQ, D]`` and ``lse_keys [HQ, Tq]`` on the rows of the small sequences
    ``runs`` (``layout.Split.small``), as ``cpu_fused.forward`` does."""
    HQ, HKV = q.shape[1], k.shape[1]
    for batch in _batches(runs, HQ, left, right):
        qs = stack_group(batch.queries(q), HKV)
        if batch.keys(k).shape[2] == 0:                  # no row sees a key
            o = unstack_group(torch.zeros_like(qs), HQ)
            batch.put_queries(out, o)
            batch.put_stat(lse_keys, torch.full(o.shape[:3], _NEG_INF))
            continue
        o, lse = block_forward(qs, batch.keys(k), batch.keys(v), _group_mask(batch.mask, HQ // HKV), softmax_scale,
                               literal)
        batch.put_queries(out, unstack_group(o, HQ))
        batch.put_stat(lse_keys, unstack_group(lse, HQ))


def backward(do, dlse, q, k, v, sinks, runs, dq, dk, dv, softmax_scale, left, right, literal=False):
    """Fill fp32 ``dq``, ``dk``, ``dv`` on the tokens of the small sequences ``runs``."""
    HQ, HKV = q.shape[1], k.shape[1]
    G = HQ // HKV
    for batch in _batches(runs, HQ, left, right):
        qs = stack_group(batch.queries(q), HKV)
        kb, vb = batch.keys(k), batch.keys(v)
        if kb.shape[2] == 0:
            batch.put_queries(dq, torch.zeros(qs.shape[0], HQ, qs.shape[2] // G, qs.shape[3]))
            batch.put_keys(dk, kb)
            batch.put_keys(dv, vb)
            continue
        n, R = qs.shape[0], qs.shape[2] // G
        sink_rows = None
        if sinks is not None:
            sink_rows = sinks.float().view(1, HKV, G, 1, 1).expand(n, HKV, G, R, 1).reshape(n, HKV, G * R, 1)
        dl = stack_group(batch.stat(dlse.float())[..., None], HKV) if dlse is not None else None
        dq_s, dk_b, dv_b = block_backward(qs, kb, vb, stack_group(batch.queries(do), HKV), dl, sink_rows,
                                          _group_mask(batch.mask, G), softmax_scale, literal)
        batch.put_queries(dq, unstack_group(dq_s, HQ))
        batch.put_keys(dk, dk_b)
        batch.put_keys(dv, dv_b)
