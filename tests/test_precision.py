"""The gates of docs/contract.md §4 decide as written."""

import math

import torch

from sinkattn.testing import precision


def test_exact_passes_and_reports_zero_error():
    g = torch.randn(100, dtype=torch.float64)
    r = precision.gate_a("o", g.half(), g)
    assert r.gate_a and r.ratio == 1.0


def test_ratio_below_required_fails():
    g = torch.ones(1000, dtype=torch.float64)
    a = g.clone()
    a[:11] += 0.01                     # 1.1% of entries beyond atol + rtol (fp16: 6.1e-5 + 1.95e-3)
    assert not precision.gate_a("o", a.half(), g).gate_a
    a = g.clone()
    a[:9] += 0.01                      # 0.9%: passes the ratio, and 0.01 < max_abs_limit 0.1
    assert precision.gate_a("o", a.half(), g).gate_a


def test_max_abs_limit_fails_even_with_good_ratio():
    g = torch.zeros(1000, dtype=torch.float64)
    a = g.clone()
    a[0] = 0.2
    r = precision.gate_a("o", a.half(), g)
    assert r.ratio >= 0.99 and not r.gate_a


def test_nan_where_golden_is_finite_fails():
    g = torch.zeros(1000, dtype=torch.float64)
    a = g.clone()
    a[0] = math.nan
    r = precision.gate_a("o", a.float(), g)
    assert not r.gate_a and math.isnan(r.max_abs_err)


def test_special_pattern_must_match():
    g = torch.tensor([1.0, math.inf, math.nan], dtype=torch.float64)
    assert precision.gate_a("lse", torch.tensor([1.0, math.inf, math.nan]), g).gate_a
    assert not precision.gate_a("lse", torch.tensor([1.0, -math.inf, math.nan]), g).gate_a
    assert not precision.gate_a("lse", torch.tensor([1.0, math.inf, 0.0]), g).gate_a


def test_thresholds_follow_dtype():
    g = torch.ones(100, dtype=torch.float64)
    a = g + 0.005                      # within bf16's rtol 2^-6, outside fp16's 2^-9
    assert precision.gate_a("o", a.to(torch.bfloat16), g, torch.bfloat16).gate_a
    assert not precision.gate_a("o", a, g, torch.float16).gate_a


def test_gate_b_factor_against_baseline():
    g = torch.zeros(100, dtype=torch.float64)
    base = g + 0.01
    r = precision.check("o", (g + 0.015).float(), g, base.float(), kind="output")
    assert r.gate_b and 1.4 < r.gate_b_factor < 1.6
    r = precision.check("o", (g + 0.025).float(), g, base.float(), kind="output")
    assert not r.gate_b
    r = precision.check("dq", (g + 0.025).float(), g, base.float(), kind="gradient")
    assert r.gate_b
