"""torch.compile and the custom ops: the default backend (inductor) in a fresh process, and
``torch.library.opcheck`` (schema, fake implementation, autograd registration) on every backend here."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinkattn import ops
from conftest import cold_cache_env

SCRIPT = Path(__file__).with_name("compile_check.py")


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_inductor_fullgraph_first_call_in_a_fresh_process(shapes, tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), shapes], capture_output=True, text=True, timeout=900,
                         env=cold_cache_env(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("ok ") == (3 if shapes == "static" else 5), run.stdout


def _op_args(lens, backend, dtype):
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    q = torch.randn(T, 4, 16, generator=g).to(dtype)
    k = torch.randn(T, 2, 16, generator=g).to(dtype)
    v = torch.randn(T, 2, 16, generator=g).to(dtype)
    sinks = torch.randn(4, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, sinks, cu, max(lens)


BACKENDS = ["cpu", "reference", "triton"]      # triton through TRITON_INTERPRET=1 (conftest) without a GPU


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lens", [[8, 8], [5, 0, 9]], ids=["equal-lengths", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck_forward_and_backward(backend, lens, dtype):
    q, k, v, sinks, cu, longest = _op_args(lens, backend, dtype)
    fwd = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), sinks.requires_grad_(), cu, cu,
           longest, longest, 0.25, -1, 0, backend, True)
    torch.library.opcheck(torch.ops.sinkattn.forward.default, fwd)
    detached = [x.detach() for x in fwd[:4]]
    out, lse, *extra = ops.forward(*detached, *fwd[4:])
    do, dlse = torch.randn(out.shape).to(dtype), torch.randn(lse.shape)
    torch.library.opcheck(torch.ops.sinkattn.backward.default,
                          (do, dlse, *detached, out, lse, cu, cu, longest, longest, 0.25, -1, 0, backend, extra))
