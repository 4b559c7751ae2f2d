"""The CPU paths on their own: the tiles (every call that needs gradients) and the fused kernel (the
inference forward): which call takes which, and the tiling plans' guarantees. Their results pass Gate A
in the matrix (test_varlen_gate_a.py)."""

import itertools

import pytest
import torch

from sinkattn.masks import Window
from sinkattn.backends import cpu_fused, cpu_tiles
from sinkattn.testing import cases, verify
from harness import tables
from conftest import describe


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in tables.INFERENCE_LEVELS[:8]])
def test_inference_takes_the_fused_kernel_and_training_does_not(case, monkeypatch):
    """Where the calls go (their results pass Gate A in the matrix, test_varlen_gate_a.py)."""
    calls = []
    for module in (cpu_fused, cpu_tiles):
        def recorded(*a, _real=module.forward, _module=module, **kw):
            calls.append(_module)
            return _real(*a, **kw)
        monkeypatch.setattr(module, "forward", recorded)
    x = case.make()
    verify.inference(case, x)
    assert cpu_tiles not in calls
    calls.clear()
    verify.outputs(case, x, "cpu")
    assert cpu_fused not in calls


@pytest.mark.parametrize("Lq,Lk", [(300, 300), (100, 250), (250, 100), (64, 1)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (63, 0), (7, 20), (-1, 9), (30, -1)])
def test_fused_plan_covers_visible_pairs_once_and_skips_invisible_blocks(Lq, Lk, window):
    window = Window(*window)
    left, right = window
    vis = window.visible(torch.arange(Lq), torch.arange(Lk), Lq, Lk)
    covered = torch.zeros(Lq, Lk, dtype=torch.int32)
    rows = torch.zeros(Lq, dtype=torch.int32)
    computed = 0
    for p in cpu_fused.plan(Lq, Lk, window):
        for r0, r1, k0, k1 in p.blocks():
            area = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool)
            if p.causal:
                area = torch.ones_like(area).tril()
            if p.mask is not None:
                area = p.mask == 0
            covered[r0:r1, k0:k1] += area.int()
            rows[r0:r1] += 1
            computed += (r1 - r0) * (k1 - k0)
    assert torch.equal(covered, vis.int())   # every visible pair once, nothing else
    assert int(rows.max()) <= 1               # each row in one call: no partial results to merge
    if left >= 0 and right >= 0:              # work tracks the visible pairs
        assert computed <= Lq * (left + right + 1 + 2 * cpu_fused.BLOCK_M)


@pytest.mark.parametrize("Lq,Lk", [(300, 300), (100, 700), (700, 100), (64, 1), (1, 900)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (63, 0), (7, 20), (-1, 9), (300, -1)])
@pytest.mark.parametrize("n,HQ,G", [(1, 4, 2), (3, 16, 8)])
def test_tiles_cover_visible_pairs_once_with_exact_masks(Lq, Lk, window, n, HQ, G):
    """Each visible pair in exactly one tile; a tile's mask (None: all visible) is the mask rule on it,
    repeated for the stacked heads; work is bounded by the visible span plus a block and a chunk."""
    window = Window(*window)
    left, right = window
    vis = window.visible(torch.arange(Lq), torch.arange(Lk), Lq, Lk)
    covered = torch.zeros(Lq, Lk, dtype=torch.int32)
    computed = 0
    row_starts = []
    for r0, r1, chunks in cpu_tiles._tiles(n, HQ, G, Lq, Lk, window):
        row_starts.append(r0)
        assert r1 - r0 <= cpu_tiles.rows_per_block(n, HQ, Lk)
        for c0, c1, mask in chunks:
            assert c1 - c0 <= cpu_tiles.BN
            tile = vis[r0:r1, c0:c1]
            if mask is None:
                assert tile.all()
            else:
                assert torch.equal(mask.keep, tile.repeat(G, 1))
                assert torch.equal(mask.bias, torch.where(mask.keep, 0.0, float("-inf")))
            covered[r0:r1, c0:c1] += tile.int()
            computed += (r1 - r0) * (c1 - c0)
    assert row_starts == sorted(set(row_starts))
    assert torch.equal(covered, vis.int())
    if left >= 0 and right >= 0:
        R = cpu_tiles.rows_per_block(n, HQ, Lk)
        assert computed <= Lq * (left + right + 1 + R + cpu_tiles.BN)


def test_rows_per_block_keeps_a_tile_within_its_budget():
    for n, HQ, keys in itertools.product((1, 2, 8), (1, 8, 64), (1, 100, 4096)):
        R = cpu_tiles.rows_per_block(n, HQ, keys)
        assert 16 <= R <= 128 and R % 16 == 0
        assert R == 16 or n * HQ * R * min(keys, cpu_tiles.BN) <= cpu_tiles.TILE_ELEMENTS


@pytest.mark.parametrize("window", [(100, 0), (40, 40), (-1, 20), (150, -1)])
def test_fused_plan_batches_the_blocks_of_a_band(window):
    """Long windowed sequences (``harness.tables.LONG_WINDOW``, which the matrix holds to Gate A): the fused
    kernel's plan batches runs of same-geometry blocks, which only a band (a window bounded on both sides)
    repeats block after block."""
    left, right = window
    bounded = left >= 0 and right >= 0
    assert any(p.count > 1 for p in cpu_fused.plan(700, 700, Window(left, right))) == bounded


def test_reference_backend_matches_the_golden_through_the_protocol():
    case = cases.Case("L2", 4, 2, (30, 0, 17), (40, 5, 17), D=8, dtype=torch.float32, causal=True, lse_grad=True)
    result = verify.run_case(case, "reference")
    assert result.passed, describe(result)
    assert all(r.max_abs_err < 1e-6 for r in result.reports), describe(result)
