"""The process group of a context-parallel call, and the check that every rank agrees on it.

Every collective here is entered by every rank of the group, in the same order: a rank that
finds its own inputs wrong still joins the descriptor exchange, so all ranks raise the same
error together instead of leaving the others waiting in a send that never comes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Group", "resolve", "agree", "Exchange"]

_ERROR_TYPES = (TypeError, ValueError, NotImplementedError)
_WIDTH = 64           # descriptor entries: an error code, the number of sequences, the facts, zero padding


@dataclass(frozen=True)
class Group:
    """A process group with this process's rank in it and its ring neighbours (global ranks).

    The group itself is held weakly: a result's autograd graph keeps a ``Group`` until the result is
    freed, and a strong reference would keep a destroyed gloo group alive until the interpreter exits,
    where its worker threads can abort the process."""

    ref: weakref.ref
    rank: int
    size: int
    next: int
    prev: int

    @property
    def handle(self):
        """The process group, while it exists."""
        handle = self.ref()
        if handle is None:
            raise RuntimeError("sinkattn.distributed: the process group of this call was destroyed before its "
                               "backward ran; call backward before torch.distributed.destroy_process_group()")
        return handle

    @property
    def comm_device(self) -> torch.device:
        """Where small host-side descriptors travel: the current GPU for NCCL, else the CPU."""
        if "nccl" in str(dist.get_backend(self.handle)).lower():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def resolve(group=None) -> Group:
    """``group`` (None: the default group) with this process's place in it."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sinkattn.distributed needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (e.g. under torchrun), or use "
                           "sinkattn.sink_attn_func / sink_attn_varlen_func on the full tensors")
    handle = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(handle)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group it passed; pass a group "
                         "that contains every rank holding a shard of the sequence")
    size = dist.get_world_size(handle)
    return Group(weakref.ref(handle), rank, size, dist.get_global_rank(handle, (rank + 1) % size),
                 dist.get_global_rank(handle, (rank - 1) % size))


def agree(group: Group, facts: dict[str, float] | None, error: Exception | None,
          show=lambda name, value: f"{value:g}", packing: list[int] | None = None) -> None:
    """Raise the same error on every rank unless every rank passed ``error=None``, equal ``facts``
    and an equal ``packing`` (sequence lengths, compared exactly, entry by entry). The error of the
    first failing rank is raised as its type (TypeError, ValueError, NotImplementedError; any other
    as RuntimeError), chained to the original on that rank.

    One ``all_gather`` of a small float64 descriptor (an error code, the number of sequences of
    ``packing``, then ``facts`` in a fixed order, at most ``_WIDTH - 2``; ints are exact up to
    2**53), and, when that agrees and ``packing`` is given, one ``all_gather`` of the int64 lengths
    (equal in size on every rank, since their number agreed). Only on failure a further exchange
    carries the failing rank's message. ``show(name, value)`` words a fact's value for the message
    when ranks disagree.
    """
    names = ["the number of sequences", *(facts if facts is not None else [])]
    if len(names) > _WIDTH - 1:
        raise ValueError(f"agree: at most {_WIDTH - 2} facts, got {len(names) - 1}")
    values = [] if facts is None else [len(packing or ()), *(float(facts[n]) for n in names[1:])]
    code = 0 if error is None else 1 + next((i for i, t in enumerate(_ERROR_TYPES) if isinstance(error, t)),
                                            len(_ERROR_TYPES))
    local = torch.zeros(_WIDTH, dtype=torch.float64)
    local[:1 + len(values)] = torch.tensor([float(code), *values], dtype=torch.float64)
    rows = _gather(group, local)
    failed = [r for r in range(group.size) if rows[r][0] != 0]
    if failed:
        messages: list = [None] * group.size
        dist.all_gather_object(messages, None if error is None else _said(error), group=group.handle)
        first = failed[0]
        kind = (*_ERROR_TYPES, RuntimeError)[int(rows[first][0]) - 1]
        raise kind(f"sinkattn.distributed: rank {first} of {group.size} rejected its inputs: "
                   f"{messages[first]}") from error
    for r in range(1, group.size):
        if not torch.equal(rows[r], rows[0]):
            i = next(i for i in range(1, _WIDTH) if not torch.equal(rows[r][i], rows[0][i]))
            name = names[i - 1]
            _disagree(name, r, show(name, rows[0][i].item()), show(name, rows[r][i].item()))
    if packing:
        lists = [row.tolist() for row in _gather(group, torch.tensor(packing, dtype=torch.int64))]
        for r in range(1, group.size):
            if lists[r] != lists[0]:
                n = next(n for n, (a, b) in enumerate(zip(lists[0], lists[r])) if a != b)
                _disagree("the packing (sequence lengths from cu_seqlens)", r, _excerpt(lists[0], n),
                          _excerpt(lists[r], n) + f": sequence {n} has length {lists[0][n]} on rank 0 but "
                                                  f"{lists[r][n]} on rank {r}")


def _said(error: Exception) -> str:
    """The message of ``error``, with its type unless it is one of the argument errors."""
    return str(error) if isinstance(error, _ERROR_TYPES) else f"{type(error).__name__}: {error}"


def _gather(group: Group, local: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``local`` (same shape and dtype on every rank), on the CPU, in rank order."""
    local = local.to(group.comm_device)
    rows = [torch.empty_like(local) for _ in range(group.size)]
    dist.all_gather(rows, local, group=group.handle)
    return [r.cpu() for r in rows]


def _excerpt(values: list[int], at: int, width: int = 8) -> str:
    """``values`` as a list, cut to about ``width`` entries around index ``at`` when longer."""
    if len(values) <= width:
        return str(values)
    lo = max(0, min(at - width // 2, len(values) - width))
    inner = ", ".join(map(str, values[lo:lo + width]))
    return f"[{'..., ' if lo else ''}{inner}{', ...' if lo + width < len(values) else ''}] ({len(values)} sequences)"


def _disagree(name: str, r: int, first: str, other: str) -> None:
    raise ValueError(f"sinkattn.distributed: ranks disagree on {name}: rank 0 has {first}, rank {r} has {other}; "
                     f"every rank of the group must pass its shard of one call (same shapes, dtype, options and "
                     f"packing)")


class Exchange:
    """One ring step in flight: ``tensors`` sent to the next rank, as many received from the previous."""

    def __init__(self, tensors, group: Group):
        tensors = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, group.next, group.handle) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, group.prev, group.handle) for b in self.received]
        self._keep = tensors                  # what is being sent must outlive the sends
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._keep = None
        return self.received
