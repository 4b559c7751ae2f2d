"""What keeping NaN/inf of k and v to the rows that see them costs the clean path on the cpu backend.

    python benchmarks/nonfinite.py [--quick] [--repeats N] [--threads N] [--json FILE]

Every cpu call whose rows do not all see the same keys first checks ``k`` and ``v`` for NaN/inf
(``sinkattn.backends.nonfinite.present``: one sum over each); clean inputs then run exactly as
before. This times sinkattn on the shapes of ``benchmarks/cpu.py``'s speed section (dense causal B=1,
HQ=16, HKV=4, S=2048, D=64; fp32 and bf16; fwd and fwd+bwd) with that check and with it replaced by
``False``, interleaved in one run, and the check alone (which on a loaded machine is the steadier
figure: the difference of two noisy times can come out negative). Asserts nothing.
"""

from __future__ import annotations

import contextlib

import torch

from sinkattn.backends import cpu
from sinkattn.testing import bench


@contextlib.contextmanager
def _unchecked():
    """The check answered ``False`` without looking (what the clean path cost before it)."""
    original = cpu.nonfinite.present
    cpu.nonfinite.present = lambda *tensors: False
    try:
        yield
    finally:
        cpu.nonfinite.present = original


def _unchecked_step(step):
    def run():
        with _unchecked():
            step()
    return run


def main(argv=None):
    args = bench.parse_script_args(bench.script_parser(__doc__, repeats=9, quick="S=256, 2 repeats (smoke run)"), argv)
    S, repeats = (256, 2) if args.quick else (2048, args.repeats)
    rows = []
    for dtype in ("float32", "bfloat16"):
        problem = bench.Problem(1, S, 16, 4, 64, dtype=dtype)
        k32, v32 = (torch.randn(S, 4, 64) for _ in range(2))       # what the check reads: k, v cast to fp32
        check = bench.time_interleaved({"check": lambda k=k32, v=v32: [cpu.nonfinite.present(k, v) for _ in range(10)]},
                                       repeats)["check"] / 10
        for mode in ("fwd", "fwdbwd"):
            step = bench.sinkattn_step(problem, mode)
            t = bench.time_interleaved({"checked": step, "unchecked": _unchecked_step(step)}, repeats)
            rows.append(dict(shape=problem.label, mode=mode, seconds=t, cost=t["checked"] / t["unchecked"] - 1,
                             check_seconds=check, check_share=check / t["checked"]))
    info = bench.header()
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    for r in rows:
        t = r["seconds"]
        print(f"{r['shape']:44s} {r['mode']:6s} checked {t['checked'] * 1e3:8.1f} ms | unchecked "
              f"{t['unchecked'] * 1e3:8.1f} ms | difference {r['cost'] * 100:+.2f}% | the check alone "
              f"{r['check_seconds'] * 1e3:.3f} ms = {r['check_share'] * 100:.2f}% of the call (budget < 2%)")
    bench.write_json(args.json, dict(header=info, rows=rows))
    return rows


if __name__ == "__main__":
    main()
