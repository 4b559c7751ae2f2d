"""The precision standard of docs/contract.md §4.

Gate A (dual gate, per tensor, thresholds by the dtype of the tensor under test):

    special = ~isfinite(golden): the NaN / inf pattern of actual must match there
    err     = |actual - golden| on finite golden entries
    ratio   = mean(err <= atol + rtol * |golden|)
    pass    = ratio >= required_ratio and max(err) <= max_abs_limit   (NaN err fails)

Gate B (the flash-attn rule): ``max err <= factor * max err of eager attention in
the input dtype + rounding``, factor 2 for outputs and 3 for gradients, with
``rounding = eps(dtype) * max|golden|``, one unit of the tensor's own rounding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["Tolerance", "TOLERANCES", "Report", "gate_a", "check", "spacing_waiver"]


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    max_abs_limit: float
    required_ratio: float


TOLERANCES = {
    torch.float16: Tolerance(2.0**-14, 2.0**-9, 0.1, 0.99),
    torch.bfloat16: Tolerance(2.0**-10, 2.0**-6, 1.0, 0.99),
    torch.float32: Tolerance(2.0**-16, 2.0**-10, 1e-2, 0.99),
}

GATE_B_FACTOR = {"output": 2.0, "gradient": 3.0}


@dataclass
class Report:
    """Errors of one tensor against the golden, and the verdict of each gate."""

    name: str
    dtype: str
    ratio: float                  # fraction of finite entries within atol + rtol |golden|
    max_abs_err: float            # over finite golden entries (nan if any error is NaN)
    rms_rel_err: float            # ||actual - golden||_2 / ||golden||_2 on finite entries
    special_ok: bool              # NaN / inf pattern matches at non-finite golden entries
    gate_a: bool
    baseline_max_abs_err: float | None = None
    gate_b_factor: float | None = None   # max_abs_err / (max eager err + rounding); <= factor passes
    gate_b: bool | None = None
    waiver: str | None = None     # why Gate A's max_abs_limit cannot apply, and what replaced it
    waiver_ok: bool | None = None

    @property
    def accepted(self) -> bool:
        """Gate A passed, or the waived check did."""
        return self.gate_a or (self.waiver is not None and bool(self.waiver_ok))

    def as_dict(self) -> dict:
        return asdict(self)


def _tolerance(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        raise TypeError(f"no precision standard for dtype {dtype}; expected one of {list(TOLERANCES)}")
    return TOLERANCES[dtype]


def _errors(actual: torch.Tensor, golden: torch.Tensor):
    a, g = actual.detach().double().cpu(), golden.detach().double().cpu()
    if a.shape != g.shape:
        raise ValueError(f"actual has shape {tuple(a.shape)}, golden has {tuple(g.shape)}")
    finite = torch.isfinite(g)
    special = ~finite
    special_ok = bool(torch.equal(torch.isnan(a[special]), torch.isnan(g[special]))
                      and torch.equal(a[special & ~torch.isnan(g)], g[special & ~torch.isnan(g)]))
    err = (a[finite] - g[finite]).abs()
    return a, g, finite, special_ok, err


def _max(err: torch.Tensor) -> float:
    if err.numel() == 0:
        return 0.0
    return math.nan if torch.isnan(err).any() else float(err.max())


def gate_a(name: str, actual: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype | None = None) -> Report:
    """Gate A for one tensor; ``dtype`` (default: actual's) picks the thresholds."""
    dtype = dtype or actual.dtype
    tol = _tolerance(dtype)
    a, g, finite, special_ok, err = _errors(actual, golden)
    gf = g[finite]
    within = err <= tol.atol + tol.rtol * gf.abs()          # NaN compares False
    ratio = float(within.double().mean()) if err.numel() else 1.0
    max_err = _max(err)
    norm = float(gf.norm())
    rms_rel = float((a[finite] - gf).norm()) / norm if norm > 0 else (0.0 if max_err == 0 else math.inf)
    passed = special_ok and ratio >= tol.required_ratio and not math.isnan(max_err) and max_err <= tol.max_abs_limit
    return Report(name, str(dtype).removeprefix("torch."), ratio, max_err, rms_rel, special_ok, passed)


def spacing_waiver(report: Report, golden: torch.Tensor, fp32_baseline: torch.Tensor) -> Report:
    """For a tensor whose golden is so large that fp32 itself cannot come within ``max_abs_limit``:
    hold it instead to ``2 * (max error of eager attention run in fp32) + 2 fp32 spacings at
    max|golden|``. The NaN/inf pattern and the ratio still have to pass."""
    g = golden.detach().double()
    finite = torch.isfinite(g)
    top = float(g[finite].abs().max()) if finite.any() else 0.0
    spacing = torch.finfo(torch.float32).eps * top
    base = _max((fp32_baseline.detach().double() - g)[finite].abs())
    limit = 2 * base + 2 * spacing
    tol = _tolerance(torch.float32)
    report.waiver = (f"|golden| reaches {top:.3g} (fp32 spacing {spacing:.3g} > max_abs_limit "
                     f"{tol.max_abs_limit:g}); held to 2x fp32 eager error + 2 spacings = {limit:.3g}")
    report.waiver_ok = (report.special_ok and report.ratio >= tol.required_ratio
                        and report.max_abs_err <= limit)
    return report


def check(name: str, actual: torch.Tensor, golden: torch.Tensor, baseline: torch.Tensor | None = None,
          kind: str = "output", dtype: torch.dtype | None = None) -> Report:
    """Gate A, and Gate B when an eager ``baseline`` (same inputs, input dtype) is given.

    ``kind`` is ``"output"`` (factor 2) or ``"gradient"`` (factor 3).
    """
    report = gate_a(name, actual, golden, dtype)
    if baseline is not None:
        _, g, _, _, base_err = _errors(baseline, golden)
        base_max = _max(base_err)
        finite_g = g[torch.isfinite(g)]
        scale = float(finite_g.abs().max()) if finite_g.numel() else 0.0
        rounding = torch.finfo(dtype or actual.dtype).eps * scale
        bound = base_max + rounding if not math.isnan(base_max) else math.inf
        report.baseline_max_abs_err = base_max
        if bound > 0:
            report.gate_b_factor = report.max_abs_err / bound
        else:
            report.gate_b_factor = 0.0 if report.max_abs_err == 0 else math.inf
        report.gate_b = (not math.isnan(report.max_abs_err)) and report.gate_b_factor <= GATE_B_FACTOR[kind]
    return report
