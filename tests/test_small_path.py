"""The cpu backend's batched path for packed short sequences (``cpu_small``), through the public API with
NaN-poisoned buffers against the float64 golden (mixed with longer sequences and decoding rows), and what
it promises beyond the values: a short sequence's result does not depend on the rest of the call, and
empty sequences cost no work. Each test runs on the PyTorch-op paths (where ``cpu_small`` takes these
sequences) and through the compiled kernel (``cpu_path``)."""

import pytest
import torch

import sinkattn
from sinkattn.backends import cpu, cpu_small, layout
from sinkattn.testing import cases, verify
from conftest import describe

pytestmark = pytest.mark.usefixtures("cpu_path")

C = cases.Case
SMALL_CASES = [
    C("L2", 4, 2, (1, 2, 3, 0, 3, 1, 2, 2), (1, 2, 3, 0, 3, 1, 2, 2), D=16, dtype=torch.float32, note="short"),
    C("L2", 4, 2, (1, 1, 4, 16, 3, 1), (5, 40, 9, 16, 0, 300), D=16, dtype=torch.float32, note="decoding"),
    C("L2", 4, 2, (1, 1, 4, 16, 3, 1), (5, 40, 9, 16, 0, 300), D=16, dtype=torch.float32, window_size=(7, 0),
      note="decoding"),
    C("L2", 8, 4, (30, 100, 7, 24, 1, 0, 2), (30, 100, 7, 24, 1, 5, 2), D=32, causal=False, window_size=(2, 3),
      lse_grad=True, note="mixed"),
    C("L2", 4, 1, (17, 23, 5, 60), (17, 23, 5, 60), D=24, dtype=torch.bfloat16, lse_grad=True, note="padded"),
    C("L2", 4, 2, (3, 9, 12, 2), (3, 9, 12, 2), D=16, causal=False, window_size=(-1, 1), sink_scale=None,
      note="nosink"),
] + [C("boundary", 4, 2, (3, 9, 12, 2), (3, 9, 12, 2), D=16, sink_value=s, note=f"sink{s}")
     for s in (float("inf"), float("-inf"), float("nan"), 0.0)]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in SMALL_CASES])
def test_small_sequences_pass_gate_a(case):
    HQ = case.HQ
    parts = cpu.split(*(case.make().cu_seqlens_q, case.make().cu_seqlens_k), HQ)
    assert parts.small is not None            # the case exercises the small path
    result = verify.run_case(case, "cpu", repeats=2)
    assert result.passed and result.deterministic, describe(result)


@pytest.mark.parametrize("seed", [1, 3])
def test_every_packed_sequence_through_the_small_path(seed, monkeypatch):
    """Random packed batches (lengths 0-300) with the small path taking every sequence it can hold."""
    monkeypatch.setattr(cpu_small, "SHORT_LENGTH", 10**9)
    case = cases.random_packed(seed)
    result = verify.run_case(case, "cpu")
    assert result.passed, describe(result)


def _sequence_in(lens, index, x, seed=5):
    """Output and gradients on sequence ``index`` of a packed batch of ``lens`` holding ``x`` there."""
    HQ, HKV, D = 4, 2, 16
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, H, D, generator=g) for H in (HQ, HKV, HKV))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    s0, L = int(cu[index]), lens[index]
    q[s0:s0 + L], k[s0:s0 + L], v[s0:s0 + L] = x
    leaves = [t.requires_grad_() for t in (q, k, v)]
    sinks = torch.linspace(-1, 1, HQ)
    out = sinkattn.sink_attn_varlen_func(*leaves, cu, cu, max(lens), max(lens), sinks=sinks, causal=True)
    grad = torch.randn(out.shape, generator=g)
    grad[s0:s0 + L] = torch.linspace(-1, 1, L * HQ * D).view(L, HQ, D)
    return [t[s0:s0 + L] for t in (out, *torch.autograd.grad(out, leaves, grad))]


@pytest.mark.parametrize("L", [3, 40])
def test_a_short_sequences_result_does_not_depend_on_the_rest_of_the_call(L):
    g = torch.Generator().manual_seed(L)
    x = (torch.randn(L, 4, 16, generator=g), torch.randn(L, 2, 16, generator=g), torch.randn(L, 2, 16, generator=g))
    alone = _sequence_in([5, L, 2], 1, x)
    for lens, index in (([L, 7, L + 1, 3, 2, L, 9] * 8, 5), ([5, L, 100], 1), ([80, L], 1)):
        assert all(torch.equal(a, b) for a, b in zip(alone, _sequence_in(lens, index, x))), lens


def test_empty_sequences_add_no_work():
    """Fixed-size cu_seqlens padded with empty sequences: the split lists none of them."""
    lens = [5, 0, 0, 70, 0, 3] + [0] * 10_000
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    parts = cpu.split(cu, cu, 4)
    assert [(r.tq, r.n, r.Lq) for r in parts.runs] == [(5, 1, 70)]
    assert parts.small.Lq.tolist() == [5, 3] and parts.keys_only is None


def test_sequences_without_queries_or_keys_pass_gate_a():
    case = C("L2", 4, 2, (0, 3, 0, 2, 0, 70, 4) + (0,) * 50, (6, 3, 0, 0, 4, 70, 4) + (0,) * 50, D=16,
             dtype=torch.float32, note="empty")
    parts = cpu.split(case.make().cu_seqlens_q, case.make().cu_seqlens_k, 4)
    assert parts.keys_only.Lk.tolist() == [6, 4]
    result = verify.run_case(case, "cpu")
    assert result.passed, describe(result)


@pytest.mark.parametrize("k_lens", [(4, 3, 0), (0, 0, 0)], ids=["last-without-keys", "no-keys-at-all"])
def test_sequences_without_keys_at_the_end(k_lens):
    case = C("L2", 4, 2, (3, 2, 5), k_lens, D=8, dtype=torch.float32, note="nokeys")
    result = verify.run_case(case, "cpu")
    assert result.passed, describe(result)


def test_padded_lengths_are_buckets_of_at_most_an_eighth_more():
    L = torch.arange(0, 5000)
    P = cpu_small.padded_length(L)
    assert (P >= L).all() and (P[L <= 16] == L[L <= 16].clamp(min=1)).all()
    assert ((P - L)[L > 16] * 8 < L[L > 16]).all()
    assert len(torch.unique(P[(L > 512) & (L <= 1024)])) == 8


def test_dense_batches_stay_one_run():
    """A dense batch of short sequences or decoding rows is one kernel call, never gathered."""
    for B, Lq, Lk in ((64, 3, 3), (4, 1, 1000)):
        cu_q, cu_k = (torch.arange(B + 1, dtype=torch.int32) * n for n in (Lq, Lk))
        parts = cpu.split(cu_q, cu_k, 8)
        assert parts.runs == [layout.Run(0, 0, B, Lq, Lk)] and parts.small is None
