"""What the thread count may change (docs/contract.md §3, "Determinism"): nothing of ``dsinks``, whose
sum over every row is blocked in one fixed order, and, on the CPUs these tests ran on, nothing at all
for 1 and 2 threads; the matrix products' own split between threads is the library's (MKL's)."""

import pytest
import torch

import sinkattn
from sinkattn import sink


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_dsinks_is_the_same_sum_for_any_thread_count(threads):
    """One head, 100k rows: a plain sum splits between threads (its rounding differs); the blocked one not."""
    g = torch.Generator().manual_seed(0)
    stats = sink.Stats(torch.randn(1, 100_000, generator=g), torch.rand(1, 100_000, generator=g))
    delta, sinks = torch.randn(1, 100_000, generator=g), torch.randn(1, generator=g)
    got = []
    for count in (1, 2, 4):
        threads(count)
        got.append(sink.dsinks_from(sinks, sink.sink_mass(sinks, stats), delta))
    assert all(torch.equal(got[0], x) for x in got[1:])


def _call(D, packed, dtype):
    g = torch.Generator().manual_seed(D)
    lens = [300, 17, 90, 90, 200] if packed else [300]
    T, HQ, HKV = sum(lens), 8, 2
    q = torch.randn(T, HQ, D, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(T, HKV, D, generator=g).to(dtype).requires_grad_() for _ in range(2))
    sinks = torch.randn(HQ, generator=g).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), sinks=sinks, causal=True,
                                              window_size=(63, 0) if packed else (-1, -1), return_lse=True)
    grads = torch.randn(out.shape, generator=g).to(dtype), torch.randn(lse.shape, generator=g)
    torch.autograd.backward([out, lse], list(grads))
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad, sinks.grad]


@pytest.mark.parametrize("D", [64, 72, 80, 100, 128])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_one_and_two_threads_give_the_same_bits(D, packed, threads):
    got = []
    for count in (1, 2):
        threads(count)
        got.append(_call(D, packed, torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(*got))
