"""``method="ring"``: K/V shards travel around the group; each rank attends its queries to the
shard in hand while the next one is in flight.

Step ``t`` on rank ``r`` holds the K/V shard of rank ``s = (r - t) mod P``. Its tiles (one per
pair of a local query chunk and a chunk of that shard, per sequence length; see ``plan``) run
without sinks, each giving ``(o_b, lse_b)`` over its keys only, merged in step order:

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

from .. import backends, masks, sink
from .group import Exchange, Group
from .layout import chunk_ids, chunks_per_sequence

__all__ = ["Tile", "plan", "attention"]


@dataclass(frozen=True)
class Tile:
    """Local rows ``q_index`` against rows ``k_index`` of a K/V shard: ``n`` sequences of one geometry,
    ``rows`` queries and ``keys`` keys each, under the local window ``(left, right)``."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    left: int
    right: int


def plan(lengths: list[int], P: int, layout: str, rank: int, source: int, left: int, right: int,
         device) -> list[Tile]:
    """The tiles of rank ``rank``'s queries against rank ``source``'s keys, in a fixed order.

    ``lengths``: the global sequence lengths; ``(left, right)`` the normalized global window.
    Sequences of one length share their geometry, so they run as one packed call.
    """
    parts = chunks_per_sequence(P, layout)
    starts, at = {}, 0
    for length in lengths:
        starts.setdefault(length, []).append(at)
        at += length // P
    tiles = []
    for length in sorted(starts):
        c = length // parts
        first = torch.tensor(starts[length], dtype=torch.int64)
        steps = torch.arange(len(first) + 1, dtype=torch.int32)
        for x, a in enumerate(chunk_ids(rank, P, layout)):
            for y, b in enumerate(chunk_ids(source, P, layout)):
                cut = masks.sub_block(a * c, c, b * c, c, left, right)
                if cut is None:
                    continue
                rows, keys, l2, r2 = cut
                q_index = (first[:, None] + x * c + torch.arange(rows)).reshape(-1)
                k_index = (first[:, None] + y * c + torch.arange(keys)).reshape(-1)
                tiles.append(Tile(q_index.to(device), k_index.to(device), (steps * rows).to(device),
                                  (steps * keys).to(device), l2, r2))
    return tiles


def _merge(o, lse, rows, o_b, lse_b) -> None:
    """Fold one tile's ``(o_b [R, HQ, D], lse_b [HQ, R])`` into rows ``rows`` of ``(o, lse)``."""
    old = lse[:, rows]
    new = torch.logaddexp(old, lse_b)
    kept, added = sink.key_mass(old, new), sink.key_mass(lse_b, new)
    o[rows] = o[rows] * kept.t()[..., None] + o_b.to(o.dtype) * added.t()[..., None]
    lse[:, rows] = new


def _tile_inputs(tile: Tile, q, k, v):
    return q.index_select(0, tile.q_index), k.index_select(0, tile.k_index), v.index_select(0, tile.k_index)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group: Group, plans, scale: float, backend: str):
        impl, out_dtype = backends.load(backend), backends.describe(backend).out_dtype
        T, HQ, D = q.shape
        o = torch.zeros((T, HQ, D), dtype=out_dtype, device=q.device)
        lse = torch.full((HQ, T), float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(group.size):
            flight = Exchange(kv, group) if step < group.size - 1 else None
            for tile in plans[step]:
                o_b, lse_b, _ = impl.forward(*_tile_inputs(tile, q, *kv), None, tile.cu_q, tile.cu_k, scale,
                                             tile.left, tile.right)
                _merge(o, lse, tile.q_index, o_b, lse_b)
            if flight is not None:
                kv = flight.wait()
        lse_f = sink.lse_with_sink(lse, sinks)
        o *= sink.key_mass(lse, lse_f).t()[..., None]
        ctx.save_for_backward(q, k, v, sinks, o, lse_f)
        ctx.setup = (group, plans, scale, backend)
        return o.to(q.dtype), lse_f

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, o, lse = ctx.saved_tensors
        group, plans, scale, backend = ctx.setup
        impl = backends.load(backend)
        dout = dout if dout is not None else torch.zeros_like(q)
        delta = sink.row_delta(dout, o, dlse)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, dkv, dkv_flight = [k.contiguous(), v.contiguous()], None, None
        for step in range(group.size):
            flight = Exchange(kv, group) if step < group.size - 1 else None
            mine = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
            for tile in plans[step]:
                qb, kb, vb = _tile_inputs(tile, q, *kv)
                o_b, lse_b, extra = impl.forward(qb, kb, vb, None, tile.cu_q, tile.cu_k, scale, tile.left, tile.right)
                do_full = dout.index_select(0, tile.q_index).float()
                w = sink.key_mass(lse_b, lse[:, tile.q_index])
                do_b = (do_full * w.t()[..., None]).to(q.dtype)
                dlse_b = w * (sink.row_delta(do_full, o_b, None) - delta[:, tile.q_index])
                dq_b, dk_b, dv_b, _ = impl.backward(do_b, dlse_b, qb, kb, vb, None, o_b, lse_b, tile.cu_q,
                                                    tile.cu_k, scale, tile.left, tile.right, extra)
                dq[tile.q_index] += dq_b.float()
                mine[0][tile.k_index] += dk_b.float()
                mine[1][tile.k_index] += dv_b.float()
            if dkv_flight is not None:
                dkv = [a + b for a, b in zip(dkv_flight.wait(), mine)]
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
