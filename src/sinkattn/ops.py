"""The backends as ``torch.library`` custom ops, so ``torch.compile`` treats a call as one node.

    sinkattn::forward(q, k, v, sinks?, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, left, right, backend, check_cu_seqlens) -> [out_acc, lse, *extra]
    sinkattn::backward(do, dlse?, q, k, v, sinks?, out_acc, lse, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, softmax_scale, left, right, backend, extra)
                       -> [dq, dk, dv, dsinks]

``out_acc`` is in the backend's declared ``out_dtype`` (fp32; float64 for ``reference``), ``extra``
the tensors it declares in ``saved``; ``dsinks`` is empty when there are no sinks. Every result is
contiguous, exactly as the fake implementations describe it, and every tensor handed to a backend
is contiguous too (a strided view such as ``cu_seqlens[::2]`` is copied first), so no backend
reads memory through a layout it does not assume. The checks on the contents of
``cu_seqlens`` run here, inside the op, where reading a tensor cannot break a traced graph
(``check_cu_seqlens=False`` for the ones the dense entry point builds itself). The window is
folded on the lengths here too (``masks.normalize_window``), where they are plain ints.
Autograd is registered on ``forward`` and routes the gradients of ``out`` and ``lse``. The backends
run with autocast off: their fp32 arithmetic is part of the contract (``sinkattn.autocast``).
"""

from __future__ import annotations

import torch

from . import autocast, autodiff, backends, masks, validation
from .backends.buffers import contiguous

if torch.distributed.is_available():
    # The first call of any torch.library op imports torch._dynamo, which imports
    # torch.distributed.nn.functional, whose functions bind ``group=dist.group.WORLD`` as default
    # arguments. Imported after init_process_group, they hold the default group for good:
    # destroy_process_group cannot free it, gloo's worker threads outlive the interpreter, and a
    # rank can abort at exit ("terminate called without an active exception", pytorch#190489).
    # Imported here, with sinkattn, it binds None instead (about 3 ms once torch is loaded).
    import torch.distributed.nn.functional  # noqa: F401

__all__ = ["forward", "backward", "forward_eager", "is_plain_eager"]


def is_plain_eager(*tensors) -> bool:
    """True when a call may run the forward op's body directly, without the op (``forward_eager``):
    eager mode (not traced or compiled, no torch function or dispatch mode such as FakeTensorMode or
    a FLOP counter), no gradient to record, and plain tensors (no subclass) on a real device. The
    op then adds nothing but its dispatch (about 30 us, as long as a whole decoding step's attention)."""
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._len_torch_dispatch_stack() > 0:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:              # a loop, not all(<generator>): this runs once per decoding step
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad) or t.is_meta):
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that dispatch as plain tensors (a model's ``sinks`` are a Parameter)."""


def forward_eager(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left, right,
                  backend, check_cu_seqlens, *, inputs_contiguous=False) -> list[torch.Tensor]:
    """The body of ``sinkattn::forward`` (same arguments, same results), for ``is_plain_eager`` calls;
    ``inputs_contiguous``: the caller made every tensor argument contiguous already."""
    if check_cu_seqlens:
        validation.check_cu_seqlens_contents(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                             max_seqlen_q, max_seqlen_k)
    left, right = masks.normalize_window(False, (left, right), max_seqlen_q, max_seqlen_k)
    if not inputs_contiguous:
        q, k, v, sinks, cu_seqlens_q, cu_seqlens_k = contiguous(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k)
    with autocast.disabled(q.device):
        out, lse, extra = backends.load(backend).forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k,
                                                         softmax_scale, left, right,
                                                         max_seqlen=(max_seqlen_q, max_seqlen_k))
    return contiguous(out, lse, *extra)


@torch.library.custom_op("sinkattn::forward", mutates_args=())
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
            softmax_scale: float, left: int, right: int, backend: str,
            check_cu_seqlens: bool) -> list[torch.Tensor]:
    return forward_eager(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left,
                         right, backend, check_cu_seqlens)


@forward.register_fake
def _(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left, right,
      backend, check_cu_seqlens):
    caps = backends.describe(backend)
    Tq, HQ, D = q.shape
    out, lse = q.new_empty((Tq, HQ, D), dtype=caps.out_dtype), q.new_empty((HQ, Tq), dtype=torch.float32)
    return [out, lse, *(s.like(q, k) for s in caps.saved)]


@torch.library.custom_op("sinkattn::backward", mutates_args=())
def backward(do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             sinks: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, left: int,
             right: int, backend: str, extra: list[torch.Tensor]) -> list[torch.Tensor]:
    left, right = masks.normalize_window(False, (left, right), max_seqlen_q, max_seqlen_k)
    do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, *extra = contiguous(
        do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, *extra)
    with autocast.disabled(q.device):
        dq, dk, dv, dsinks = backends.load(backend).backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q,
                                                             cu_seqlens_k, softmax_scale, left, right, tuple(extra),
                                                             max_seqlen=(max_seqlen_q, max_seqlen_k))
    dsinks = dsinks if dsinks is not None else q.new_empty((0,))
    return contiguous(dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks)


@backward.register_fake
def _(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      left, right, backend, extra):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks]


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left, right, backend, _ = (
        inputs)
    out, lse, *extra = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, *extra)
    ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, left, right, backend)
    ctx.has_sinks = sinks is not None
    ctx.set_materialize_grads(False)    # an unused out or lse arrives as None, not as zeros to look into


def _backward(ctx, grads):
    autodiff.refuse_double_backward()
    dout, dlse = grads[0], grads[1]
    q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, *extra = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    # The public output is out_acc cast to q's dtype, so dout holds q-dtype values: cast back exactly.
    dlse = dlse.contiguous() if dlse is not None else None
    dq, dk, dv, dsinks = backward(dout.to(q.dtype).contiguous(), dlse, q, k, v, sinks, out, lse,
                                  cu_seqlens_q, cu_seqlens_k, *ctx.options, list(extra))
    return (dq, dk, dv, (dsinks if ctx.has_sinks else None)) + (None,) * 9


forward.register_autograd(_backward, setup_context=_setup_context)
