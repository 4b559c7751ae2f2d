"""Head dims beyond the level tables: a value head dim ``Dv`` other than q's and k's ``D`` (MiMo-V2-Flash's
192 / 128, MLA-style models' query dim above the value dim, or below it), and head dims up to 512
(DeepSeek-V4's), forward and backward against the float64 golden with the precision standard
(Gate A), through the public API with NaN-poisoned result buffers. The Triton backend's cases are in
test_triton.py (through its interpreter)."""

import pytest
import torch

import sinkattn
from sinkattn.testing import cases, precision, verify
from conftest import describe

CASES = [
    cases.Case("L2", 4, 2, (37, 0, 70), (37, 0, 70), D=24, Dv=16),
    cases.Case("L2", 4, 2, (53, 21), (53, 21), D=192, Dv=128, dtype=torch.bfloat16, window_size=(15, 0)),
    cases.Case("L2", 4, 4, (29, 40), (45, 40), D=16, Dv=40, dtype=torch.float32, causal=False),
    cases.Case("L2", 2, 1, (3, 1, 2), (3, 4, 2), D=40, Dv=8, dtype=torch.float32, window_size=(1, 1)),
    cases.Case("L2", 2, 2, (70,), (70,), D=512),
    cases.Case("L2", 2, 2, (41, 9), (41, 9), D=512, dtype=torch.float32, causal=False, window_size=(8, 5)),
    cases.Case("L2", 4, 4, (33,), (33,), D=320, Dv=512, dtype=torch.bfloat16, lse_grad=True),
]
IDS = [c.name for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_training_call_passes_gate_a(case):
    result = verify.run_case(case, "cpu")
    assert result.passed, describe(result)
    dv = [r for r in result.reports if r.name == "dv"]
    assert len(dv) == 1


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inference_call_passes_gate_a(case):
    """No gradient: the fused kernel's path where it takes the call (Dv = D), else the tiles."""
    x = case.make()
    out, lse = verify.inference(case, x)
    assert out.shape == x.q.shape[:-1] + x.v.shape[-1:]
    reports = verify.inference_reports(case, x=x, results=(out, lse))
    assert all(r.gate_a for r in reports), [r.as_dict() for r in reports]


@pytest.mark.parametrize("D,Dv", [(192, 128), (16, 40), (512, 512)])
def test_dense_call_with_its_own_value_dim(D, Dv):
    """The dense API (and, without gradient, the cpu backend's dense fast path) against the golden."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 9, 4, D, generator=g), torch.randn(2, 12, 2, D, generator=g)
    v, sinks = torch.randn(2, 12, 2, Dv, generator=g), torch.randn(4, generator=g)
    gold = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, backend="reference")
    with torch.no_grad():
        out = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)
    assert out.shape == (2, 9, 4, Dv)
    assert precision.gate_a("o", out, gold).gate_a


@pytest.mark.parametrize("case", CASES[:4], ids=IDS[:4])
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
