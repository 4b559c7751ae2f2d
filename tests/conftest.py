import os
import platform

if platform.machine() in ("x86_64", "AMD64"):
    # Under the Triton interpreter tl.dot is numpy's matmul (OpenBLAS). OpenBLAS's Haswell and Zen
    # kernels (AVX2 CPUs) round a product differently by matrix shape, so the backward's recomputed
    # scores differ from the forward's in the last bit, which scores of 1e6 and more turn into
    # misses of the standard; its Sandybridge kernels do not (a GPU's tl.dot is not measured yet:
    # benchmarks/gpu.py checks Gate A there). Read when numpy loads: before torch, which imports it.
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # pytest -n: the cores are shared between the workers (and the processes their tests start);
    # OpenMP teams that add up to more threads than cores wait on each other
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import torch  # noqa: E402

if not torch.cuda.is_available():   # run the Triton kernels on CPU tensors through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from harness import interpreter

    interpreter.patch_once_per_launch()

import pytest  # noqa: E402

from sinkattn.backends import cpu_native
from sinkattn.testing.verify import TENSORS

def pytest_runtest_setup(item):
    """Under ``--dist loadgroup`` pytest-xdist sends a group's tests to one worker by renaming them
    ``nodeid@group`` on each worker; a pytest that ignores the rename (9.2 with xdist 3.8) would
    spread a group over the workers, each launching the group's process groups: fail instead."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") \
            and "@" not in item.nodeid:
        pytest.fail(f"pytest-xdist did not group this xdist_group test under pytest {pytest.__version__} "
                    f"(loadgroup renames tests, which this pytest ignores): install pytest < 9.2", pytrace=False)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton tests put their tensors: the GPU when there is one, else the interpreter's CPU."""


def cold_cache_env(tmp_path) -> dict:
    """The environment for a fresh process whose compile caches start empty: PyTorch's cache keys
    do not cover a custom op's registered backward (pytorch#144344), so a warm cache can replay
    compiled code of the sinkattn that was here before, instead of compiling this one."""
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                TRITON_CACHE_DIR=str(tmp_path / "triton"))


@pytest.fixture
def one_thread():
    """torch on one thread for the test: a local call compared with ranks that run one thread each, or a
    small golden (on two shared cores, OpenMP teams wait on each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def describe(result) -> str:
    """One line per tensor, for assertion messages."""
    if result.error:
        return result.error
    lines = [f"{result.case.name} on {result.backend}: deterministic={result.deterministic}"]
    for r in result.reports:
        lines.append(f"  {r.name:6s} {r.dtype:8s} ratio={r.ratio:.4f} max_abs={r.max_abs_err:.3g} "
                     f"special_ok={r.special_ok} gate_a={r.gate_a} waiver={r.waiver_ok}")
    return "\n".join(lines)


@pytest.fixture(params=["compiled", "python"])
def cpu_path(request, monkeypatch):
    """Each of the cpu backend's two ways to its tiles in turn (``SINKATTN_CPU_KERNEL``): the compiled
    kernel (skipped without a C++ compiler) and the PyTorch-op paths."""
    if request.param == "compiled" and cpu_native.compiler() is None:
        pytest.skip("no C++ compiler: the compiled kernel is not built")
    monkeypatch.setenv("SINKATTN_CPU_KERNEL", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


__all__ = ["describe", "DEVICE", "TENSORS", "cpu_path"]
