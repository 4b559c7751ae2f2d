"""Narrower instruction sets on a wider CPU: what a CPU without AVX-512, its bf16 units or AMX gets.

PyTorch, MKL and oneDNN each choose their kernels by instruction set when they load, and each takes a
ceiling from the environment (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``).
A process started with ``environment(level)`` runs the code such a CPU would run (its speed is this
CPU's at that code, not the other CPU's clock and caches); ``capability()`` in it tells whether
PyTorch took the ceiling."""

from __future__ import annotations

import os

import torch

__all__ = ["LEVELS", "MATRIX_UNITS_FROM", "environment", "capability", "ceiling", "matrix_units_allowed"]

LEVELS = {
    "default": dict(ATEN_CPU_CAPABILITY="default", MKL_ENABLE_INSTRUCTIONS="SSE4_2", ONEDNN_MAX_CPU_ISA="SSE41"),
    "avx2": dict(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2"),
    "avx512": dict(ATEN_CPU_CAPABILITY="avx512", MKL_ENABLE_INSTRUCTIONS="AVX512",
                   ONEDNN_MAX_CPU_ISA="AVX512_CORE"),
    "avx512_bf16": dict(ATEN_CPU_CAPABILITY="avx512", MKL_ENABLE_INSTRUCTIONS="AVX512_E3",
                        ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16"),
}
"""Per level: the ceilings of the three libraries. ``default`` is PyTorch's scalar kernels; ``avx512`` is
AVX-512 without its bf16 instructions and without AMX (oneDNN's ``AVX512_CORE``), as on CPUs before
Cooper Lake and Zen 4; ``avx512_bf16`` is AVX-512 with its bf16 dot products and without AMX, as on Zen 4
and Cooper Lake (on an AMX CPU: what those get)."""

MATRIX_UNITS_FROM = "AVX512_E4"
"""oneMKL's first ``MKL_ENABLE_INSTRUCTIONS`` level with AMX."""


def environment(level: str) -> dict[str, str]:
    """``os.environ`` with the ceilings of ``level`` (one of ``LEVELS``) set, for a child process."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}, got {level!r}")
    return {**os.environ, **LEVELS[level]}


def capability() -> str:
    """The instruction set PyTorch's CPU kernels run at in this process, lower case (``avx512``, ``avx2``,
    ``default``; a ceiling above the CPU's own is not taken). The ``avx512`` and ``avx512_bf16`` levels
    both read ``avx512`` here (they differ in MKL's and oneDNN's ceilings)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def ceiling() -> str | None:
    """The ceilings set in this process's environment, e.g. ``ATEN_CPU_CAPABILITY=avx2 ...``; None: none."""
    names = dict.fromkeys(name for level in LEVELS.values() for name in level)
    return " ".join(f"{name}={os.environ[name]}" for name in names if name in os.environ) or None


def matrix_units_allowed() -> bool:
    """Whether this process's ceilings leave oneMKL its AMX kernels (no ``MKL_ENABLE_INSTRUCTIONS``, or
    ``AVX512_E4`` and up)."""
    held = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "").strip().upper()
    return not held or (held.startswith("AVX512_E") and held >= MATRIX_UNITS_FROM)
