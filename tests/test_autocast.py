"""``torch.autocast`` at the public functions: q, k, v cast to the autocast dtype as for SDPA, sinks
in their own dtype, gradients back in the inputs' dtypes; checked against the float64 golden of the
cast inputs, against the same call on pre-cast inputs outside autocast, and compiled."""

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICE, cold_cache_env

import sinkattn
from sinkattn import reference
from sinkattn.autocast import autocast_inputs
from sinkattn.backends import buffers
from sinkattn.masks import Window
from sinkattn.testing import precision

HQ, HKV, D = 4, 2, 16
LENS = [37, 0, 20]
CU = [0, 37, 37, 57]
LOW = [torch.bfloat16, torch.float16]


def _mixed_inputs(device, other_low, seed=0, scale=1.0):
    """What gpt-oss hands over under autocast: q and k promoted to fp32 by the rotary code, v in a low
    dtype (here the other one than autocast's, to show any mix is cast); fp32 master sinks."""
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    q = (torch.randn(T, HQ, D, generator=g) * scale).to(device).requires_grad_()
    k = (torch.randn(T, HKV, D, generator=g) * scale).to(device).requires_grad_()
    v = torch.randn(T, HKV, D, generator=g).to(device, other_low).requires_grad_()
    sinks = torch.randn(HQ, generator=g).to(device).requires_grad_()
    do = torch.randn(T, HQ, D, generator=g).to(device)
    dlse = torch.randn(HQ, T, generator=g).to(device)
    return q, k, v, sinks, do, dlse


def _call(q, k, v, sinks, backend, window=(-1, -1)):
    cu = torch.tensor(CU, dtype=torch.int32, device=q.device)
    return sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, max(LENS), max(LENS), sinks=sinks, causal=True,
                                          window_size=window, return_lse=True, backend=backend)


@pytest.mark.floor
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_mixed_inputs_cast_to_autocast_dtype_pass_gate_a_against_golden_of_cast_inputs(backend, dtype):
    device = DEVICE if backend == "triton" else "cpu"
    other = LOW[1 - LOW.index(dtype)]
    q, k, v, sinks, do, dlse = _mixed_inputs(device, other)
    with buffers.poisoned():
        with torch.autocast(device, dtype):
            out, lse = _call(q, k, v, sinks, backend, window=(9, 0))
        dq, dk, dv, dsinks = torch.autograd.grad([out, lse], [q, k, v, sinks], [do.to(dtype), dlse])

    assert (out.dtype, lse.dtype) == (dtype, torch.float32)
    assert (dq.dtype, dk.dtype, dv.dtype, dsinks.dtype) == (torch.float32, torch.float32, other, torch.float32)

    cu = torch.tensor(CU, dtype=torch.int32, device=device)
    cast = [x.detach().to(dtype) for x in (q, k, v)]
    args = (*cast, sinks.detach(), cu, cu, D ** -0.5, Window(9, 0))
    gold = [*reference.forward(*args), *reference.backward(do.to(dtype), dlse, *args)]
    for name, actual, golden in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, dq, dk, dv, dsinks), gold):
        # thresholds of the autocast dtype, or of the tensor's own when coarser (dv comes back in v's dtype);
        # lse and dsinks are fp32 results of fp32 arithmetic on the cast inputs
        coarser = max(dtype, actual.dtype, key=lambda t: torch.finfo(t).eps)
        report = precision.gate_a(name, actual, golden, torch.float32 if name in ("lse", "dsinks") else coarser)
        assert report.gate_a, report


@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["fused-path", "large-scores-path"])
@pytest.mark.parametrize("api", ["varlen", "dense"])
def test_autocast_equals_the_call_on_precast_inputs_outside_autocast(api, scale):
    """Bitwise: the backends' fp32 arithmetic is untouched by the autocast region, in the forward and
    in a backward run inside it too (a leak would round their fp32 matrix products to bf16)."""
    q, k, v, sinks, do, dlse = _mixed_inputs("cpu", torch.float16, seed=1, scale=scale)

    def run(q, k, v):
        if api == "varlen":
            out, lse = _call(q, k, v, sinks, "cpu")
        else:
            shape = (3, 19)
            out, lse = sinkattn.sink_attn_func(*(x.view(*shape, *x.shape[1:]) for x in (q, k, v)), sinks=sinks,
                                               causal=True, window_size=(5, 0), return_lse=True)
            out, lse = out.flatten(0, 1), lse.transpose(0, 1).flatten(1)
        return [out, lse, *torch.autograd.grad([out, lse], [q, k, v, sinks], [do.to(out.dtype), dlse])]

    with torch.autocast("cpu", torch.bfloat16):
        got = run(q, k, v)
    precast = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    want = run(*precast)
    for a, b, original in zip(got, want, [None, None, q, k, v, sinks]):
        if original is not None:
            assert a.dtype == original.dtype
        assert torch.equal(a, b.to(a.dtype))


def test_autocast_inputs_rule():
    x32, x16, xb = torch.ones(2), torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16)
    x64, xi = torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.int32)
    assert autocast_inputs(x32, x16, xb) == (x32, x16, xb)                   # outside autocast: untouched
    with torch.autocast("cpu", torch.float16):
        q, k, v = autocast_inputs(x32, xb, x64)
        assert (q.dtype, k.dtype, v) == (torch.float16, torch.float16, x64)   # fp64 is not eligible
        assert autocast_inputs(xi, x16, None)[::2] == (xi, None)               # left for validation
        assert autocast_inputs(x16, x16, x16)[0] is x16                        # already there: no copy


def test_dtype_mix_outside_autocast_and_fp64_under_it_stay_errors():
    q, k, v, sinks, *_ = _mixed_inputs("cpu", torch.bfloat16)
    with pytest.raises(TypeError, match="q, k and v must share one dtype, got q torch.float32"):
        _call(q, k, v, sinks, "auto")
    fp64 = "q must have dtype .* got torch.float64"
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(TypeError, match=fp64):
        _call(q.double(), k, v, sinks, "auto")
    with torch.autocast("cpu", torch.bfloat16, enabled=False), pytest.raises(TypeError, match="share one dtype"):
        _call(q, k, v, sinks, "auto")


COMPILED = textwrap.dedent("""
    import torch, sinkattn

    def packed(q, k, v, sinks, cu):
        with torch.autocast("cpu", torch.bfloat16):             # the region inside the compiled function
            out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, 30, 30, sinks=sinks, causal=True,
                                                      window_size=(9, 0), return_lse=True)
        return out.float().square().sum() + lse.sum(), out.dtype

    def dense(q, k, v, sinks):                                   # the region around the compiled call
        return sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True).float().square().sum()

    g = torch.Generator().manual_seed(0)
    def leaves(*tokens):
        return [torch.randn(*tokens, h, 16, generator=g).requires_grad_() for h in (4, 2)] + [
            torch.randn(*tokens, 2, 16, generator=g).bfloat16().requires_grad_(),
            torch.randn(4, generator=g).requires_grad_()]

    x = leaves(47)
    cu = torch.tensor([0, 30, 30, 47], dtype=torch.int32)
    (loss, dtype), (want, _) = torch.compile(packed, fullgraph=True)(*x, cu), packed(*x, cu)
    assert dtype == torch.bfloat16, dtype
    for a, b in zip(torch.autograd.grad(loss, x), torch.autograd.grad(want, x)):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    print("ok packed", flush=True)

    x = leaves(2, 24)
    with torch.autocast("cpu", torch.bfloat16):
        loss, want = torch.compile(dense, fullgraph=True)(*x), dense(*x)
    for a, b in zip(torch.autograd.grad(loss, x), torch.autograd.grad(want, x)):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    print("ok dense", flush=True)
""")


@pytest.mark.floor
def test_inductor_fullgraph_under_autocast_in_a_fresh_process(tmp_path):
    run = subprocess.run([sys.executable, "-c", COMPILED], capture_output=True, text=True, timeout=900,
                         env=cold_cache_env(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["ok", "packed", "ok", "dense"]
