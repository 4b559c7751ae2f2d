"""Where the sequences of a Hugging Face batch are: padding masks and packed rows as varlen layouts.

Hugging Face hands attention ``[B, S, ...]`` tensors. sinkattn's varlen API wants the tokens of
the N sequences one after another, with ``cu_seqlens int32 [N+1]``. A ``Layout`` says which
flattened rows (``0 .. B*S - 1``) go where and where each sequence starts:

    index_q  int64 [Tq]     flattened query rows in varlen order (None: all B*Sq rows, in order)
    index_k  int64 [Tk]     the same for keys (None: all B*Sk rows)
    cu_q, cu_k  int32 [N+1] sequence s owns varlen rows cu[s] .. cu[s+1] - 1
    max_q, max_k  int       bounds of the longest sequence (the varlen API's max_seqlen)
    contiguous  bool        every row's real keys are one run of columns (no padding inside);
                            computed by ``exact`` only (``key_mask`` checks it for traced calls)
    all_real    bool        every key is real (no padding at all); ``exact`` only

The sequences: every row's real tokens (the key mask's True columns; all columns without a
mask), split where ``position_ids`` restarts at 0 (Hugging Face's padding-free packing, honoured
with a padding mask too). A row's first real token always starts a sequence; rows never share
one. Positions are read only for self-attention (``Sq == Sk``): with a cache, the queries of a
row are the last ``Sq`` of its one sequence's keys (bottom-right aligned).

``flash(kwargs, tokens)`` takes the packing as given by the four flash-attention kwargs
(``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): all ``B*S`` rows, in order.

Two builders give the same sequences:

    exact(...)   only the real tokens and the real sequences; reads the lengths back to the host
                 once (memoized per tensor, so the layers of one forward pass share one read).
    fixed(...)   shapes that depend on the tensor shapes only, nothing read back: traceable by
                 ``torch.compile`` / ``torch.export`` without a graph break. All ``B*S`` rows are
                 kept, sorted so that each sequence's tokens are adjacent; the padding of row b
                 forms two sequences after the row's real ones (its queries without keys, which
                 come out 0, and its keys without queries), and ``cu`` has a slot for every
                 possible sequence (``2B + B*S``, most of them empty); ``max_q, max_k = Sq, Sk``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["Layout", "exact", "fixed", "flash", "memoized", "one_run", "FLASH_KWARGS"]

FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class Layout:
    index_q: torch.Tensor | None
    index_k: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    contiguous: bool = True
    all_real: bool = False

    @property
    def sequences(self) -> int:
        return self.cu_q.numel() - 1


def _bound(value, tokens):
    """A ``max_length_*`` kwarg as the varlen API's ``max_seqlen``. A tensor is read back in eager
    mode; under tracing, where reading it would break the graph, the token count bounds it."""
    if isinstance(value, torch.Tensor):
        return tokens if torch.compiler.is_compiling() else int(value.item())
    return value if torch.compiler.is_compiling() else int(value)


def flash(kwargs, tokens: int) -> Layout | None:
    """The packed layout of the flash kwargs ``cu_seq_lens_q/k`` (int ``[N+1]``) and ``max_length_q/k``
    over ``tokens`` rows, or None when none is given; all four or none (else ValueError)."""
    given = [k for k in FLASH_KWARGS if kwargs.get(k) is not None]
    if not given:
        return None
    if len(given) != len(FLASH_KWARGS):
        missing = [k for k in FLASH_KWARGS if k not in given]
        raise ValueError(f"sinkattn.hf: packed rows need all of {FLASH_KWARGS}, got {given}, missing {missing}; "
                         f"DataCollatorWithFlattening(return_flash_attn_kwargs=True) produces all four")
    cu_q, cu_k = (kwargs[k].to(torch.int32).reshape(-1) for k in ("cu_seq_lens_q", "cu_seq_lens_k"))
    return Layout(None, None, cu_q, cu_k, _bound(kwargs["max_length_q"], tokens),
                  _bound(kwargs["max_length_k"], tokens))


def _starts(real: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """bool ``[B, S]``: the real tokens that begin a sequence (a row's first, or position 0)."""
    first = real & (torch.cumsum(real, -1) == 1)
    return first if positions is None else first | (real & (positions == 0))


def _positions(position_ids: torch.Tensor | None, B: int, Sq: int, Sk: int) -> torch.Tensor | None:
    """``position_ids`` as ``[B, S]`` when they can describe packing (self-attention), else None."""
    if position_ids is None or Sq != Sk or Sq < 2:
        return None
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[-1] != Sq or (pos.shape[0] != 1 and pos.shape[0] != B):    # not `in (1, B)`: B may be symbolic
        raise ValueError(f"sinkattn.hf: position_ids must be [B, S] or [1, S] with B = {B}, S = {Sq}, got "
                         f"{tuple(position_ids.shape)}")
    return pos.expand(B, Sq)


def one_run(real: torch.Tensor) -> torch.Tensor:
    """bool 0-d tensor: the True columns of every row of ``real [B, S]`` are one run (no gap)."""
    count = real.sum(-1)
    first = torch.argmax(real.to(torch.int8), -1)
    last = real.shape[-1] - 1 - torch.argmax(real.flip(-1).to(torch.int8), -1)
    return ((count == 0) | (last - first + 1 == count)).all()


def _cu(counts: torch.Tensor) -> torch.Tensor:
    """``counts [N]`` -> ``cu_seqlens int32 [N+1]`` = ``[0, c0, c0+c1, ...]``."""
    return torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))


def exact(mask: torch.Tensor | None, position_ids: torch.Tensor | None, B: int, Sq: int, Sk: int,
          device=None) -> Layout:
    """The real tokens and sequences of keys ``[B, Sk]`` (``mask``: True = real key, None = all
    real) and their last ``Sq`` columns as queries; one host read-back."""
    real = mask if mask is not None else torch.ones(B, Sk, dtype=torch.bool, device=device)
    pos = _positions(position_ids, B, Sq, Sk)
    flat = real.reshape(-1)
    index_k = torch.nonzero(flat).reshape(-1) if mask is not None else None
    if Sq == Sk:
        starts = _starts(real, pos).reshape(-1)
        starts = starts[index_k] if index_k is not None else starts
        count = starts.new_tensor([starts.numel()], dtype=torch.int32)
        cu_k = torch.cat([torch.nonzero(starts).reshape(-1).to(torch.int32), count])
        cu_q, index_q = cu_k, index_k
    else:
        # one sequence per row: its real keys, and its real queries among the last Sq columns
        cu_k, cu_q = _cu(real.sum(-1, dtype=torch.int32)), _cu(real[:, Sk - Sq:].sum(-1, dtype=torch.int32))
        index_q = torch.nonzero(real[:, Sk - Sq:].reshape(-1)).reshape(-1) if mask is not None else None
    zero = cu_k.new_zeros(1)
    max_q, max_k, contiguous, all_real = torch.stack([
        torch.cat([zero, cu_q.diff()]).max(), torch.cat([zero, cu_k.diff()]).max(), one_run(real).to(torch.int32),
        real.all().to(torch.int32)]).tolist()
    return Layout(index_q, index_k, cu_q, cu_k, max_q, max_k, bool(contiguous), bool(all_real))


def fixed(mask: torch.Tensor | None, position_ids: torch.Tensor | None, B: int, Sq: int, Sk: int,
          device=None, q_end: torch.Tensor | None = None) -> Layout:
    """``exact``'s sequences in shapes fixed by ``B, Sq, Sk`` (see the module doc); nothing read back.
    ``q_end`` (int64 ``[B, 1]``, default ``Sk``): the queries are columns ``q_end - Sq .. q_end - 1``.

    Sequence ids, for a token of row b with ``c`` sequence starts up to it (row-major, inclusive)
    and ``C_b`` starts in rows ``<= b``: a real token is in sequence ``2b + c - 1``, a padded query
    in ``2b + C_b``, a padded key in ``2b + C_b + 1``; they never decrease from row to row, so
    sorting the tokens by id (stably) makes every sequence one run.
    """
    real = mask if mask is not None else torch.ones(B, Sk, dtype=torch.bool, device=device)
    pos = _positions(position_ids, B, Sq, Sk)
    c = torch.cumsum(_starts(real, pos).reshape(-1), 0).view(B, Sk)
    row = 2 * torch.arange(B, device=real.device)[:, None]
    ids_k = torch.where(real, row + c - 1, row + c[:, -1:] + 1)
    ids_q = torch.where(real, row + c - 1, row + c[:, -1:])
    if q_end is None:
        ids_q = ids_q[:, Sk - Sq:]
    else:
        ids_q = ids_q.gather(1, q_end - Sq + torch.arange(Sq, device=real.device))
    slots = 2 * B + (B * Sk if pos is not None else B)         # ids 0 .. slots - 1: the sequences of cu
    bounds = torch.arange(slots + 1, device=real.device)

    def sort(ids):
        if mask is None:                                           # no padding: ids already in row order
            return None, torch.searchsorted(ids.reshape(-1), bounds).to(torch.int32)
        ids, order = torch.sort(ids.reshape(-1), stable=True)
        return order, torch.searchsorted(ids, bounds).to(torch.int32)

    (index_q, cu_q), (index_k, cu_k) = sort(ids_q), sort(ids_k)
    return Layout(index_q, index_k, cu_q, cu_k, Sq, Sk)


_MEMO: dict[tuple, tuple[tuple, object]] = {}
_MEMO_SIZE = 8


def _same(state: tuple, tensors: tuple) -> bool:
    """Whether ``tensors`` are the live, unmodified objects ``state`` (weak references and versions) recorded."""
    for h, t in zip(state, tensors):
        if t is None:
            if h is not None:
                return False
        elif h is None or h[0]() is not t or h[1] != t._version:
            return False
    return True


def memoized(build, tensors: tuple, *extra):
    """``build(*tensors, *extra)``, reused while ``tensors`` are the same live, unmodified objects.

    Every attention layer of a forward pass gets the same mask / position_ids tensors; this keeps
    their host read-back to one per pass. Not used under ``torch.compile`` tracing.
    """
    key = (build, *map(id, tensors), *extra)
    hit = _MEMO.get(key)
    if hit is not None and _same(hit[0], tensors):
        return hit[1]
    state = tuple((weakref.ref(t), t._version) if t is not None else None for t in tensors)
    value = build(*tensors, *extra)
    if len(_MEMO) >= _MEMO_SIZE:
        _MEMO.pop(next(iter(_MEMO)))
    _MEMO[key] = (state, value)
    return value
