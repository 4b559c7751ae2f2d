"""Valid inputs at the edges of the options: each is computed right (against the float64 golden) or
refused with an error that names the feature."""

import sys

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import sinkattn

BACKENDS = ["cpu", "triton", "reference"]      # triton through TRITON_INTERPRET=1 (conftest) without a GPU


def _dense(B=1, S=24, HQ=4, HKV=2, D=16, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g).requires_grad_(requires_grad) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(HQ, generator=g).requires_grad_(requires_grad)


def _outputs_and_grads(backend, q, k, v, sinks, **options):
    out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, return_lse=True, backend=backend, **options)
    grads = torch.autograd.grad((out * out).sum() + lse.sum(), (q, k, v, sinks))
    return [out, lse, *grads]


def _assert_matches_golden(backend, **options):
    q, k, v, sinks = _dense()
    got = _outputs_and_grads(backend, q, k, v, sinks, **options)
    want = _outputs_and_grads("reference", q, k, v, sinks, **options)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        assert torch.isfinite(a).all(), f"{name} has NaN/inf with {options}"
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.0, -0.3])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(-1, 0)), dict(window_size=(5, 3)), {}],
                         ids=["causal", "left_unbounded_right0", "two_sided", "full"])
def test_zero_and_negative_softmax_scale(backend, scale, mask):
    _assert_matches_golden(backend, softmax_scale=scale, **mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,same_as", [((0, sys.maxsize), (0, -1)), ((2**63, 0), (-1, 0)),
                                            ((10**30, 10**30), (-1, -1)), ((23, 3), (-1, 3)),
                                            ((np.int64(4), np.int64(2**62)), (4, -1))])
def test_huge_windows_mean_unbounded(backend, window, same_as):
    q, k, v, sinks = _dense(requires_grad=False)
    got = sinkattn.sink_attn_func(q, k, v, sinks=sinks, window_size=window, backend=backend)
    want = sinkattn.sink_attn_func(q, k, v, sinks=sinks, window_size=same_as, backend=backend)
    assert torch.equal(got, want)
    _assert_matches_golden(backend, window_size=window)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bound", [2**63, 2**100, sys.maxsize])
def test_huge_max_seqlen_is_a_loose_bound(backend, bound):
    """Any bound at least the longest sequence is valid: past the op's int64 it gave a schema error,
    and the Triton grid (sized from it) grew without limit."""
    q, k, v = (x[0] for x in _dense(B=1, S=21, requires_grad=False)[:3])
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    run = lambda m: sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True,     # noqa: E731
                                                   window_size=(5, 0), backend=backend)
    assert torch.equal(run(bound), run(12))


def test_triton_grid_is_capped_at_the_token_count():
    from sinkattn.backends import triton as triton_backend
    from sinkattn.backends.capabilities import Batch
    q, k = torch.empty(21, 4, 8), torch.empty(30, 2, 8)
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    assert triton_backend._max_lens(q, k, Batch(cu, cu, 2**62, 2**40)) == (21, 30)
    assert triton_backend._max_lens(q, k, Batch(cu, cu, 12, 13)) == (12, 13)


@pytest.mark.parametrize("backend", ["cpu"])
def test_scores_beyond_fp32_are_refused_by_the_fp32_backends(backend):
    """A legal softmax_scale with large q and k: fp32 scores would overflow to NaN; the float64 reference
    computes them. (Triton does not check, which would read back to the host: what it returns instead is
    test_triton.py::test_scores_beyond_fp32_are_computed_as_fp32_holds_them.)"""
    q, k, v, sinks = (x * 1e10 if i < 2 else x for i, x in enumerate(_dense(requires_grad=False)))
    with pytest.raises(ValueError, match="softmax_scale.*beyond what fp32 holds"):
        sinkattn.sink_attn_func(q, k, v, sinks=sinks, softmax_scale=1e18, backend=backend)
    assert torch.isfinite(sinkattn.sink_attn_func(q, k, v, sinks=sinks, softmax_scale=1e18,
                                                  backend="reference")).all()


def test_numpy_bools_are_bools():
    q, k, v, sinks = _dense(requires_grad=False)
    out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=np.bool_(True), return_lse=np.bool_(True))
    assert torch.equal(out, sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True))


def test_forward_mode_ad_is_refused():
    q, k, v, sinks = _dense(requires_grad=False)
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        sinkattn.sink_attn_func(q, k, forward_ad.make_dual(v, torch.ones_like(v)), sinks=sinks)
    with forward_ad.dual_level():      # a dual level without tangents on sinkattn's inputs is fine
        assert torch.isfinite(sinkattn.sink_attn_func(q, k, v, sinks=sinks)).all()


@pytest.mark.parametrize("transform", ["jvp", "vjp", "grad", "jacrev", "vmap"])
def test_torch_func_transforms_are_refused_with_what_to_use(transform):
    """None works over the custom op's autograd (PyTorch fails deep inside); the error says so and
    points to reverse mode outside them, which the message's advice must then really do."""
    q, k, v, sinks = _dense(requires_grad=False)
    f = lambda q: sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)    # noqa: E731
    run = {"jvp": lambda: torch.func.jvp(f, (q,), (torch.ones_like(q),)),
           "vjp": lambda: torch.func.vjp(f, q)[1](torch.ones_like(q)),
           "grad": lambda: torch.func.grad(lambda q: f(q).sum())(q),
           "jacrev": lambda: torch.func.jacrev(f)(q),
           "vmap": lambda: torch.func.vmap(f)(q[None])}[transform]
    with pytest.raises(NotImplementedError, match="torch.func transforms.*torch.autograd.grad"):
        run()
    q.requires_grad_(True)
    (dq,) = torch.autograd.grad(f(q).sum(), q)
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0


def test_double_backward_is_refused_at_the_first_create_graph():
    q, k, v, sinks = _dense()
    out = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
