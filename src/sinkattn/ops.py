"""The backends as ``torch.library`` custom ops, so ``torch.compile`` treats a call as one node, and
the only code that calls a backend.

    sinkattn::forward(q, k, v, sinks?, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k,
                      softmax_scale, left, right, backend, check_cu_seqlens, for_backward)
                      -> (o, lse, m, log_l)
    sinkattn::backward(do, dlse?, q, k, v, sinks?, o, m, log_l, cu_seqlens_q?, cu_seqlens_k?,
                       max_seqlen_q, max_seqlen_k, softmax_scale, left, right, backend, partial,
                       fp32_grads=False)
                       -> (dq, dk, dv, dsinks)

A call is packed (``q [Tq, HQ, D]`` with ``cu_seqlens_*``) or dense (``q [B, Sq, HQ, D]``,
``cu_seqlens_*`` None; the op packs it, except an inference call a ``dense`` backend takes as it is).
The forward runs the backend's softmax over keys and joins the sink once (``sinkattn.sink``):
``o`` (tokens first, in the backend's ``out_dtype``; the caller casts it to q's dtype) and the
final statistics ``Stats(m, log_l)`` ``[HQ, T]`` with ``lse`` fp32 ``[HQ, T]`` (``T = B * Sq`` for a
dense call). Without sinks the results are the softmax over the call's keys alone, which is what
context parallelism merges tile by tile. The backward forms ``dsinks`` (empty without sinks) from
the ``Delta`` the backend used; ``partial`` says the call holds only some keys of its rows (``Delta``
from ``o``). ``fp32_grads`` returns ``dq``, ``dk``, ``dv`` in fp32 instead of the dtypes of q, k, v, for
a caller that sums partial gradients and rounds the sum once (context parallelism: a ring tile sets
both flags; a Ulysses call whose KV head is shared with other ranks holds every key of its rows but
only part of that head's dk/dv, and sets ``fp32_grads`` alone). Neither flag implies the other.

Every result is contiguous, exactly as the fake implementations describe it; every tensor handed
to a backend is contiguous too (a strided view such as ``cu_seqlens[::2]`` is copied first), but
the dense tensors of an inference call. The checks on the contents of ``cu_seqlens`` run inside
the op, where reading a tensor cannot break a traced graph (``check_cu_seqlens=False`` for the
ones sinkattn builds itself), and the window is folded on the lengths there too, where they are
plain ints. Autograd is registered on ``forward``. The backends run with autocast off: their fp32
arithmetic is part of the contract (``sinkattn.autocast``).

``attention`` and ``gradients`` are how the rest of sinkattn calls the ops: through the dispatcher,
or, for a plain eager call (``is_plain_eager``), the ops' own implementation directly (the same
function, without the ~30 us dispatch, as long as a decoding step's attention). A plain eager call
that autograd records goes through ``_Eager``, an ``autograd.Function`` around the same
implementation, context and backward as the op's registered autograd (the op's autograd layer and
two dispatches cost ~100 us, as much as the attention of a short sequence).
"""

from __future__ import annotations

import functools

import torch

from . import autocast, autodiff, backends, sink, validation
from .backends.buffers import contiguous
from .backends.capabilities import Batch
from .backends.protocol import Final, Partial
from .masks import Window

if torch.distributed.is_available():
    # The first call of any torch.library op imports torch._dynamo, which imports
    # torch.distributed.nn.functional, whose functions bind ``group=dist.group.WORLD`` as default
    # arguments. Imported after init_process_group, they hold the default group for good:
    # destroy_process_group cannot free it, gloo's worker threads outlive the interpreter, and a
    # rank can abort at exit ("terminate called without an active exception", pytorch#190489).
    # Imported here, with sinkattn, it binds None instead (about 3 ms once torch is loaded).
    import torch.distributed.nn.functional  # noqa: F401

__all__ = ["forward", "backward", "attention", "gradients", "is_plain_eager"]

Results = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""Four tensors: a tuple, not a list, so that each has its own entry in the op's schema (a DTensor
sharding rule gives every output its own placement, ``sinkattn.dtensor``)."""


def is_plain_eager(*tensors, recorded: bool = False) -> bool:
    """True when a call may run the op's implementation directly: eager mode (not traced or compiled,
    no torch function or dispatch mode such as FakeTensorMode or a FLOP counter), no gradient to
    record (``recorded``: the caller records it itself, ``_Eager``), and plain tensors (no subclass)
    on a real device."""
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._len_torch_dispatch_stack() > 0:
        return False
    grad = torch.is_grad_enabled() and not recorded
    for t in tensors:              # a loop, not all(<generator>): this runs once per decoding step
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad) or t.is_meta):
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that dispatch as plain tensors (a model's ``sinks`` are a Parameter)."""


def _packed(q, k, v, *rest):
    """A dense call's tensors ``[B, S, H, D]`` as a packed batch: ``(q, k, v, *rest)`` contiguous
    ``[B*S, H, D]`` (``rest``: more query-side tensors) and the ``Batch`` of ``B`` equal sequences."""
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    flat = [None if t is None else t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).contiguous()
            for t in (q, k, v, *rest)]
    offsets = _cpu_offsets(B, Sq, Sk) if q.device.type == "cpu" else _offsets(B, Sq, Sk, q.device)
    return flat, Batch(*offsets, Sq, Sk)


def _offsets(B: int, Sq: int, Sk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens_q``, ``cu_seqlens_k`` (int32 ``[B+1]``) of ``B`` sequences of ``Sq`` queries and ``Sk`` keys."""
    steps = torch.arange(B + 1, dtype=torch.int32, device=device)
    return steps * Sq, steps * Sk


_cpu_offsets = functools.lru_cache(maxsize=16)(functools.partial(_offsets, device="cpu"))
"""``_offsets`` on the CPU, made once per shape (every layer of a model asks for the same; the backends only
read them). Not on a GPU, where a tensor made during a CUDA graph capture belongs to that graph's memory."""


def _joined(impl, caps, partial: Partial, sinks) -> Final:
    """The sink joins a forward's results once (``sinkattn.sink``'s rule, or the backend's copy of it)."""
    if sinks is not None and caps.joins_sink:
        final = impl.join_sink(partial.o, partial.stats, sinks)
        if final is not None:
            return final
    o, stats = sink.with_sink(partial.o, partial.stats, sinks, caps.base2)
    return Final(o, stats, sink.lse_of(stats, caps.base2, sinks, partial.stats).float())


def _forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left, right,
             backend, check_cu_seqlens, for_backward) -> Results:
    """The implementation of ``sinkattn::forward``."""
    impl = backends.load(backend)
    caps = impl.CAPABILITIES
    dense = cu_seqlens_q is None
    window = Window(left, right).folded(max_seqlen_q, max_seqlen_k)
    with autocast.disabled(q.device):
        final = None
        if dense and caps.dense and not for_backward:
            final = impl.forward_dense(q, k, v, sinks, window, softmax_scale)
        if final is None:
            if dense:
                (qp, kp, vp), batch = _packed(q, k, v)
            else:
                if check_cu_seqlens:
                    validation.check_cu_seqlens_contents(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                                         max_seqlen_q, max_seqlen_k)
                qp, kp, vp, cu_q, cu_k = contiguous(q, k, v, cu_seqlens_q, cu_seqlens_k)
                batch = Batch(cu_q, cu_k, max_seqlen_q, max_seqlen_k)
            final = _joined(impl, caps, impl.forward(qp, kp, vp, batch, window, softmax_scale, for_backward), sinks)
    o = final.o if final.o.dim() == q.dim() else final.o.view(q.shape[:-1] + final.o.shape[-1:])   # [B, Sq, HQ, Dv]
    return o.contiguous(), final.lse, final.stats.m, final.stats.log_l


@torch.library.custom_op("sinkattn::forward", mutates_args=())
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
            cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
            max_seqlen_k: int, softmax_scale: float, left: int, right: int, backend: str,
            check_cu_seqlens: bool, for_backward: bool) -> Results:
    return _forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left,
                    right, backend, check_cu_seqlens, for_backward)


@forward.register_fake
def _(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left, right,
      backend, check_cu_seqlens, for_backward):
    out_dtype = backends.describe(backend).out_dtype
    HQ = q.shape[-2]
    T = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
    stat = (HQ, T)
    return (q.new_empty(q.shape[:-1] + v.shape[-1:], dtype=out_dtype), q.new_empty(stat, dtype=torch.float32),
            q.new_empty(stat, dtype=out_dtype), q.new_empty(stat, dtype=out_dtype))


def _backward(do, dlse, q, k, v, sinks, o, m, log_l, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, left, right, backend, partial, fp32_grads=False) -> Results:
    """The implementation of ``sinkattn::backward``."""
    caps, impl = backends.describe(backend), backends.load(backend)
    shapes = (q.shape, k.shape, v.shape)
    if cu_seqlens_q is None:
        (q, k, v, do, o), batch = _packed(q, k, v, do, o)
    else:
        do, q, k, v, o, cu_seqlens_q, cu_seqlens_k = contiguous(do, q, k, v, o, cu_seqlens_q, cu_seqlens_k)
        batch = Batch(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    window = Window(left, right).folded(max_seqlen_q, max_seqlen_k)
    dlse, m, log_l = contiguous(dlse, m, log_l)
    stats = sink.Stats(m, log_l)
    with autocast.disabled(q.device):
        mass = sink.sink_mass(sinks, stats, caps.base2) if sinks is not None else None
        dq, dk, dv, delta = impl.backward(do, dlse, q, k, v, o, stats, mass, batch, window, softmax_scale, partial)
        dsinks = sink.dsinks_from(sinks, mass, delta) if sinks is not None else q.new_empty((0,))
    dtypes = (torch.float32,) * 3 if fp32_grads else (q.dtype, k.dtype, v.dtype)
    return tuple(contiguous(*(g.to(dtype).view(shape) for g, dtype, shape in zip((dq, dk, dv), dtypes, shapes)),
                            dsinks))


@torch.library.custom_op("sinkattn::backward", mutates_args=())
def backward(do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             sinks: torch.Tensor | None, o: torch.Tensor, m: torch.Tensor, log_l: torch.Tensor,
             cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
             max_seqlen_k: int, softmax_scale: float, left: int, right: int, backend: str,
             partial: bool, fp32_grads: bool = False) -> Results:
    return _backward(do, dlse, q, k, v, sinks, o, m, log_l, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, left, right, backend, partial, fp32_grads)


@backward.register_fake
def _(do, dlse, q, k, v, sinks, o, m, log_l, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, left, right, backend, partial, fp32_grads=False):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    grads = [x.new_empty(x.shape, dtype=torch.float32 if fp32_grads else x.dtype) for x in (q, k, v)]
    return *grads, dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, left, right, backend = (
        inputs[:12])
    o, _, m, log_l = output
    ctx.save_for_backward(q, k, v, sinks, o, m, log_l, cu_seqlens_q, cu_seqlens_k)
    ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, left, right, backend)
    ctx.has_sinks = sinks is not None
    ctx.set_materialize_grads(False)      # an unused lse hands None, not zeros to read


def _autograd_backward(ctx, dout, dlse, _dm, _dlog_l):
    autodiff.refuse_double_backward()
    q, k, v, sinks, o, m, log_l, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    # The public output is o cast to q's dtype, so dout holds q-dtype values: cast back exactly.
    # (zeros_like: o's type and placement when the call ran on DTensors)
    dout = torch.zeros_like(o, dtype=q.dtype) if dout is None else dout.to(q.dtype)
    args = (dout.contiguous(), dlse, q, k, v, sinks, o, m, log_l, cu_seqlens_q, cu_seqlens_k, *ctx.options, False)
    dq, dk, dv, dsinks = _backward(*args) if is_plain_eager(dout, dlse, q, k, v, sinks, o) else backward(*args)
    return (dq, dk, dv, (dsinks if ctx.has_sinks else None)) + (None,) * 10


forward.register_autograd(_autograd_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """``sinkattn::forward`` with its registered autograd (``_setup_context``, ``_autograd_backward``), for a
    plain eager call: the same implementation and gradients, without the dispatcher."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _autograd_backward(ctx, *grads)


def attention(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
              window: Window, backend: str, needs_grad: bool, check_cu_seqlens: bool = True,
              for_backward: bool | None = None):
    """``(o, lse, m, log_l)`` of ``sinkattn::forward`` (see the module doc), recorded by autograd when
    ``needs_grad``. ``for_backward`` (default: ``needs_grad``): the statistics will serve a backward, exact
    (context parallelism's tiles ask for them without autograd)."""
    for_backward = needs_grad if for_backward is None else for_backward
    args = (q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window.left,
            window.right, backend, check_cu_seqlens, for_backward)
    if is_plain_eager(q, k, v, sinks, recorded=needs_grad):
        return _Eager.apply(*args) if needs_grad else _forward(*args)
    return forward(*args)


def gradients(do, dlse, q, k, v, o, m, log_l, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
              softmax_scale: float, window: Window, backend: str, partial: bool = False, fp32_grads: bool = False):
    """``(dq, dk, dv)`` of ``sinkattn::backward`` without sinks, from the final ``o``, ``m``, ``log_l``
    of the rows (context parallelism's tiles); fp32 with ``fp32_grads``, else in the dtypes of q, k, v."""
    args = (do, dlse, q, k, v, None, o, m, log_l, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, window.left, window.right, backend, partial, fp32_grads)
    dq, dk, dv, _ = _backward(*args) if is_plain_eager(do, q, k, v) else backward(*args)
    return dq, dk, dv
