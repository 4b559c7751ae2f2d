"""Gate A (docs/contract.md §4) on the packed entry point, ``sink_attn_varlen_func``: each case table on
each path that takes it, training and inference, against the float64 golden, through ``verify`` (the
public API, result buffers NaN-poisoned). One matrix, ``table x path x mode``; ids read
``<table or levels>-<case>-<path>-<mode>``. The dense entry point's matrix: test_dense_gate_a.py.

Paths: ``cpu`` (the backend as a user gets it: the compiled kernel where it builds, PyTorch's fused kernel
for an inference call, ``cpu_small`` for short sequences); ``cpu-compiled`` / ``cpu-python``
(``SINKATTN_CPU_KERNEL``; a training call's recorded calls show the path taken); ``cpu-compiled-bf16``
(``SINKATTN_CPU_PRODUCTS=bf16``); ``-all-short`` (``cpu_small.SHORT_LENGTH`` raised: ``cpu_small`` takes
every sequence it can hold); ``triton`` (through its interpreter without a GPU). Modes: ``training``
(forward and backward: o, lse, dq, dk, dv, dsinks; ``xN``: N runs, bitwise equal), ``inference`` (no
gradient: o, lse). Tables: ``sinkattn.testing.cases`` (levels, random) and ``harness.tables``.

    table (xN: N runs)                    paths                              modes
    L0 (x3: determinism)                  cpu                                training
    L1, L2, boundary                      cpu                                training
    INFERENCE_LEVELS                      cpu                                inference
    levels at interpreter size (L0[:4] x3) triton                            training
    head-dims                             cpu                                both
    kernel (x2)                           cpu-compiled, cpu-python           training
    kernel-bf16 (x2)                      cpu-compiled-bf16                  training
    short (x2), short-edges               cpu-compiled, cpu-python           training
    random seeds 1, 3                     cpu-compiled/python-all-short      training
    small-calls (x2)                      cpu                                training
    long-window                           cpu                                both
    triton-shapes (512s x2)               triton                             training
    random: 32 seeds fp16, 12 bf16 and    triton                             training
      12 fp32 (seeds 0, 1 x2)
    random (hypothesis)                   cpu                                training
    sharp_cases (hypothesis)              cpu                                inference

A case that two tables hold on the same path and mode runs once, with all their level markers (L1's first
case is L0's first; at the Triton interpreter's size 20 of the 56 level cases are copies of others). Gate A checks that
stay beside what else they check: test_nonfinite.py (NaN / inf inputs), test_sink.py (keyless rows
take the sink), test_autocast.py (autocast's dtypes), test_score_sizes.py (Gate B), test_head_dims.py
(one tensor as k and v), test_triton.py (the large-scores flag, unused outputs, scores past fp32),
test_cpu_paths.py (the reference backend within 1e-6).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from sinkattn.backends import cpu, cpu_native, cpu_small, cpu_tiles
from sinkattn.testing import cases, verify
from harness import tables
from conftest import DEVICE, describe

CPU_PATHS = {
    "cpu": {},
    "cpu-compiled": {"SINKATTN_CPU_KERNEL": "compiled"},
    "cpu-python": {"SINKATTN_CPU_KERNEL": "python"},
    "cpu-compiled-bf16": {"SINKATTN_CPU_KERNEL": "compiled", "SINKATTN_CPU_PRODUCTS": "bf16"},
    "cpu-compiled-all-short": {"SINKATTN_CPU_KERNEL": "compiled"},
    "cpu-python-all-short": {"SINKATTN_CPU_KERNEL": "python"},
}
PATHS = [*CPU_PATHS, "triton"]
MODES = ["training", "inference"]


class Cell(NamedTuple):
    table: str            # the name of its table; a level case's, its levels: "L0+L1"
    case: cases.Case
    path: str
    mode: str
    repeats: int = 1
    marks: tuple = ()


def block(table_cases, paths, modes, table=None, repeats=1, levels=False, marks=()):
    """The cells ``table_cases x paths x modes``, named ``table`` (default: each case's level); ``levels``:
    each case marked with its level (``pytest -m L0``)."""
    assert set(paths) <= set(PATHS) and set(modes) <= set(MODES)
    return [Cell(table or c.level, c, path, mode, repeats, ((getattr(pytest.mark, c.level),) if levels else ()) + marks)
            for c in table_cases for path in paths for mode in modes]


def _same(case: cases.Case) -> cases.Case:
    """What a case computes: its inputs and call (a level and a note are names only)."""
    return dataclasses.replace(case, level="", note="")


def merged(cells):
    """One cell per computation (case, path, mode): the most repeats, every table's name and marker."""
    found: dict = {}
    for cell in cells:
        key = (_same(cell.case), cell.path, cell.mode)
        first = found.setdefault(key, cell)
        if first is not cell:
            tables_ = first.table.split("+") + [t for t in [cell.table] if t not in first.table.split("+")]
            found[key] = first._replace(table="+".join(tables_), repeats=max(first.repeats, cell.repeats),
                                        marks=first.marks + tuple(m for m in cell.marks if m not in first.marks))
    return list(found.values())


def param(cell: Cell):
    name = cell.table + cell.case.name[len(cell.case.level):]
    repeats = f"-x{cell.repeats}" if cell.repeats > 1 else ""
    return pytest.param(cell, id=f"{name}-{cell.path}-{cell.mode}{repeats}", marks=cell.marks)


L0, L1, L2, BOUNDARY = (cases.cases(level) for level in ("L0", "L1", "L2", "boundary"))
INTERPRETER_L0 = [tables.interpreter_size(c) for c in L0]
DETERMINISM = (pytest.mark.determinism,)

MATRIX = merged([
    *block(L0, ["cpu"], ["training"], repeats=3, levels=True, marks=DETERMINISM),
    *block(L1 + L2 + BOUNDARY, ["cpu"], ["training"], levels=True),
    *block(tables.INFERENCE_LEVELS, ["cpu"], ["inference"]),
    *block(INTERPRETER_L0[:4], ["triton"], ["training"], repeats=3, levels=True, marks=DETERMINISM),
    *block(INTERPRETER_L0[4:] + [tables.interpreter_size(c) for c in L1 + L2 + BOUNDARY], ["triton"], ["training"],
           levels=True),
    *block(tables.HEAD_DIMS, ["cpu"], MODES, "head-dims"),
    *block(tables.KERNEL, ["cpu-compiled", "cpu-python"], ["training"], "kernel", repeats=2),
    *block(tables.KERNEL_BF16, ["cpu-compiled-bf16"], ["training"], "kernel-bf16", repeats=2),
    *block(tables.SHORT, ["cpu-compiled", "cpu-python"], ["training"], "short", repeats=2),
    *block(tables.SHORT_EDGES, ["cpu-compiled", "cpu-python"], ["training"], "short-edges"),
    *block([cases.random_packed(seed) for seed in (1, 3)], ["cpu-compiled-all-short", "cpu-python-all-short"],
           ["training"]),
    *block(tables.SMALL_CALLS, ["cpu"], ["training"], "small-calls", repeats=2),
    *block(tables.LONG_WINDOW, ["cpu"], MODES, "long-window"),
    *block(tables.TRITON_SHAPES[:4] + tables.TRITON_SHAPES[6:], ["triton"], ["training"], "triton-shapes"),
    *block(tables.TRITON_SHAPES[4:6], ["triton"], ["training"], "triton-shapes", repeats=2),
    *[cell for dtype, seeds in tables.INTERPRETER_SEEDS.items() for seed in seeds
      for cell in block([tables.interpreter_random(seed, dtype)], ["triton"], ["training"],
                        repeats=2 if seed in tables.INTERPRETER_DETERMINISM_SEEDS else 1)],
])


def _recorded(calls: list, real, name: str):
    def recorded(*a, **kw):
        calls.append(name)
        return real(*a, **kw)
    return recorded


def _take(path: str, monkeypatch) -> list | None:
    """Set ``path`` up for the test; on an explicit cpu path, the calls of the PyTorch-op paths from now on."""
    if path == "triton":
        return None
    for name, value in CPU_PATHS[path].items():
        if value == "compiled" and cpu_native.compiler() is None:
            pytest.skip("no C++ compiler: the compiled kernel is not built")
        monkeypatch.setenv(name, value)
    if path.endswith("-all-short"):
        monkeypatch.setattr(cpu_small, "SHORT_LENGTH", 10**9)
    if path == "cpu":
        return None
    calls = []
    for module in (cpu_tiles, cpu_small):
        for name in ("forward", "backward"):
            monkeypatch.setattr(module, name, _recorded(calls, getattr(module, name), f"{module.__name__}.{name}"))
    return calls


def _short(case: cases.Case) -> bool:
    """Whether a sequence of the case is ``cpu_small``'s."""
    Lq, Lk = torch.tensor(case.q_lens), torch.tensor(case.k_lens)
    return bool(((Lq > 0) & cpu_small.takes(Lq, Lk, case.HQ)).any())


def _check_route(calls: list, case: cases.Case, path: str):
    """The PyTorch-op paths take a python path's call; the compiled kernel takes every sequence but the short
    ones (``cpu_small``'s, many at a time) of a compiled path's."""
    if "python" in path:
        assert calls
        return
    assert not any(c.startswith(cpu_tiles.__name__) for c in calls), calls
    assert any(c.startswith(cpu_small.__name__) for c in calls) == _short(case), calls


@pytest.mark.parametrize("cell", [param(cell) for cell in MATRIX])
def test_gate_a(cell: Cell, monkeypatch):
    case, path = cell.case, cell.path
    calls = _take(path, monkeypatch)
    backend = "triton" if path == "triton" else "cpu"
    if cell.mode == "inference":
        x = case.make()
        out, lse = verify.inference(case, x, backend)
        assert out.shape == x.q.shape[:-1] + x.v.shape[-1:]
        reports = verify.inference_reports(case, backend, x=x, results=(out, lse))
        assert all(r.gate_a for r in reports), [r.as_dict() for r in reports]
        return
    result = verify.run_case(case, backend, repeats=cell.repeats, device=DEVICE if backend == "triton" else "cpu")
    assert result.passed, describe(result)
    assert cell.repeats == 1 or result.deterministic is True, describe(result)
    with_sinks = case.sink_scale is not None or case.sink_value is not None
    assert [r.name for r in result.reports] == list(verify.TENSORS[:6 if with_sinks else 5])
    if calls is not None:
        _check_route(calls, case, path)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_gate_a_random_cpu_training(seed):
    """Random packed batches at full size: 1-9 sequences of 0-300 tokens (``cases.random_packed``)."""
    result = verify.run_case(cases.random_packed(seed), "cpu")
    assert result.passed, describe(result)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tables.sharp_cases())
def test_gate_a_sharp_cpu_inference(case):
    """Any score size (``tables.sharp_cases``: bounds 1 to 4096, around 256 and past it), no gradient."""
    reports = verify.inference_reports(case)
    assert all(r.gate_a for r in reports), (case.name, [r.as_dict() for r in reports])


def test_the_tables_reach_what_they_are_for():
    """Each table holds what its cells are for: the short table short sequences, the 512 class of the
    Triton shapes that class, and the interpreter's random seeds the edges (empty and 1-token sequences,
    odd lengths, lengths past one interpreter block (16) and not a multiple of it, every D, G, mask kind
    and sink)."""
    from sinkattn.backends.triton import config

    for case in tables.SHORT:
        x = case.make()
        assert cpu.split(x.cu_seqlens_q, x.cu_seqlens_k, case.HQ).small is not None, case.name
    assert all(config.block_d(max(c.D, c.Dv or c.D)) == 512 for c in tables.TRITON_SHAPES[4:6])
    drawn = [tables.interpreter_random(seed, torch.float16) for seed in tables.INTERPRETER_SEEDS[torch.float16]]
    lengths = {n for c in drawn for n in c.q_lens + c.k_lens}
    assert {0, 1} <= lengths
    assert any(n % 2 and n > 16 for n in lengths) and any(n > 16 and n % 16 for n in lengths)
    assert {c.D for c in drawn} == {16, 24, 32, 40, 64}
    assert {c.G for c in drawn} == {1, 2, 4}
    assert {c.causal for c in drawn} == {True, False}
    assert any(c.window_size[0] in (0, 7) for c in drawn) and any(c.window_size[1] >= 0 for c in drawn)
    variants = {(c.sink_scale, c.sink_value) for c in drawn}
    assert variants == {(v.get("sink_scale", 1.0), v.get("sink_value")) for v in cases.SINK_VARIANTS.values()}
