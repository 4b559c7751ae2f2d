"""Run one level case on a backend against the float64 golden: the engine of the tests and the CLI.

Outputs and gradients come from the public API with NaN-poisoned result
buffers; the golden comes from ``sinkattn.reference`` on the same
low-precision inputs; each tensor gets a ``precision.Report``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import defaults, reference
from ..backends import buffers
from ..interface import sink_attn_varlen_func
from ..masks import Window
from . import eager, precision
from .cases import Case, Inputs

__all__ = ["CaseResult", "run_case", "outputs", "inference", "inference_reports", "eager_outputs", "golden", "TENSORS"]

TENSORS = ("o", "lse", "dq", "dk", "dv", "dsinks")


@dataclass
class CaseResult:
    case: Case
    backend: str
    reports: list[precision.Report] = field(default_factory=list)
    deterministic: bool | None = None     # None: not checked
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.deterministic is not False and all(r.accepted for r in self.reports)


def _leaves(x: Inputs) -> list[torch.Tensor]:
    return [t for t in (x.q, x.k, x.v, x.sinks) if t is not None]


def _backward(out, lse, x: Inputs, leaves):
    outputs, grads = [out], [x.do]
    if x.dlse is not None:
        outputs.append(lse)
        grads.append(x.dlse)
    return torch.autograd.grad(outputs, leaves, grads)


def outputs(case: Case, x: Inputs, backend: str):
    """``[o, lse, dq, dk, dv, (dsinks)]`` from the public API on ``backend``, result buffers NaN-poisoned."""
    leaves = [t.detach().requires_grad_() for t in _leaves(x)]
    q, k, v = leaves[:3]
    sinks = leaves[3] if x.sinks is not None else None
    with buffers.poisoned():
        out, lse = sink_attn_varlen_func(q, k, v, x.cu_seqlens_q, x.cu_seqlens_k, x.max_seqlen_q, x.max_seqlen_k,
                                         sinks=sinks, causal=case.causal, window_size=case.window_size,
                                         return_lse=True, backend=backend)
        grads = _backward(out, lse, x, leaves)
    return [out.detach(), lse.detach(), *grads]


def inference(case: Case, x: Inputs, backend: str = "cpu"):
    """``(o, lse)`` of an inference call (no gradient) on ``backend``, result buffers NaN-poisoned."""
    with torch.no_grad(), buffers.poisoned():
        return sink_attn_varlen_func(x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.max_seqlen_q, x.max_seqlen_k,
                                     sinks=x.sinks, causal=case.causal, window_size=case.window_size,
                                     return_lse=True, backend=backend)


def inference_reports(case: Case, backend: str = "cpu", x: Inputs | None = None,
                      results: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[precision.Report]:
    """Gate A reports of ``o`` and ``lse`` of an inference call (``inference``) against the golden: of the
    call on ``x`` (the case's inputs by default), or of its ``results`` ``(o, lse)`` when the caller made it."""
    x = case.make() if x is None else x
    out, lse = inference(case, x, backend) if results is None else results
    gold = golden(case, x)
    return [precision.gate_a("o", out, gold[0]), precision.gate_a("lse", lse, gold[1], torch.float32)]


def eager_outputs(case: Case, x: Inputs):
    """``[o, lse, dq, dk, dv, (dsinks)]`` from eager attention (``testing.eager``) in the inputs' dtype."""
    leaves = [t.detach().requires_grad_() for t in _leaves(x)]
    q, k, v = leaves[:3]
    sinks = leaves[3] if x.sinks is not None else None
    out, lse = eager.sink_attention_varlen(q, k, v, x.cu_seqlens_q, x.cu_seqlens_k, sinks,
                                           causal=case.causal, window_size=case.window_size)
    return [out.detach(), lse.detach(), *_backward(out, lse, x, leaves)]


def _as_fp32(x: Inputs) -> Inputs:
    def up(t):
        return None if t is None else t.float()
    return Inputs(up(x.q), up(x.k), up(x.v), up(x.sinks), x.cu_seqlens_q, x.cu_seqlens_k,
                  x.max_seqlen_q, x.max_seqlen_k, up(x.do), x.dlse)


def golden(case: Case, x: Inputs):
    """``[o, lse, dq, dk, dv, (dsinks)]`` in float64 from the reference."""
    window = Window.of(case.causal, case.window_size)
    scale = defaults.softmax_scale(case.D)
    args = (x.q, x.k, x.v, x.sinks, x.cu_seqlens_q, x.cu_seqlens_k, scale, window)
    o, lse = reference.forward(*args)
    dq, dk, dv, dsinks = reference.backward(x.do, x.dlse, *args)
    return [o, lse, dq, dk, dv] + ([dsinks] if x.sinks is not None else [])


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.itemsize == 2:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def run_case(case: Case, backend: str = "auto", gate_b: bool = False, repeats: int = 1,
             device: str = "cpu") -> CaseResult:
    """Gate A (and Gate B when ``gate_b``) for every tensor; determinism when ``repeats > 1``."""
    result = CaseResult(case, backend)
    x = case.make(device)
    try:
        actual = outputs(case, x, backend)
        if repeats > 1:
            result.deterministic = all(
                all(_bitwise_equal(a, b) for a, b in zip(actual, outputs(case, x, backend)))
                for _ in range(repeats - 1))
    except (NotImplementedError, RuntimeError, ValueError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    gold = golden(case, x)
    base = eager_outputs(case, x) if gate_b else [None] * len(gold)
    base32 = eager_outputs(case, _as_fp32(x)) if case.spacing_limited else None
    for i, (name, a, g) in enumerate(zip(TENSORS, actual, gold)):
        dtype = torch.float32 if name == "lse" else a.dtype
        kind = "output" if i < 2 else "gradient"
        report = precision.check(name, a, g, base[i], kind=kind, dtype=dtype)
        if name in case.spacing_limited:
            precision.spacing_waiver(report, g, base32[i])
        result.reports.append(report)
    return result
