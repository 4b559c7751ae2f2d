"""sinkattn / python -m sinkattn: is it right, and how fast is it, on this machine.

    sinkattn verify [--level L0|L1|L2|boundary|all] [--backend auto|cpu|triton|reference] [--device cpu|cuda]
                    [--dtype fp16|bf16|fp32] [--repeats N] [--no-gate-b] [--json FILE]
    sinkattn bench  [--config NAME | --shape B,S,HQ,HKV,D] [--window L,R] [--no-causal] [--dtype fp16|bf16|fp32]
                    [--modes fwd,bwd,fwdbwd] [--providers NAME,...] [--repeats N] [--device cpu|cuda]
                    [--threads N] [--json FILE] [--plot FILE]
    sinkattn [--out DIR]   verify L0, then bench this device's default configuration; files under DIR

verify runs the level cases of the contract (section 5 of docs/contract.md, in the
sinkattn repository; not shipped in the wheel) against the float64 golden and
prints, per case and tensor, Gate A (A ratio: the share of elements within the
tolerance; max abs error; verdict), the Gate B factor (max error over that of
eager attention in the input dtype) and bitwise determinism over --repeats runs
(1: not checked); the exit code is 0 only if every case passes. It runs on the
GPU when there is one (backend auto -> triton), else on the CPU.

bench times sinkattn against the attention available here (see
sinkattn.testing.bench): the median, min and max of --repeats runs, with a
warning when they spread more than 20%; --plot writes any format matplotlib
writes, by the file's extension (png, pdf, svg, jpg, ...). The exit code is 1
if sinkattn failed on any problem or mode (a peer that cannot run or fails is
reported in a note).

Dtypes take either spelling (fp16 or float16, ...). Every option is checked
before any work: a bad value is a one-line error and exit code 2.
"""
# The docstring above is the --help text as printed: plain text, no reStructuredText markup.

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import torch

from .testing import bench, cases, options, precision, verify

__all__ = ["main"]

_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

LEGEND = (f"A ratio: share within Gate A's tolerance (pass >= "
          f"{min(t.required_ratio for t in precision.TOLERANCES.values()):g}); "
          f"B factor: max err / eager's (pass <= {precision.GATE_B_FACTOR['output']:g}, "
          f"gradients <= {precision.GATE_B_FACTOR['gradient']:g})",
          "A, B: the gates' verdicts; det: outputs and gradients bitwise equal over the runs")
"""The verify table's legend, two lines printed under it: what its columns mean and where they pass."""

PEAK_LEGEND = "peak MiB: the call's peak memory growth (CPU: peak resident set, 0 where it reuses memory)"
"""The bench table's memory column, printed under it."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``sinkattn bench: error: argument --x: why (see ... --help)``, exit 2."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes "-1,0" (after --window) for an option; let number lists with a leading minus be values
        self._negative_number_matcher = re.compile(r"^-\d[\d,.\-]*$|^-\.\d")

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _rich():
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table
    except ImportError:
        sys.exit(f"the sinkattn command needs its display extras: {options.CLI_EXTRAS}")
    console = Console()
    if not console.is_terminal:      # files and pipes: wide enough for the tables, no wrapping
        console = Console(width=120)
    # no auto refresh: its background thread can deadlock with the main thread when Ctrl-C lands inside rich's
    # lock; the bar is redrawn by each step instead (_advance)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True, auto_refresh=False)
    return console, Table, progress


def _advance(progress, task) -> None:
    progress.update(task, advance=1, refresh=True)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _write(path: str, write) -> bool:
    """``write(file)`` into ``path``; a one-line message instead of a traceback when the system refuses."""
    try:
        with open(path, "w") as f:
            write(f)
        return True
    except OSError as exc:
        print(f"sinkattn: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return False


def check_verify(ap, args) -> None:
    """Everything ``verify`` needs, settled before any work: cases, device, the backend that runs them."""
    args.cases = cases.cases(args.level)
    if args.dtype is not None:
        args.cases = [dataclasses.replace(c, dtype=args.dtype) for c in args.cases]
    if args.device is None:
        args.device = "cpu" if args.backend == "cpu" else options.default_device()
    try:
        args.runs_on = options.backend_for(args.backend, args.device, [(c.dtype, c.D) for c in args.cases], True)
    except (NotImplementedError, ValueError) as exc:
        ap.error(f"argument --backend: {exc}")


def cmd_verify(args) -> int:
    console, Table, progress = _rich()
    results = []
    t0 = time.perf_counter()
    ran = args.backend if args.backend == args.runs_on else f"{args.backend} -> {args.runs_on}"
    with progress:
        task = progress.add_task(f"verify {args.level} on {ran}", total=len(args.cases))
        progress.refresh()
        for case in args.cases:
            results.append(verify.run_case(case, args.backend, gate_b=not args.no_gate_b,
                                           repeats=args.repeats, device=args.device))
            _advance(progress, task)
    table = Table(title=f"sinkattn verify: level {args.level}, backend {ran}, {args.device} tensors, "
                        f"golden = float64 reference")
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
    for line in LEGEND:
        console.print(line, markup=False)
    for r in results:
        for rep in r.reports:
            if rep.waiver:
                console.print(f"waiver {r.case.name} {rep.name}: {rep.waiver} -> {'ok' if rep.waiver_ok else 'FAIL'}")
    verdict = "[green]PASS[/]" if not failed else "[red]FAIL[/]"
    checked = (f" and determinism over {args.repeats} runs" if args.repeats > 1
               else "; determinism not checked (--repeats 1)")
    console.print(f"verdict: {verdict}: {len(results) - failed} of {len(results)} cases pass Gate A"
                  f"{checked} ({time.perf_counter() - t0:.1f} s)")
    record = dict(level=args.level, backend=args.backend, runs_on=args.runs_on, device=args.device,
                  repeats=args.repeats, determinism_checked=args.repeats > 1, passed=not failed,
                  cases=[dict(case=r.case.name, backend=r.backend, passed=r.passed, deterministic=r.deterministic,
                              error=r.error, reports=[rep.as_dict() for rep in r.reports]) for r in results])
    if args.json:
        if not _write(args.json, lambda f: json.dump(record, f, indent=2)):
            return 1
        console.print(f"table written to {args.json}", markup=False)
    return 0 if not failed else 1


def _problems(args) -> list[bench.Problem]:
    """The problems of ``--shape`` or ``--config``, with ``--dtype``, ``--window`` and ``--no-causal`` applied."""
    if args.shape:
        problems = [bench.Problem(*args.shape)]
    else:
        problems = bench.CONFIGS[args.config or ("gpu-default" if args.device == "cuda" else "cpu-default")]
    change = {}
    if args.dtype is not None:
        change["dtype"] = str(args.dtype).removeprefix("torch.")
    if not args.causal:
        change["causal"] = False
    if args.window is not None:
        left, right = args.window
        # causal attention has right = 0 whatever is asked: say (left, 0), or no window at all
        change["window"] = (args.window if not args.causal else (left, 0) if left >= 0 else (-1, -1))
    return [dataclasses.replace(p, **change) for p in problems]


def _memory_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_bench(ap, args) -> None:
    """Everything ``bench`` needs, settled before any work: device, problems, that sinkattn can take them."""
    args.device = args.device or options.default_device()
    if args.config and args.config.startswith("gpu-") and args.device != "cuda":
        cpu_configs = ", ".join(c for c in sorted(bench.CONFIGS) if c.startswith("cpu-"))
        ap.error(f"argument --config: {args.config} is sized for a GPU (its largest problem would run for a long "
                 f"time without output on the {args.device}); use {cpu_configs} or --shape")
    if args.causal and args.window is not None and args.window[1] > 0:
        ap.error(f"argument --window: right = {args.window[1]} needs --no-causal (bench runs causal attention, "
                 f"whose right side is 0)")
    args.problems = _problems(args)
    source = "--shape" if args.shape else "--config"
    try:
        options.backend_for("auto", args.device, [(p.torch_dtype, p.D) for p in args.problems],
                            needs_grad=args.modes != ("fwd",))
    except (NotImplementedError, ValueError) as exc:
        ap.error(f"argument {source}: {exc}")
    need, have = max(p.tensor_bytes for p in args.problems), _memory_bytes(args.device)
    if need > have:
        ap.error(f"argument {source}: inputs, outputs and gradients alone need {need / 2**30:.1f} GiB, "
                 f"more than the {have / 2**30:.1f} GiB of {args.device} memory here")
    if args.providers is None:
        args.providers = (("sinkattn", "sdpa", "flex_lse", "flash_attn", "eager") if args.device == "cuda"
                          else ("sinkattn", "sdpa", "sdpa_lse", "eager"))
    elif "sinkattn" not in args.providers:
        ap.error(f"argument --providers: bench times sinkattn against its peers; include sinkattn "
                 f"(e.g. --providers sinkattn,{','.join(args.providers)})")


def cmd_bench(args) -> int:
    console, Table, progress = _rich()
    problems, modes = args.problems, args.modes
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    info = bench.header(args.device)
    console.print("bench: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    with progress:
        task = progress.add_task("bench", total=len(problems) * len(modes))
        progress.refresh()
        rows = bench.run(problems, args.providers, modes, repeats=args.repeats, warmup=1, device=args.device,
                         progress=lambda: _advance(progress, task))
    setting = bench.common_label(problems)
    table = Table(title=f"sinkattn bench: {setting}\n"
                        f"ms: median of {args.repeats} run{'s' if args.repeats > 1 else ''} (min–max); "
                        f"GFLOP/s of visible pairs; "
                        f"vs peer = best peer ms / ours")
    for col in ("B", "S", "mode", "provider", "ms", "min–max", "GFLOP/s", "vs peer", "peak MiB"):
        table.add_column(col, justify="left" if col in ("mode", "provider") else "right")
    notes = {}
    for r in rows:
        mark = ""
        if r.note:
            notes.setdefault(r.note, len(notes) + 1)
            mark = f" [{notes[r.note]}]"
        spread = "-" if r.ms is None else f"{r.ms_min:.2f}–{r.ms_max:.2f}"
        table.add_row(str(r.problem.B), str(r.problem.S), bench.MODE_NAMES[r.mode], r.provider + mark,
                      _fmt(r.ms, ".2f"), spread, _fmt(r.gflops, ".1f"),
                      _fmt(r.vs_best_peer, ".2f") + ("x" if r.vs_best_peer else ""), _fmt(r.peak_mem_mib, ".1f"))
    console.print(table)
    for note, i in notes.items():
        console.print(f"[{i}] {note}", markup=False)
    console.print(PEAK_LEGEND, markup=False)
    noise = bench.noise_warning((r.where, r.spread) for r in rows if r.ms is not None)
    if noise:
        console.print(noise, markup=False)
    ours = [r for r in rows if r.provider == "sinkattn"]
    failed = [r for r in ours if r.ms is None]
    for r in failed:
        console.print(f"FAIL: sinkattn did not run {r.problem.label} {r.mode}: {r.note}", markup=False)
    if failed:
        console.print(f"sinkattn failed on {len(failed)} of {len(ours)} (problem, mode) runs", markup=False)
    title = f"sinkattn bench on {info['machine']} ({info['threads']} threads): {setting}"
    record = dict(header=info, setting=setting, title=title, sinkattn_failed=len(failed), repeats=args.repeats,
                  noise_limit=bench.NOISE_LIMIT, noise_warning=noise, rows=[r.as_dict() for r in rows])
    written = not args.json or _write(args.json, lambda f: json.dump(record, f, indent=2))
    if args.json and written:
        console.print(f"table written to {args.json}", markup=False)
    if args.plot:
        try:
            bench.plot(rows, args.plot, title)
            console.print(f"plot written to {args.plot}")
        except OSError as exc:
            print(f"sinkattn: cannot write {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            written = False
    return 1 if failed or not written else 0


def _threads(text: str) -> int:
    """``--threads``: an integer from 1 to this machine's CPU count (more threads than CPUs only wait on each
    other)."""
    cpus = os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {cpus} (this machine's CPUs), "
                                         f"got {text!r}") from None
    if not 1 <= value <= cpus:
        raise argparse.ArgumentTypeError(f"must be from 1 to {cpus} (this machine's CPUs), got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="sinkattn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=options.out_dir, metavar="DIR",
                    help="folder for the default run's JSON and PNG (default: sinkattn-out; the PNG needs matplotlib)")
    sub = ap.add_subparsers(dest="command")
    dtype = dict(type=options.dtype, metavar="fp16|bf16|fp32", help=f"input dtype: {options.DTYPE_CHOICES}")
    device = dict(type=options.device, metavar="cpu|cuda", help="where the tensors live (default: the GPU if any)")

    about = ("run a level of the contract's test cases (docs/contract.md §5, in the sinkattn repository) "
             "against the float64 golden")
    v = sub.add_parser("verify", help=about, description=about[0].upper() + about[1:] + ".")
    v.add_argument("--level", default="L0", choices=["L0", "L1", "L2", "boundary", "all"])
    v.add_argument("--backend", default="auto", choices=["auto", "cpu", "triton", "reference"],
                   help="auto: triton on a GPU, cpu on the CPU (triton on CPU tensors needs TRITON_INTERPRET=1)")
    v.add_argument("--device", **device)
    v.add_argument("--dtype", **(dtype | dict(help="override the cases' input dtype: " + options.DTYPE_CHOICES)))
    v.add_argument("--repeats", type=options.at_least(1), default=3, metavar="N",
                   help="runs compared bitwise for determinism (1: not checked); default 3")
    v.add_argument("--no-gate-b", action="store_true", help="skip the eager baseline (faster)")
    v.add_argument("--json", type=options.json_file, metavar="FILE", help="write every figure to this file")
    v.set_defaults(parser=v, check=check_verify, run=cmd_verify)

    about = "time sinkattn against the attention available here"
    b = sub.add_parser("bench", help=about, description=about[0].upper() + about[1:] + ".")
    which = b.add_mutually_exclusive_group()
    which.add_argument("--config", choices=sorted(bench.CONFIGS),
                       help="a sweep over S (default: gpu-default on a GPU, else cpu-default)")
    which.add_argument("--shape", type=options.shape, metavar="B,S,HQ,HKV,D", help="one problem instead of a config")
    b.add_argument("--window", type=options.window, metavar="L,R",
                   help="sliding window (left, right; -1 unbounded) for every problem, the config's too; "
                        "right > 0 needs --no-causal")
    b.add_argument("--no-causal", dest="causal", action="store_false", help="attention without the causal mask")
    b.add_argument("--dtype", **dtype)
    b.add_argument("--modes", type=options.names(bench.MODES), default=("fwd", "fwdbwd"), metavar="MODE,...",
                   help="comma list of " + ", ".join(f"{m} ({bench.MODE_NAMES[m]})" for m in bench.MODES)
                        + " (default: fwd,fwdbwd)")
    b.add_argument("--providers", type=options.names(bench.PROVIDERS), metavar="NAME,...",
                   help=f"comma list of {', '.join(bench.PROVIDERS)} (default: those for the device)")
    b.add_argument("--repeats", type=options.at_least(1), default=3, metavar="N",
                   help="timed runs (median, min, max); default 3")
    b.add_argument("--device", **device)
    b.add_argument("--threads", type=_threads, metavar="N",
                   help=f"torch threads for every provider, 1 to {os.cpu_count() or 1} here (default: torch's own, "
                        f"one per core); on a machine other jobs keep busy, 1 is often several times faster")
    b.add_argument("--json", type=options.json_file, metavar="FILE", help="write every figure to this file")
    b.add_argument("--plot", type=options.plot_file, metavar="FILE",
                   help="time against sequence length, a panel per mode, in the format of FILE's extension "
                        "(png, pdf, svg, jpg, ...: any matplotlib writes)")
    b.set_defaults(parser=b, check=check_bench, run=cmd_bench)
    return ap


def _unknown_option(ap, argv) -> str | None:
    """The first option before the command that ``ap`` does not know (argparse would take the value after it
    for the command, and blame that), or None."""
    known = {s: a for a in ap._actions for s in a.option_strings}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        name = argv[i].split("=", 1)[0]
        matches = [s for s in known if s == name] or [s for s in known if s.startswith(name)]
        if len(matches) != 1:
            return argv[i]
        i += 1 if known[matches[0]].nargs == 0 or "=" in argv[i] else 2
    return None


def _default_steps(ap, out: str) -> list:
    """The default run: verify, then bench with its JSON (and a plot where matplotlib is installed)."""
    plot = []
    if options.has_matplotlib():
        plot = ["--plot", os.path.join(out, "bench.png")]
    else:
        print(f"sinkattn: no plot (matplotlib is not installed; for plots: {options.CLI_EXTRAS})", file=sys.stderr)
    return [ap.parse_args(["verify", "--json", os.path.join(out, "verify.json")]),
            ap.parse_args(["bench", "--json", os.path.join(out, "bench.json"), *plot])]


def _run(argv) -> int:
    ap = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    unknown = _unknown_option(ap, argv)
    if unknown is not None:
        ap.error(f"unrecognized arguments: {unknown} (before a command only --out DIR; verify and bench take "
                 f"their options after their name)")
    args, extra = ap.parse_known_args(argv)
    if extra:
        hint = ("; --out DIR is for the default run (no command): give verify/bench --json FILE"
                if any(a.split("=", 1)[0] == "--out" for a in extra) else "")
        (args.parser if args.command is not None else ap).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if args.command is not None:
        if args.out is not None:
            ap.error("argument --out: is for the default run (no command); give verify/bench --json or --plot")
        args.check(args.parser, args)
        return args.run(args)
    out = args.out or "sinkattn-out"
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        ap.error(f"argument --out: cannot create {out!r}: {exc.strerror or exc}")
    steps = _default_steps(ap, out)
    for step in steps:
        step.check(step.parser, step)
    return max([step.run(step) for step in steps])


def main(argv=None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("sinkattn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
