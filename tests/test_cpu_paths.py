"""Both CPU paths (fused kernel and slab) on their own, and the tiling plan's guarantees."""

import pytest
import torch

from sinkattn import masks
from sinkattn.testing import cases, verify
from sinkattn.backends import cpu, cpu_fused
from conftest import describe


@pytest.fixture(params=["fused", "slab"])
def forced_path(request, monkeypatch):
    path = cpu.cpu_slab if request.param == "slab" else cpu.cpu_fused
    monkeypatch.setattr(cpu, "path_for", lambda q, k, scale: path)
    return request.param


PATH_CASES = [c for c in cases.cases("L2") if max(c.q_lens + c.k_lens) <= 200] + [
    c for c in cases.cases("boundary") if not c.qk_uniform and c.input_affine[0] < 10]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in PATH_CASES])
def test_each_path_passes_gate_a(case, forced_path):
    result = verify.run_case(case, "cpu")
    assert result.passed, describe(result)


def test_large_scores_take_the_slab_path():
    q = torch.randn(10, 2, 64) * 10
    assert cpu.path_for(q, q, 0.125) is cpu.cpu_slab
    assert cpu.path_for(q / 10, q / 10, 0.125) is cpu.cpu_fused


@pytest.mark.parametrize("Lq,Lk", [(300, 300), (100, 250), (250, 100), (64, 1)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (63, 0), (7, 20), (-1, 9), (30, -1)])
def test_plan_covers_visible_pairs_once_and_skips_invisible_blocks(Lq, Lk, window):
    left, right = window
    vis = masks.visible(torch.arange(Lq), torch.arange(Lk), Lq, Lk, left, right)
    covered = torch.zeros(Lq, Lk, dtype=torch.int32)
    computed = 0
    for p in cpu_fused.plan(Lq, Lk, left, right):
        for r0, r1, k0, k1 in p.blocks():
            area = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool)
            if p.causal:
                area = torch.ones_like(area).tril()
            if p.mask is not None:
                area = p.mask == 0
            covered[r0:r1, k0:k1] += area.int()
            computed += (r1 - r0) * (k1 - k0)
    assert torch.equal(covered, vis.int())   # every visible pair once, nothing else
    # work tracks the visible pairs: each block computes at most its rows x (visible span + block)
    if left >= 0 and right >= 0:
        assert computed <= Lq * (left + right + 1 + 2 * cpu_fused.BLOCK_M)


@pytest.mark.parametrize("window", [(100, 0), (40, 40), (-1, 20), (150, -1)])
@pytest.mark.parametrize("B", [1, 2])
def test_batched_runs_of_blocks_match_the_golden(window, B):
    """Long windowed sequences take the batched path (runs of same-geometry blocks, overlapping key
    windows); dense B > 1 goes item by item inside a run."""
    case = cases.Case("L2", 4, 2, (700,) * B, (700,) * B, D=32, dtype=torch.float32, causal=False,
                      window_size=window)
    left, right = window
    bounded = left >= 0 and right >= 0          # only a band repeats its geometry block after block
    assert any(p.count > 1 for p in cpu_fused.plan(700, 700, left, right)) == bounded
    result = verify.run_case(case, "cpu")
    assert result.passed, describe(result)
