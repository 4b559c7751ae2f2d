"""What a backend declares: what it can run (and the one check that reads it), and what its
forward returns, so the custom op's fake implementation can describe a call without running it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["Capabilities", "Call", "Saved"]


class Call(NamedTuple):
    """The facts about one call that decide whether a backend can take it (a tuple: one is made per
    call, and a frozen dataclass costs a microsecond to build)."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    needs_grad: bool


@dataclass(frozen=True)
class Saved:
    """One extra tensor the forward returns for the backward: its shape in the symbols
    ``Tq``, ``Tk``, ``HQ``, ``HKV``, ``D`` (``()`` for a scalar), its dtype, on q's device."""

    name: str
    shape: tuple[str, ...]
    dtype: torch.dtype

    def like(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """An empty tensor of this description for ``q [Tq, HQ, D]``, ``k [Tk, HKV, D]``."""
        sizes = dict(Tq=q.shape[0], HQ=q.shape[1], D=q.shape[2], Tk=k.shape[0], HKV=k.shape[1])
        return q.new_empty(tuple(sizes[s] for s in self.shape), dtype=self.dtype)


@dataclass(frozen=True)
class Capabilities:
    name: str
    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_head_dim: int
    backward: bool = True
    device_hint: str = ""      # what to do about a device it does not take
    out_dtype: torch.dtype = torch.float32      # dtype of the forward's ``out`` (cast to q's by the caller)
    saved: tuple[Saved, ...] = ()              # the forward's extra tensors, in order

    def why_not(self, call: Call) -> str | None:
        """None when the backend can take ``call``, else the reason in one sentence."""
        if call.device_type not in self.device_types:
            return (f"backend {self.name!r} runs on {sorted(self.device_types)} tensors, "
                    f"got {call.device_type!r} tensors" + (f"; {self.device_hint}" if self.device_hint else ""))
        if call.dtype not in self.dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"backend {self.name!r} supports dtypes {names}, got {call.dtype}"
        if call.head_dim > self.max_head_dim:
            return f"backend {self.name!r} supports head dims up to {self.max_head_dim}, got {call.head_dim}"
        if call.needs_grad and not self.backward:
            return f"backend {self.name!r} has no backward"
        return None
