"""The Triton backend's real kernels, on this machine through ``TRITON_INTERPRET=1`` (set in
conftest when there is no GPU), against the float64 golden. Cases are scaled down (lengths <= 64,
heads <= 4, D <= 32) so the interpreter stays within CI's budget."""

import pytest
import torch

from sinkattn.testing import cases, verify
from sinkattn.backends import triton as triton_backend
from conftest import DEVICE, describe


def _small(case):
    return case.scaled(max_len=64, max_heads=4, max_dim=32)


def _params(level):
    mark = getattr(pytest.mark, level)
    return [pytest.param(_small(c), id=_small(c).name, marks=mark) for c in cases.cases(level)]


@pytest.mark.parametrize("case", _params("L0") + _params("L1") + _params("L2") + _params("boundary"))
def test_triton_gate_a(case):
    result = verify.run_case(case, "triton", device=DEVICE)
    assert result.passed, describe(result)


@pytest.mark.parametrize("D", [80, 256])
def test_triton_full_head_dims(D):
    case = cases.Case("L2", 2, 2, (40,), (40,), D=D)
    result = verify.run_case(case, "triton", device=DEVICE)
    assert result.passed, describe(result)


@pytest.mark.determinism
@pytest.mark.parametrize("case", [pytest.param(_small(c), id=_small(c).name) for c in cases.cases("L0")[:4]])
def test_triton_bitwise_deterministic(case):
    result = verify.run_case(case, "triton", repeats=3, device=DEVICE)
    assert result.deterministic is True, describe(result)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compensated_backward_is_more_accurate(dtype, monkeypatch):
    case = cases.Case("L2", 4, 2, (64,), (64,), D=32, dtype=dtype)
    errors = {}
    for flag in (False, True):
        monkeypatch.setattr(triton_backend, "COMPENSATED", flag)
        result = verify.run_case(case, "triton", device=DEVICE)
        errors[flag] = {r.name: r.rms_rel_err for r in result.reports}
    for name in ("dq", "dk", "dv"):
        assert errors[True][name] < errors[False][name], (name, errors)


def test_kernels_compile_for_ampere_and_hopper():
    """The interpreter is lenient; this builds the kernels with Triton's GPU compiler (no GPU needed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_aot.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("compiled") == 4


def test_compensated_flag_must_be_a_bool(monkeypatch):
    monkeypatch.setattr(triton_backend, "COMPENSATED", None)
    result = verify.run_case(_small(cases.cases("L0")[0]), "triton", device=DEVICE)
    assert result.error is not None and result.error.startswith("TypeError") and "COMPENSATED" in result.error


@pytest.mark.parametrize("bounds", [(9, 9), (9 + 64, 9 + 130)], ids=["exact", "over-estimated"])
def test_launch_sized_by_max_seqlen_equals_reading_cu_seqlens(bounds):
    """Given ``max_seqlen``, the launchers size their grids from it instead of copying ``cu_seqlens``
    to the host; blocks past a sequence's end (a bound that over-estimates) must write nothing."""
    torch.manual_seed(0)
    lens, HQ, HKV, D = [5, 0, 9], 4, 2, 16
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens), HQ, D, device=DEVICE)
    k, v = torch.randn(2, sum(lens), HKV, D, device=DEVICE)
    sinks, do, dlse = torch.randn(HQ, device=DEVICE), torch.randn_like(q), torch.randn(HQ, sum(lens), device=DEVICE)
    results = []
    for max_seqlen in (None, bounds):
        out, lse, extra = triton_backend.forward(q, k, v, sinks, cu, cu, 0.3, 3, 0, max_seqlen=max_seqlen)
        grads = triton_backend.backward(do, dlse, q, k, v, sinks, out, lse, cu, cu, 0.3, 3, 0, extra,
                                        max_seqlen=max_seqlen)
        results.append([out, lse, *grads])
    assert not any(t.isnan().any() for t in results[1])
    assert all(torch.equal(a, b) for a, b in zip(*results))
