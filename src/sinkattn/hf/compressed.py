"""DeepSeek-V4's compressed layers (``compressed_sparse_attention``, ``heavily_compressed_attention``).

Such a layer appends ``T`` compressed entries to its sliding-window keys (one per ``m`` tokens,
``m = compress_rate``) and writes which entries each query sees into its mask, after the sliding
part: the block rule (entry ``w`` once its ``m`` tokens are all at or before the query) and, for
``compressed_sparse_attention``, the indexer's top-k of them. One softmax with the sink runs over
both key sets:

    o = (sum_{window j} e^{s_j} v_j + sum_{seen entries c} e^{s_c} v_c) / (e^{sink} + sum_j e^{s_j} + sum_c e^{s_c})

sinkattn computes it as two parts merged by their log-sum-exps (``sinkattn.hf.listed``), exactly:

    window    (o_w, lse_w)  sinkattn over the sliding keys with the sink (the layer's mask pattern,
                            padding honoured; a padded query row: o_w = 0, lse_w = sink)
    entries   (o_c, lse_c)  the seen entries in fp32 PyTorch ops, scores ``[B, HQ, Sq, T]``
                            (lse_c = -inf, o_c = 0 where a query sees none)
    o = (e^{lse_w} o_w + e^{lse_c} o_c) / (e^{lse_w} + e^{lse_c})

The entries cost eager's arithmetic over them (``T / Sq = 1 / m`` of eager's), in blocks of queries of
bounded memory; the window part is sinkattn's. The mask Hugging Face builds for the layer is
``[B, 1, Sq, Sk + T]``, as eager's is (``sinkattn.hf.masks.COMPRESSED``): only through it does the
indexer's choice reach the attention function.

Which keys are the window's: without earlier tokens in the cache (training, a forward without a
cache, generation's prefill) the layer has ``Sq`` window keys and ``T = Sq // m`` entries; a single
query (decoding) sees exactly what its mask row says, window and entries alike, so it runs as one
call over those keys. More than one query after earlier tokens (chunked prefill, assisted decoding)
is refused: the split cannot be told from the shapes then.
"""

from __future__ import annotations

import torch

from . import layout
from .masks import OR_EAGER as _EAGER

__all__ = ["split", "one_query", "NO_CONTEXT_PARALLEL"]

NO_CONTEXT_PARALLEL = (
    "sinkattn.hf: DeepSeek-V4's compressed layers cannot run context parallel: each rank's compressor would see only "
    f"its shard of the tokens; train them in one process per sequence (data parallel), {_EAGER}")


def split(module, q, k, mask, kwargs) -> tuple[torch.Tensor, int | None]:
    """What a compressed layer's call sees (module doc): ``(seen bool [B, 1, Sq, Sk], W)`` with ``W``
    the number of window keys (the entries follow them), or ``W = None`` for a single query, which
    sees exactly its mask row; ``ValueError`` for what cannot be told apart or honoured."""
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    if any(kwargs.get(name) is not None for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise ValueError("sinkattn.hf: DeepSeek-V4's compressed layers mix the documents of a packed row in their "
                         f"compressor; pass one document per row (padding is fine), {_EAGER}")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[2:]) != (Sq, Sk):
        raise ValueError("sinkattn.hf: a DeepSeek-V4 compressed layer needs its [B, 1, Sq, Sk] mask (the entries each "
                         "query sees), which sinkattn's mask function makes: load the model with the attention "
                         f"implementation sinkattn.hf.register() returned, {_EAGER}")
    seen = mask.expand(B, -1, -1, -1)
    if Sq == 1:
        return seen, None
    if Sk != Sq + Sq // int(module.compressor.compress_rate):
        raise ValueError(f"sinkattn.hf: a DeepSeek-V4 compressed layer got {Sq} queries after earlier tokens "
                         f"({Sk} keys and entries); sinkattn runs these layers on a whole sequence (training, "
                         f"prefill) or one query at a time (decoding), {_EAGER}")
    return seen, Sq


def one_query(seen: torch.Tensor) -> layout.Layout:
    """The varlen layout of single queries over the keys their row of ``seen bool [B, 1, 1, Sk]`` marks
    (any columns, not one run; a row may see none): sequence b = query b and row b's seen keys; the
    key bound ``Sk``, read from the shape (nothing read back)."""
    row = seen[:, 0, 0]
    counts = row.sum(-1, dtype=torch.int32)
    cu_q = torch.arange(row.shape[0] + 1, dtype=torch.int32, device=row.device)
    cu_k = torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
    return layout.Layout(None, torch.nonzero(row.reshape(-1)).reshape(-1), cu_q, cu_k, 1, row.shape[1],
                         contiguous=False)
