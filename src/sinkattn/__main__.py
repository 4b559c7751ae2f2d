"""``sinkattn`` / ``python -m sinkattn``: is it right, and how fast is it, on this machine.

    sinkattn verify [--level L0|L1|L2|boundary|all] [--backend ...] [--dtype ...] [--json FILE]
    sinkattn bench  [--config NAME | --shape B,S,HQ,HKV,D] [--modes fwd,bwd,fwdbwd]
                    [--providers ...] [--json FILE] [--plot FILE.png]
    sinkattn        verify L0, then bench the default configuration, files under sinkattn-out/

verify runs the level cases of DESIGN.md §5 against the float64 golden and
prints, per case and tensor, Gate A (ratio, max abs error, verdict), the Gate B
factor against eager attention in the input dtype, and bitwise determinism over
three runs; the exit code is 0 only if every case passes. bench times sinkattn
against the attention available here (see ``sinkattn.testing.bench``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from .testing import bench, cases, verify

__all__ = ["main"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _rich():
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table
    except ImportError:
        sys.exit("the sinkattn command needs its display extras: pip install 'sinkattn[cli]'")
    console = Console()
    if not console.is_terminal:      # files and pipes: wide enough for the tables, no wrapping
        console = Console(width=120)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    return console, Table, progress


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def cmd_verify(args) -> int:
    console, Table, progress = _rich()
    level_cases = cases.cases(args.level)
    if args.dtype:
        level_cases = [dataclasses.replace(c, dtype=_DTYPES[args.dtype]) for c in level_cases]
    device = "cuda" if args.backend == "triton" and torch.cuda.is_available() else "cpu"
    results = []
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task(f"verify {args.level} on {args.backend}", total=len(level_cases))
        for case in level_cases:
            results.append(verify.run_case(case, args.backend, gate_b=not args.no_gate_b,
                                           repeats=args.repeats, device=device))
            progress.advance(task)
    table = Table(title=f"sinkattn verify: level {args.level}, backend {args.backend}, golden = float64 reference")
    for col, just in (("case", "left"), ("tensor", "left"), ("dtype", "left"), ("A ratio", "right"),
                      ("max err", "right"), ("A", "center"), ("B factor", "right"), ("B", "center"),
                      ("det", "center")):
        table.add_column(col, justify=just)
    failed = 0
    for r in results:
        det = {None: "-", True: "yes", False: "[red]NO[/]"}[r.deterministic]
        if r.error:
            table.add_row(r.case.name, "[red]error[/]", "", "", "", "[red]FAIL[/]", "", "", det)
            table.add_row("", r.error, *[""] * 7)
        for i, rep in enumerate(r.reports):
            a = "pass" if rep.gate_a else ("waived" if rep.accepted else "[red]FAIL[/]")
            b = {None: "-", True: "pass", False: "[yellow]over[/]"}[rep.gate_b]
            table.add_row(r.case.name if i == 0 else "", rep.name, _SHORT.get(rep.dtype, rep.dtype), f"{rep.ratio:.4f}",
                          f"{rep.max_abs_err:.3g}", a, _fmt(rep.gate_b_factor, ".3f"), b, det if i == 0 else "")
        failed += not r.passed
    console.print(table)
    for r in results:
        for rep in r.reports:
            if rep.waiver:
                console.print(f"waiver {r.case.name} {rep.name}: {rep.waiver} -> {'ok' if rep.waiver_ok else 'FAIL'}")
    verdict = "[green]PASS[/]" if not failed else "[red]FAIL[/]"
    console.print(f"verdict: {verdict}: {len(results) - failed} of {len(results)} cases pass Gate A"
                  f"{' and determinism' if args.repeats > 1 else ''} ({time.perf_counter() - t0:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(level=args.level, backend=args.backend, passed=not failed,
                           cases=[dict(case=r.case.name, backend=r.backend, passed=r.passed,
                                       deterministic=r.deterministic, error=r.error,
                                       reports=[rep.as_dict() for rep in r.reports]) for r in results]),
                      f, indent=2)
    return 0 if not failed else 1


def _problems(args):
    if args.shape:
        B, S, HQ, HKV, D = (int(x) for x in args.shape.split(","))
        window = tuple(int(x) for x in args.window.split(",")) if args.window else (-1, -1)
        return [bench.Problem(B, S, HQ, HKV, D, dtype=args.dtype or "float32", window=window)]
    problems = bench.CONFIGS[args.config]
    if args.dtype:
        problems = [dataclasses.replace(p, dtype=args.dtype) for p in problems]
    return problems


def cmd_bench(args) -> int:
    console, Table, progress = _rich()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    problems = _problems(args)
    modes = tuple(args.modes.split(","))
    providers = tuple(args.providers.split(",")) if args.providers else (
        ("sinkattn", "sdpa", "flex_lse", "flash_attn", "eager") if device == "cuda"
        else ("sinkattn", "sdpa", "sdpa_lse", "eager"))
    info = bench.header(device)
    console.print("bench: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    with progress:
        task = progress.add_task("bench", total=len(problems) * len(modes))
        rows = bench.run(problems, providers, modes, repeats=args.repeats, warmup=1, device=device,
                         progress=lambda: progress.advance(task))
    shared = problems[0].label.split(" ", 2)[2] if len({p.label.split(" ", 2)[2] for p in problems}) == 1 else ""
    table = Table(title=f"sinkattn bench: {shared}\nmedian ms; GFLOP/s of visible pairs; vs peer = best peer ms / ours")
    for col in ("B", "S", "mode", "provider", "ms", "GFLOP/s", "vs peer", "peak MiB"):
        table.add_column(col, justify="left" if col in ("mode", "provider") else "right")
    notes = {}
    for r in rows:
        mark = ""
        if r.note:
            notes.setdefault(r.note, len(notes) + 1)
            mark = f" [{notes[r.note]}]"
        table.add_row(str(r.problem.B), str(r.problem.S), r.mode, r.provider + mark, _fmt(r.ms, ".2f"),
                      _fmt(r.gflops, ".1f"), _fmt(r.vs_best_peer, ".2f") + ("x" if r.vs_best_peer else ""),
                      _fmt(r.peak_mem_mib, ".1f"))
    console.print(table)
    for note, i in notes.items():
        console.print(f"[{i}] {note}", markup=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=info, rows=[r.as_dict() for r in rows]), f, indent=2)
    if args.plot:
        bench.plot(rows, args.plot, f"sinkattn bench on {info['machine']} ({info['threads']} threads): "
                                    f"B={problems[0].B} {shared}")
        console.print(f"plot written to {args.plot}")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sinkattn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="sinkattn-out", help="folder for the default run's JSON and PNG")
    sub = ap.add_subparsers(dest="command")
    v = sub.add_parser("verify", help="run a level of DESIGN.md §5 against the float64 golden")
    v.add_argument("--level", default="L0", choices=["L0", "L1", "L2", "boundary", "all"])
    v.add_argument("--backend", default="auto", choices=["auto", "cpu", "triton", "reference"])
    v.add_argument("--dtype", choices=sorted(_DTYPES), help="override the cases' input dtype")
    v.add_argument("--repeats", type=int, default=3, help="runs compared bitwise for determinism (1: skip)")
    v.add_argument("--no-gate-b", action="store_true", help="skip the eager baseline (faster)")
    v.add_argument("--json", help="write every figure to this file")
    b = sub.add_parser("bench", help="time sinkattn against the attention available here")
    b.add_argument("--config", default="cpu-default", choices=sorted(bench.CONFIGS))
    b.add_argument("--shape", help="B,S,HQ,HKV,D instead of a config")
    b.add_argument("--window", help="left,right with --shape (causal)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--modes", default="fwd,fwdbwd", help="comma list of fwd, bwd, fwdbwd")
    b.add_argument("--providers", help=f"comma list of {', '.join(bench.PROVIDERS)}")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--device", choices=["cpu", "cuda"])
    b.add_argument("--json")
    b.add_argument("--plot", help="PNG file: time against sequence length, a panel per mode")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "verify":
        return cmd_verify(args)
    if args.command == "bench":
        return cmd_bench(args)
    os.makedirs(args.out, exist_ok=True)
    status = cmd_verify(ap.parse_args(["verify", "--json", os.path.join(args.out, "verify.json")]))
    cmd_bench(ap.parse_args(["bench", "--json", os.path.join(args.out, "bench.json"),
                             "--plot", os.path.join(args.out, "bench.png")]))
    return status


if __name__ == "__main__":
    sys.exit(main())
