"""Result buffers of the fast backends, and the switch that poisons them for tests.

Backends allocate every result with ``new`` (uninitialized) and must write each
element. Inside ``poisoned()`` the buffers start as NaN, so an element a
backend forgot to write shows up as a NaN the precision check rejects.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["new", "poisoned"]

_poison = False


def new(shape, dtype: torch.dtype, device) -> torch.Tensor:
    if _poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned():
    """Within the block, ``new`` returns NaN-filled buffers."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous
