"""The context-parallel entry points: checks (agreed by every rank), then ring or Ulysses."""

from __future__ import annotations

import torch

from .. import autocast, autodiff, backends, validation
from ..call import Call, settle
from . import group as groups
from . import ring, ulysses
from .layout import LAYOUTS, check_layout, check_lengths, lengths_of

__all__ = ["sink_attn_func", "sink_attn_varlen_func", "METHODS"]

METHODS = ("ring", "ulysses")
_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def _check_method(method) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


_DEVICES = ("cpu", "cuda", "another device")


def _facts(q, k, sinks, call: Call, return_lse, method, layout, P):
    """What every rank must agree on besides the packing, as numbers: shapes, dtype, device kind,
    options (``_shown`` puts each back in words)."""
    return {
        "the group size": P, **{f"q.shape[{i}]": n for i, n in enumerate(q.shape)},
        **{f"k.shape[{i}]": n for i, n in enumerate(k.shape)}, "the dtype": _DTYPES[q.dtype],
        "the device type": _DEVICES.index(q.device.type) if q.device.type in _DEVICES[:2] else 2,
        "whether sinks are given": sinks is not None, "softmax_scale": call.softmax_scale,
        "the left window": call.window.left, "the right window (0 under causal=True)": call.window.right,
        "return_lse": bool(return_lse), "method": METHODS.index(method),
        "layout": LAYOUTS.index(layout), "backend": backends.NAMES.index(call.backend),
        "whether gradients are needed": call.needs_grad,
    }


def _shown(name: str, value: float) -> str:
    """A fact of ``_facts`` in words, for the message when ranks disagree."""
    words = {"the dtype": {v: str(d).removeprefix("torch.") for d, v in _DTYPES.items()},
             "the device type": dict(enumerate(_DEVICES)), "method": dict(enumerate(METHODS)),
             "layout": dict(enumerate(LAYOUTS)), "backend": dict(enumerate(backends.NAMES))}
    if name in words:
        return repr(words[name][int(value)])
    if name.startswith(("whether", "return_lse")):
        return "yes" if value else "no"
    if "window" in name:
        return "unbounded (-1)" if value == -1 else f"{value:g}"
    return f"{value:g}"


def _refuse_meta(*tensors) -> None:
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        raise NotImplementedError("context parallelism exchanges shards between ranks, and meta tensors hold "
                                  "no data; for shapes only, call sinkattn.sink_attn_func / sink_attn_varlen_func "
                                  "on meta tensors (the result has q's shape, lse is fp32)")


def _check_device(q, g) -> None:
    if "nccl" in str(groups.dist.get_backend(g.handle)).lower() and q.device.type != "cuda":
        raise ValueError(f"the group uses NCCL, which needs CUDA tensors; got q on {q.device}: move the "
                         f"shards to this rank's GPU or use a gloo group for CPU tensors")


def _prepare(q, k, v, sinks, lengths_fn, softmax_scale, causal, window_size, return_lse, group, method, layout,
             backend, packed):
    """Checks on this rank, then the agreement of all ranks (the packing too when ``packed``).

    ``lengths_fn(q, k, v, P)`` checks the shapes and returns ``(lengths, longest)``. Returns the
    group, ``(q, k, v)`` as the methods take them (cast under autocast, see ``sinkattn.autocast``)
    and ``(lengths, call)``, the call settled once (``sinkattn.call``), its window folded on ``longest``."""
    autodiff.refuse_transforms()   # no collective runs inside one; a transform wraps the call on every rank
    g = groups.resolve(group)
    facts, error, ready, lengths = None, None, None, None
    try:
        q, k, v = autocast.autocast_inputs(q, k, v)
        _refuse_meta(q, k, v)
        _check_method(method)
        check_layout(layout)
        lengths, longest = lengths_fn(q, k, v, g.size)
        validation.check_options(q, sinks, softmax_scale, causal, window_size, return_lse)
        _check_device(q, g)
        call = settle(q, k, v, sinks, softmax_scale, causal, window_size, backend)
        call = call._replace(window=call.window.folded(longest, longest))
        if method == "ulysses":
            ulysses.check_heads(q.shape[-2], k.shape[-2], g.size)
        facts = _facts(q, k, sinks, call, return_lse, method, layout, g.size)
        ready = (lengths, call)
    except Exception as exc:       # noqa: BLE001 - every rank learns why this one cannot go on (groups.agree)
        error = exc
    groups.agree(g, facts, error, _shown, packing=lengths if packed else None)
    return g, (q, k, v), ready


def _attention(method, q, k, v, sinks, g, layout, ready):
    lengths, call = ready
    run = ring.attention if method == "ring" else ulysses.attention
    with autocast.disabled(q.device):     # q, k, v are cast already; the merges stay fp32
        return run(q, k, v, sinks, lengths, g, layout, call)


def sink_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, *, sinks=None, softmax_scale=None, causal=False,
                          window_size=(-1, -1), return_lse=False, group=None, method="ring", layout="zigzag",
                          backend="auto"):
    """Context-parallel ``sinkattn.sink_attn_varlen_func`` for self-attention on a packed batch.

    ``cu_seqlens`` (int32 ``[N+1]``) and ``max_seqlen`` describe the GLOBAL packing, the same on
    every rank; ``q [T/P, HQ, D]``, ``k [T/P, HKV, D]``, ``v [T/P, HKV, Dv]`` are this rank's
    ``shard_varlen(x, cu_seqlens, group, layout)`` (every sequence's length divisible by P, or 2P
    for ``zigzag``). Returns this rank's shard of the single-process result: ``out [T/P, HQ, Dv]``,
    and ``lse [HQ, T/P]`` with ``return_lse``. Gradients of q/k/v are this rank's shards of the
    full ones; the gradient of ``sinks`` is this rank's contribution (sum it over the group).
    ``method``: ``"ring"`` or ``"ulysses"``; see ``sinkattn.distributed``.
    """
    def lengths_fn(q, k, v, P):
        validation.check_qkv(q, k, v, 1, "[T/P, HQ, D], this rank's shard", "[T/P, HKV, D], this rank's shard")
        validation.check_cu_seqlens("cu_seqlens", cu_seqlens, q.device)
        validation.check_max_seqlen("max_seqlen", max_seqlen)
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"context parallelism is self-attention: k must have the token count of q, got "
                             f"q {q.shape[0]}, k {k.shape[0]}")
        offsets = cu_seqlens.tolist()
        validation.check_offsets("cu_seqlens", offsets, None, "max_seqlen", max_seqlen)
        lengths = lengths_of(offsets)
        check_lengths(lengths, P, layout, "cu_seqlens")
        if offsets[-1] != q.shape[0] * P:
            raise ValueError(f"q holds {q.shape[0]} tokens on this rank, but cu_seqlens covers {offsets[-1]} tokens, "
                             f"{offsets[-1] // P} on each of the P={P} ranks: pass this rank's "
                             f"shard_varlen(x, cu_seqlens, group, layout={layout!r}) of the global packing")
        return lengths, max_seqlen

    g, (q, k, v), ready = _prepare(q, k, v, sinks, lengths_fn, softmax_scale, causal, window_size, return_lse, group,
                                   method, layout, backend, packed=True)
    out, lse = _attention(method, q, k, v, sinks, g, layout, ready)
    return (out, lse) if return_lse else out


def sink_attn_func(q, k, v, *, sinks=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                   return_lse=False, group=None, method="ring", layout="zigzag", backend="auto"):
    """Context-parallel ``sinkattn.sink_attn_func``: ``q [B, S/P, HQ, D]``, ``k``/``v [B, S/P, HKV, D]``
    are this rank's ``shard(x, dim=1, group, layout)`` of self-attention over ``S`` tokens.

    Returns this rank's shard of ``out [B, S/P, HQ, Dv]`` (and ``lse [B, HQ, S/P]``); options and
    gradients as in ``sink_attn_varlen_func``.
    """
    def lengths_fn(q, k, v, P):
        validation.check_qkv(q, k, v, 2, "[B, S/P, HQ, D], this rank's shard", "[B, S/P, HKV, D], this rank's shard")
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"context parallelism is self-attention: k must have the sequence length of q, got "
                             f"q {q.shape[1]}, k {k.shape[1]}")
        S = q.shape[1] * P
        check_lengths([S], P, layout, f"the sequence (P x q.shape[1] = {P} x {q.shape[1]})")
        return [S] * q.shape[0], S

    g, (q, k, v), ready = _prepare(q, k, v, sinks, lengths_fn, softmax_scale, causal, window_size, return_lse, group,
                                   method, layout, backend, packed=False)
    B, S_local, HQ, D = q.shape
    HKV = k.shape[2]
    out, lse = _attention(method, q.reshape(B * S_local, HQ, D), k.reshape(B * S_local, HKV, D),
                          v.reshape(B * S_local, HKV, v.shape[-1]), sinks, g, layout, ready)
    out = out.view(B, S_local, HQ, v.shape[-1])
    return (out, lse.reshape(HQ, B, S_local).transpose(0, 1)) if return_lse else out
