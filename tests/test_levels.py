"""The level tables of docs/contract.md §5 at full size on the cpu backend, against the float64 golden
(the Triton backend runs them scaled down for its interpreter in test_triton.py; ``reference`` is the golden).

Results come through the public API with NaN-poisoned result buffers (``verify.run_case``)."""

import pytest

from sinkattn.testing import cases, verify
from conftest import describe

BACKENDS = ["cpu"]


def _params(level):
    mark = getattr(pytest.mark, level)
    return [pytest.param(c, id=c.name, marks=mark) for c in cases.cases(level)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _params("L0") + _params("L1") + _params("L2") + _params("boundary"))
def test_gate_a(case, backend):
    result = verify.run_case(case, backend)
    assert result.passed, describe(result)
    assert [r.name for r in result.reports] == list(verify.TENSORS[:5 if case.sink_scale is None
                                                                   and case.sink_value is None else 6])


@pytest.mark.determinism
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in cases.cases("L0")])
def test_bitwise_deterministic(case, backend):
    result = verify.run_case(case, backend, repeats=3)
    assert result.deterministic is True, describe(result)
    assert result.passed, describe(result)
