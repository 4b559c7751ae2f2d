"""The backends as ``torch.library`` custom ops, so ``torch.compile`` treats a call as one node.

    sinkattn::forward(q, k, v, sinks?, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, backend)
        -> [out_acc, lse, *extra]
    sinkattn::backward(do, dlse?, q, k, v, sinks?, out_acc, lse, cu_seqlens_q, cu_seqlens_k,
                       softmax_scale, left, right, backend, extra) -> [dq, dk, dv, dsinks]

``out_acc`` is the backend's accumulation dtype (fp32; float64 for ``reference``), ``extra``
whatever the backend keeps for its backward; ``dsinks`` is empty when there are no sinks.
Autograd is registered on ``forward`` and routes the gradients of ``out`` and ``lse``.
"""

from __future__ import annotations

import torch

from . import backends

__all__ = ["forward", "backward"]


@torch.library.custom_op("sinkattn::forward", mutates_args=())
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, softmax_scale: float, left: int,
            right: int, backend: str) -> list[torch.Tensor]:
    out, lse, extra = backends.load(backend).forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k,
                                                     softmax_scale, left, right)
    return [out, lse, *extra]


@forward.register_fake
def _(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, backend):
    Tq, HQ, D = q.shape
    acc = torch.float64 if backend == "reference" else torch.float32
    out, lse = q.new_empty((Tq, HQ, D), dtype=acc), q.new_empty((HQ, Tq), dtype=torch.float32)
    extra = {"cpu": [q.new_empty((), dtype=torch.bool)],
             "triton": [q.new_empty((HQ, Tq), dtype=torch.float32) for _ in range(2)]}.get(backend, [])
    return [out, lse, *extra]


@torch.library.custom_op("sinkattn::backward", mutates_args=())
def backward(do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             sinks: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
             cu_seqlens_k: torch.Tensor, softmax_scale: float, left: int, right: int, backend: str,
             extra: list[torch.Tensor]) -> list[torch.Tensor]:
    if dlse is not None and not bool(dlse.any()):   # autograd hands zeros when lse went unused
        dlse = None
    dq, dk, dv, dsinks = backends.load(backend).backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q,
                                                         cu_seqlens_k, softmax_scale, left, right, tuple(extra))
    dsinks = dsinks if dsinks is not None else q.new_empty((0,))
    return [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks]


@backward.register_fake
def _(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, backend,
      extra):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_empty((0,))
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks]


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, backend = inputs
    out, lse, *extra = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, *extra)
    ctx.options = (softmax_scale, left, right, backend)
    ctx.has_sinks = sinks is not None


def _backward(ctx, grads):
    dout, dlse = grads[0], grads[1]
    q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, *extra = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    # The public output is out_acc cast to q's dtype, so dout holds q-dtype values: cast back exactly.
    dq, dk, dv, dsinks = backward(dout.to(q.dtype).contiguous(), dlse, q, k, v, sinks, out, lse,
                                  cu_seqlens_q, cu_seqlens_k, *ctx.options, list(extra))
    return dq, dk, dv, (dsinks if ctx.has_sinks else None), None, None, None, None, None, None


forward.register_autograd(_backward, setup_context=_setup_context)
