"""Public entry points: validation, backend choice, and the autograd glue.

Backends compute; this module only checks arguments, picks one, and calls it through
the ``sinkattn::forward`` custom op (``sinkattn.ops``), whose registered autograd routes
the gradients of ``out`` and ``lse`` to the backend's ``backward``. Everything here
traces under ``torch.compile(fullgraph=True)``: it reads shapes and Python values only.
"""

from __future__ import annotations

import torch

from . import autodiff, backends, defaults, masks, ops, validation
from .autocast import autocast_inputs

__all__ = ["sink_attn_varlen_func", "sink_attn_func"]


def _call(q, k, v, sinks, softmax_scale, causal, window_size, backend):
    """What every call settles first: ``(backend name, needs_grad, left, right, softmax_scale)``."""
    autodiff.refuse_unsupported(q, k, v, sinks)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sinks))
    name = backends.choose(backend, backends.Call(q.device.type, q.dtype, q.shape[-1], needs_grad))
    left, right = masks.normalize_window(validation.as_bool("causal", causal), window_size)   # the op folds on lengths
    return name, needs_grad, left, right, defaults.softmax_scale(q.shape[-1], softmax_scale)


def _run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, call, check_cu_seqlens=True):
    """``(out, lse [HQ, Tq])`` of a packed call settled by ``_call``."""
    name, needs_grad, left, right, softmax_scale = call
    args = (q.contiguous(), k.contiguous(), v.contiguous(), sinks.contiguous() if sinks is not None else None,
            cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
            softmax_scale, left, right, name, check_cu_seqlens)
    if not needs_grad and ops.is_plain_eager(*args[:6]):     # the op's body without its dispatch
        out_acc, lse, *_ = ops.forward_eager(*args, inputs_contiguous=True)
    else:
        out_acc, lse, *_ = ops.forward(*args)
    return out_acc.to(q.dtype), lse


def _dense_eager(q, k, v, sinks, call):
    """``(out [B, Sq, HQ, D], lse [B, HQ, Sq])`` of an eager, no-grad dense call (settled by ``_call``) that
    the backend computes on the tensors as they are (``forward_dense``: one kernel call, as in decoding),
    else None."""
    name, needs_grad, left, right, softmax_scale = call
    dense = getattr(backends.load(name), "forward_dense", None)
    if dense is None or needs_grad or not ops.is_plain_eager(q, k, v, sinks) or torch.is_autocast_enabled(
            q.device.type):        # under autocast the op's body runs the backend with autocast off
        return None
    result = dense(q, k, v, sinks, softmax_scale, left, right)
    if result is None:
        return None
    out, lse = result
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse


def sink_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                          sinks=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                          return_lse=False, backend="auto"):
    """Sink attention on a packed batch of N variable-length sequences.

    Args:
        q: ``[Tq, HQ, D]``; k, v: ``[Tk, HKV, D]``; one dtype among fp16 / bf16 / fp32.
        cu_seqlens_q, cu_seqlens_k: int32 ``[N+1]``, sequence ``b`` owns tokens
            ``cu[b]:cu[b+1]``.
        max_seqlen_q, max_seqlen_k: ints, upper bounds of the lengths.
        sinks: ``[HQ]`` raw logits (not scaled), any float dtype, or None.
        softmax_scale: defaults to ``1/sqrt(D)``.
        causal, window_size: ``visible(i, j) = lo(i) <= j < hi(i)`` bottom-right
            aligned (see ``sinkattn.masks``); ``causal`` forces ``right = 0``; a side of
            ``-1``, or one reaching past every key, is unbounded.
        return_lse: also return ``lse`` fp32 ``[HQ, Tq]`` (natural log, sink included).
        backend: ``"auto"`` (``cpu`` for CPU tensors, ``triton`` for CUDA tensors), ``"cpu"``,
            ``"triton"`` or ``"reference"`` (float64, materialized).

    For query head ``h`` (KV head ``h // G``) and row ``i`` of a sequence:

        lse_i = log(exp(sink_h) + sum_{visible j} exp(scale <q_i, k_j>))
        o_i   = sum_{visible j} exp(scale <q_i, k_j> - lse_i) v_j

    Under ``torch.autocast``, q, k and v are first cast to its dtype, as for SDPA (``sinkattn.autocast``).

    Returns ``out [Tq, HQ, D]`` in q's dtype, or ``(out, lse)``.
    """
    q, k, v = autocast_inputs(q, k, v)
    validation.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    validation.check_options(q, sinks, softmax_scale, causal, window_size, return_lse)
    # a bound past the token count bounds no more than it (and then fits the op's int64)
    max_seqlen_q, max_seqlen_k = torch.sym_min(max_seqlen_q, q.shape[0]), torch.sym_min(max_seqlen_k, k.shape[0])
    out, lse = _run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
                    _call(q, k, v, sinks, softmax_scale, causal, window_size, backend))
    return (out, lse) if validation.as_bool("return_lse", return_lse) else out


def sink_attn_func(q, k, v, *, sinks=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                   return_lse=False, backend="auto"):
    """Sink attention on a dense batch: ``q [B, Sq, HQ, D]``, ``k``/``v [B, Sk, HKV, D]``.

    Same function, options and autocast rule as ``sink_attn_varlen_func``; ``lse`` is fp32 ``[B, HQ, Sq]``.
    """
    q, k, v = autocast_inputs(q, k, v)
    validation.check_dense(q, k, v)
    validation.check_options(q, sinks, softmax_scale, causal, window_size, return_lse)
    B, Sq, HQ, D = q.shape
    Sk, HKV = k.shape[1], k.shape[2]
    call = _call(q, k, v, sinks, softmax_scale, causal, window_size, backend)
    decoded = _dense_eager(q, k, v, sinks, call)
    if decoded is not None:
        out, lse = decoded
    else:
        steps = torch.arange(B + 1, dtype=torch.int32, device=q.device)
        out, lse = _run(q.reshape(B * Sq, HQ, D), k.reshape(B * Sk, HKV, D), v.reshape(B * Sk, HKV, D),
                        steps * Sq, steps * Sk, Sq, Sk, sinks, call, check_cu_seqlens=False)
        out, lse = out.view(B, Sq, HQ, D), lse.view(HQ, B, Sq).transpose(0, 1)
    return (out, lse) if validation.as_bool("return_lse", return_lse) else out
