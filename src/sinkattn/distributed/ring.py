"""``method="ring"``: K/V shards travel around the group; each rank attends its queries to the
shard in hand while the next one is in flight.

Step ``t`` on rank ``r`` holds the K/V shard of rank ``s = (r - t) mod P``. Its tiles (at most
``TILE_ROWS`` rows of a local query chunk against one chunk of that shard, for a run of sequences
of one length; see ``plan``) run without sinks, each giving ``(o_b, lse_b)`` over its keys only,
merged in step order:

    lse = logaddexp(lse, lse_b),   o = exp(lse_old - lse) o + exp(lse_b - lse) o_b

and the sink enters once at the end (``sinkattn.sink``): ``lse_f = logaddexp(lse, sink)``,
``o_f = exp(lse - lse_f) o``. Tiles no query can see are never computed.

Backward, per tile, with ``w = exp(lse_b - lse_f)`` (the tile's share of a row's mass) and
``Delta = <dO, o_f> - dlse`` over the whole row: the tile's own forward is recomputed and its
backend's backward is called with ``dO_b = w dO`` and ``dlse_b = w (<dO, o_b> - Delta)``, so the
backend's ``Delta_b = <dO_b, o_b> - dlse_b = w Delta`` and its ``P_b (dP_b - Delta_b)`` equals
``P (dP - Delta)`` of the full softmax: the exact dQ / dK / dV contributions of the tile, from
any backend. dK/dV accumulators travel the ring behind their K/V and arrive home after P steps,
summed in ring order. ``dsinks = -sum_rows exp(sink - lse_f) Delta`` over this rank's rows.
Every sum runs in one fixed order: results are bitwise reproducible for a fixed P and layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import autocast, autodiff, backends, masks, sink
from .group import Exchange, Group
from .layout import chunk_ids, chunks_per_sequence

__all__ = ["Rows", "Tile", "plan", "attention", "TILE_ROWS"]

TILE_ROWS = 1024
"""Query rows per tile (over all sequences of a run): bounds the backend's workspace per call,
which would otherwise grow with the chunk (S / 2P rows)."""


@dataclass(frozen=True)
class Rows:
    """Rows ``start + i * spacing + [0, count)`` for ``i < n`` of a ``[T, ...]`` tensor: one chunk of
    ``n`` equally spaced sequences, taken as a strided view (no copy)."""

    start: int
    spacing: int
    n: int
    count: int

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, ...]`` (contiguous) -> view ``[n, count, ...]``."""
        st = x.stride()
        return x.as_strided((self.n, self.count, *x.shape[1:]), (self.spacing * st[0], *st),
                            x.storage_offset() + self.start * st[0])

    def stat(self, s: torch.Tensor) -> torch.Tensor:
        """``s [HQ, T]`` (contiguous) -> view ``[HQ, n, count]``."""
        st = s.stride()
        return s.as_strided((s.shape[0], self.n, self.count), (st[0], self.spacing * st[1], st[1]),
                            s.storage_offset() + self.start * st[1])

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """The rows as a contiguous ``[n * count, ...]`` tensor (a copy only when ``n > 1``)."""
        return self.of(x).reshape(self.n * self.count, *x.shape[1:]).contiguous()


@dataclass(frozen=True)
class Tile:
    """Rows ``q`` of the local queries against rows ``k`` of a K/V shard (``n`` sequences of one
    geometry, one packed call) under the local window ``(left, right)``."""

    q: Rows
    k: Rows
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    left: int
    right: int

    @property
    def max_seqlen(self) -> tuple[int, int]:
        """The lengths of its query and key sequences (all equal within a tile)."""
        return self.q.count, self.k.count


def plan(lengths: list[int], P: int, layout: str, rank: int, source: int, left: int, right: int,
         device) -> list[Tile]:
    """The tiles of rank ``rank``'s queries against rank ``source``'s keys, in a fixed order.

    ``lengths``: the global sequence lengths; ``(left, right)`` the normalized global window.
    A run of consecutive sequences of one length (a dense batch is one run) shares its geometry
    and spacing, so each of its tiles is one packed call on strided views.
    """
    parts = chunks_per_sequence(P, layout)
    runs, at = [], 0                       # (local start, length, count) of each run
    for length in lengths:
        if runs and runs[-1][1] == length:
            runs[-1][2] += 1
        else:
            runs.append([at, length, 1])
        at += length // P
    tiles = []
    for first, length, n in runs:
        c = length // parts
        steps = torch.arange(n + 1, dtype=torch.int32)
        for x, a in enumerate(chunk_ids(rank, P, layout)):
            for r0 in range(0, c, max(1, TILE_ROWS // n)):
                m = min(max(1, TILE_ROWS // n), c - r0)
                for y, b in enumerate(chunk_ids(source, P, layout)):
                    cut = masks.sub_block(a * c + r0, m, b * c, c, left, right)
                    if cut is None:
                        continue
                    rows, keys, l2, r2 = cut
                    tiles.append(Tile(Rows(first + x * c + r0, length // P, n, rows),
                                      Rows(first + y * c, length // P, n, keys),
                                      (steps * rows).to(device), (steps * keys).to(device), l2, r2))
    return tiles


def _heads_last(w: torch.Tensor) -> torch.Tensor:
    """``[HQ, n, R]`` -> ``[n, R, HQ, 1]``, to scale ``[n, R, HQ, D]`` rows."""
    return w.permute(1, 2, 0)[..., None]


def _merge(o, lse, rows: Rows, o_b, lse_b) -> None:
    """Fold one tile's ``(o_b [n R, HQ, D], lse_b [HQ, n R])`` into its rows of ``(o, lse)``, in place."""
    o_v, lse_v = rows.of(o), rows.stat(lse)
    lse_b = lse_b.view(lse_b.shape[0], rows.n, rows.count)
    new = torch.logaddexp(lse_v, lse_b)
    o_v.mul_(_heads_last(sink.key_mass(lse_v, new)))
    o_v.add_(o_b.view(o_v.shape).to(o.dtype).mul_(_heads_last(sink.key_mass(lse_b, new))))
    lse_v.copy_(new)


def _tile_inputs(tile: Tile, q, k, v):
    return tile.q.packed(q), tile.k.packed(k), tile.k.packed(v)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group: Group, plans, scale: float, backend: str):
        impl, out_dtype = backends.load(backend), backends.describe(backend).out_dtype
        q = q.contiguous()
        T, HQ, D = q.shape
        o = torch.zeros((T, HQ, D), dtype=out_dtype, device=q.device)
        lse = torch.full((HQ, T), float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(group.size):
            flight = Exchange(kv, group) if step < group.size - 1 else None
            for tile in plans[step]:
                o_b, lse_b, _ = impl.forward(*_tile_inputs(tile, q, *kv), None, tile.cu_q, tile.cu_k, scale,
                                             tile.left, tile.right, max_seqlen=tile.max_seqlen)
                _merge(o, lse, tile.q, o_b, lse_b)
            if flight is not None:
                kv = flight.wait()
        lse_f = sink.lse_with_sink(lse, sinks)
        o *= sink.key_mass(lse, lse_f).t()[..., None]
        ctx.save_for_backward(q, k, v, sinks, o, lse_f)
        ctx.setup = (group, plans, scale, backend)
        return o.to(q.dtype), lse_f

    @staticmethod
    def backward(ctx, dout, dlse):
        autodiff.refuse_double_backward()       # the same on every rank: before any communication
        with autocast.disabled(ctx.saved_tensors[0].device):   # as the forward ran
            return _Ring.gradients(ctx, dout, dlse)

    @staticmethod
    def gradients(ctx, dout, dlse):
        q, k, v, sinks, o, lse = ctx.saved_tensors
        group, plans, scale, backend = ctx.setup
        impl = backends.load(backend)
        dout = dout.contiguous() if dout is not None else torch.zeros_like(q)
        delta = sink.row_delta(dout, o, dlse).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, dkv, dkv_flight = [k.contiguous(), v.contiguous()], None, None
        for step in range(group.size):
            flight = Exchange(kv, group) if step < group.size - 1 else None
            mine = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
            for tile in plans[step]:
                qb, kb, vb = _tile_inputs(tile, q, *kv)
                o_b, lse_b, extra = impl.forward(qb, kb, vb, None, tile.cu_q, tile.cu_k, scale, tile.left, tile.right,
                                                 max_seqlen=tile.max_seqlen)
                do_full = tile.q.packed(dout)
                w = sink.key_mass(lse_b.view(-1, tile.q.n, tile.q.count), tile.q.stat(lse))   # [HQ, n, R]
                do_b = do_full.view(tile.q.n, tile.q.count, *do_full.shape[1:]).float() * _heads_last(w)
                dlse_b = w * (sink.row_delta(do_full, o_b, None).view(w.shape) - tile.q.stat(delta))
                dq_b, dk_b, dv_b, _ = impl.backward(do_b.view(do_full.shape).to(q.dtype), dlse_b.reshape(lse_b.shape),
                                                    qb, kb, vb, None, o_b, lse_b, tile.cu_q, tile.cu_k, scale,
                                                    tile.left, tile.right, extra, max_seqlen=tile.max_seqlen)
                rows_q = tile.q.of(dq)
                rows_q += dq_b.view(rows_q.shape)
                for acc, grad in zip(mine, (dk_b, dv_b)):
                    rows_k = tile.k.of(acc)
                    rows_k += grad.view(rows_k.shape)
            if dkv_flight is not None:
                dkv = [a.add_(b) for a, b in zip(dkv_flight.wait(), mine)]
            else:
                dkv = mine
            dkv_flight = Exchange(dkv, group) if group.size > 1 else None
            if flight is not None:
                kv = flight.wait()
        if dkv_flight is not None:
            dkv = dkv_flight.wait()
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink.dsinks_from(sinks, lse, delta)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None, None, None, None


def attention(q, k, v, sinks, lengths: list[int], group: Group, layout: str, scale: float, left: int, right: int,
              backend: str):
    """This rank's ``(out [T, HQ, D], lse [HQ, T])`` of self-attention over the packing ``lengths``,
    from its shards ``q [T, HQ, D]``, ``k``/``v [T, HKV, D]`` (``T = sum(lengths) / P``)."""
    plans = [plan(lengths, group.size, layout, group.rank, (group.rank - step) % group.size, left, right, q.device)
             for step in range(group.size)]
    return _Ring.apply(q, k, v, sinks, group, plans, scale, backend)
