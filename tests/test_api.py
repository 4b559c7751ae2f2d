"""Behaviour of the public API beyond the level tables: layouts, options, autograd plumbing."""

import math

import pytest
import torch

import sinkattn
from sinkattn import reference
from sinkattn.masks import Window

pytestmark = pytest.mark.floor   # also run on the oldest supported torch (.ci/floor)


def _dense(B=2, Sq=37, Sk=37, HQ=4, HKV=2, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, HQ, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Sk, HKV, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Sk, HKV, D, generator=g).to(dtype).requires_grad_()
    sinks = torch.randn(HQ, generator=g).requires_grad_()
    return q, k, v, sinks


def test_dense_equals_packed():
    q, k, v, sinks = _dense()
    out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, return_lse=True)
    cu = torch.tensor([0, 37, 74], dtype=torch.int32)
    out_p, lse_p = sinkattn.sink_attn_varlen_func(q.reshape(74, 4, 16), k.reshape(74, 2, 16), v.reshape(74, 2, 16),
                                                  cu, cu, 37, 37, sinks=sinks, causal=True, return_lse=True)
    assert out.shape == (2, 37, 4, 16) and lse.shape == (2, 4, 37) and lse.dtype == torch.float32
    assert torch.equal(out.reshape(74, 4, 16), out_p)
    assert torch.equal(lse, lse_p.view(4, 2, 37).transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_output_and_gradient_dtypes(dtype):
    q, k, v, _ = _dense(dtype=dtype)
    sinks = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    out = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)
    out.float().sum().backward()
    assert out.dtype == dtype
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    assert sinks.grad.dtype == torch.bfloat16 and sinks.grad.shape == (4,)


@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_meta_tensors_give_the_metadata_of_a_real_run(backend, packed):
    """Shapes only: on meta tensors every backend describes its results (the ops' fake implementations)
    without running; out, lse and every gradient have the shape, dtype and strides of a real CPU run."""
    def run(device):
        q, k, v, _ = (t.detach().to(device).requires_grad_() for t in _dense(dtype=torch.bfloat16))
        sinks = torch.randn(4, device=device).requires_grad_()
        if packed:
            cu = torch.tensor([0, 30, 74], dtype=torch.int32, device=device)
            q, k, v = (t.detach().reshape(74, *t.shape[2:]).requires_grad_() for t in (q, k, v))
            out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, 44, 44, sinks=sinks, causal=True,
                                                      return_lse=True, backend=backend)
        else:
            out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, return_lse=True, backend=backend)
        (out.float().sum() + lse.sum()).backward()
        return [(t.shape, t.dtype, t.stride(), t.device.type) for t in (out, lse, q.grad, k.grad, v.grad, sinks.grad)]
    real, meta = run("cpu"), run("meta")
    assert [m[:3] for m in meta] == [r[:3] for r in real]
    assert {m[3] for m in meta} == {"meta"}


def test_minus_inf_sink_equals_no_sink():
    q, k, v, _ = _dense()
    a = sinkattn.sink_attn_func(q, k, v, sinks=torch.full((4,), -math.inf), causal=True)
    b = sinkattn.sink_attn_func(q, k, v, sinks=None, causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_causal_is_right_window_zero_and_gpt_oss_sliding_window():
    q, k, v, sinks = _dense(Sq=50, Sk=50)
    a = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)
    b = sinkattn.sink_attn_func(q, k, v, sinks=sinks, window_size=(-1, 0))
    assert torch.equal(a, b)
    # sliding_window = W keys including the query itself
    W = 8
    out = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, window_size=(W - 1, 0))
    i = 30
    keys = torch.arange(i - W + 1, i + 1)
    s = torch.einsum("hd,khd->hk", q[0, i].double(), k[0, keys].double().repeat_interleave(2, 1)) / 4.0
    p = torch.softmax(torch.cat([s, sinks.double()[:, None]], 1), 1)[:, :W]
    expect = torch.einsum("hk,khd->hd", p, v[0, keys].double().repeat_interleave(2, 1))
    torch.testing.assert_close(out[0, i].double(), expect, rtol=1e-5, atol=1e-6)


def test_softmax_scale_applies_to_scores_not_sink():
    q, k, v, sinks = _dense(B=1, Sq=20, Sk=20)
    out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, softmax_scale=0.3, return_lse=True)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    ref_o, ref_l = reference.forward(q[0], k[0], v[0], sinks, cu, cu, 0.3, Window(-1, -1))
    torch.testing.assert_close(out[0].double(), ref_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[0].double(), ref_l, rtol=1e-5, atol=1e-6)


def test_lse_gradient_flows():
    q, k, v, sinks = _dense(B=1, Sq=30, Sk=40)
    out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, return_lse=True)
    g = torch.autograd.grad(lse.sum(), (q, k, v, sinks))
    cu_q, cu_k = torch.tensor([0, 30], dtype=torch.int32), torch.tensor([0, 40], dtype=torch.int32)
    ones = torch.ones(4, 30, dtype=torch.float64)
    ref = reference.backward(torch.zeros(30, 4, 16), ones, q[0].detach(), k[0].detach(), v[0].detach(),
                             sinks.detach(), cu_q, cu_k, 0.25, Window(-1, 0))
    for a, b in zip(g, (ref[0][None], ref[1][None], ref[2][None], ref[3])):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_nan_sink_poisons_only_its_head():
    q, k, v, _ = _dense(B=1, HQ=4, HKV=4)
    sinks = torch.tensor([0.0, float("nan"), 1.0, 2.0])
    out = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)
    assert torch.isnan(out[:, :, 1]).all()
    assert torch.isfinite(out[:, :, [0, 2, 3]]).all()


def test_empty_batch_and_empty_sequences():
    q, k = torch.randn(0, 4, 8, requires_grad=True), torch.randn(0, 2, 8, requires_grad=True)
    cu = torch.zeros(3, dtype=torch.int32)
    out, lse = sinkattn.sink_attn_varlen_func(q, k, k, cu, cu, 0, 0, sinks=torch.zeros(4), return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_no_grad_inputs_and_no_grad_mode():
    q, k, v, sinks = _dense()
    with torch.no_grad():
        a = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)
    b = sinkattn.sink_attn_func(q.detach(), k.detach(), v.detach(), sinks=sinks.detach(), causal=True)
    assert not a.requires_grad and not b.requires_grad and torch.equal(a, b)


def test_non_contiguous_inputs():
    q, k, v, sinks = _dense(B=1, Sq=24, Sk=24)
    qt = q.detach().transpose(0, 1).contiguous().transpose(0, 1)   # same values, other strides
    a = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)
    b = sinkattn.sink_attn_func(qt, k, v, sinks=sinks, causal=True)
    assert torch.equal(a, b)


def test_reference_backend_through_the_api():
    q, k, v, sinks = _dense(B=1, Sq=20, Sk=25)
    a = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, backend="reference")
    b = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, backend="cpu")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(a.sum(), (q, k, v, sinks))
    gb = torch.autograd.grad(b.sum(), (q, k, v, sinks))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
