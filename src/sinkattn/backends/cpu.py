"""``backend="cpu"``: sink attention on CPU tensors, in fp32 for every input dtype.

Two paths compute the softmax over keys; the sink is added around them here
(``sinkattn.sink``):

* ``cpu_fused`` drives PyTorch's fused flash-attention CPU kernel, tile by tile
  under the mask. The fast path.
* ``cpu_slab`` computes blocks of rows against their visible keys with plain
  matrix products, recomputing scores bitwise and summing ``Delta`` from the
  same ``P`` and ``dP``. Taken when scores may be large enough
  (``scores.score_bound``) for the fused kernel's recomputation and
  ``Delta = <dO, o>`` to lose the exact cancellation of peaked rows.

fp16 / bf16 inputs are cast up once (the fp32 kernel is also far faster than
the bf16 one on CPUs without bf16 matrix units); results are cast by the
caller. dK/dV are reduced over the group inside the paths, in fp32 and a fixed
order: results are bitwise reproducible.
"""

from __future__ import annotations

import torch

from .. import sink
from . import cpu_fused, cpu_slab
from .capabilities import Capabilities, Saved
from .scores import LARGE_SCORE, check_fp32_range, score_bound

__all__ = ["CAPABILITIES", "forward", "backward", "path_for"]

CAPABILITIES = Capabilities(
    name="cpu",
    device_types=frozenset({"cpu"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_dim=256,
    saved=(Saved("took_slab_path", (), torch.bool),),
)


def path_for(q32: torch.Tensor, k32: torch.Tensor, softmax_scale: float):
    """The path module for these inputs: ``cpu_slab`` when scores may be large, or when
    ``softmax_scale <= 0`` (the fused kernel scales after its causal mask: ``-inf * 0`` is NaN);
    ValueError when the scores may not fit fp32."""
    bound = score_bound(q32, k32, softmax_scale)
    check_fp32_range(bound, q32, k32)
    return cpu_slab if softmax_scale <= 0 or bound > LARGE_SCORE else cpu_fused


def forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, max_seqlen=None):
    """``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``, ``sinks [HQ]`` or None
    -> ``(out [Tq, HQ, D] fp32, lse [HQ, Tq] fp32, (took_slab_path,))``."""
    q32, k32, v32 = q.float(), k.float(), v.float()
    path = path_for(q32, k32, softmax_scale)
    out, lse_keys = path.forward(q32, k32, v32, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)
    lse = sink.lse_with_sink(lse_keys, sinks)
    out *= sink.key_mass(lse_keys, lse).t()[..., None]
    return out, lse, (torch.tensor(path is cpu_slab),)


def backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right,
             extra, max_seqlen=None):
    """``do [Tq, HQ, D]``, ``dlse [HQ, Tq]`` or None, the forward's inputs and fp32 ``out``/``lse``
    -> ``(dq, dk, dv)`` fp32 and ``dsinks [HQ]`` in the sinks' dtype (or None). ``extra`` is the
    forward's ``(took_slab_path,)``: the backward takes the path the forward took."""
    q32, k32, v32, do32 = q.float(), k.float(), v.float(), do.float()
    (took_slab_path,) = extra
    if bool(took_slab_path):
        dq, dk, dv = cpu_slab.backward(do32, dlse, q32, k32, v32, sinks, cu_seqlens_q, cu_seqlens_k,
                                       softmax_scale, left, right)
    else:
        dq, dk, dv = cpu_fused.backward(do32, dlse, q32, k32, v32, out, lse, cu_seqlens_q, cu_seqlens_k,
                                        softmax_scale, left, right)
    dsinks = None
    if sinks is not None:
        dsinks = sink.dsinks_from(sinks, lse, sink.row_delta(do32, out, dlse))
    return dq, dk, dv, dsinks
