"""Context parallelism inside a Hugging Face model: every rank runs the model on its shard of the tokens.

    name = sinkattn.hf.register("sinkattn_cp", context_parallel=ContextParallel(group, method="ring"))
    local = sinkattn.hf.shard_batch(batch, group=group)           # this rank's tokens, the global packing
    model(**local).loss.backward()                                # then sum the gradients over the group

Everything in a decoder but attention works token by token, so each rank runs embeddings, MLPs
and the head on its own tokens; rotary embeddings get each token's true position from
``position_ids`` (sharded with the tokens). Each attention layer calls ``sinkattn.distributed``
on the rank's q/k/v shards, with the layer's sinks, scale and sliding window, over the GLOBAL
packing given as ``cu_seq_lens_q/k`` and ``max_length_q/k`` (every document cut by the layout on
its own: zigzag per document); without them each row of the batch is one sequence, cut along
dim 1 (``sinkattn.distributed.shard``).

Checked in every layer, on every rank together (the same error raised on all of them, none left
waiting in a collective): no padding mask and no cache (shard_batch pads whole documents instead;
decoding is not context-parallel), packed kwargs for one flattened row with equal q and k
packing, and ``position_ids`` equal to the true positions of the rank's tokens (one comparison
per forward pass, memoized like ``sinkattn.hf.layout``'s read-back).
"""

from __future__ import annotations

import weakref

import torch

from .. import distributed
from ..distributed import group as groups
from ..distributed.layout import check_layout, check_lengths, lengths_of, rank_order
from . import layout

__all__ = ["ContextParallel", "attention", "true_positions"]


class ContextParallel:
    """Where and how attention layers run context-parallel: ``group`` (a process group; None: the
    default group), ``method`` (``"ring"`` or ``"ulysses"``) and ``layout`` (``"zigzag"`` or
    ``"contiguous"``), as in ``sinkattn.distributed``. The group is held weakly, so that a
    registered attention implementation does not keep a destroyed group alive."""

    __slots__ = ("_group", "method", "layout")

    def __init__(self, group=None, method: str = "ring", layout: str = "zigzag"):
        if method not in distributed.METHODS:
            raise ValueError(f"method must be one of {distributed.METHODS}, got {method!r}")
        check_layout(layout)
        self._group = None if group is None else weakref.ref(group)
        self.method, self.layout = method, layout

    @property
    def group(self):
        """The process group (None: the default group)."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise RuntimeError("sinkattn.hf: the process group of this ContextParallel was destroyed; register the "
                               "attention implementation again with a live group")
        return group

    def _key(self):
        return (self._group, self.method, self.layout)

    def __eq__(self, other):
        return isinstance(other, ContextParallel) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        group = "default" if self._group is None else "given"
        return f"ContextParallel(group={group}, method={self.method!r}, layout={self.layout!r})"


def true_positions(lengths: list[int], P: int, layout: str, rank: int, device=None) -> torch.Tensor:
    """int64 ``[T/P]``: the position within its sequence of each token of ``rank``'s shard of the
    packing ``lengths``, in the shard's order (what ``position_ids`` must hold there)."""
    sizes = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    positions = torch.arange(int(sizes.sum())) - torch.repeat_interleave(starts, sizes)
    local = positions.numel() // P
    return positions[rank_order(lengths, P, layout)[rank * local:(rank + 1) * local]].to(device)


def _positions_hold(position_ids: torch.Tensor, lengths: tuple, P: int, layout_name: str, rank: int) -> bool:
    """Whether every row of ``position_ids [B, T/P]`` is ``true_positions`` (one host read-back)."""
    expected = true_positions(list(lengths), P, layout_name, rank, position_ids.device)
    return position_ids.shape[-1] == expected.numel() and bool((position_ids == expected).all())


def _plan(q, k, mask, kwargs, g, cp: ContextParallel):
    """This rank's checks; returns ``(lengths, run)`` with ``run(q, k, v, **options)`` the call."""
    B, Sq = q.shape[0], q.shape[1]
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        raise ValueError("sinkattn.hf context parallelism cannot run an indexed-attention layer (HY-V4's DSA "
                         "indexer, which reads the layer's 4-D mask and selects keys over the whole sequence, "
                         "which no rank holds): run this model without context_parallel")
    if mask is not None:
        raise ValueError("sinkattn.hf context parallelism takes no padding mask: pad whole documents instead "
                         "(sinkattn.hf.shard_batch does, with labels -100 at the padding)")
    if k.shape[1] != Sq:
        raise ValueError(f"sinkattn.hf context parallelism is self-attention without a cache, got {Sq} queries and "
                         f"{k.shape[1]} keys: run generation with the single-process attention implementation")
    packed = layout.flash(kwargs, B * Sq)
    if packed is not None:
        if B != 1:
            raise ValueError(f"sinkattn.hf context parallelism: cu_seq_lens_q/k describe one flattened row, got a "
                             f"batch of {B} rows; flatten the batch (sinkattn.hf.shard_batch does)")
        if not torch.equal(packed.cu_q, packed.cu_k):
            raise ValueError("sinkattn.hf context parallelism is self-attention: cu_seq_lens_q and cu_seq_lens_k "
                             "must be equal")
        lengths, max_len, cu = lengths_of(packed.cu_q), packed.max_q, packed.cu_q

        def run(q, k, v, **options):
            return distributed.sink_attn_varlen_func(q[0], k[0], v[0], cu, max_len, **options)[None]
    else:
        lengths, run = [Sq * g.size], distributed.sink_attn_func
    check_lengths(lengths, g.size, cp.layout, "cu_seq_lens_q" if packed is not None else "the sequence (P x Sq)")
    if sum(lengths) != Sq * g.size:
        raise ValueError(f"sinkattn.hf context parallelism: cu_seq_lens_q covers {sum(lengths)} tokens but the "
                         f"P={g.size} ranks hold {Sq} each; pass the global packing of the sharded batch "
                         f"(sinkattn.hf.shard_batch gives both)")
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and not layout.memoized(_positions_hold, (position_ids,), tuple(lengths), g.size,
                                                        cp.layout, g.rank):
        raise ValueError(f"sinkattn.hf context parallelism: position_ids on rank {g.rank} are not the positions of "
                         f"its tokens in their sequences; shard position_ids like the tokens (layout={cp.layout!r}), "
                         f"as sinkattn.hf.shard_batch does, so that rotary embeddings see the true positions")
    return run


def attention(q, k, v, mask, kwargs, options, cp: ContextParallel) -> torch.Tensor:
    """This rank's ``out [B, Sq, HQ, D]`` from its shards ``q [B, Sq, HQ, D]``, ``k``/``v [B, Sq, HKV, D]``.

    ``mask``: what ``sinkattn.hf.masks.key_mask`` returned (must be None); ``kwargs``: the layer's
    keyword arguments (``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``); ``options``: the
    keywords of the call (sinks, softmax_scale, causal, window_size, backend)."""
    g = groups.resolve(cp.group)
    run, error = None, None
    try:
        run = _plan(q, k, mask, kwargs, g, cp)
    except Exception as exc:       # noqa: BLE001 - every rank learns why this one cannot go on
        error = exc
    groups.agree(g, {} if error is None else None, error)
    return run(q, k, v, **options, group=cp.group, method=cp.method, layout=cp.layout)
