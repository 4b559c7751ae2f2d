"""``python -m sinkattn`` / ``sinkattn``: check the library on this machine.

    sinkattn verify [--level L0|L1|L2|boundary|all] [--backend auto|cpu|reference] [--json FILE]

With no sub-command it runs ``verify --level L0`` on the default backend. Each
case and tensor gets a line: Gate A ratio, max abs error and verdict, the
Gate B factor against eager attention in the input dtype, and bitwise
determinism over three runs. The exit code is 0 only if every case passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from . import cases, verify

__all__ = ["main"]


def _verify(args) -> int:
    level_cases = cases.cases(args.level)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    if dtype is not None:
        level_cases = [dataclasses.replace(c, dtype=dtype) for c in level_cases]
    print(f"sinkattn verify: level {args.level}, backend {args.backend}, {len(level_cases)} cases, "
          f"golden = float64 reference, Gate A per DESIGN.md §4")
    print(f"{'case':58s} {'tensor':6s} {'dtype':8s} {'ratio':>7s} {'max_abs':>9s} {'A':4s} {'B factor':>8s} {'det':4s}")
    results, failed = [], 0
    t0 = time.perf_counter()
    for case in level_cases:
        r = verify.run_case(case, args.backend, gate_b=not args.no_gate_b, repeats=args.repeats)
        results.append(r)
        det = {None: "-", True: "yes", False: "NO"}[r.deterministic]
        if r.error:
            print(f"{case.name:58s} ERROR {r.error}")
        for rep in r.reports:
            verdict = "pass" if rep.gate_a else ("waiv" if rep.accepted else "FAIL")
            b = f"{rep.gate_b_factor:8.3f}" if rep.gate_b_factor is not None else f"{'-':>8s}"
            print(f"{case.name:58s} {rep.name:6s} {rep.dtype:8s} {rep.ratio:7.4f} {rep.max_abs_err:9.3g} "
                  f"{verdict:4s} {b} {det:4s}")
            if rep.waiver:
                print(f"{'':58s} waiver: {rep.waiver} -> {'ok' if rep.waiver_ok else 'FAIL'}")
        failed += not r.passed
    elapsed = time.perf_counter() - t0
    print(f"verdict: {'PASS' if not failed else 'FAIL'}: {len(results) - failed} of {len(results)} cases pass "
          f"Gate A{' and determinism' if args.repeats > 1 else ''} ({elapsed:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(case=r.case.name, backend=r.backend, passed=r.passed, deterministic=r.deterministic,
                            error=r.error, reports=[rep.as_dict() for rep in r.reports]) for r in results],
                      f, indent=2)
    return 0 if not failed else 1


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sinkattn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command")
    v = sub.add_parser("verify", help="run a level of DESIGN.md §5 against the float64 golden")
    v.add_argument("--level", default="L0", choices=["L0", "L1", "L2", "boundary", "all"])
    v.add_argument("--backend", default="auto", choices=["auto", "cpu", "reference"])
    v.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="override the cases' input dtype")
    v.add_argument("--repeats", type=int, default=3, help="runs compared bitwise for determinism (1: skip)")
    v.add_argument("--no-gate-b", action="store_true", help="skip the eager baseline (faster)")
    v.add_argument("--json", help="write every report to this file")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command is None:
        args = ap.parse_args(["verify", *(argv or [])])
    return _verify(args)


if __name__ == "__main__":
    sys.exit(main())
