"""Result buffers of the fast backends, the switch that poisons them for tests, and the layout of
the tensors handed to a backend.

Backends allocate every result with ``new`` (uninitialized) and must write each
element. Inside ``poisoned()`` the buffers start as NaN, so an element a
backend forgot to write shows up as a NaN the precision check rejects.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["new", "poisoned", "poisoning", "contiguous"]

_poison = False


def new(shape, dtype: torch.dtype, device) -> torch.Tensor:
    if _poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def poisoning() -> bool:
    """Whether ``new`` poisons now (for code that allocates its results elsewhere, e.g. in C++)."""
    return _poison


@contextlib.contextmanager
def poisoned():
    """Within the block, ``new`` returns NaN-filled buffers."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous


def contiguous(*tensors) -> list:
    """Each tensor contiguous (a no-op when it already is; ``None`` passes through): the layout every
    backend and every kernel pointer argument assumes, so a strided or offset view is copied first."""
    return [t.contiguous() if t is not None else None for t in tensors]
