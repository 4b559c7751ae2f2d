"""The instruction sets this process's CPU kernels run at, and the ceilings its environment sets on them.

PyTorch, oneMKL and oneDNN each choose their kernels by instruction set when they load, and each takes a
ceiling from the environment (``CEILINGS``: ``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``,
``ONEDNN_MAX_CPU_ISA``). The cpu backend reads them to decide whether bf16 products run on AMX tiles
(``matrix_units_allowed``, ``cpu_native``); ``sinkattn bench`` reports them (``capability``, ``ceiling``).
The test harness starts processes held to a narrower level (``tests/harness/isa.py``)."""

from __future__ import annotations

import os

import torch

__all__ = ["CEILINGS", "MATRIX_UNITS_FROM", "capability", "ceiling", "matrix_units_allowed"]

CEILINGS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
"""The environment variables that hold PyTorch's dispatch, oneMKL and oneDNN below the CPU's own level."""

MATRIX_UNITS_FROM = "AVX512_E4"
"""oneMKL's first ``MKL_ENABLE_INSTRUCTIONS`` level with AMX."""


def capability() -> str:
    """The instruction set PyTorch's CPU kernels run at in this process, lower case (``avx512``, ``avx2``,
    ``default``; a ceiling above the CPU's own is not taken)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def ceiling() -> str | None:
    """The ceilings set in this process's environment, e.g. ``ATEN_CPU_CAPABILITY=avx2 ...``; None: none."""
    return " ".join(f"{name}={os.environ[name]}" for name in CEILINGS if name in os.environ) or None


def matrix_units_allowed() -> bool:
    """Whether this process's ceilings leave oneMKL its AMX kernels (no ``MKL_ENABLE_INSTRUCTIONS``, or
    ``AVX512_E4`` and up)."""
    held = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "").strip().upper()
    return not held or (held.startswith("AVX512_E") and held >= MATRIX_UNITS_FROM)
