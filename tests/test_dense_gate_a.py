"""Gate A (docs/contract.md §4) on the dense entry point, ``sink_attn_func``: the dense table
(``harness.tables.DENSE``: decoding, speculative, prefill, full, windows, sharp scores, a value head dim of
its own) x layout x mode on the ``cpu`` backend, against the float64 golden of the same inputs packed
(``verify.golden``), result buffers NaN-poisoned. The packed entry point's matrix: test_varlen_gate_a.py.

Layouts: ``tokens-first`` (``[B, S, H, D]`` contiguous), ``heads-first`` (Hugging Face's cache layout
``[B, H, S, D]`` handed over transposed). Modes: ``inference`` (no gradient: a dense call the backend takes
as it is, ``forward_dense``: the compiled kernel for a few queries, else PyTorch's fused kernel, else the
packed paths), ``training`` (the packed paths, forward and backward: o, lse, dq, dk, dv, dsinks). Sinks
are fp32 whatever the inputs' dtype, as a model's parameter.
"""

from __future__ import annotations

import pytest
import torch

import sinkattn
from sinkattn.backends import buffers
from sinkattn.testing import cases, precision, verify
from harness import tables

LAYOUTS = ["tokens-first", "heads-first"]
MODES = ["training", "inference"]


def _id(case: cases.Case) -> str:
    B, Sq, Sk = len(case.q_lens), case.q_lens[0], case.k_lens[0]
    dims = f"d{case.D}" + ("" if case.Dv is None else f"-dv{case.Dv}")
    return f"{case.note}-b{B}-q{Sq}-k{Sk}-{dims}-{str(case.dtype).removeprefix('torch.')}"


def _dense(x: torch.Tensor, B: int, layout: str) -> torch.Tensor:
    """Packed ``[B*S, H, D]`` as dense ``[B, S, H, D]``, in ``layout``."""
    x = x.view(B, -1, *x.shape[1:])
    return x.transpose(1, 2).contiguous().transpose(1, 2) if layout == "heads-first" else x


def _packed_lse(lse: torch.Tensor) -> torch.Tensor:
    """Dense ``lse [B, HQ, S]`` as packed ``[HQ, B*S]``."""
    return lse.transpose(0, 1).reshape(lse.shape[1], -1)


def outputs(case: cases.Case, x: cases.Inputs, layout: str, mode: str):
    """``[o, lse, (dq, dk, dv, dsinks)]`` of a dense call on ``x``'s tensors, packed, buffers NaN-poisoned."""
    B = len(case.q_lens)
    leaves = [_dense(t, B, layout).detach().requires_grad_(mode == "training") for t in (x.q, x.k, x.v)]
    sinks = x.sinks.detach().requires_grad_(mode == "training")
    options = dict(sinks=sinks, causal=case.causal, window_size=case.window_size, return_lse=True, backend="cpu")
    with buffers.poisoned(), torch.set_grad_enabled(mode == "training"):
        out, lse = sinkattn.sink_attn_func(*leaves, **options)
        assert out.shape == (B, case.q_lens[0], case.HQ, x.v.shape[-1]) and out.is_contiguous()
        assert lse.shape == (B, case.HQ, case.q_lens[0])
        results = [out.reshape(-1, *out.shape[2:]), _packed_lse(lse)]
        if mode == "training":
            seeds, grads = [_dense(x.do, B, layout)], [out]
            if x.dlse is not None:
                seeds.append(x.dlse.view(case.HQ, B, -1).transpose(0, 1))
                grads.append(lse)
            dq, dk, dv, dsinks = torch.autograd.grad(grads, [*leaves, sinks], seeds)
            results += [g.reshape(-1, *g.shape[2:]) for g in (dq, dk, dv)] + [dsinks]
    return [t.detach() for t in results]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [pytest.param(c, id=_id(c)) for c in tables.DENSE])
def test_gate_a(case, layout, mode):
    x = case.make()
    x.sinks = x.sinks.float()
    actual = outputs(case, x, layout, mode)
    golden = verify.golden(case, x)
    for name, a, g in zip(verify.TENSORS, actual, golden):
        report = precision.check(name, a, g, dtype=torch.float32 if name == "lse" else a.dtype)
        assert report.gate_a, (name, report.as_dict())
    assert len(actual) == (6 if mode == "training" else 2)
