"""Random packed batches (random lengths, GQA shape, mask, head dim and sink vector) against the golden:
on ``cpu`` at full size (1-9 sequences of 0-300 tokens) from hypothesis' seeds, on ``triton`` through
the interpreter (1-3 sequences of 0-32 tokens) from 32 fixed seeds per dtype."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from sinkattn.testing import cases, verify
from conftest import DEVICE, describe

TRITON_SEEDS = range(32)
TRITON_DETERMINISM_SEEDS = range(2)       # these also run twice and must match bitwise


def _triton_case(seed: int, dtype: torch.dtype) -> cases.Case:
    return cases.random_packed(seed, dtype=dtype, **cases.INTERPRETER_RANDOM)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_packed_batch_cpu(seed):
    case = cases.random_packed(seed)
    result = verify.run_case(case, "cpu")
    assert result.passed, describe(result)


def test_triton_random_batches_reach_the_edges():
    """The fixed seeds draw what the triton test is for: empty and 1-token sequences, odd lengths,
    lengths past one interpreter block (16) and not a multiple of it, every D, G, mask kind and sink."""
    drawn = [_triton_case(seed, torch.float16) for seed in TRITON_SEEDS]
    lengths = {n for c in drawn for n in c.q_lens + c.k_lens}
    assert {0, 1} <= lengths
    assert any(n % 2 and n > 16 for n in lengths) and any(n > 16 and n % 16 for n in lengths)
    assert {c.D for c in drawn} == {16, 24, 32, 40, 64}
    assert {c.G for c in drawn} == {1, 2, 4}
    assert {c.causal for c in drawn} == {True, False}
    assert any(c.window_size[0] in (0, 7) for c in drawn) and any(c.window_size[1] >= 0 for c in drawn)
    variants = {(c.sink_scale, c.sink_value) for c in drawn}
    assert variants == {(v.get("sink_scale", 1.0), v.get("sink_value")) for v in cases.SINK_VARIANTS.values()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_random_packed_batches_triton(dtype):
    """Gate A on out, lse, dq, dk, dv, dsinks with the backend's default settings for ``dtype``."""
    failures = []
    for seed in TRITON_SEEDS:
        repeats = 2 if seed in TRITON_DETERMINISM_SEEDS else 1
        result = verify.run_case(_triton_case(seed, dtype), "triton", repeats=repeats, device=DEVICE)
        if not result.passed:
            failures.append(describe(result))
    assert not failures, f"{len(failures)} of {len(TRITON_SEEDS)} batches failed:\n" + "\n".join(failures)
