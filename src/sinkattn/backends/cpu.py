"""``backend="cpu"``: sink attention on CPU tensors, in fp32 for every input dtype.

Three paths compute the softmax over keys; the sink is added around them here
(``sinkattn.sink``). Each call's sequences are split between them
(``layout.split``):

* ``cpu_small`` takes the packed sequences of at most ``cpu_small.SHORT_LENGTH``
  queries and keys, many per batch, scores materialized.
* ``cpu_fused`` drives PyTorch's fused flash-attention CPU kernel, tile by tile
  under the mask, one run of equal-length sequences per call. The fast path
  for the others.
* ``cpu_slab`` computes blocks of rows against their visible keys with plain
  matrix products, recomputing scores bitwise and summing ``Delta`` from the
  same ``P`` and ``dP``. Takes the others' place when scores may be large enough
  (``scores.score_bound``) for the fused kernel's recomputation and
  ``Delta = <dO, o>`` to lose the exact cancellation of peaked rows, and when
  ``k`` or ``v`` hold NaN or inf (``nonfinite``: they reach the rows that see
  their key only, which the fused kernel's tiles do not ensure).

fp16 / bf16 inputs are cast up once (the fp32 kernel is also far faster than
the bf16 one on CPUs without bf16 matrix units); results are cast by the
caller. dK/dV are reduced over the group inside the paths, in fp32 and a fixed
order: results are bitwise reproducible.
"""

from __future__ import annotations

import torch

from .. import masks, sink
from . import buffers, cpu_fused, cpu_slab, cpu_small, layout, nonfinite
from .capabilities import Capabilities, Saved
from .scores import LARGE_SCORE, MAX_SCORE, check_fp32_range, loose_bound, score_bound

__all__ = ["CAPABILITIES", "forward", "forward_dense", "backward", "path_for", "split"]

CAPABILITIES = Capabilities(
    name="cpu",
    device_types=frozenset({"cpu"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_dim=256,
    saved=(Saved("took_slab_path", (), torch.bool),),
)


_TOOK_SLAB_PATH = {flag: torch.tensor(flag) for flag in (False, True)}
"""The forward's saved flag, one read-only tensor per value (a new one would cost a call's worth of decoding)."""


def path_for(q32: torch.Tensor, k32: torch.Tensor, softmax_scale: float):
    """The path module for these inputs' long sequences: ``cpu_slab`` when scores may be large or
    ``k`` is not finite, or when ``softmax_scale <= 0`` (the fused kernel scales after its causal
    mask: ``-inf * 0`` is NaN); ValueError when the scores may not fit fp32."""
    bound = score_bound(q32, k32, softmax_scale)
    check_fp32_range(bound, q32, k32)
    return cpu_slab if softmax_scale <= 0 or bound > LARGE_SCORE else cpu_fused


def split(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, HQ: int) -> layout.Split:
    """The call's sequences by path: ``cpu_small`` for those it ``takes``, the others in runs."""
    return layout.split(cu_seqlens_q, cu_seqlens_k, lambda Lq, Lk: cpu_small.takes(Lq, Lk, HQ))


def _literal(single, k32: torch.Tensor, v32: torch.Tensor) -> bool:
    """NaN or inf in ``k`` or ``v``, where some row does not see some key of a product: the call then
    takes the paths that keep them to the rows that see them (``nonfinite``). A call whose rows all
    see the same keys (``_all_see_all`` of its ``cpu_fused.single_call``: decoding, full attention)
    needs no check: each of its products is one of the formula's."""
    return not _all_see_all(single) and nonfinite.present(k32, v32)


def _all_see_all(single) -> bool:
    """One kernel call without a mask or a causal diagonal (``cpu_fused.single_call``'s result, or None)."""
    return single is not None and not single[1].causal


def forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, max_seqlen=None):
    """``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``, ``sinks [HQ]`` or None
    -> ``(out [Tq, HQ, D] fp32, lse [HQ, Tq] fp32, (took_slab_path,))``."""
    q32, k32, v32 = q.float(), k.float(), v.float()
    Tq, HQ, D = q.shape
    parts = split(cu_seqlens_q, cu_seqlens_k, HQ)
    path = path_for(q32, k32, softmax_scale)
    single = cpu_fused.single_call(parts, left, right)
    literal = _literal(single, k32, v32)
    if literal:
        path = cpu_slab
    took_slab_path = _TOOK_SLAB_PATH[path is cpu_slab]
    if not parts.runs:
        out, lse = cpu_small.forward(q32, k32, v32, parts.small, softmax_scale, left, right, literal, sinks)
        return out, lse, (took_slab_path,)
    if single is not None and path is cpu_fused:
        out, lse_keys = cpu_fused.forward_single(q32, k32, v32, single, softmax_scale)
    else:
        out = buffers.new((Tq, HQ, D), torch.float32, q.device)
        lse_keys = buffers.new((HQ, Tq), torch.float32, q.device)
        if path is cpu_slab:
            cpu_slab.forward(q32, k32, v32, parts.runs, out, lse_keys, softmax_scale, left, right, literal)
        else:
            cpu_fused.forward(q32, k32, v32, parts.runs, out, lse_keys, softmax_scale, left, right)
    lse = sink.lse_with_sink(lse_keys, sinks)
    out *= sink.key_mass(lse_keys, lse).t()[..., None]
    # the small sequences' rows, final (sink in their softmax) whatever else the call holds; the merge
    # above met them unwritten
    cpu_small.forward(q32, k32, v32, parts.small, softmax_scale, left, right, literal, sinks, out=out, lse=lse)
    return out, lse, (took_slab_path,)


def forward_dense(q, k, v, sinks, softmax_scale, left, right):
    """Inference on a dense batch as it is (any strides), when one unmasked kernel call computes it
    (decoding, full attention: ``cpu_fused.single_call``) and ``q``, ``k`` are finite with scores well
    inside fp32 (``loose_bound``): ``q [B, Sq, HQ, D]``, ``k``/``v [B, Sk, HKV, D]``
    -> ``(out [B, Sq, HQ, D] fp32, lse [B, HQ, Sq] fp32)``; None for any other call (``forward`` takes it).
    Nothing is kept for a backward, so the fused kernel serves large scores too (their hazard is the
    fused backward's recomputation, ``path_for``); there its values may differ from ``forward``'s in the
    last bits. NaN / inf in ``v`` stay in the formula's terms: every row sees every key of the call, or
    (a causal diagonal) the call goes to ``forward``."""
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    left, right = masks.normalize_window(False, (left, right), Sq, Sk)
    part = cpu_fused.single_part(Sq, Sk, left, right) if B > 0 and softmax_scale > 0 else None
    if part is None:
        return None
    q32, k32, v32 = q.float(), k.float(), v.float()
    if not loose_bound(q32, k32, softmax_scale) <= MAX_SCORE:      # q or k not finite, or scores may not fit fp32
        return None
    if part.causal and nonfinite.present(v32):     # its diagonal tiles would carry them to rows that do not see them
        return None
    o, lse = cpu_fused.forward_heads_first(q32.transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2),
                                           part, softmax_scale)                  # [B, HQ, Sq, D], [B, HQ, Sq]
    if sinks is not None:
        lse_keys, lse = lse, sink.lse_with_sink(lse, sinks)
        o.mul_(sink.key_mass(lse_keys, lse, rows_have_keys=True).unsqueeze(-1))   # finite q, k: finite lse_keys
    return o.transpose(1, 2).contiguous(), lse     # o is laid out as q: contiguous for tokens-first q and Sq = 1


def backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right,
             extra, max_seqlen=None):
    """``do [Tq, HQ, D]``, ``dlse [HQ, Tq]`` or None, the forward's inputs and fp32 ``out``/``lse``
    -> ``(dq, dk, dv)`` fp32 and ``dsinks [HQ]`` in the sinks' dtype (or None). ``extra`` is the
    forward's ``(took_slab_path,)``: the backward takes the path the forward took."""
    q32, k32, v32, do32 = q.float(), k.float(), v.float(), do.float()
    (took_slab_path,) = extra
    parts = split(cu_seqlens_q, cu_seqlens_k, q.shape[1])
    literal = bool(took_slab_path) and _literal(cpu_fused.single_call(parts, left, right), k32, v32)
    single = cpu_fused.single_call(parts, left, right, all_keys=True) if not bool(took_slab_path) else None
    if single is not None:
        dq, dk, dv = cpu_fused.backward_single(do32, dlse, q32, k32, v32, out, lse, single, softmax_scale)
    else:
        dq = buffers.new(q.shape, torch.float32, q.device)
        dk = buffers.new(k.shape, torch.float32, q.device)
        dv = buffers.new(v.shape, torch.float32, q.device)
        if bool(took_slab_path):
            cpu_slab.backward(do32, dlse, q32, k32, v32, sinks, parts.runs, dq, dk, dv, softmax_scale, left, right,
                              literal)
        else:
            cpu_fused.backward(do32, dlse, q32, k32, v32, out, lse, parts.runs, dq, dk, dv, softmax_scale, left,
                               right)
        cpu_small.backward(do32, dlse, q32, k32, v32, sinks, parts.small, dq, dk, dv, softmax_scale, left, right,
                           literal)
        if parts.keys_only is not None:        # keys of sequences without queries: no row sees them
            unseen = layout.token_ranges(parts.keys_only.tk, parts.keys_only.Lk)
            dk.index_fill_(0, unseen, 0.0)
            dv.index_fill_(0, unseen, 0.0)
    dsinks = None
    if sinks is not None:
        dsinks = sink.dsinks_from(sinks, lse, sink.row_delta(do32, out, dlse))
    return dq, dk, dv, dsinks
