"""Narrower instruction sets on a wider CPU: what a CPU without AVX-512, its bf16 units or AMX gets.

PyTorch, MKL and oneDNN each choose their kernels by instruction set when they load, and each takes a
ceiling from the environment (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``).
A process started with ``environment(level)`` runs the code such a CPU would run (its speed is this
CPU's at that code, not the other CPU's clock and caches); ``capability()`` in it tells whether
PyTorch took the ceiling."""

from __future__ import annotations

import os

import torch

__all__ = ["LEVELS", "environment", "capability", "ceiling"]

LEVELS = {
    "default": dict(ATEN_CPU_CAPABILITY="default", MKL_ENABLE_INSTRUCTIONS="SSE4_2", ONEDNN_MAX_CPU_ISA="SSE41"),
    "avx2": dict(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2"),
    "avx512": dict(ATEN_CPU_CAPABILITY="avx512", MKL_ENABLE_INSTRUCTIONS="AVX512",
                   ONEDNN_MAX_CPU_ISA="AVX512_CORE"),
}
"""Per level (``ATEN_CPU_CAPABILITY``'s name): the ceilings of the three libraries. ``default`` is
PyTorch's scalar kernels; ``avx512`` is AVX-512 without its bf16 instructions and without AMX (oneDNN's
``AVX512_CORE``), as on CPUs before Cooper Lake and Zen 4."""


def environment(level: str) -> dict[str, str]:
    """``os.environ`` with the ceilings of ``level`` (one of ``LEVELS``) set, for a child process."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}, got {level!r}")
    return {**os.environ, **LEVELS[level]}


def capability() -> str:
    """The instruction set PyTorch's CPU kernels run at in this process, lower case (``avx512``, ``avx2``,
    ``default``; a ceiling above the CPU's own is not taken)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def ceiling() -> str | None:
    """The ceilings set in this process's environment, e.g. ``ATEN_CPU_CAPABILITY=avx2 ...``; None: none."""
    names = dict.fromkeys(name for level in LEVELS.values() for name in level)
    return " ".join(f"{name}={os.environ[name]}" for name in names if name in os.environ) or None
