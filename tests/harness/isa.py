"""Narrower instruction sets on a wider CPU: what a CPU without AVX-512, its bf16 units or AMX gets.

PyTorch, MKL and oneDNN each choose their kernels by instruction set when they load, and each takes a
ceiling from the environment (``sinkattn.backends.isa.CEILINGS``). A process started with
``environment(level)`` runs the code such a CPU would run (its speed is this CPU's at that code, not the
other CPU's clock and caches); ``sinkattn.backends.isa.capability()`` in it tells whether PyTorch took
the ceiling."""

from __future__ import annotations

import os

from sinkattn.backends.isa import CEILINGS

__all__ = ["LEVELS", "environment"]

LEVELS = {
    "default": dict(zip(CEILINGS, ("default", "SSE4_2", "SSE41"))),
    "avx2": dict(zip(CEILINGS, ("avx2", "AVX2", "AVX2"))),
    "avx512": dict(zip(CEILINGS, ("avx512", "AVX512", "AVX512_CORE"))),
    "avx512_bf16": dict(zip(CEILINGS, ("avx512", "AVX512_E3", "AVX512_CORE_BF16"))),
}
"""Per level: the ceilings of the three libraries (PyTorch's dispatch, oneMKL, oneDNN, in ``CEILINGS``'s
order). ``default`` is PyTorch's scalar kernels; ``avx512`` is AVX-512 without its bf16 instructions and
without AMX (oneDNN's ``AVX512_CORE``), as on CPUs before Cooper Lake and Zen 4; ``avx512_bf16`` is AVX-512
with its bf16 dot products and without AMX, as on Zen 4 and Cooper Lake (on an AMX CPU: what those get).
The ``avx512`` and ``avx512_bf16`` levels both read ``avx512`` in ``capability()`` (they differ in MKL's
and oneDNN's ceilings)."""


def environment(level: str) -> dict[str, str]:
    """``os.environ`` with the ceilings of ``level`` (one of ``LEVELS``) set, for a child process."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {list(LEVELS)}, got {level!r}")
    return {**os.environ, **LEVELS[level]}
