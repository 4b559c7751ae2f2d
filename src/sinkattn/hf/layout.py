"""Where the real tokens of a Hugging Face batch are: padding masks and packed rows as varlen layouts.

Hugging Face hands attention ``[B, S, ...]`` tensors. sinkattn's varlen API wants the real tokens
of the N sequences packed one after another, with ``cu_seqlens int32 [N+1]``. A ``Layout`` says
which flattened rows (``0 .. B*S - 1``) are real and where each sequence starts:

    index_q  int64 [Tq]     flattened query rows that are real, in order (None: all B*Sq rows)
    index_k  int64 [Tk]     the same for keys (None: all B*Sk rows)
    cu_q, cu_k  int32 [N+1] sequence b owns packed rows cu[b] .. cu[b+1] - 1
    max_q, max_k  int       longest sequence (the varlen API's max_seqlen)
    contiguous  bool        every sequence's real keys are one run of columns (no padding inside)

Building one reads a few numbers back to the host (the lengths); the result is memoized per
mask / position_ids tensor, so the layers of one forward pass share one read-back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["Layout", "from_padding_mask", "from_position_ids", "memoized"]


@dataclass(frozen=True)
class Layout:
    index_q: torch.Tensor | None
    index_k: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    contiguous: bool = True

    @property
    def sequences(self) -> int:
        return self.cu_q.numel() - 1


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    """``lengths [N]`` -> ``cu_seqlens int32 [N+1]`` = ``[0, l0, l0+l1, ...]``."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def from_padding_mask(mask: torch.Tensor, Sq: int) -> Layout:
    """A 2-D padding mask ``[B, Sk]`` (True = real key) -> one sequence per batch row.

    The queries are the last ``Sq`` columns (``Sq <= Sk``; with a cache the earlier columns are
    past keys), so sequence ``b`` has ``Lk_b = mask[b].sum()`` keys and ``Lq_b = mask[b, -Sq:].sum()``
    queries, the last ``Lq_b`` of its keys: bottom-right aligned, as sinkattn computes.
    """
    B, Sk = mask.shape
    len_k = mask.sum(-1, dtype=torch.int32)
    len_q = len_k if Sq == Sk else mask[:, Sk - Sq:].sum(-1, dtype=torch.int32)
    # A row's real keys are one run iff last_true - first_true + 1 == count (or the row is empty).
    first = torch.argmax(mask.to(torch.int8), -1)
    last = Sk - 1 - torch.argmax(mask.flip(-1).to(torch.int8), -1)
    runs = (len_k == 0) | (last - first + 1 == len_k)
    zero = len_k.new_zeros(1)
    max_k, max_q, contiguous = torch.stack([torch.cat([zero, len_k]).max(), torch.cat([zero, len_q]).max(),
                                            runs.all().to(torch.int32)]).tolist()
    index_k = torch.nonzero(mask.reshape(-1)).reshape(-1)
    index_q = index_k if Sq == Sk else torch.nonzero(mask[:, Sk - Sq:].reshape(-1)).reshape(-1)
    cu_k = _cu(len_k)
    cu_q = cu_k if Sq == Sk else _cu(len_q)
    return Layout(index_q, index_k, cu_q, cu_k, max_q, max_k, bool(contiguous))


def from_position_ids(position_ids: torch.Tensor, B: int) -> Layout:
    """``position_ids [B or 1, S]`` -> the packed sequences of Hugging Face's padding-free convention.

    A sequence starts at every column where the position is 0, and at the start of every row
    (rows never share a sequence). No padding: every row is real (``index_q = index_k = None``).
    """
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[0] not in (1, B):
        raise ValueError(f"position_ids must be [B, S] or [1, S] with B = {B}, got {tuple(position_ids.shape)}")
    pos = pos.expand(B, -1)
    starts = pos == 0
    starts[:, 0] = True
    begin = torch.nonzero(starts.reshape(-1)).reshape(-1).to(torch.int32)
    total = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    cu = torch.cat([begin, total])
    lengths = torch.diff(cu).tolist()
    longest = max(lengths, default=0)
    return Layout(None, None, cu, cu, longest, longest)


_MEMO: dict[tuple, tuple[weakref.ref, int, object]] = {}
_MEMO_SIZE = 8


def memoized(kind: str, tensor: torch.Tensor, build, *extra):
    """``build(tensor, *extra)``, reused while ``tensor`` is the same live, unmodified object.

    Every attention layer of a forward pass gets the same mask / position_ids tensor; this keeps
    their host read-back to one per pass. Skipped under ``torch.compile`` tracing.
    """
    if torch.compiler.is_compiling():
        return build(tensor, *extra)
    key = (kind, id(tensor), *extra)
    hit = _MEMO.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
        return hit[2]
    value = build(tensor, *extra)
    if len(_MEMO) >= _MEMO_SIZE:
        _MEMO.pop(next(iter(_MEMO)))
    _MEMO[key] = (weakref.ref(tensor), tensor._version, value)
    return value
