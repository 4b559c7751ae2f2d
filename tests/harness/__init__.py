"""The test harness: what the tests and benchmarks run besides the library, not shipped with it.

* ``cp``, ``tp``: context- and tensor-parallel cases run in one spawned gloo group per world size;
* ``hf_cp``, ``hf_deepspeed``: a tiny gpt-oss trained one step under ``torchrun`` (sinkattn's context
  parallelism, DeepSpeed's Ulysses), and ``hf_cp.launch`` that starts them;
* ``gpt_oss``, ``families``: tiny seeded Hugging Face models with sinks (no downloads);
* ``training``: a tokenizer, data sets and a collator made here, for the trainer tests;
* ``isa``: child processes held to a narrower CPU instruction set;
* ``triton_audit``: the Triton kernels' resource audit (``PYTHONPATH=tests python -m harness.triton_audit``);
* ``tables``: the tests' case tables beyond the levels (the Gate A matrices', and what other tests run on them).

Importable as ``harness`` with ``tests/`` on ``sys.path``: pytest puts it there (``tests/`` has no
``__init__.py``), as does Python for a script run from ``tests/``; processes started with
``environment()`` find it too. The library itself never imports it: what users call in their own
tests (the precision gates, the level tables, the float64 golden, what ``sinkattn verify`` and
``sinkattn bench`` run) is ``sinkattn.testing``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TESTS", "environment"]

TESTS = Path(__file__).resolve().parents[1]
"""The repository's ``tests/`` folder: the one that holds this package."""


def environment(env=None) -> dict[str, str]:
    """``env`` (default ``os.environ``) with ``TESTS`` first on ``PYTHONPATH``, for a process that imports
    ``harness`` (``python -m harness.hf_cp`` under ``torchrun``, whose workers' path is their own)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env
