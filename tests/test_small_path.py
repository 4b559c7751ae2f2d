"""The cpu backend's batched path for packed short sequences (``cpu_small``): what it promises beyond the
values (those pass Gate A in the matrix, test_varlen_gate_a.py: tables ``short``, ``short-edges`` and
random batches with every sequence it can hold): a short sequence's result does not depend on the rest
of the call, and empty sequences cost no work. Each test runs on the PyTorch-op paths (where ``cpu_small``
takes these sequences) and through the compiled kernel (``cpu_path``)."""

import pytest
import torch

import sinkattn
from sinkattn.backends import cpu, cpu_small, layout
from harness import tables

pytestmark = pytest.mark.usefixtures("cpu_path")


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


def test_keys_of_sequences_without_queries_are_listed_apart():
    """Sequences without queries but with keys (``harness.tables.SHORT_EDGES``' first batch, which the matrix
    holds to Gate A): no row sees their keys (their gradients are 0), listed as ``keys_only``."""
    x = tables.SHORT_EDGES[0].make()
    assert cpu.split(x.cu_seqlens_q, x.cu_seqlens_k, 4).keys_only.Lk.tolist() == [6, 4]


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
