"""The cpu backend on instruction sets other than the test machine's, by switching PyTorch's dispatch.

PyTorch picks its CPU kernels per instruction set at start-up (``ATEN_CPU_CAPABILITY``); MKL and oneDNN
do the same (``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``). The cpu backend is built from those
kernels, and its compiled kernel is built for the same level (``cpu_native``), so a CPU with fewer
vector units (AVX2 only, or none: the scalar ``default`` kernels) runs other code for its exponentials,
reductions, conversions and products, bf16 products (``SINKATTN_CPU_PRODUCTS=bf16``) included. Each level
below runs in a fresh
process limited to it by ``harness.isa`` (which reports the capability it got, so a limit that
did not take fails the test): training and inference calls in fp16, bf16 and fp32, windows, packed
and dense, sharp scores, against the float64 golden (Gate A) with NaN-poisoned buffers, and the same
bits on a second run."""

import json
import subprocess
import sys

import pytest

from sinkattn.backends import cpu_native
from harness import isa

_CHILD = """
import json, os, torch
from sinkattn.backends import cpu_native, isa
from sinkattn.testing import cases, verify
torch.set_num_threads(1)
checks = [
    cases.random_packed(3, max_seqs=3, max_len=70, dtype=torch.bfloat16),
    cases.random_packed(8, max_seqs=3, max_len=70, dtype=torch.float16),
    cases.Case("L2", 4, 2, (45, 0, 130), (45, 7, 150), D=32, dtype=torch.float32, window_size=(20, 0),
               lse_grad=True),
    cases.Case("L2", 2, 2, (40,), (40,), D=8, dtype=torch.float32, causal=False, score_bound=300.0),
    cases.Case("L2", 4, 4, (3, 1, 5, 16), (3, 9, 5, 16), D=16, dtype=torch.bfloat16),   # the short-sequence path
]
out = {"capability": isa.capability(), "path": cpu_native.describe(), "failed": []}
for products in ("fp32", "bf16"):      # the compiled kernel's products of bf16 inputs
    os.environ["SINKATTN_CPU_PRODUCTS"] = products
    for case in checks if products == "fp32" else [c for c in checks if c.dtype == torch.bfloat16]:
        name = f"{case.name} {products} products"
        result = verify.run_case(case, "cpu", repeats=2)
        if not result.passed:
            out["failed"].append([name, result.error, result.deterministic,
                                  [r.as_dict() for r in result.reports if not r.accepted]])
        bad = [r.as_dict() for r in verify.inference_reports(case) if not r.gate_a]
        if bad:
            out["failed"].append([name + " inference", bad])
print(json.dumps(out))
"""


@pytest.mark.parametrize("level", ["default", "avx2"])
def test_cpu_backend_meets_the_standard_on_a_narrower_instruction_set(level):
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=isa.environment(level),
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["capability"] == level, got      # the limit took
    if cpu_native.compiler():   # the compiled kernel, built for that level
        assert got["path"].startswith(f"compiled kernel ({level.upper()}, "), got["path"]
    assert got["failed"] == [], got["failed"]
