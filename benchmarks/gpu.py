"""GPU benchmark of the Triton backend: one command, one JSON, within a time budget (default 7 min).

    PYTHONPATH=src python benchmarks/gpu.py --json gpu.json [--budget 420] [--sections ...] [--repeats N]
    python benchmarks/gpu.py --tiny --json tiny.json     # no GPU: every section through the Triton
                                                         # interpreter on tiny shapes (nothing timed counts)

``--quick`` is ``--tiny``; ``--threads N`` sets torch's CPU threads (the interpreter's work).

Sections, in this order (``--sections`` picks some):

* ``blocks``  masked vs unmasked (tile, block) pairs of each kernel on the full-size speed shapes,
              per chip's table (host arithmetic: ``backends.triton.schedule``, also without a GPU);
* ``check``   L0 and L1 at full size on ``backend="triton"`` against the float64 golden: Gate A per
              tensor, bitwise determinism over 3 runs;
* ``speed``   fwd, bwd, fwd+bwd medians of sinkattn (sinks), sinkattn without sinks (the sinks' own
              cost) and SDPA's flash kernel (no sinks; dense, no window), interleaved: the Ascend
              kernel's configuration (B=8, HQ=64, HKV=4, S=2048, D=128, causal, fp16 and bf16) and
              gpt-oss shapes (HQ=64, HKV=8, D=64, bf16: causal full and window 128, dense and a packed
              batch of mixed lengths);
* ``flex``    the same shapes against FlexAttention with the sink added through its lse (compiling
              it takes a while, hence after the rest), sinkattn timed again beside it;
* ``sweep``   each kernel alone at a few tiles around the table's choice (time, registers, spills).

The JSON is rewritten after every unit, so a run cut short keeps what it measured; a unit that
would start past the budget is skipped and said so; a watchdog ends the run 45 s past the budget.
Needs no package metadata (run from the source tree with ``PYTHONPATH=src``) and no network.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from sinkattn import masks, sink  # noqa: E402
from sinkattn.backends import triton as triton_backend  # noqa: E402
from sinkattn.backends.capabilities import Batch  # noqa: E402
from sinkattn.backends.triton import config, launch, schedule  # noqa: E402
from sinkattn.testing import bench, cases, verify  # noqa: E402

MODES = ("fwd", "bwd", "fwdbwd")
SECTIONS = ("blocks", "check", "speed", "flex", "sweep")
P = bench.Problem
GPT_OSS = dict(HQ=64, HKV=8, D=64, dtype="bfloat16")
PACKED_LENS = (4096, 3000, 2048, 2000, 1024, 700, 517, 300, 129, 1)


def speed_problems(tiny: bool) -> dict[str, bench.Problem]:
    if tiny:
        return {"tiny causal fp16": P(1, 24, 4, 2, 32, dtype="float16"),
                "tiny packed w8 bf16": P(3, 0, 4, 2, 16, dtype="bfloat16", window=(7, 0), lens=(20, 5, 1))}
    return {
        "ascend fp16": P(8, 2048, 64, 4, 128, dtype="float16"),
        "ascend bf16": P(8, 2048, 64, 4, 128, dtype="bfloat16"),
        "gpt-oss full": P(4, 4096, **GPT_OSS),
        "gpt-oss window 128": P(4, 4096, **GPT_OSS, window=(127, 0)),
        "gpt-oss packed full": P(len(PACKED_LENS), 0, **GPT_OSS, lens=PACKED_LENS),
        "gpt-oss packed window 128": P(len(PACKED_LENS), 0, **GPT_OSS, window=(127, 0), lens=PACKED_LENS),
    }


class Report:
    """The run's JSON, rewritten after every unit; the clock the budget is read from."""

    def __init__(self, path: str | None, budget: float):
        self.path, self.budget, self.t0 = path, budget, time.perf_counter()
        self.data: dict = {}
        self.lock = threading.Lock()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def has_time(self, reserve: float) -> bool:
        return self.elapsed() + reserve <= self.budget

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", flush=True)

    def add(self, section: str, row: dict) -> None:
        with self.lock:
            self.data.setdefault(section, []).append(row)
        self.write()

    def write(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            if self.path:
                tmp = self.path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(self.data, f, indent=1)
                os.replace(tmp, self.path)


def environment(device: str) -> dict:
    info = bench.header(device) | dict(argv=sys.argv[1:], platform=platform.platform())
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= dict(capability=list(torch.cuda.get_device_capability()), sms=props.multi_processor_count,
                     shared_optin=getattr(props, "shared_memory_per_block_optin", None),
                     chip_table=config.chip_for(torch.device("cuda")))
    else:
        info |= dict(chip_table=None, note="Triton interpreter on CPU tensors: times are not GPU figures")
    return info


# ---------------------------------------------------------------------------------------------- blocks

def block_counts(report: Report, problems: dict) -> None:
    """Masked (cut) and unmasked (interior) tile-block pairs per kernel, for every chip's table."""
    for name, p in problems.items():
        window = masks.Window.of(p.causal, p.window)
        for chip in config.CHIPS:
            for kernel in config.KERNELS:
                blocks = config.blocks_for(chip, kernel, p.D, p.torch_dtype)
                c = schedule.count_blocks(kernel, p.seq_lens, p.seq_lens, window, blocks, p.HQ, p.HKV)
                report.add("blocks", dict(problem=name, chip=chip, kernel=kernel, tile=list(vars(blocks).values()),
                                          interior=c.interior, cut=c.cut, interior_share=round(c.interior_share, 4)))
        sm90 = [r for r in report.data["blocks"] if r["problem"] == name and r["chip"] == "sm90"]
        report.say(f"blocks {name}: sm90 unmasked share " + ", ".join(
            f"{r['kernel']} {r['interior_share']:.3f}" for r in sm90))


def blocks_markdown(rows: list[dict], problems: dict, chip: str = "sm90") -> str:
    """docs/backends.md's table of unmasked / masked (tile, block) pairs on ``chip``, from the ``blocks`` rows."""
    lines = [f"| shape ({chip} tiles) | forward: unmasked / masked (tile, block) pairs | dQ | dK/dV |",
             "|---|---|---|---|"]
    for name, p in problems.items():
        cells = []
        for kernel in ("fwd", "dq", "dkdv"):
            r = next(r for r in rows if (r["problem"], r["chip"], r["kernel"]) == (name, chip, kernel))
            cells.append(f"{r['interior']:,} / {r['cut']:,} ({r['interior_share']:.1%})")
        lines.append(f"| {name}: {p.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- check

def correctness(report: Report, device: str, tiny: bool) -> bool | None:
    """True when every case ran and passed, False when one failed, None when none ran."""
    ok = None
    # the boundary cases with scores of 1e6 and more: the backward's recomputed scores must be the forward's
    selected = [c for level in ("L0", "L1") for c in cases.cases(level)] + [
        c for c in cases.cases("boundary") if c.qk_uniform is not None and c.qk_uniform >= 1000]
    if tiny:
        selected = [c.scaled(max_len=32, max_heads=4, max_dim=32) for c in (selected[0], selected[3])]
    for case in selected:
        if not report.has_time(20):
            report.add("check", dict(case=case.name, skipped="time budget"))
            continue
        t0 = time.perf_counter()
        r = verify.run_case(case, "triton", repeats=3, device=device)
        ok = r.passed and ok is not False
        report.add("check", dict(case=case.name, passed=r.passed, deterministic=r.deterministic, error=r.error,
                                 seconds=round(time.perf_counter() - t0, 2),
                                 reports=[rep.as_dict() for rep in r.reports]))
        report.say(f"check {case.name}: {'pass' if r.passed else 'FAIL'} deterministic={r.deterministic}"
                   + (f" {r.error}" if r.error else ""))
    return ok


# ---------------------------------------------------------------------------------------------- speed

def _sdpa_flash(p, q, k, v, sinks):
    """SDPA with its flash kernel forced on CUDA (no sinks); on CPU whatever SDPA picks."""
    fn, note = bench.PROVIDERS["sdpa"](p, q, k, v, sinks)
    if fn is None or q.device.type != "cuda":
        return fn, note
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash(*args):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return fn(*args)
    return flash, "flash kernel, no sinks"


PROVIDERS = {"sinkattn": bench.sinkattn_provider(backend="triton"),
             "sinkattn_nosink": bench.sinkattn_provider(backend="triton", with_sinks=False),
             "sdpa_flash": _sdpa_flash,
             "flex_lse": bench.PROVIDERS["flex_lse"]}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_problem(report: Report, section: str, name: str, p: bench.Problem, providers, device: str,
                 repeats: int) -> None:
    """Every mode of ``p`` for ``providers``, interleaved; one row per (provider, mode)."""
    inputs = bench.problem_inputs(p, torch.device(device))
    built = {}
    for prov in providers:
        try:
            built[prov] = PROVIDERS[prov](p, *inputs)
        except Exception as exc:  # noqa: BLE001 - a provider that cannot start is reported
            built[prov] = None, f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    for mode in MODES:
        if not report.has_time(30):
            report.add(section, dict(problem=name, mode=mode, skipped="time budget"))
            continue
        steps, rows = {}, {}
        for prov, (fn, note) in built.items():
            rows[prov] = dict(problem=name, label=p.label, provider=prov, mode=mode, note=note, ms=None)
            if fn is None:
                continue
            try:
                step = bench.mode_step(fn, inputs, mode)
                t0 = time.perf_counter()
                rows[prov]["peak_growth_mib"] = bench.step_peak_growth_mib(step, device)   # also the warm-up
                rows[prov]["first_call_s"] = round(time.perf_counter() - t0, 2)
                step()
                steps[prov] = step
            except Exception as exc:  # noqa: BLE001 - a provider that fails is reported, not fatal
                rows[prov]["note"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        for prov, seconds in bench.time_interleaved(steps, repeats, warmup=0, device=device).items():
            rows[prov]["ms"] = seconds * 1e3
            rows[prov]["tflops"] = p.flops(mode) / seconds / 1e12
        ours = rows.get("sinkattn", {}).get("ms")
        for prov, row in rows.items():
            if ours and row["ms"] and prov != "sinkattn":
                row["sinkattn_time_ratio"] = ours / row["ms"]      # > 1: sinkattn slower than this peer
            report.add(section, row)
        report.say(f"{section} {name} {mode}: " + ", ".join(
            f"{prov} {row['ms']:.3f} ms" if row["ms"] else f"{prov} ({row['note'][:60]})"
            for prov, row in rows.items()))


# ---------------------------------------------------------------------------------------------- sweep

def _candidates(base: config.Blocks, tiny: bool) -> list[config.Blocks]:
    """The table's tile and four around it: key or row blocks halved or doubled."""
    if tiny:
        return [base, config.Blocks(32, 16, 1, 1)]
    B = config.Blocks
    out = [base, B(base.BM, base.BN * 2, base.num_warps, base.num_stages),
           B(base.BM, max(16, base.BN // 2), base.num_warps, base.num_stages),
           B(base.BM * 2, base.BN, min(8, base.num_warps * 2), base.num_stages),
           B(max(16, base.BM // 2), base.BN, base.num_warps, base.num_stages)]
    return list(dict.fromkeys(out))


def _time_launch(plan, device: str, repeats: int) -> tuple[float, object]:
    compiled = plan()                          # compiles
    _sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            plan()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            plan()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), compiled


def _sweep_plans(p: bench.Problem, chip, device: str) -> dict:
    """``kernel -> (blocks -> Launch)`` over one problem's inputs; the backward's inputs from a forward."""
    q, k, v, sinks = bench.problem_inputs(p, torch.device(device))
    if p.lens is None:
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
    cu = torch.tensor([0, *torch.tensor(p.seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    L = max(p.seq_lens)
    window = masks.Window.of(p.causal, p.window).folded(L, L)
    scale = p.D ** -0.5
    out, (m2, log2_l) = sink.with_sink(*triton_backend.forward(q, k, v, Batch(cu, cu, L, L), window, scale, True),
                                       sinks, base2=True)
    lse = torch.empty_like(m2)
    do = torch.randn_like(q)
    delta = torch.empty_like(lse)
    launch.delta(out, do, None, delta, chip)()
    dq, dk, dv = torch.empty_like(out), torch.empty(k.shape, device=device), torch.empty(v.shape, device=device)
    opts = dict(chip=chip, compensated=triton_backend.COMPENSATED, upcast=triton_backend._upcast(q.dtype))
    common = (cu, cu, scale, window, L)
    return {"fwd": lambda b: launch.forward(q, k, v, sinks.float(), out, lse, m2, log2_l, *common, **opts, blocks=b),
            "dq": lambda b: launch.dq(q, k, v, do, m2, log2_l, None, delta, dq, *common, **opts,
                                      exact=torch.zeros(1, dtype=torch.int32, device=device), exact_delta=False,
                                      blocks=b),
            "dkdv": lambda b: launch.dkdv(q, k, v, do, m2, log2_l, delta, dk, dv, *common, **opts, blocks=b)}


def sweep(report: Report, problems: dict, device: str, tiny: bool, repeats: int) -> None:
    """Each kernel alone on the first problem of each head dim, at tiles around the table's."""
    chip = config.chip_for(torch.device(device))
    picked = {}
    for name, p in problems.items():
        picked.setdefault(p.D, (name, p))
    for name, p in picked.values():
        for kernel, make in _sweep_plans(p, chip, device).items():
            base = config.blocks_for(chip, kernel, p.D, p.torch_dtype)
            for b in _candidates(base, tiny):
                row = dict(problem=name, label=p.label, kernel=kernel, tile=list(vars(b).values()),
                           table_choice=b == base)
                if not report.has_time(25):
                    report.add("sweep", row | dict(skipped="time budget"))
                    continue
                try:
                    ms, compiled = _time_launch(make(b), device, repeats)
                    row |= dict(ms=ms, registers=getattr(compiled, "n_regs", None),
                                spills=getattr(compiled, "n_spills", None),
                                shared=getattr(getattr(compiled, "metadata", None), "shared", None))
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a finding
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                report.add("sweep", row)
                report.say(f"sweep {name} {kernel} {row['tile']}: "
                           + (f"{row['ms']:.3f} ms regs={row['registers']} spills={row['spills']}"
                              if "ms" in row else row["error"][:100]))


# ---------------------------------------------------------------------------------------------- main

def _watchdog(report: Report, grace: float) -> None:
    def fire():
        report.data["stopped"] = f"watchdog: {report.budget + grace:.0f} s passed"
        report.write()
        print(f"[{report.elapsed():6.1f}s] stopped by the watchdog; partial JSON written", flush=True)
        os._exit(3)
    timer = threading.Timer(report.budget + grace, fire)
    timer.daemon = True
    timer.start()


def main(argv=None) -> int:
    ap = bench.script_parser(__doc__, repeats="10, tiny 1",
                             quick="tiny shapes (implied without a GPU: the interpreter)")
    ap.add_argument("--tiny", dest="quick", action="store_true", help="the same as --quick")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; units that would start later are skipped")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    args = bench.parse_script_args(ap, argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"argument --sections: unknown {unknown}; choose from {list(SECTIONS)}")
    tiny = args.quick or not HAS_GPU
    device = "cuda" if HAS_GPU else "cpu"
    repeats = args.repeats or (1 if tiny else 10)
    report = Report(args.json, args.budget)
    _watchdog(report, grace=45.0)
    report.data.update(environment=environment(device), tiny=tiny, budget_s=args.budget, sections=sections,
                       tables={chip: {f"{k}/{'fp32' if f else '16-bit'}/D{d}": list(vars(b).values())
                                      for (k, f, d), b in t.items()} for chip, t in config.TABLE.items()})
    report.write()
    report.say(f"{'GPU ' + torch.cuda.get_device_name() if HAS_GPU else 'no GPU: Triton interpreter'}, torch "
               f"{torch.__version__}, triton {triton.__version__}, budget {args.budget:.0f} s, sections {sections}")
    problems = speed_problems(tiny)
    ok = None                                   # None: not checked
    if "blocks" in sections:
        block_counts(report, speed_problems(tiny=False))       # host arithmetic: full size even when tiny
        print(blocks_markdown(report.data["blocks"], speed_problems(tiny=False)), flush=True)
    if "check" in sections:
        ok = correctness(report, device, tiny)
    if "speed" in sections:
        for name, p in problems.items():
            time_problem(report, "speed", name, p, ["sinkattn", "sinkattn_nosink", "sdpa_flash"], device, repeats)
    if "flex" in sections:
        for name, p in problems.items():
            time_problem(report, "flex", name, p, ["sinkattn", "flex_lse"], device, repeats)
    if "sweep" in sections:
        sweep(report, problems, device, tiny, repeats)
    report.data["verdict"] = dict(correctness_passed=ok, finished=True)
    report.write()
    report.say(f"verdict: correctness {({True: 'PASS', False: 'FAIL', None: 'not checked'})[ok]}"
               + ("" if HAS_GPU else "; no GPU: nothing timed here is a GPU figure"))
    return 1 if ok is False else 0


if __name__ == "__main__":
    sys.exit(main())
