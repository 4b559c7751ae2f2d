"""torch.compile and the custom ops: the default backend (inductor) in a fresh process, and
``torch.library.opcheck`` (schema, fake implementation, autograd registration) on every backend here."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import sinkattn
from sinkattn import ops
from conftest import cold_cache_env

SCRIPT = Path(__file__).with_name("compile_check.py")


@pytest.mark.parametrize("shapes", [pytest.param("static", marks=pytest.mark.floor), "dynamic"])
def test_inductor_fullgraph_first_call_in_a_fresh_process(shapes, tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), shapes], capture_output=True, text=True, timeout=900,
                         env=cold_cache_env(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("ok ") == (4 if shapes == "static" else 6), run.stdout


def _op_args(lens, backend, dtype):
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    q = torch.randn(T, 4, 16, generator=g).to(dtype)
    k = torch.randn(T, 2, 16, generator=g).to(dtype)
    v = torch.randn(T, 2, 16, generator=g).to(dtype)
    sinks = torch.randn(4, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, sinks, cu, max(lens)


LENS = {"equal-lengths": [8, 8], "packed": [5, 0, 9], "dense": "dense"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPCHECKS = [(backend, layout, dtype) for backend in ("cpu", "reference") for layout in LENS for dtype in DTYPES] + [
    ("triton", "packed", "fp32"), ("triton", "equal-lengths", "bf16"), ("triton", "dense", "bf16")]
"""Every layout and dtype on ``cpu`` and ``reference``; on ``triton`` (its interpreter without a GPU, 5-7 s a
check) each layout once and each dtype."""


@pytest.mark.parametrize("backend, layout, dtype", OPCHECKS, ids=["-".join(c[::-1]) for c in OPCHECKS])
def test_opcheck_forward_and_backward(backend, layout, dtype):
    """Packed calls, and dense ones (no ``cu_seqlens``: the op packs them, or a ``dense`` backend takes an
    inference call as it is), forward with and without a backward to follow, and the backward."""
    lens, dtype = LENS[layout], DTYPES[dtype]
    dense = lens == "dense"
    q, k, v, sinks, cu, longest = _op_args([8, 8] if dense else lens, backend, dtype)
    if dense:
        q, k, v = (x.view(2, 8, *x.shape[1:]) for x in (q, k, v))
        cu = None
    for needs_grad in (True, False):
        leaves = [x.detach().requires_grad_(needs_grad) for x in (q, k, v, sinks)]
        fwd = (*leaves, cu, cu, longest, longest, 0.25, -1, 0, backend, not dense, needs_grad)
        torch.library.opcheck(torch.ops.sinkattn.forward.default, fwd)
    detached = [x.detach() for x in (q, k, v, sinks)]
    out, lse, m, log_l = ops.forward(*detached, cu, cu, longest, longest, 0.25, -1, 0, backend, not dense, True)
    do, dlse = torch.randn(out.shape).to(dtype), torch.randn(lse.shape)
    torch.library.opcheck(torch.ops.sinkattn.backward.default,
                          (do, dlse, *detached, out, m, log_l, cu, cu, longest, longest, 0.25, -1, 0, backend, False))


@pytest.mark.parametrize("lens", [[5, 0, 9], "dense"], ids=["packed", "dense"])
def test_opcheck_backward_with_fp32_gradients(lens):
    """``fp32_grads`` (a caller that sums partial gradients, with ``partial`` as a context-parallel ring tile
    calls it, or alone): dq, dk, dv of bf16 inputs in fp32, as the fake implementation says; rounded to bf16
    they are bitwise the gradients of a call without it."""
    dense = lens == "dense"
    q, k, v, sinks, cu, longest = _op_args([8, 8] if dense else lens, "cpu", torch.bfloat16)
    if dense:
        q, k, v = (x.view(2, 8, *x.shape[1:]) for x in (q, k, v))
        cu = None
    out, lse, m, log_l = ops.forward(q, k, v, sinks, cu, cu, longest, longest, 0.25, -1, 0, "cpu", not dense, True)
    do, dlse = torch.randn(out.shape).to(torch.bfloat16), torch.randn(lse.shape)
    args = (do, dlse, q, k, v, sinks, out, m, log_l, cu, cu, longest, longest, 0.25, -1, 0, "cpu")
    for partial in (False, True):
        torch.library.opcheck(torch.ops.sinkattn.backward.default, (*args, partial, True))
        rounded = ops.backward(*args, partial)
        fp32 = ops.backward(*args, partial, True)
        assert [g.dtype for g in fp32[:3]] == [torch.float32] * 3
        assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(fp32[:3], rounded[:3]))
        assert torch.equal(fp32[3], rounded[3])


NUMPY_BOOL = """
import numpy as np, torch, sinkattn
q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16)
eager = sinkattn.sink_attn_func(q, k, v, causal=True)
f = lambda q, k, v, c: sinkattn.sink_attn_func(q, k, v, causal=c)
print("default", torch.equal(torch.compile(f)(q, k, v, np.bool_(True)), eager))
g = lambda q, k, v, c: sinkattn.sink_attn_func(q, k, v, causal=c)   # another code object: compiled anew
try:
    torch.compile(g, fullgraph=True)(q, k, v, np.bool_(True))
    print("fullgraph accepted")
except Exception as exc:
    print("fullgraph refused:", "pass bool(causal)" in str(exc))
"""


@pytest.mark.floor
def test_numpy_bool_under_compile_runs_or_says_pass_a_python_bool(tmp_path):
    """torch.compile traces a numpy bool as an array: the default compile (which may break the graph)
    runs it as eager does; fullgraph=True gets our message, not dynamo's failure to print an array."""
    run = subprocess.run([sys.executable, "-c", NUMPY_BOOL], capture_output=True, text=True, timeout=600,
                         env=cold_cache_env(tmp_path))
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split("\n")[:2] == ["default True", "fullgraph refused: True"], run.stdout + run.stderr[-3000:]


def test_tracing_a_call_warns_nothing(monkeypatch):
    """Dynamo warns about any ``functools.lru_cache`` it traces through ("silent incorrectness is a potential
    risk"): under compile the backend choice is made uncached, and a traced call warns nothing."""
    from torch._dynamo import utils

    monkeypatch.setattr(utils, "warn_once_cache", set())          # warnings other tests have drawn out
    q, k, v, sinks, cu, longest = _op_args([5, 0, 9], "cpu", torch.float32)

    @torch.compile(backend="eager", fullgraph=True)
    def attend(q, k, v, sinks):
        return sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, longest, longest, sinks=sinks, causal=True)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = attend(q, k, v, sinks)
    assert torch.equal(out, sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, longest, longest, sinks=sinks,
                                                           causal=True))
    assert [str(w.message) for w in caught] == []

