"""Random packed batches (1-9 sequences, lengths 0-300, random GQA shape and mask) against the golden."""

from hypothesis import HealthCheck, given, settings, strategies as st

from sinkattn.testing import cases, verify
from conftest import describe


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_packed_batch_cpu(seed):
    case = cases.random_packed(seed)
    result = verify.run_case(case, "cpu")
    assert result.passed, describe(result)
