"""What a backend declares: what it can run (and the one check that reads it), and what its forward
returns, so the custom op's fake implementation can describe a call without running it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["Capabilities", "Request", "Batch"]


class Request(NamedTuple):
    """The facts about one call that decide whether a backend can take it (a tuple: one is made per
    call, and a frozen dataclass costs a microsecond to build)."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    needs_grad: bool
    value_dim: int = -1         # v's head dim Dv; -1: the same as head_dim


class Batch(NamedTuple):
    """A packed batch: sequence ``b`` owns query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (int32
    ``[N+1]``) and the keys of ``cu_seqlens_k``; ``max_seqlen_*`` bound the lengths (ints, checked)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class Capabilities:
    name: str
    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_head_dim: int
    backward: bool = True
    device_hint: str = ""      # what to do about a device it does not take
    out_dtype: torch.dtype = torch.float32      # dtype of the forward's ``o`` and statistics
    base2: bool = False        # statistics in base 2 (``sinkattn.sink``)
    dense: bool = False        # forward_dense: a dense call without gradients whole (``protocol``)
    joins_sink: bool = False   # join_sink: the sink's rule in its own code (``protocol``)
    value_dim: bool = True     # takes v with a head dim Dv other than q's and k's D

    def why_not(self, request: Request) -> str | None:
        """None when the backend can take ``request``, else the reason in one sentence."""
        if request.device_type not in self.device_types:
            return (f"backend {self.name!r} runs on {sorted(self.device_types)} tensors, "
                    f"got {request.device_type!r} tensors" + (f"; {self.device_hint}" if self.device_hint else ""))
        if request.dtype not in self.dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"backend {self.name!r} supports dtypes {names}, got {request.dtype}"
        if request.head_dim > self.max_head_dim:
            return f"backend {self.name!r} supports head dims up to {self.max_head_dim}, got {request.head_dim}"
        if request.value_dim > self.max_head_dim:
            return f"backend {self.name!r} supports head dims up to {self.max_head_dim}, got v's {request.value_dim}"
        if not self.value_dim and request.value_dim not in (-1, request.head_dim):
            return (f"backend {self.name!r} needs v's head dim equal to q's and k's, got Dv={request.value_dim}, "
                    f"D={request.head_dim}; use backend='cpu' (CPU tensors) or 'reference', or pad v to D and "
                    f"slice the output's last dim back to Dv")
        if request.needs_grad and not self.backward:
            return f"backend {self.name!r} has no backward"
        return None
