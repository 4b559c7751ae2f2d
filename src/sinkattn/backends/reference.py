"""``backend="reference"``: the float64 golden behind the public API (any device), in the backend protocol.

The forward is ``sinkattn.reference.forward`` without sinks (the softmax over keys, float64), with
``Stats(lse_keys, 0)``; the backward forms ``P = exp(S - m - log_l)`` from the final statistics,
``dS = P (dP - Delta)`` and the gradient sums over visible pairs, per sequence, in float64.
"""

from __future__ import annotations

import torch

from .. import reference, sink
from .capabilities import Capabilities
from .protocol import Gradients, Partial

__all__ = ["CAPABILITIES", "forward", "backward"]

CAPABILITIES = Capabilities(
    name="reference",
    device_types=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_dim=512,
    out_dtype=torch.float64,
)


def forward(q, k, v, batch, window, softmax_scale, for_backward):
    """``Partial(o [Tq, HQ, D] float64, Stats [HQ, Tq] float64)`` over keys."""
    o, lse = reference.forward(q, k, v, None, batch.cu_seqlens_q, batch.cu_seqlens_k, softmax_scale, window)
    return Partial(o, sink.stats_of_lse(lse))


def backward(do, dlse, q, k, v, o, stats, sink_mass, batch, window, softmax_scale, partial):
    """``(dq, dk, dv)`` float64 and ``delta [HQ, Tq]`` float64."""
    delta = sink.row_delta(do.double(), o.double(), dlse).double()
    lse = stats.m.double() + stats.log_l.double()
    return Gradients(*reference.gradients(do, delta, lse, q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k,
                                          softmax_scale, window), delta)
