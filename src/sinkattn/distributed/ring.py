"""``method="ring"``: K/V shards travel around the group; each rank attends its queries to the
shard in hand while the next one is in flight.

Step ``t`` on rank ``r`` holds the K/V shard of rank ``s = (r - t) mod P``. Its tiles (at most
``TILE_ROWS`` rows of a local query chunk against one chunk of that shard, for a run of sequences
of one length; see ``plan``) are calls of the ``sinkattn::forward`` op without sinks, each giving
the softmax over its keys, merged into the rows in step order (``sinkattn.sink.merge``); the sink
joins once at the end (``sinkattn.sink.with_sink``), exactly as in a single call. Tiles no query
can see are never computed.

Backward, per tile, the ``sinkattn::backward`` op with the rows' final ``o`` and statistics (the
sink and every key of the ring included) and ``dO`` as it came: the backend's ``P`` is then the
full softmax's restricted to the tile and its ``Delta = <dO, o> - dlse`` the full row's, so each
tile's dQ / dK / dV terms are the exact ones, from any backend. They come back in fp32 (the op's
``fp32_grads``) and are summed in fp32 accumulators: dK/dV's travel the ring behind their K/V and
arrive home after P steps, summed in ring order, and every gradient is rounded to its input's
dtype once, at the end. ``dsinks = -sum_rows exp(sink - lse) Delta`` over this rank's rows. Every
sum runs in one fixed order: results are bitwise reproducible for a fixed P and layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import autocast, autodiff, backends, ops, sink
from ..call import Call
from ..masks import Window
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
    geometry, one packed call) under the local window."""

    q: Rows
    k: Rows
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    window: Window

    @property
    def max_seqlen(self) -> tuple[int, int]:
        """The lengths of its query and key sequences (all equal within a tile)."""
        return self.q.count, self.k.count


def plan(lengths: list[int], P: int, layout: str, rank: int, source: int, window: Window, device) -> list[Tile]:
    """The tiles of rank ``rank``'s queries against rank ``source``'s keys, in a fixed order.

    ``lengths``: the global sequence lengths; ``window`` the global one, folded.
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
                    cut = window.sub_block(a * c + r0, m, b * c, c)
                    if cut is None:
                        continue
                    rows, keys, tile_window = cut
                    tiles.append(Tile(Rows(first + x * c + r0, length // P, n, rows),
                                      Rows(first + y * c, length // P, n, keys),
                                      (steps * rows).to(device), (steps * keys).to(device), tile_window))
    return tiles


def _stats_rows(stats: sink.Stats, rows: Rows) -> sink.Stats:
    return sink.Stats(rows.stat(stats.m), rows.stat(stats.log_l))


def _tile_inputs(tile: Tile, q, k, v):
    return tile.q.packed(q), tile.k.packed(k), tile.k.packed(v)


def _tile_stats(tile: Tile, *stats):
    """The tile's rows of ``[HQ, T]`` statistics as contiguous ``[HQ, n*R]`` tensors."""
    return [tile.q.stat(s).reshape(s.shape[0], -1).contiguous() for s in stats]


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group: Group, plans, call: Call):
        caps = backends.describe(call.backend)
        q = q.contiguous()
        T, HQ = q.shape[:2]
        o = torch.zeros((T, HQ, v.shape[-1]), dtype=caps.out_dtype, device=q.device)     # Dv: v's head dim
        stats = sink.Stats(torch.full((HQ, T), float("-inf"), dtype=caps.out_dtype, device=q.device),
                           torch.full((HQ, T), float("-inf"), dtype=caps.out_dtype, device=q.device))
        kv = [k.contiguous(), v.contiguous()]
        for step in range(group.size):
            flight = Exchange(kv, group) if step < group.size - 1 else None
            for tile in plans[step]:
                o_b, _, m_b, l_b = ops.attention(*_tile_inputs(tile, q, *kv), None, tile.cu_q, tile.cu_k,
                                                 *tile.max_seqlen, call.softmax_scale, tile.window, call.backend,
                                                 needs_grad=False, check_cu_seqlens=False, for_backward=True)
                rows = tile.q
                tile_stats = sink.Stats(*(x.view(HQ, rows.n, rows.count) for x in (m_b, l_b)))
                merged, new = sink.merge(rows.of(o), _stats_rows(stats, rows), o_b.view(rows.of(o).shape),
                                         tile_stats, caps.base2)
                rows.of(o).copy_(merged)
                for acc, value in zip(_stats_rows(stats, rows), new):
                    acc.copy_(value)
            if flight is not None:
                kv = flight.wait()
        keys = stats
        o, stats = sink.with_sink(o, keys, sinks, caps.base2)
        lse = sink.lse_of(stats, caps.base2, sinks, keys).float()
        ctx.save_for_backward(q, k, v, sinks, o, *stats)
        ctx.setup = (group, plans, call)
        return o.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        autodiff.refuse_double_backward()       # the same on every rank: before any communication
        with autocast.disabled(ctx.saved_tensors[0].device):   # as the forward ran
            return _Ring.gradients(ctx, dout, dlse)

    @staticmethod
    def gradients(ctx, dout, dlse):
        q, k, v, sinks, o, m, log_l = ctx.saved_tensors
        group, plans, call = ctx.setup
        dout = dout.to(q.dtype).contiguous() if dout is not None else torch.zeros_like(q)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, dkv, dkv_flight = [k.contiguous(), v.contiguous()], None, None
        for step in range(group.size):
            flight = Exchange(kv, group) if step < group.size - 1 else None
            mine = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v)]
            for tile in plans[step]:
                dlse_b = _tile_stats(tile, dlse)[0] if dlse is not None else None
                dq_b, dk_b, dv_b = ops.gradients(tile.q.packed(dout), dlse_b, *_tile_inputs(tile, q, *kv),
                                                 tile.q.packed(o), *_tile_stats(tile, m, log_l), tile.cu_q,
                                                 tile.cu_k, *tile.max_seqlen, call.softmax_scale, tile.window,
                                                 call.backend, partial=True, fp32_grads=True)
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
            delta = sink.row_delta(dout, o, dlse)
            mass = sink.sink_mass(sinks, sink.Stats(m, log_l), backends.describe(call.backend).base2)
            dsinks = sink.dsinks_from(sinks, mass, delta)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None, None, None


def attention(q, k, v, sinks, lengths: list[int], group: Group, layout: str, call: Call):
    """This rank's ``(out [T, HQ, Dv], lse [HQ, T])`` of self-attention over the packing ``lengths``,
    from its shards ``q [T, HQ, D]``, ``k [T, HKV, D]``, ``v [T, HKV, Dv]`` (``T = sum(lengths) / P``)."""
    plans = [plan(lengths, group.size, layout, group.rank, (group.rank - step) % group.size, call.window, q.device)
             for step in range(group.size)]
    return _Ring.apply(q, k, v, sinks, group, plans, call)
