import os

import torch

if not torch.cuda.is_available():   # run the Triton kernels on CPU tensors through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sinkattn.testing.verify import TENSORS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton tests put their tensors: the GPU when there is one, else the interpreter's CPU."""


def cold_cache_env(tmp_path) -> dict:
    """The environment for a fresh process whose compile caches start empty: PyTorch's cache keys
    do not cover a custom op's registered backward (pytorch#144344), so a warm cache can replay
    compiled code of the sinkattn that was here before, instead of compiling this one."""
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                TRITON_CACHE_DIR=str(tmp_path / "triton"))


def describe(result) -> str:
    """One line per tensor, for assertion messages."""
    if result.error:
        return result.error
    lines = [f"{result.case.name} on {result.backend}: deterministic={result.deterministic}"]
    for r in result.reports:
        lines.append(f"  {r.name:6s} {r.dtype:8s} ratio={r.ratio:.4f} max_abs={r.max_abs_err:.3g} "
                     f"special_ok={r.special_ok} gate_a={r.gate_a} waiver={r.waiver_ok}")
    return "\n".join(lines)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


__all__ = ["describe", "DEVICE", "TENSORS"]
