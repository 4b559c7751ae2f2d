"""Tensor parallelism over heads: sinkattn on DTensors (``torch.distributed.tensor``).

Heads do not interact, so attention on head-sharded inputs needs no communication: every rank
runs the ops on its own heads, exactly the call one process makes on that slice of the heads, and
its results are bitwise those of that call. The sharding rules, registered with torch's
``register_sharding`` for ``sinkattn::forward`` and ``sinkattn::backward``, say so; on each mesh dim:

    head-sharded:  q [B, S, HQ, D] Shard(2) (packed q [T, HQ, D]: Shard(1)), k and v the same,
                   sinks Shard(0), cu_seqlens Replicate
                   -> o like q, lse / m / log_l [HQ, T] Shard(0); dq, dk, dv like q, k, v, dsinks Shard(0)
    replicated:    every input and output Replicate

Inputs placed otherwise are refused with a ValueError (``check_layout``, run by the public
functions and by the rules themselves), never redistributed: a sequence shard points to
``sinkattn.distributed`` (context parallelism), Partial or another dim to a ``redistribute``.
``k`` and ``v`` have to be sharded like ``q`` and HKV has to divide by the number of head shards,
so each rank holds whole GQA groups. What DTensor does move, by the rules: upstream gradients
(``dout``, ``dlse``) in another placement than the outputs (a local slice from Replicate, a
reduce-scatter from Partial), and, in a direct call of the ops, sinks (a slice or an all-gather).

The public functions (``placed``) also take plain ``cu_seqlens`` (each rank's tensor: replicated)
and bring ``sinks`` to q's head placement through ``DTensor.redistribute``, which autograd records,
so the gradient of a replicated sinks parameter is replicated too (an all-gather in the backward).

``import sinkattn`` does not import ``torch.distributed.tensor`` (about a second): the rules are
registered at the first public call on DTensors; a direct caller of the ops on DTensors calls
``register_sharding_rules()`` first.
"""

from __future__ import annotations

import functools
import sys

import torch

__all__ = ["placed", "check_layout", "register_sharding_rules"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dtensor_type():
    """``DTensor``, or None while ``torch.distributed.tensor`` is not imported (no DTensor exists then)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def placed(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k):
    """The arguments of a public call as the ops take them. Plain tensors come back as they are;
    with DTensors, after ``check_layout``: ``sinks`` redistributed to q's head placement (Shard(0)
    where q is head-sharded, else Replicate) and plain ``cu_seqlens`` as replicated DTensors on q's
    mesh. q, k and v must all be DTensors on one mesh, and sinks too when q is one."""
    if all(t is None or type(t) in _PLAIN for t in (q, k, v, sinks, cu_seqlens_q, cu_seqlens_k)):
        return q, k, v, sinks, cu_seqlens_q, cu_seqlens_k
    DTensor = _dtensor_type()
    named = (("q", q), ("k", k), ("v", v), ("sinks", sinks), ("cu_seqlens_q", cu_seqlens_q),
             ("cu_seqlens_k", cu_seqlens_k))
    dtensors = [name for name, t in named if DTensor is not None and isinstance(t, DTensor)]
    if not dtensors:
        return q, k, v, sinks, cu_seqlens_q, cu_seqlens_k
    plain = [name for name, t in named[:4] if t is not None and name not in dtensors]
    if plain:
        raise TypeError(f"{', '.join(dtensors)} {'is a DTensor' if len(dtensors) == 1 else 'are DTensors'} but "
                        f"{', '.join(plain)} {'is a plain torch.Tensor' if len(plain) == 1 else 'are plain tensors'}"
                        f": pass q, k, v (and sinks) all as DTensors on one mesh (e.g. "
                        f"ColwiseParallel(use_local_output=False) for the projections, "
                        f"distribute_tensor(sinks, mesh, [Shard(0)]) for the sinks), or all as local tensors "
                        f"(x.to_local())")
    mesh = q.device_mesh
    for name, t in named[1:]:
        if isinstance(t, DTensor) and t.device_mesh != mesh:
            raise ValueError(f"{name} is on another device mesh than q ({t.device_mesh} vs {mesh}): pass every "
                             f"DTensor of the call on q's mesh")
    register_sharding_rules()
    check_layout(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k)
    from torch.distributed.tensor import Replicate, Shard
    if sinks is not None:
        want = tuple(Shard(0) if p.is_shard() else Replicate() for p in q.placements)
        if tuple(sinks.placements) != want:
            sinks = sinks.redistribute(mesh, want)
    replicated = [Replicate()] * mesh.ndim
    cu_seqlens_q, cu_seqlens_k = (cu if cu is None or isinstance(cu, DTensor) else
                                  DTensor.from_local(cu, mesh, replicated, run_check=False)
                                  for cu in (cu_seqlens_q, cu_seqlens_k))
    return q, k, v, sinks, cu_seqlens_q, cu_seqlens_k


def _where(x, i: int) -> str:
    return f"{x.placements[i]!r} on mesh dim {i}"


def _refuse_q(p, i: int, ndim: int) -> None:
    """The ValueError for q's placement ``p`` on mesh dim ``i`` (neither head-sharded nor replicated)."""
    head, layout = (2, "q [B, S, HQ, D]") if ndim == 4 else (1, "packed q [T, HQ, D]")
    sequence = ndim - 3
    wanted = (f"sinkattn runs on DTensors sharded over heads (Shard({head}) of {layout}) or replicated "
              f"(Replicate()) on every mesh dim")
    if p.is_shard() and p.dim == sequence:
        raise ValueError(f"q is sharded over the {'sequence' if ndim == 4 else 'tokens'} (Shard({sequence}) of "
                         f"{layout}) on mesh dim {i}: {wanted}. For context parallelism (sequence shards) use "
                         f"sinkattn.distributed.sink_attn_func / sink_attn_varlen_func on the local shards "
                         f"(x.to_local()) with the mesh dim's process group (mesh.get_group({i})); or redistribute "
                         f"q, k and v to Shard({head}) first")
    raise ValueError(f"q has placement {p!r} on mesh dim {i}: {wanted}; redistribute q, k and v to Shard({head}) "
                     f"or Replicate() on that mesh dim first (x.redistribute(mesh, placements))")


def check_layout(q, k, v, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """The placements sinkattn takes (the module doc), on DTensors or their specs (``.placements``,
    ``.ndim``, ``.shape``, ``.device_mesh``): a ValueError naming the argument otherwise."""
    from torch.distributed.tensor import Shard
    head, mesh = q.ndim - 2, q.device_mesh
    shards = 1
    for i, p in enumerate(q.placements):
        if type(p) is Shard and p.dim == head:         # (not a _StridedShard, a subclass)
            shards *= mesh.size(i)
        elif not p.is_replicate():
            _refuse_q(p, i, q.ndim)
    for name, x in (("k", k), ("v", v)):
        if tuple(x.placements) != tuple(q.placements):
            raise ValueError(f"{name} must be placed like q (k, v sharded over the same heads: whole GQA groups on "
                             f"each rank), got q {tuple(q.placements)}, {name} {tuple(x.placements)}; redistribute "
                             f"{name} to q's placements")
    HKV = k.shape[-2]
    if HKV % shards:
        raise ValueError(f"k and v have HKV={HKV} heads, not divisible by the {shards} head shards of the mesh: each "
                         f"rank must hold whole GQA groups (its query heads and the KV heads they use); shard over "
                         f"fewer ranks, or repeat the KV heads up to a multiple of {shards}")
    if sinks is not None:
        for i, p in enumerate(sinks.placements):
            if not (p.is_replicate() or type(p) is Shard and p.dim == 0):
                raise ValueError(f"sinks must be sharded over heads (Shard(0)) or replicated on every mesh dim, got "
                                 f"{_where(sinks, i)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is not None and hasattr(cu, "placements") and not all(p.is_replicate() for p in cu.placements):
            bad = next(i for i, p in enumerate(cu.placements) if not p.is_replicate())
            raise ValueError(f"{name} must be replicated (every rank holds the whole packing), got "
                             f"{_where(cu, bad)}")


def _strategies(q, outputs: list, inputs: list) -> list:
    """The two single-mesh-dim strategies ``(output placements, input placements)``: head-sharded and
    replicated. Each entry of ``outputs`` and ``inputs`` is a kind: "q" (placed like q), "stats"
    (``[HQ, T]``) or "sinks" (``[HQ]``): both Shard(0) when head-sharded; "index" or "empty" (an
    index tensor, an empty result): Replicate; None: an absent optional tensor."""
    from torch.distributed.tensor import Replicate, Shard
    by_kind = {"q": Shard(q.ndim - 2), "stats": Shard(0), "sinks": Shard(0), "index": Replicate(),
               "empty": Replicate(), None: None}
    sharded = ([by_kind[kind] for kind in outputs], [by_kind[kind] for kind in inputs])
    replicated = tuple([None if kind is None else Replicate() for kind in kinds] for kinds in (outputs, inputs))
    return [sharded, replicated]


def _optional(t, kind: str):
    return None if t is None else kind


def _forward_rule(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, *_options):
    check_layout(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k)
    inputs = ["q", "q", "q", _optional(sinks, "sinks"), _optional(cu_seqlens_q, "index"),
              _optional(cu_seqlens_k, "index")]
    return _strategies(q, ["q", "stats", "stats", "stats"], inputs)


def _backward_rule(do, dlse, q, k, v, sinks, o, m, log_l, cu_seqlens_q, cu_seqlens_k, *_options):
    check_layout(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k)
    inputs = ["q", _optional(dlse, "stats"), "q", "q", "q", _optional(sinks, "sinks"), "q", "stats", "stats",
              _optional(cu_seqlens_q, "index"), _optional(cu_seqlens_k, "index")]
    return _strategies(q, ["q", "q", "q", "empty" if sinks is None else "sinks"], inputs)


@functools.cache
def register_sharding_rules() -> None:
    """Register the rules of ``sinkattn::forward`` and ``sinkattn::backward`` with DTensor (once;
    the public functions do it at their first DTensor call)."""
    from torch.distributed.tensor.experimental import register_sharding
    register_sharding(torch.ops.sinkattn.forward.default)(_forward_rule)
    register_sharding(torch.ops.sinkattn.backward.default)(_backward_rule)

