"""Head dims beyond the level tables: a value head dim ``Dv`` other than q's and k's ``D`` (MiMo-V2-Flash's
192 / 128, MLA-style models' query dim above the value dim, or below it), and head dims up to 512
(DeepSeek-V4's): the golden held to a second formulation, one tensor as both k and v, and the limit.
Their Gate A (``harness.tables.HEAD_DIMS``, the Triton backend's ``TRITON_SHAPES``, the dense call's
``value-dim``) is in the matrices, test_varlen_gate_a.py and test_dense_gate_a.py."""

import pytest
import torch

import sinkattn
from sinkattn.testing import cases, precision, verify
from harness import tables

CASES = tables.HEAD_DIMS[:4]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_matches_an_independent_formulation(case):
    """The float64 golden with Dv != D against eager attention (the sink as an extra softmax column) in
    float64, forward and backward: two formulations, ~1e-12 apart."""
    x = case.make()
    x64 = cases.Inputs(*(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                         for t in (x.q, x.k, x.v, x.sinks, x.cu_seqlens_q, x.cu_seqlens_k, x.max_seqlen_q,
                                   x.max_seqlen_k, x.do, x.dlse)))
    gold = verify.golden(case, x)
    other = verify.eager_outputs(case, x64)
    assert len(gold) == len(other) == 6
    for name, a, b in zip(verify.TENSORS, other, gold):
        assert a.shape == b.shape, name
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a)), name
        assert torch.allclose(a[finite], b[finite], rtol=1e-10, atol=1e-10), name


def test_shared_key_and_value_tensor():
    """DeepSeek-V4 passes one tensor as k and v (D = Dv = 512): its gradient is dk + dv."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(20, 4, 512, generator=g, requires_grad=True)
    kv = torch.randn(20, 1, 512, generator=g, requires_grad=True)
    sinks = torch.randn(4, generator=g, requires_grad=True)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    grads = {}
    for backend in ("cpu", "reference"):
        out = sinkattn.sink_attn_varlen_func(q, kv, kv, cu, cu, 13, 13, sinks=sinks, causal=True,
                                             window_size=(5, 0), backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), (q, kv, sinks))
    for name, a, b in zip(("dq", "dkv", "dsinks"), grads["cpu"], grads["reference"]):
        assert precision.gate_a(name, a, b).gate_a, name


def test_value_head_dim_past_the_limit_is_refused():
    q, k = torch.randn(4, 2, 512), torch.randn(4, 2, 512)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="v's head dim Dv must be in 1..512, got 640"):
        sinkattn.sink_attn_varlen_func(q, k, torch.randn(4, 2, 640), cu, cu, 4, 4)
