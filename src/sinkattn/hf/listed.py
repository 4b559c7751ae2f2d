"""Attention over keys listed per query, in fp32 PyTorch ops, and the merge of two key sets.

For what sinkattn's kernels cannot take as a window: DeepSeek-V4's compressed entries and HY-V4's
sparse top-k selection (``sinkattn.hf.compressed``, ``sinkattn.hf.attention``). Two disjoint key
sets A and B of one softmax with the sink give, from each set's ``(o, lse)``,

    o = (e^{lse_A} o_A + e^{lse_B} o_B) / (e^{lse_A} + e^{lse_B})

exactly: ``sinkattn.sink.merge``, whose rules for rows without keys are the library's. The set that holds
the sink has it in its lse; without a window part the sink joins the entries (``sinkattn.sink.with_sink``).
The listed keys cost eager's arithmetic over them (scores ``[B, HQ, Sq, T]``), in blocks of queries
(``CHUNK_SCORES``) recomputed in the backward, so memory stays bounded.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .. import defaults, sink

__all__ = ["entries", "joined", "CHUNK_SCORES"]


CHUNK_SCORES = 1 << 24
"""Scores ``entries`` holds at once (64 MiB in fp32): longer calls run in blocks of queries, each
recomputed in the backward (``torch.utils.checkpoint``), so memory does not grow with ``Sq * T``."""


def entries(q, k, v, seen, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over explicitly listed keys, in fp32, without a sink.

    Args:
        q: ``[B, Sq, HQ, D]``; k: ``[B, T, HKV, D]``; v: ``[B, T, HKV, Dv]``; seen: ``bool [B, Sq, T]``.

    Returns:
        ``o fp32 [B, Sq, HQ, Dv]`` and ``lse fp32 [B, Sq, HQ]``: ``lse_i = log sum_{seen c} e^{s_ic}``,
        ``o_i = sum_{seen c} e^{s_ic - lse_i} v_c``; a row that sees nothing: ``lse = -inf``, ``o = 0``.
        Blocks of ``CHUNK_SCORES / (B * HQ * T)`` queries at a time.
    """
    B, Sq, HQ = q.shape[:3]
    rows = max(1, CHUNK_SCORES // max(1, B * HQ * k.shape[1]))
    if rows >= Sq:
        return _entries(q, k, v, seen, scale)
    parts = [checkpoint(_entries, q[:, i:i + rows], k, v, seen[:, i:i + rows], scale, use_reentrant=False)
             for i in range(0, Sq, rows)]
    return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)


def _entries(q, k, v, seen, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, Sq, HQ, D = q.shape
    HKV = k.shape[2]
    with torch.autocast(q.device.type, enabled=False):          # fp32 products under autocast too
        qg = q.float().view(B, Sq, HKV, HQ // HKV, D)
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * scale
        s = s.masked_fill(~seen[:, None, None], -torch.inf)
        lse = torch.logsumexp(s, dim=-1)                                              # [B, HKV, G, Sq]
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        o = torch.einsum("bhgqk,bkhd->bqhgd", p, v.float())
    return o.reshape(B, Sq, HQ, -1), lse.permute(0, 3, 1, 2).reshape(B, Sq, HQ)


def joined(q, k, v, seen, options, o_w=None, lse_w=None) -> torch.Tensor:
    """The layer's output from the window part ``(o_w [B, Sq, HQ, Dv], lse_w fp32 [B, Sq, HQ])`` and the
    entries ``k [B, T, HKV, D]``, ``v [B, T, HKV, Dv]`` each query sees (``seen bool [B, Sq, T]``), in q's
    dtype: the two merged by ``sinkattn.sink.merge``. No window part (None): the entries and the sink
    alone (``sinkattn.sink.with_sink``)."""
    scale = defaults.softmax_scale(q.shape[-1], options.get("softmax_scale"))
    o_c, lse_c = entries(q, k, v, seen, scale)
    entries_stats = sink.stats_of_lse(lse_c.permute(2, 0, 1))                 # [HQ, B, Sq]
    if o_w is None:
        o, _ = sink.with_sink(o_c, entries_stats, options.get("sinks"))
    else:
        o, _ = sink.merge(o_w.float(), sink.stats_of_lse(lse_w.permute(2, 0, 1)), o_c, entries_stats)
    return o.to(q.dtype)
