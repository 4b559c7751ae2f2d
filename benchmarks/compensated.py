"""Gate A over the Triton backend's random packed batches with plain and with compensated products.

    python benchmarks/compensated.py [--seeds 32] [--threads N] [--json FILE] [--quick]

The batches are those of ``tests/test_random_packed.py::test_random_packed_batches_triton`` (seeds
0..N-1, ``cases.random_packed`` at ``cases.INTERPRETER_RANDOM`` sizes), run through the interpreter
when there is no GPU. For fp16 and bf16, each with ``COMPENSATED = False`` and ``True``: how many
batches fail Gate A, which ones, and per tensor the worst ratio and largest error over all batches.
The wall time of the checks (golden included) is printed for CI's budget; an interpreter time says
nothing about GPU speed, and nothing else is timed (no ``--repeats``). Asserts nothing.
"""

from __future__ import annotations

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sinkattn.backends import triton as triton_backend  # noqa: E402
from sinkattn.testing import bench, cases, verify  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def measure(dtype: torch.dtype, compensated: bool, seeds: int) -> dict:
    triton_backend.COMPENSATED = compensated
    worst: dict[str, dict] = {}
    failed = []
    start = time.perf_counter()
    for seed in range(seeds):
        case = cases.random_packed(seed, dtype=dtype, **cases.INTERPRETER_RANDOM)
        result = verify.run_case(case, "triton", device=DEVICE)
        if result.error:
            raise RuntimeError(f"{case.name}: {result.error}")
        if not result.passed:
            failed.append({"case": case.name, "tensors": {r.name: round(r.ratio, 4) for r in result.reports
                                                          if not r.accepted}})
        for r in result.reports:
            w = worst.setdefault(r.name, {"min_ratio": 1.0, "max_abs_err": 0.0})
            w["min_ratio"] = min(w["min_ratio"], r.ratio)
            w["max_abs_err"] = max(w["max_abs_err"], r.max_abs_err)
    return {"dtype": str(dtype).removeprefix("torch."), "compensated": compensated, "seeds": seeds,
            "failed": len(failed), "wall_s": round(time.perf_counter() - start, 1), "worst": worst,
            "failures": failed}


def main(argv=None) -> dict:
    ap = bench.script_parser(__doc__, repeats=None, quick="smoke run: one seed (--seeds 1)")
    ap.add_argument("--seeds", type=int, default=32)
    args = bench.parse_script_args(ap, argv)
    seeds = 1 if args.quick else args.seeds
    saved = triton_backend.COMPENSATED
    rows = []
    try:
        for name, dtype in DTYPES.items():
            for compensated in (False, True):
                row = measure(dtype, compensated, seeds)
                rows.append(row)
                worst = "  ".join(f"{t} {w['min_ratio']:.4f}" for t, w in row["worst"].items())
                print(f"{name} {'compensated' if compensated else 'plain      '}: {row['failed']:3d} of "
                      f"{seeds} fail Gate A  (worst ratio: {worst})  [{row['wall_s']} s, {DEVICE}]")
                for f in row["failures"]:
                    print(f"    {f['case']}: {f['tensors']}")
    finally:
        triton_backend.COMPENSATED = saved
    report = {"header": {**bench.header(DEVICE), "interpreter": DEVICE != "cuda"},
              "command": f"python benchmarks/compensated.py --seeds {seeds}"
                         + (f" --threads {args.threads}" if args.threads else ""), "rows": rows}
    bench.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
