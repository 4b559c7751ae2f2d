"""GPU benchmark of the Triton backend: correctness first, then speed against the peers, one run.

    python benchmarks/gpu.py [--json FILE] [--plot FILE.png]

On a CUDA machine: L0 and L1 at full size on ``backend="triton"`` against the
float64 golden (Gate A; bitwise determinism over 3 runs for L0), then
``sinkattn bench --config gpu-targets --modes fwd,bwd,fwdbwd``: medians,
GFLOP/s of visible pairs and ratios against SDPA (flash backend on these
shapes, no sinks), FlexAttention with the sink added through its lse, eager
sink attention where its scores fit, and flash-attn when installed, for the
Ascend kernel's configuration (B=8, HQ=64, HKV=4, S=2048, D=128, causal, fp16
and bf16), dense causal S=8192, and a packed batch of mixed lengths with
window (127, 0). Without a GPU it runs the correctness part through the
Triton interpreter on tiny shapes and says that speed was not measured.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sinkattn import __main__ as cli  # noqa: E402
from sinkattn.testing import bench, cases, verify  # noqa: E402


def correctness(levels, scaled: bool) -> list[dict]:
    rows = []
    device = "cuda" if HAS_GPU else "cpu"
    for level in levels:
        for case in cases.cases(level):
            if scaled:
                case = case.scaled(max_len=48, max_heads=4, max_dim=32)
            r = verify.run_case(case, "triton", repeats=3 if level == "L0" else 1, device=device)
            rows.append(dict(case=case.name, passed=r.passed, deterministic=r.deterministic, error=r.error,
                             reports=[rep.as_dict() for rep in r.reports]))
            print(f"[check] {case.name:60s} {'pass' if r.passed else 'FAIL'} det={r.deterministic}"
                  + (f" {r.error}" if r.error else ""))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="correctness report (the bench JSON goes next to it as *-bench.json)")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    report = dict(gpu=torch.cuda.get_device_name() if HAS_GPU else None, torch=torch.__version__)
    bench_rc = 0
    if HAS_GPU:
        report["correctness"] = correctness(["L0", "L1"], scaled=False)
        bench_args = ["bench", "--config", "gpu-targets", "--modes", "fwd,bwd,fwdbwd", "--repeats", "20",
                      "--providers", "sinkattn,sdpa,flex_lse,flash_attn,eager"]
        if args.json:
            bench_args += ["--json", args.json.removesuffix(".json") + "-bench.json"]
        if args.plot:
            bench_args += ["--plot", args.plot]
        bench_rc = cli.main(bench_args)        # 1 when sinkattn failed on a problem or mode
        report["bench_exit_code"] = bench_rc
    else:
        print("no CUDA GPU: correctness through the Triton interpreter on tiny shapes; GPU speed NOT measured")
        report["correctness"] = correctness(["L0"], scaled=True)
    ok = all(r["passed"] for r in report["correctness"])
    print(f"verdict: correctness {'PASS' if ok else 'FAIL'}"
          + (f"; bench FAILED (exit code {bench_rc})" if bench_rc else ""))
    bench.write_json(args.json, report)
    return 0 if ok and bench_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
