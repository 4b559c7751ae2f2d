"""``backend="cpu"``: sink attention on CPU tensors, in fp32 for every input dtype.

Every path computes the softmax over keys of the backend protocol (``sinkattn.backends.protocol``) in
the tiles of ``cpu_tiles`` (its docstring gives the numerics); the sink joins by ``sinkattn.sink``'s
rule, in the compiled kernel's copy of it where that is built (``join_sink``, ``forward_dense``):

* the compiled kernel (``cpu_native``, built on first use where a C++ compiler is present) takes
  every call that needs gradients, every backward, and the forwards the fused kernel cannot take
  (``Dv != D``, a scale <= 0): all sequences of a packed batch in one call, the element-wise work
  fused between its matrix products;
* PyTorch's fused flash-attention kernel (``cpu_fused``, the fastest CPU forward) takes a call
  without gradients; a dense batch that one unmasked fused-kernel call covers, as in decoding, is
  handed over as it is, any strides, and its results taken when they are the formula's
  (``forward_dense``);
* the PyTorch-op paths take the rest: inputs holding NaN or inf (those reach exactly the rows that
  see their key, ``nonfinite``, which only these ensure), and every call where the kernel is not
  built (``SINKATTN_CPU_KERNEL=python``, no compiler). ``cpu_small`` takes the packed sequences of at
  most ``cpu_small.SHORT_LENGTH`` queries and keys, many per tile; ``cpu_tiles`` the others, in runs
  of equal-length sequences (a dense batch is one run).

fp16 / bf16 inputs are cast up once; results are cast by the caller. dK/dV are reduced over the group
inside the paths, in fp32 and a fixed order: results are bitwise reproducible (the compiled kernel's
for any thread count: each result element is one thread's).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .. import sink
from ..masks import Window
from . import buffers, cpu_fused, cpu_native, cpu_small, cpu_tiles, layout, nonfinite
from .capabilities import Capabilities
from .layout import Sequences
from .protocol import Final, Gradients, Partial
from .scores import MAX_SCORE, check_fp32_range, loose_bound, norms, score_bound

__all__ = ["CAPABILITIES", "forward", "forward_dense", "backward", "join_sink", "split"]

CAPABILITIES = Capabilities(
    name="cpu",
    device_types=frozenset({"cpu"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_dim=512,
    dense=True,
    joins_sink=True,
)

_NEG_INF = float("-inf")


NATIVE_BM = 128
"""Stacked rows (``G`` heads times positions) per row block of the compiled kernel."""

BACKWARD_SPLIT = 0
"""The compiled backward's tasks: 0 (``auto``) its split passes (dQ by row block, then dK/dV by chunk of keys:
seven products per tile where the fused pass has five) when its fused tasks (one per sequence and KV head)
would keep at most half of torch's threads busy and its sequences have two chunks of keys (``cpu_tiles.BN``)
on average, 1 always the fused tasks, 2 always the split passes. The results are the same bits either way."""


def _scales(softmax_scale: float) -> tuple[float, float]:
    """The compiled kernel's ``(row_scale, score_scale)``: ``cpu_tiles.row_scale`` / ``score_scale``, 1 for none."""
    row, score = cpu_tiles.row_scale(softmax_scale), cpu_tiles.score_scale(softmax_scale)
    return (1.0 if row is None else row), (1.0 if score is None else score)


class _Native(NamedTuple):
    """How a packed call reaches the compiled kernel: the kernel's view of its sequences (``cu_q``, ``cu_k``
    int64 ``[N+1]``, ``bounds`` int64 ``[T, 2]``: the keys ``[lo, hi)`` of its own sequence each query token
    sees, ``sinkattn.masks``; ``skip`` int64 ``[N]`` or empty: the sequences it leaves to ``cpu_small``), and
    those short sequences (``small``, or None)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    bounds: torch.Tensor
    skip: torch.Tensor
    small: Sequences | None = None

    @property
    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.cu_q, self.cu_k, self.bounds, self.skip


def _native(batch, window: Window, HQ: int) -> _Native:
    """The kernel's part of the call (``_Native``). A short sequence (``cpu_small.takes``: at most
    ``cpu_small.SHORT_LENGTH`` queries and keys) goes to ``cpu_small`` whatever it is packed with, many per
    tile (one kernel task each would cost far more than its attention), so a sequence's results depend on its
    own inputs only; the kernel skips it. Kept for the last few layouts: a model's layers, and a call's
    backward, share one."""
    return _native_of(tuple(batch.cu_seqlens_q.tolist()), tuple(batch.cu_seqlens_k.tolist()), window, HQ)


@functools.lru_cache(maxsize=8)
def _native_of(cu_seqlens_q: tuple[int, ...], cu_seqlens_k: tuple[int, ...], window: Window, HQ: int):
    cu_q, cu_k = torch.tensor(cu_seqlens_q, dtype=torch.int64), torch.tensor(cu_seqlens_k, dtype=torch.int64)
    Tq = cu_seqlens_q[-1]
    Lq, Lk = cu_q.diff(), cu_k.diff()
    seq = torch.repeat_interleave(torch.arange(Lq.numel()), Lq, output_size=Tq)
    lo, hi = window.key_bounds(torch.arange(Tq) - cu_q[seq], Lq[seq], Lk[seq])
    bounds = torch.stack((lo, hi), 1)
    short = (Lq > 0) & cpu_small.takes(Lq, Lk, HQ)
    if not bool(short.any()):
        return _Native(cu_q, cu_k, bounds, cu_q.new_empty(0))
    index = short.nonzero().flatten()
    small = Sequences(cu_q[:-1][index], cu_k[:-1][index], Lq[index], Lk[index])
    return _Native(cu_q, cu_k, bounds, short.to(torch.int64), small)


def split(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, HQ: int) -> layout.Split:
    """The call's sequences by path: ``cpu_small`` for those it ``takes``, the others in runs."""
    return layout.split(cu_seqlens_q, cu_seqlens_k, lambda Lq, Lk: cpu_small.takes(Lq, Lk, HQ))


SMALL_ROWS = 4
"""A dense inference call of at most this many queries per sequence (decoding) runs whole in the compiled
kernel (``forward_small``): a fused-attention library call costs more than its arithmetic there."""


@functools.lru_cache(maxsize=64)
def _row_bounds(Lq: int, Lk: int, window: Window) -> torch.Tensor:
    """int64 ``[Lq, 2]``: the keys ``[lo, hi)`` each query row of a sequence sees (``sinkattn.masks``)."""
    return torch.stack(window.key_bounds(torch.arange(Lq), Lq, Lk), 1)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 with its last dim contiguous (the compiled kernel's rows), any other strides."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def _dense_ok(q, k, o, lse_keys, softmax_scale: float) -> bool:
    """Whether the fused kernel's dense results are the formula's (``forward_dense``): scores well inside
    fp32 (``score_bound``), and ``o`` and every row's ``lse`` over keys finite. The compiled ``join_dense``
    decides the same in C++."""
    return (score_bound(q, k, softmax_scale) <= MAX_SCORE and bool(torch.isfinite(lse_keys).all())
            and bool(torch.isfinite(o).all()))


def forward_dense(q, k, v, sinks, window, softmax_scale):
    """A dense call without gradients whole, when one unmasked fused-kernel call covers it (decoding, full
    or square causal attention): ``Final(o [B, Sq, HQ, Dv], stats, lse [HQ, B*Sq])`` on ``q [B, Sq, HQ, D]``,
    ``k``/``v [B, Sk, HKV, D]`` as they are (any strides), else None.

    The results are taken when they are the formula's (``_dense_ok``): every row of such a call sees a key,
    so a non-finite ``lse`` or ``o`` means a NaN or inf input (or a score past fp32) reached it, and the call
    goes the exact way instead (``forward``), whose paths confine such values to the terms that hold them;
    so does a call whose scores may leave fp32 (refused there)."""
    chosen = cpu_native.check_settings()
    B, Sq, HQ = q.shape[:3]
    if Sq <= SMALL_ROWS and B > 0:
        native = cpu_native.load(chosen=chosen)
        if native is not None:
            q32, k32, v32 = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
            done = native.forward_small(q32, k32, v32, _row_bounds(Sq, k.shape[1], window), sinks, softmax_scale,
                                        MAX_SCORE, buffers.poisoning())
            return Final(done[0], sink.Stats(done[1], done[2]), done[3]) if done else None
    if v.shape[-1] != q.shape[-1] or B == 0 or softmax_scale <= 0:        # the fused kernel takes one head dim
        return None
    part = cpu_fused.single_part(Sq, k.shape[1], window)
    if part is None:
        return None
    q32, k32, v32 = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    o, lse_keys = cpu_fused.forward_heads_first(q32.transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2),
                                                part, softmax_scale)                # [B, HQ, Sq, D], [B, HQ, Sq]
    o = o.transpose(1, 2)                                                             # [B, Sq, HQ, D]
    native = cpu_native.load(chosen=chosen)
    if native is not None:
        joined = native.join_dense(o, lse_keys, q32, k32, sinks, softmax_scale, MAX_SCORE, buffers.poisoning())
        return Final(o, sink.Stats(joined[0], joined[1]), joined[2]) if joined else None
    if not _dense_ok(q32, k32, o, lse_keys, softmax_scale):
        return None
    stats = sink.stats_of_lse(lse_keys.transpose(0, 1).reshape(HQ, B * Sq))
    o, stats = sink.with_sink(o.reshape(B * Sq, HQ, -1) if o.is_contiguous() else o.contiguous().view(B * Sq, HQ, -1),
                              stats, sinks)
    return Final(o, stats, sink.lse_of(stats))


def forward(q, k, v, batch, window, softmax_scale, for_backward):
    """``q [Tq, HQ, D]``, ``k [Tk, HKV, D]``, ``v [Tk, HKV, Dv]`` -> ``Partial(o [Tq, HQ, Dv] fp32, Stats [HQ, Tq]
    fp32)`` over keys."""
    cpu_native.check_settings()
    q32, k32, v32 = q.float(), k.float(), v.float()
    Tq, HQ, D = q.shape
    norm_q, norm_k, norm_v = norms(q32, k32, v32)          # what nonfinite.present reads, for all three at once
    qk_finite = math.isfinite(norm_q) and math.isfinite(norm_k)
    # the exact row-norm bound only when the loose one (rounded in fp32) is not well inside fp32
    if not (qk_finite and loose_bound(q32, k32, softmax_scale, norm_q, norm_k) <= MAX_SCORE / 2):
        bound = score_bound(q32, k32, softmax_scale)
        check_fp32_range(bound, q32, k32)
        # finite row norms mean finite q and k, even where their squares summed over all rows overflow
        qk_finite = qk_finite or 0.0 < bound < math.inf
    literal = not (qk_finite and math.isfinite(norm_v))
    out = buffers.new((Tq, HQ, v.shape[2]), torch.float32, q.device)          # [Tq, HQ, Dv]
    m = buffers.new((HQ, Tq), torch.float32, q.device)
    log_l = buffers.new((HQ, Tq), torch.float32, q.device)
    # the fused kernel masks before it scales, and takes one head dim (Dv = D)
    native = None if literal else cpu_native.load()
    if native is not None and (for_backward or softmax_scale <= 0 or v.shape[2] != D):
        plan = _native(batch, window, HQ)
        native.forward(q32.contiguous(), k32.contiguous(), v32.contiguous(), *plan.sequences, *_scales(softmax_scale),
                       NATIVE_BM, cpu_tiles.BN, cpu_native.bf16_products(q, k, v), out, m, log_l)
        if plan.small is not None:
            cpu_small.forward(q32, k32, v32, plan.small, out, m, log_l, softmax_scale, window)
        return Partial(out, sink.Stats(m, log_l))
    parts = split(batch.cu_seqlens_q, batch.cu_seqlens_k, HQ)
    if not for_backward and not literal and softmax_scale > 0 and v.shape[2] == D:
        cpu_fused.forward(q32, k32, v32, parts.runs, out, m, softmax_scale, window)
        for run in parts.runs:
            rows = slice(run.tq, run.tq + run.n * run.Lq)
            m[:, rows], log_l[:, rows] = sink.stats_of_lse(m[:, rows])
    else:
        cpu_tiles.forward(q32, k32, v32, parts.runs, out, m, log_l, softmax_scale, window, literal)
    cpu_small.forward(q32, k32, v32, parts.small, out, m, log_l, softmax_scale, window, literal)
    return Partial(out, sink.Stats(m, log_l))


def join_sink(o, stats, sinks):
    """The sink's rule (``sinkattn.sink.with_sink`` and ``lse_of``) in one compiled call on ``forward``'s own
    results (``o [T, HQ, Dv]`` fp32 contiguous, scaled in place; ``stats [HQ, T]``): ``Final``, or None where
    the kernel is not built."""
    native = cpu_native.load()
    if native is None:
        return None
    m, log_l = stats.m.contiguous(), stats.log_l.contiguous()
    lse = buffers.new(m.shape, torch.float32, o.device)
    native.join_sink(o, m, log_l, sinks.float().contiguous(), lse)
    return Final(o, sink.Stats(m, log_l), lse)


def _inverse_l(stats: sink.Stats) -> torch.Tensor:
    """``1 / l`` of the final statistics, 0 where ``l = 0`` (no key and no sink: ``P = 0``)."""
    return torch.where(stats.log_l == _NEG_INF, 0.0, torch.exp(-stats.log_l))


def backward(do, dlse, q, k, v, o, stats, sink_mass, batch, window, softmax_scale, partial):
    """``do [Tq, HQ, D]``, ``dlse [HQ, Tq]`` or None, the forward's inputs, the final fp32 ``o`` and
    ``stats`` -> ``(dq, dk, dv)`` fp32 and ``delta [HQ, Tq]``. The tiles are the forward's. ``Delta`` is
    summed from the products themselves (``cpu_tiles.backward``), or, when the call holds only some keys
    of its rows (``partial``), taken from ``o``."""
    cpu_native.check_settings()
    q32, k32, v32, do32 = q.float(), k.float(), v.float(), do.float()
    literal = nonfinite.present(q32, k32, v32)
    dq = buffers.new(q.shape, torch.float32, q.device)
    dk = buffers.new(k.shape, torch.float32, q.device)
    dv = buffers.new(v.shape, torch.float32, q.device)
    native = None if literal else cpu_native.load()
    if native is not None:
        plan = _native(batch, window, q.shape[1])
        # the kernel sums Delta of every row itself unless the call holds only some of its keys
        delta = sink.row_delta(do32, o, dlse).contiguous() if partial else buffers.new(stats.m.shape, torch.float32,
                                                                                         q.device)
        none = q32.new_empty(0)
        native.backward(do32.contiguous(), q32.contiguous(), k32.contiguous(), v32.contiguous(),
                        stats.m.contiguous(), stats.log_l.contiguous(), delta,
                        none if dlse is None else dlse.float().contiguous(),
                        none if sink_mass is None else sink_mass.float().contiguous(),
                        *plan.sequences, *_scales(softmax_scale), softmax_scale, not partial,
                        NATIVE_BM, cpu_tiles.BN, cpu_tiles.KEPT_ELEMENTS, cpu_native.bf16_products(q, k, v, do),
                        BACKWARD_SPLIT, dq, dk, dv)
        if plan.small is not None:
            cpu_small.backward(do32, q32, k32, v32, stats.m, _inverse_l(stats), delta, dlse, sink_mass, plan.small,
                               dq, dk, dv, softmax_scale, window, exact=not partial)
        return Gradients(dq, dk, dv, delta)
    delta = sink.row_delta(do32, o, dlse)
    inv_l = _inverse_l(stats)
    parts = split(batch.cu_seqlens_q, batch.cu_seqlens_k, q.shape[1])
    for path, sequences in ((cpu_tiles, parts.runs), (cpu_small, parts.small)):
        path.backward(do32, q32, k32, v32, stats.m, inv_l, delta, dlse, sink_mass, sequences, dq, dk, dv,
                      softmax_scale, window, literal, exact=not partial)
    if parts.keys_only is not None:        # keys of sequences without queries: no row sees them
        unseen = layout.token_ranges(parts.keys_only.tk, parts.keys_only.Lk)
        dk.index_fill_(0, unseen, 0.0)
        dv.index_fill_(0, unseen, 0.0)
    return Gradients(dq, dk, dv, delta)
