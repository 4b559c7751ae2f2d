"""Public entry points: argument checks, the settled call (``sinkattn.call``), the op.

Backends compute; this module only checks arguments, settles the call once and runs it through
``sinkattn.ops`` (the ``sinkattn::forward`` custom op, whose registered autograd routes the
gradients of ``out`` and ``lse`` to the backend's backward). Everything here traces under
``torch.compile(fullgraph=True)``: it reads shapes and Python values only.
"""

from __future__ import annotations


from . import dtensor, ops, validation
from .autocast import autocast_inputs
from .call import settle

__all__ = ["sink_attn_varlen_func", "sink_attn_func"]


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
    q, k, v and sinks may be DTensors sharded over heads, or replicated (tensor parallelism,
    ``sinkattn.dtensor``): results are DTensors, each rank's the plain call on its heads.

    Returns ``out [Tq, HQ, D]`` in q's dtype, or ``(out, lse)``.
    """
    q, k, v = autocast_inputs(q, k, v)
    validation.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    validation.check_options(q, sinks, softmax_scale, causal, window_size, return_lse)
    q, k, v, sinks, cu_seqlens_q, cu_seqlens_k = dtensor.placed(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k)
    call = settle(q, k, v, sinks, softmax_scale, causal, window_size, backend, return_lse, max_seqlen_q, max_seqlen_k)
    o, lse, *_ = ops.attention(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k,
                               call.softmax_scale, call.window, call.backend, call.needs_grad)
    out = o if o.dtype == q.dtype else o.to(q.dtype)
    return (out, lse) if call.return_lse else out


def sink_attn_func(q, k, v, *, sinks=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                   return_lse=False, backend="auto"):
    """Sink attention on a dense batch: ``q [B, Sq, HQ, D]``, ``k``/``v [B, Sk, HKV, D]``.

    Same function, options and autocast rule as ``sink_attn_varlen_func``; ``lse`` is fp32 ``[B, HQ, Sq]``.
    """
    q, k, v = autocast_inputs(q, k, v)
    validation.check_dense(q, k, v)
    validation.check_options(q, sinks, softmax_scale, causal, window_size, return_lse)
    q, k, v, sinks, _, _ = dtensor.placed(q, k, v, sinks, None, None)
    call = settle(q, k, v, sinks, softmax_scale, causal, window_size, backend, return_lse)
    o, lse, *_ = ops.attention(q, k, v, sinks, None, None, call.max_seqlen_q, call.max_seqlen_k, call.softmax_scale,
                               call.window, call.backend, call.needs_grad)
    out = o if o.dtype == q.dtype else o.to(q.dtype)
    if not call.return_lse:
        return out
    B, Sq, HQ = q.shape[:3]
    return out, lse.view(HQ, B, Sq).transpose(0, 1)
