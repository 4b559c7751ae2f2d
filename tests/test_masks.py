"""The mask rule (``sinkattn.masks.Window``) against docs/contract.md §1 written out directly, and the
block helpers against it: properties over windows (either side unbounded, zero, bounded, past every
key), lengths (``Lq < Lk``, ``Lq > Lk``, empty) and ``causal``."""

import itertools
import sys

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sinkattn.masks import BEYOND_ANY_LENGTH, Window


def _design_visible(i, j, Lq, Lk, causal, left, right):
    """§1's ``visible(i, j)``, literally (``-1`` = unbounded, ``causal`` apart from ``right``)."""
    offset = Lk - Lq
    return ((not causal or j <= i + offset)
            and (left < 0 or j >= i + offset - left)
            and (right < 0 or j <= i + offset + right))


def _design_matrix(Lq, Lk, causal, left, right) -> torch.Tensor:
    return torch.tensor([[_design_visible(i, j, Lq, Lk, causal, left, right) for j in range(Lk)]
                         for i in range(Lq)], dtype=torch.bool).reshape(Lq, Lk)


def _matrix(window: Window, Lq: int, Lk: int) -> torch.Tensor:
    return window.visible(torch.arange(Lq), torch.arange(Lk), Lq, Lk)


LENGTHS = st.integers(0, 24)
SIDES = st.one_of(st.just(-1), st.integers(0, 30), st.sampled_from([BEYOND_ANY_LENGTH, 2**63, sys.maxsize]))
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True)


@PROPERTY
@given(Lq=LENGTHS, Lk=LENGTHS, causal=st.booleans(), left=SIDES, right=SIDES)
@example(Lq=5, Lk=11, causal=True, left=3, right=-1)      # Lq < Lk
@example(Lq=11, Lk=5, causal=True, left=-1, right=-1)     # Lq > Lk: the first rows see nothing
@example(Lq=11, Lk=5, causal=False, left=2, right=3)
@example(Lq=0, Lk=4, causal=False, left=-1, right=-1)
@example(Lq=4, Lk=0, causal=True, left=0, right=0)
def test_visible_is_the_design_rule_folded_or_not(Lq, Lk, causal, left, right):
    """``Window.of(causal, (left, right))`` sees what §1 says, and so does the window folded on the
    lengths (or on any upper bounds of them); ``key_bounds`` gives the same rows on ints as on tensors."""
    want = _design_matrix(Lq, Lk, causal, left, right)
    window = Window.of(causal, (left, right))
    assert torch.equal(_matrix(window, Lq, Lk), want)
    for bound_q, bound_k in ((Lq, Lk), (Lq + 3, Lk + 7)):
        folded = window.folded(bound_q, bound_k)
        assert folded.left >= -1 and folded.right >= -1
        assert torch.equal(_matrix(folded, Lq, Lk), want), folded
    lo, hi = window.key_bounds(torch.arange(Lq), Lq, Lk)
    assert list(zip(lo.tolist(), hi.tolist())) == [window.key_bounds(i, Lq, Lk) for i in range(Lq)]


@PROPERTY
@given(Lq=LENGTHS, Lk=LENGTHS, left=SIDES, right=SIDES)
@example(Lq=5, Lk=11, left=3, right=0)
@example(Lq=11, Lk=5, left=-1, right=0)
def test_row_bounds_are_the_rows_that_see_each_key(Lq, Lk, left, right):
    window = Window.of(False, (left, right))
    vis = _matrix(window, Lq, Lk)
    for j in range(Lk):
        i_lo, i_hi = window.row_bounds(j, Lq, Lk)
        want = torch.zeros(Lq, dtype=torch.bool)
        want[max(i_lo, 0):max(i_hi, 0)] = True
        assert torch.equal(vis[:, j], want), j


@PROPERTY
@given(Lq=st.integers(1, 17), Lk=st.integers(1, 17), left=SIDES, right=SIDES)
@example(Lq=9, Lk=17, left=-1, right=0)
@example(Lq=17, Lk=9, left=-1, right=0)
def test_block_ranges_cover_exactly_the_visible_keys(Lq, Lk, left, right):
    window = Window.of(False, (left, right))
    vis = _matrix(window, Lq, Lk)
    for r0, r1 in itertools.combinations(range(Lq + 1), 2):
        k0, k1 = window.block_key_range(r0, r1, Lq, Lk)
        cols = vis[r0:r1].any(0).nonzero().flatten()
        if cols.numel() == 0:
            assert k1 <= k0
            continue
        assert (k0, k1) == (int(cols.min()), int(cols.max()) + 1)
        full = window.block_fully_visible(r0, r1, k0, k1, Lq, Lk)
        assert full == bool(vis[r0:r1, k0:k1].all())


@PROPERTY
@given(Lq=LENGTHS, Lk=LENGTHS, left=SIDES, right=SIDES, block_rows=st.integers(1, 8))
def test_row_blocks_are_the_blocks_that_see_a_key(Lq, Lk, left, right, block_rows):
    window = Window.of(False, (left, right))
    vis = _matrix(window, Lq, Lk)
    want = []
    for r0 in range(0, Lq, block_rows):
        r1 = min(r0 + block_rows, Lq)
        cols = vis[r0:r1].any(0).nonzero().flatten()
        if cols.numel():
            k0, k1 = int(cols.min()), int(cols.max()) + 1
            want.append((r0, r1, k0, k1, bool(vis[r0:r1, k0:k1].all())))
    assert list(window.row_blocks(Lq, Lk, block_rows)) == want


@PROPERTY
@given(Lq=st.integers(1, 24), Lk=st.integers(1, 24), left=SIDES, right=SIDES, data=st.data())
def test_block_visible_is_the_block_of_the_full_mask(Lq, Lk, left, right, data):
    """Inside a sequence (``0 <= k0``, ``k0 + C <= Lk``) a block's mask depends on ``(R, C, shift)`` only."""
    window = Window.of(False, (left, right))
    r0 = data.draw(st.integers(0, Lq - 1))
    r1 = data.draw(st.integers(r0 + 1, Lq))
    k0 = data.draw(st.integers(0, Lk - 1))
    k1 = data.draw(st.integers(k0 + 1, Lk))
    got = window.block_visible(r1 - r0, k1 - k0, r0 + (Lk - Lq) - k0)
    assert torch.equal(got, _matrix(window, Lq, Lk)[r0:r1, k0:k1])


def test_window_folds_on_lengths_only_when_given():
    """Without lengths (what traced code builds) only sides past any tensor's length fold; with
    concrete lengths (what the ops fold with), every side reaching past the keys folds."""
    W = Window
    assert W.of(False, (2**62, 2**70)) == (-1, -1)
    assert W.of(False, (2**62 - 1, 7)) == (2**62 - 1, 7)
    assert W.of(True, (7, 5)) == (7, 0)
    assert W.of(True, (7, 5)).folded(5, 5) == (-1, 0)
    assert W.of(False, (3, 4)).folded(5, 9) == (3, -1)
    assert W(-1, -1).unbounded and not W(-1, 0).unbounded


@PROPERTY
@given(left=st.one_of(st.just(-1), st.integers(0, 30)), right=st.one_of(st.just(-1), st.integers(0, 30)),
       a=st.integers(0, 23), m=st.integers(0, 24), b=st.integers(0, 23), n=st.integers(0, 24))
@example(left=-1, right=0, a=8, m=8, b=0, n=8)         # a tile below the diagonal, whole
@example(left=3, right=0, a=0, m=4, b=16, n=8)         # a tile no row sees
@example(left=-1, right=0, a=3, m=5, b=4, n=4)         # a band wholly above the tile's diagonal
def test_sub_block_reproduces_the_tile_of_the_full_mask(left, right, a, m, b, n):
    S = 24
    m, n = min(m, S - a), min(n, S - b)
    window = Window(left, right).folded(S, S)
    want = _matrix(window, S, S)[a:a + m, b:b + n]
    got = window.sub_block(a, m, b, n)
    if got is None:
        assert not want.any(), (a, m, b, n)
        return
    rows, keys, tile_window = got
    assert isinstance(tile_window, Window) and tile_window.left >= -1 and tile_window.right >= -1
    assert tile_window == tile_window.folded(rows, keys)
    tile = torch.zeros(m, n, dtype=torch.bool)
    tile[:rows, :keys] = _matrix(tile_window, rows, keys)
    assert torch.equal(tile, want), (a, m, b, n, got)
