"""The cpu backend at any score size: random shapes, masks and score bounds ``|scale| max|q| max|k|`` drawn
from 1 to 4096, around 256 and past it (``harness.tables.sharp_cases``). Training calls pass Gate A on every
tensor and Gate B (within 2x / 3x of eager attention in fp32) on o, lse, dq, dk and dv, as an RMS over
enough rows. Inference calls (no gradient) are held to Gate A in the matrix, test_varlen_gate_a.py."""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from sinkattn.backends import cpu_tiles
from sinkattn.testing import cases, precision, verify
from harness import tables
from conftest import describe

GATE_B = ("o", "lse", "dq", "dk", "dv")
ROWS = 256
EPS = torch.finfo(torch.float32).eps


def _seeds(case) -> int:
    """Seeds whose errors Gate B takes together: enough for ``ROWS`` rows (query positions x heads), 4 to 64."""
    return min(64, max(4, -(-ROWS // max(1, case.HQ * sum(case.q_lens)))))


def _squares(actual, golden):
    finite = torch.isfinite(golden)
    return float(((actual.double() - golden)[finite] ** 2).sum()), int(finite.sum()), golden[finite]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tables.sharp_cases())
@example(case=cases.Case("L2", 2, 2, (1,), (28,), D=1, dtype=torch.float32, window_size=(7, -1), score_bound=200.0,
                         seed=311))   # a key of P = 0.56 whose dS is 1: an fp32 sum for its correction cost it 3 ulp
@example(case=cases.Case("L2", 1, 1, (3,), (6,), D=1, dtype=torch.float32, causal=False, score_bound=255.0,
                         seed=0))     # short rows (cpu_small's): two keys of opposite sign share the mass (seed 19)
def test_training_meets_gate_a_and_gate_b_at_any_score_size(case):
    """Gate A on every seed; Gate B's factors (2 on outputs, 3 on gradients, against eager attention in
    fp32) on the RMS error of several seeds of the drawn shape taken together, at least ``ROWS`` rows.
    Not on one draw's max error: over a handful of rows that is mostly luck (where two keys compete, the
    rounding of their two products decides, and eager attention's matmul adds them in another order;
    one draw in a thousand puts either side 3x behind the other)."""
    _meets_gates_over_seeds(case)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bound", [3.0, 255.0])
@pytest.mark.parametrize("HQ, G", [(1, 1), (4, 2)], ids=["mha1", "gqa"])
@pytest.mark.parametrize("lens", [((3,), (6,)), ((16,), (9,))], ids=["q3k6", "q16k9"])
def test_short_rows_with_one_dimension_meet_gate_b(lens, HQ, G, bound, causal):
    """Short sequences (``cpu_small``'s) of head dim 1: ``dQ`` is one sum over a few keys, where two keys of
    opposite sign sharing the mass leave the direct ``dS`` errors uncancelled; the identity on every row keeps
    it with eager's."""
    _meets_gates_over_seeds(cases.Case("L2", HQ, G, *lens, D=1, dtype=torch.float32, causal=causal,
                                       score_bound=bound, seed=0))


def _meets_gates_over_seeds(case):
    ours, eager_sq, scale, count = {}, {}, {}, {}
    for seed in range(case.seed, case.seed + _seeds(case)):
        one = dataclasses.replace(case, seed=seed)
        x = one.make()
        actual, golden, eager = verify.outputs(one, x, "cpu"), verify.golden(one, x), verify.eager_outputs(one, x)
        for name, a, g, e in zip(verify.TENSORS, actual, golden, eager):
            report = precision.gate_a(name, a, g, torch.float32)
            assert report.gate_a, (one.name, report.as_dict())
            if name in GATE_B:
                sq, n, finite = _squares(a, g)
                ours[name] = ours.get(name, 0.0) + sq
                eager_sq[name] = eager_sq.get(name, 0.0) + _squares(e, g)[0]
                scale[name] = scale.get(name, 0.0) + float((finite * EPS).square().sum())
                count[name] = count.get(name, 0) + n
    for name in ours:
        if count[name]:
            rms, base, rounding = (math.sqrt(t[name] / count[name]) for t in (ours, eager_sq, scale))
            factor = precision.GATE_B_FACTOR["output" if name in ("o", "lse") else "gradient"]
            assert rms <= factor * (base + rounding), (case.name, name, rms, base)


@pytest.mark.parametrize("bound", [100.0, 200.0, 250.0])
@pytest.mark.parametrize("Lq,Lk,D", [(139, 169, 2), (64, 256, 2), (139, 169, 32), (169, 169, 2), (169, 139, 2)])
def test_causal_rows_with_more_keys_than_queries(Lq, Lk, D, bound):
    """The shapes where a merge of partial results over the keys rounded ``lse`` at ``ulp(|lse|)`` and lost
    dq's precision (one causal sequence, Lq < Lk, sharp scores below 256), and their Lq >= Lk neighbours:
    four seeds each, Gate A and Gate B on every seed."""
    for seed in range(4):
        case = cases.Case("L2", 2, 2, (Lq,), (Lk,), D=D, dtype=torch.float32, score_bound=bound, seed=seed)
        result = verify.run_case(case, "cpu", gate_b=True)
        assert result.passed, describe(result)
        assert all(r.gate_b for r in result.reports if r.name in GATE_B), describe(result)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize("Lq,Lk,causal", [(17, 17, False), (17, 17, True), (24, 3, True), (17, 5, False)])
def test_row_blocks_that_cannot_keep_their_products(monkeypatch, Lq, Lk, causal):
    """A row block over more keys than ``KEPT_ELEMENTS`` allows computes ``P``/``dP`` twice and adds the dominant
    key's correction after the products: the same gates as the kept path, on one-hot rows (D=1, sharp scores;
    without the correction these shapes miss Gate B on dq or dk)."""
    monkeypatch.setattr(cpu_tiles, "KEPT_ELEMENTS", 0)
    _meets_gates_over_seeds(cases.Case("L2", 2, 2, (Lq,), (Lk,), D=1, dtype=torch.float32, causal=causal,
                                       window_size=(-1, 0 if causal else -1), score_bound=255.0, seed=0))
