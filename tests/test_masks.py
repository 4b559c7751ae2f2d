"""The mask rule against docs/contract.md §1 written out directly, and the block helpers against it."""

import itertools

import pytest
import torch

from sinkattn import masks


def _design_visible(i, j, Lq, Lk, causal, left, right):
    offset = Lk - Lq
    if causal:
        right = 0
    return ((not causal or j <= i + offset)
            and (left < 0 or j >= i + offset - left)
            and (right < 0 or j <= i + offset + right))


SHAPES = [(7, 7), (5, 11), (11, 5), (1, 9), (9, 1), (0, 4), (4, 0)]
WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (2, 3), (10, 0)]


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_matches_design(Lq, Lk, causal, window):
    left, right = masks.Window.of(causal, window)
    got = masks.visible(torch.arange(Lq), torch.arange(Lk), Lq, Lk, left, right)
    want = torch.tensor([[_design_visible(i, j, Lq, Lk, causal, *window) for j in range(Lk)]
                         for i in range(Lq)], dtype=torch.bool).reshape(Lq, Lk)
    assert torch.equal(got, want)


def test_window_folds_on_lengths_only_when_given():
    """Without lengths (what traced code builds) only sides past any tensor's length fold; with
    concrete lengths (what the ops fold with), every side reaching past the keys folds."""
    W = masks.Window
    assert W.of(False, (2**62, 2**70)) == (-1, -1)
    assert W.of(False, (2**62 - 1, 7)) == (2**62 - 1, 7)
    assert W.of(True, (7, 5)) == (7, 0)
    assert W.of(True, (7, 5)).folded(5, 5) == (-1, 0)
    assert W.of(False, (3, 4)).folded(5, 9) == (3, -1)
    assert W(-1, -1).unbounded and not W(-1, 0).unbounded


@pytest.mark.parametrize("Lq,Lk", [(13, 13), (9, 17), (17, 9)])
@pytest.mark.parametrize("window", WINDOWS)
def test_block_ranges_cover_exactly_the_visible_keys(Lq, Lk, window):
    left, right = window
    vis = masks.visible(torch.arange(Lq), torch.arange(Lk), Lq, Lk, left, right)
    for r0, r1 in itertools.combinations(range(Lq + 1), 2):
        k0, k1 = masks.block_key_range(r0, r1, Lq, Lk, left, right)
        cols = vis[r0:r1].any(0).nonzero().flatten()
        if cols.numel() == 0:
            assert k1 <= k0
            continue
        assert (k0, k1) == (int(cols.min()), int(cols.max()) + 1)
        full = masks.block_fully_visible(r0, r1, k0, k1, Lq, Lk, left, right)
        assert full == bool(vis[r0:r1, k0:k1].all())


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (3, 0), (5, -1), (-1, 4), (2, 3), (9, 1), (0, 6)])
def test_sub_block_reproduces_the_tile_of_the_full_mask(window):
    S = 24
    left, right = masks.Window(*window).folded(S, S)
    full = masks.visible(torch.arange(S), torch.arange(S), S, S, left, right)
    tiles = [(0, 4), (4, 4), (8, 8), (16, 8), (3, 5), (0, 24), (20, 4), (5, 1)]
    for (a, m), (b, n) in itertools.product(tiles, tiles):
        want = full[a:a + m, b:b + n]
        got = masks.sub_block(a, m, b, n, left, right)
        if got is None:
            assert not want.any(), (a, m, b, n)
            continue
        rows, keys, l2, r2 = got
        assert l2 >= -1 and r2 >= -1
        tile = torch.zeros(m, n, dtype=torch.bool)
        tile[:rows, :keys] = masks.visible(torch.arange(rows), torch.arange(keys), rows, keys, l2, r2)
        assert torch.equal(tile, want), (a, m, b, n, got)
