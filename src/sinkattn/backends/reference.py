"""``backend="reference"``: the float64 golden behind the public API (any device)."""

from __future__ import annotations

import torch

from .. import reference
from .capabilities import Capabilities

__all__ = ["CAPABILITIES", "forward", "backward"]

CAPABILITIES = Capabilities(
    name="reference",
    device_types=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_dim=256,
    out_dtype=torch.float64,
)


def forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, max_seqlen=None):
    """``(out [Tq, HQ, D] float64, lse [HQ, Tq] fp32, ())``."""
    out, lse = reference.forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)
    return out, lse.float(), ()


def backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right,
             extra, max_seqlen=None):
    """``(dq, dk, dv)`` float64 and ``dsinks [HQ]`` in the sinks' dtype (or None)."""
    dq, dk, dv, dsinks = reference.backward(do, dlse, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k,
                                            softmax_scale, left, right)
    return dq, dk, dv, (dsinks.to(sinks.dtype) if sinks is not None else None)
