"""CPU path for packed short sequences, many at a time.

A sequence of a packed batch is short (``takes``) when it has at most ``SHORT_LENGTH`` queries and
keys. One kernel call per such sequence would cost far more than its attention (a 1-3 token
sequence: about 45 us for a few hundred flops); instead the short sequences of a call are gathered
into buckets of one padded shape ``(Pq, Pk) = (padded_length(Lq), padded_length(K))`` (``K``: the
keys its rows can see, ``Window.block_key_range``), zero-filled and masked past each sequence's own
lengths, and each bucket's ``[Pq, Pk]`` scores are materialized at once as one tile of
``cpu_tiles`` (same algebra, exact at any score size); results are scattered back to the token layout. (A dense batch,
whose sequences share their lengths, and a run of consecutive equal-length sequences are one kernel
call on the other paths.)

A sequence's padded shape depends on its own lengths only; a batch holds at most ``SLAB_ELEMENTS``
scores, and each sequence at most ``SHORT_LENGTH**2`` per head, so memory stays O(tokens x heads);
Python loops run per bucket, not per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import Window
from .cpu_tiles import (EVERY_ROW, Dominant, TileMask, block_ds, block_forward, block_probabilities, block_products,
                        row_scale, row_sums, score_scale)
from .layout import Sequences, token_ranges

__all__ = ["takes", "padded_length", "forward", "backward", "SHORT_LENGTH", "SLAB_ELEMENTS"]

SLAB_ELEMENTS = 1 << 22
"""Scores per bucket of short sequences (fp32: 16 MiB)."""

SHORT_LENGTH = 16
"""Sequences with at most this many queries and keys are batched here, in training too (the compiled
kernel skips them). Measured by ``benchmarks/packing.py`` (its threshold section: fwd+bwd per visible pair
against 1024-token sequences, packed batches of alternating lengths L and L+1) and ``benchmarks/ab.py``'s
``tiny`` section: from L = 16 on the batch and a kernel task per sequence are within the shared machine's
noise of each other; below, the batch wins where the sequences are many (20,000 of 1-3 tokens: 2.4x faster
per training step). Figures: docs/benchmarks.md, "Packed lengths"."""


def padded_length(L: torch.Tensor) -> torch.Tensor:
    """int64 ``L`` rounded up elementwise to its bucket size: exact to 16, then 8 sizes per octave
    (at most 1/8 padding); 1 for 0."""
    bits = torch.frexp((L - 1).clamp(min=1).double())[1]          # (L - 1).bit_length()
    step = torch.pow(2, (bits - 4).clamp(min=0)).to(L.dtype)
    return torch.where(L <= 16, L.clamp(min=1), (L + step - 1) // step * step)


def takes(Lq: torch.Tensor, Lk: torch.Tensor, HQ: int) -> torch.Tensor:
    """bool: whether this path computes the sequences of ``Lq >= 1`` queries and ``Lk`` keys (int64, elementwise)."""
    return (torch.maximum(Lq, Lk) <= SHORT_LENGTH) & (HQ * padded_length(Lq) * padded_length(Lk) <= SLAB_ELEMENTS)


@dataclass
class _Gathered:
    """``n`` packed sequences copied into one padded shape: row ``i`` of sequence ``b`` is query token
    ``rows[b, i]`` (where ``row_ok``), key slot ``j`` is key token ``slots[b, j]`` (where ``slot_ok``);
    ``unseen`` lists the keys of these sequences that no row sees. Query-side tensors and statistics
    are gathered straight into the stacked layout ``[n, HKV, G*Pq, ...]`` (row ``g*Pq + i`` is head
    ``g`` of the group, query ``i``), one copy each; padding is 0."""

    rows: torch.Tensor        # int64 [n, Pq]
    row_ok: torch.Tensor      # bool [n, Pq]
    slots: torch.Tensor       # int64 [n, Pk]
    slot_ok: torch.Tensor     # bool [n, Pk]
    mask: torch.Tensor        # bool [n, Pq, Pk]
    unseen: torch.Tensor      # int64 [U]
    HKV: int

    def __post_init__(self):
        self.rows_full, self.slots_full = bool(self.row_ok.all()), bool(self.slot_ok.all())

    def _heads(self, H: int):     # index tensors of the KV head and the head within the group
        G = H // self.HKV
        return torch.arange(self.HKV).view(1, -1, 1, 1), torch.arange(G).view(1, 1, -1, 1), G

    def queries(self, x):         # [T, HQ, D] -> [n, HKV, G*Pq, D]
        h, g, G = self._heads(x.shape[1])
        out = x.view(x.shape[0], self.HKV, G, x.shape[2])[self.rows[:, None, None], h, g]    # [n, HKV, G, Pq, D]
        if not self.rows_full:
            out.masked_fill_(~self.row_ok[:, None, None, :, None], 0.0)
        return out.flatten(2, 3)

    def stat(self, s):            # [HQ, T] -> [n, HKV, G*Pq]
        h, g, G = self._heads(s.shape[0])
        out = s.view(self.HKV, G, s.shape[1])[h, g, self.rows[:, None, None]]             # [n, HKV, G, Pq]
        if not self.rows_full:
            out.masked_fill_(~self.row_ok[:, None, None, :], 0.0)
        return out.flatten(2, 3)

    def keys(self, x):            # [T, HKV, D] -> [n, HKV, Pk, D]
        if x.shape[0] == 0:       # the call has no key at all
            return x.new_zeros(self.slots.shape[0], self.HKV, self.slots.shape[1], x.shape[2])
        out = x[self.slots[:, None], torch.arange(self.HKV).view(1, -1, 1)]
        if not self.slots_full:
            out.masked_fill_(~self.slot_ok[:, None, :, None], 0.0)
        return out

    def put_queries(self, dst, value):
        h, g, G = self._heads(dst.shape[1])
        value = value.unflatten(2, (G, -1))                                               # [n, HKV, G, Pq, D]
        if self.rows_full:
            dst.view(dst.shape[0], self.HKV, G, dst.shape[2]).index_put_((self.rows[:, None, None], h, g), value)
        else:
            dst.index_copy_(0, self.rows[self.row_ok], value.permute(0, 3, 1, 2, 4)[self.row_ok].flatten(1, 2))

    def put_stat(self, dst, value):
        h, g, G = self._heads(dst.shape[0])
        value = value.unflatten(2, (G, -1))                                               # [n, HKV, G, Pq]
        if self.rows_full:
            dst.view(self.HKV, G, dst.shape[1]).index_put_((h, g, self.rows[:, None, None]), value)
        else:
            dst[:, self.rows[self.row_ok]] = value.permute(1, 2, 0, 3)[:, :, self.row_ok].flatten(0, 1)

    def put_keys(self, dst, value):     # value [n, HKV, Pk, D]; keys no row sees get 0
        if self.slots_full:
            dst.index_put_((self.slots[:, None], torch.arange(self.HKV).view(1, -1, 1)), value)
        else:
            dst.index_copy_(0, self.slots[self.slot_ok], value.transpose(1, 2)[self.slot_ok])
        if self.unseen.numel():
            dst.index_fill_(0, self.unseen, 0.0)


def _gathered(seqs: Sequences, k0: torch.Tensor, k1: torch.Tensor, Pq: int, Pk: int, HKV: int,
              window: Window) -> _Gathered:
    """One bucket of ``seqs``, whose rows see the keys ``[k0, k1)`` (int64 ``[n]``), padded to ``(Pq, Pk)``."""
    i, j = torch.arange(Pq), torch.arange(Pk)
    row_ok = i < seqs.Lq[:, None]
    slot_ok = j < (k1 - k0)[:, None]
    rows = torch.where(row_ok, seqs.tq[:, None] + i, 0)          # padding reads token 0, then zeroed
    slots = torch.where(slot_ok, (seqs.tk + k0)[:, None] + j, 0)
    seen = window.visible(i, (k0[:, None] + j)[:, None, :], seqs.Lq[:, None], seqs.Lk[:, None])
    mask = seen & row_ok[:, :, None] & slot_ok[:, None, :]
    unseen = torch.cat([token_ranges(seqs.tk, k0), token_ranges(seqs.tk + k1, seqs.Lk - k1)])
    return _Gathered(rows, row_ok, slots, slot_ok, mask, unseen, HKV)


def _gathered_batches(seqs: Sequences, HQ: int, HKV: int, window: Window):
    """Buckets of one padded shape, in a fixed order, each cut to at most ``SLAB_ELEMENTS`` scores."""
    k0, _ = window.key_bounds(torch.zeros_like(seqs.Lq), seqs.Lq, seqs.Lk)
    _, k1 = window.key_bounds(seqs.Lq - 1, seqs.Lq, seqs.Lk)
    k1 = torch.maximum(k0, k1)
    Pq, Pk = padded_length(seqs.Lq), padded_length(k1 - k0)
    order = torch.sort(Pq * (Pk.max() + 1) + Pk, stable=True)
    shapes, counts = torch.unique_consecutive(order.values, return_counts=True)
    start = 0
    for count in counts.tolist():
        index = order.indices[start:start + count]
        pq, pk = int(Pq[index[0]]), int(Pk[index[0]])
        step = max(1, SLAB_ELEMENTS // (HQ * pq * pk))
        for b0 in range(0, count, step):
            chunk = index[b0:b0 + step]
            part = Sequences(seqs.tq[chunk], seqs.tk[chunk], seqs.Lq[chunk], seqs.Lk[chunk])
            yield _gathered(part, k0[chunk], k1[chunk], pq, pk, HKV, window)
        start += count


def _batches(small: Sequences | None, HQ: int, HKV: int, window: Window):
    return () if small is None else _gathered_batches(small, HQ, HKV, window)


def _group_mask(mask: torch.Tensor, G: int) -> TileMask:
    """``[n, R, K]`` -> ``[n, 1, G*R, K]``, broadcastable to the stacked scores ``[n, HKV, G*R, K]``."""
    return TileMask(mask.repeat(1, G, 1)[:, None])


def _scaled(rows: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    scale = row_scale(softmax_scale)
    return rows if scale is None else rows.mul_(scale)


def forward(q, k, v, small, out, m, log_l, softmax_scale, window, literal=False):
    """Fill fp32 ``out [Tq, HQ, D]`` (the softmax over keys) and ``m``/``log_l [HQ, Tq]`` on the rows of the
    small sequences (``layout.Split.small``), as ``cpu_tiles.forward`` does. A sequence's values depend on
    its own inputs only (its padded shape is a function of its lengths)."""
    HQ, HKV = q.shape[1], k.shape[1]
    G = HQ // HKV
    for batch in _batches(small, HQ, HKV, window):
        o, mb, lb = block_forward(_scaled(batch.queries(q), softmax_scale),
                                  [(batch.keys(k), batch.keys(v), _group_mask(batch.mask, G), literal)],
                                  score_scale(softmax_scale))
        batch.put_queries(out, o)
        batch.put_stat(m, mb.squeeze(-1))
        batch.put_stat(log_l, lb.squeeze(-1))


def backward(do, q, k, v, m, inv_l, delta, dlse, sink_mass, small, dq, dk, dv, softmax_scale, window, literal=False,
             exact=False):
    """Fill fp32 ``dq``, ``dk``, ``dv`` on the tokens of the small sequences from the final statistics
    (``m``, ``inv_l = 1 / l``) and ``delta``, all ``[HQ, Tq]``; ``exact`` as in ``cpu_tiles.backward``
    (each bucket is one tile: its products give ``Delta`` at no extra cost)."""
    HQ, HKV = q.shape[1], k.shape[1]
    G = HQ // HKV
    post = score_scale(softmax_scale)
    for batch in _batches(small, HQ, HKV, window):
        qs, dos, kb, mask = _scaled(batch.queries(q), softmax_scale), batch.queries(do), batch.keys(k), (
            _group_mask(batch.mask, G))
        p, dp = block_probabilities(qs, kb, batch.keys(v), dos, batch.stat(m)[..., None], batch.stat(inv_l)[..., None],
                                    mask, literal, post)
        dominant, dl = None, batch.stat(dlse)[..., None] if dlse is not None else None
        if exact:
            db = row_sums(p, dp)
            if dl is not None:
                db = db.sub_(dl)
            batch.put_stat(delta, db.squeeze(-1))
            if not literal:                             # non-finite inputs: the terms as they are
                dominant = Dominant.for_rows(batch.stat(inv_l), EVERY_ROW)
            if dominant is not None:
                dominant.see(p, 0)
        else:
            db = batch.stat(delta)[..., None]
        ds = block_ds(p, dp, db, mask, literal)
        if dominant is not None:                        # the dominant key's dS from the others'
            dominant.add(ds)
            sink_b = batch.stat(sink_mass)[..., None] if sink_mass is not None else None
            dominant.fold(dominant.correction(sink_b, db, dl), [(ds, 0)])
        dq_s, dk_b, dv_b = block_products(p, ds, qs, kb, dos, mask, literal)
        batch.put_queries(dq, dq_s.mul_(softmax_scale))
        batch.put_keys(dk, dk_b if post is None else dk_b.mul_(post))
        batch.put_keys(dv, dv_b)
