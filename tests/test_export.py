"""torch.export of the public functions with dynamic token counts and a sliding window: the exported
program takes every valid batch, sequences shorter than the window included, and returns what the
same call returns in eager mode."""

import pytest
import torch
from torch.export import Dim, export

import sinkattn

pytestmark = pytest.mark.floor   # also run on the oldest supported torch (.ci/floor)

HQ, HKV, D = 4, 2, 16
WINDOW = (7, 0)


class Packed(torch.nn.Module):
    def forward(self, q, k, v, sinks, cu_seqlens, max_seqlen):
        return sinkattn.sink_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, sinks=sinks,
                                              causal=True, window_size=WINDOW)


class Dense(torch.nn.Module):
    def forward(self, q, k, v, sinks):
        return sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, window_size=WINDOW)


def _packed(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return (torch.randn(T, HQ, D, generator=g), torch.randn(T, HKV, D, generator=g),
            torch.randn(T, HKV, D, generator=g), torch.randn(HQ, generator=g), cu, max(lengths))


def _dense(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, HQ, D, generator=g), torch.randn(B, S, HKV, D, generator=g),
            torch.randn(B, S, HKV, D, generator=g), torch.randn(HQ, generator=g))


@pytest.fixture(scope="module")
def packed_program():
    auto = {0: Dim.AUTO}
    return export(Packed(), _packed([12, 28], 0), dynamic_shapes=(auto, auto, auto, None, auto, Dim.AUTO)).module()


@pytest.mark.parametrize("lengths", [[3, 5], [1, 0, 6, 2], [30, 2, 9], [8]], ids=str)
def test_packed_export_takes_sequences_shorter_than_the_window(packed_program, lengths):
    inputs = _packed(lengths, 1)
    assert torch.equal(packed_program(*inputs), Packed()(*inputs))


def test_dense_export_with_a_named_sequence_length():
    S = Dim("S")
    program = export(Dense(), _dense(2, 20, 0), dynamic_shapes=({1: S}, {1: S}, {1: S}, None)).module()
    for seq in (5, 1, 33):                                       # shorter than the window, one token, longer
        inputs = _dense(2, seq, seq)
        assert torch.equal(program(*inputs), Dense()(*inputs)), f"S={seq}"
