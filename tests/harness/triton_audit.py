"""Resource audit of the Triton kernels: compile every launch configuration the backend can choose,
for each GPU generation it has a table for, and read ptxas' report. No GPU is needed.

    PYTHONPATH=tests python -m harness.triton_audit [--out FILE] [--reuse FILE] [--jobs N] [--only TEXT]
                                                    [--markdown] [--tile BM,BN,WARPS,STAGES]

(from the repository root, with sinkattn importable: installed, or ``PYTHONPATH=src:tests``)

A configuration is (chip, kernel, dtype, head dim, variant): chips ``config.CHIPS``; kernels
``fwd``, ``dkdv``, ``dq``, ``delta``; fp16, bf16, fp32; head dims 16, 32, 64, 128, 256, 512 (every
padded width the kernels take), 72 and 320 (padded to 128 and 512: the same kernels as 128 and 512),
where the chip's table has a tile (``sm86`` has no fp32 dK/dV or dQ at 512); variants the
constexpr flags a call can set (compensated products for fp16 / bf16, the dQ kernel's exact Delta
with or without an lse gradient, the Delta kernel's lse gradient). Each is built by the launchers'
own plan (``backends.triton.launch``) from example tensors (8 query heads, 2 KV heads, 256 tokens),
specialized as Triton's JIT would specialize those arguments, compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, whose ``ptxas -v`` report
(Triton's own ptxas run, its flags) is read. Recorded per configuration: shared memory (Triton's
dynamic allocation), registers, stack frame, spill stores and loads.

Limits (``problems``): shared memory at most the chip's ``shared_bytes``; no spill in fp16 / bf16.
fp32 may spill; docs/backends.md lists where and how much.

Each entry carries a ``key``: a hash of the kernels' source, the Triton and ptxas versions and
everything that decides the compile (signature, constexprs, warps, stages, arch). Configurations
with one key are one kernel, compiled once (D = 72 runs the D = 128 kernel on zero-padded
tensors); ``--reuse`` takes entries whose key is unchanged from an earlier JSON instead of
compiling them again; the tests recompute the keys to prove the recorded JSON covers what the
code chooses today.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["Config", "configs", "entry_key", "compile_config", "run", "problems", "markdown", "main",
           "EXAMPLE_HEAD_DIMS", "DTYPES"]

DTYPES = ("float16", "bfloat16", "float32")
EXAMPLE_HEAD_DIMS = (16, 32, 64, 128, 256, 512, 72, 320)
EXAMPLE_SHAPE = dict(T=256, HQ=8, HKV=2, N=2)


@dataclass(frozen=True)
class Config:
    chip: str
    kernel: str
    dtype: str
    head_dim: int
    compensated: bool = False
    exact_delta: bool = False
    dlse: bool = False
    tile: tuple[int, int, int, int] | None = None      # (BM, BN, warps, stages) instead of the table's

    @property
    def name(self) -> str:
        flags = [f for f, on in (("compensated", self.compensated), ("exact_delta", self.exact_delta),
                                 ("dlse", self.dlse)) if on]
        tile = [f"tile{'_'.join(map(str, self.tile))}"] if self.tile else []
        return "/".join([self.chip, self.kernel, self.dtype, f"D{self.head_dim}", *flags, *tile])


def _variants(kernel: str, low_precision: bool) -> list[dict]:
    """The constexpr flags a call can set for ``kernel``: COMPENSATED (fp16 / bf16 only, the
    default and the opt-out), the dQ kernel's EXACT_DELTA with or without an lse gradient (every
    backward launches both EXACT_DELTA variants; the device flag picks the one that works),
    the Delta kernel's lse gradient."""
    comp = [dict(compensated=True), dict(compensated=False)] if low_precision else [dict(compensated=False)]
    if kernel == "dq":
        return [c | d for c in comp for d in (dict(), dict(exact_delta=True), dict(exact_delta=True, dlse=True))]
    if kernel == "delta":
        return [dict(), dict(dlse=True)]
    return comp


def configs(chips=None) -> list[Config]:
    """Every configuration the backend can choose, on ``chips`` (default: all of ``config.CHIPS``):
    those its table has a tile for (``config.blocks_for`` refuses the others)."""
    from sinkattn.backends.triton import config

    out = []
    for chip in chips or config.CHIPS:
        for dtype in DTYPES:
            for D in EXAMPLE_HEAD_DIMS:
                for kernel in (*config.KERNELS, "delta"):
                    try:
                        config.blocks_for(chip, kernel, D, getattr(torch, dtype))
                    except NotImplementedError:
                        continue
                    for flags in _variants(kernel, dtype != "float32"):
                        out.append(Config(chip, kernel, dtype, D, **flags))
    return out


def _example(cfg: Config):
    """The launch plan of ``cfg`` over example CPU tensors (never launched)."""
    from sinkattn.backends.triton import config, launch
    from sinkattn.masks import Window

    dt = getattr(torch, cfg.dtype)
    T, HQ, HKV, N = (EXAMPLE_SHAPE[k] for k in ("T", "HQ", "HKV", "N"))
    D = config.block_d(cfg.head_dim)            # the launchers pad the head dim to this
    q, do = torch.zeros(T, HQ, D, dtype=dt), torch.zeros(T, HQ, D, dtype=dt)
    k, v = torch.zeros(T, HKV, D, dtype=dt), torch.zeros(T, HKV, D, dtype=dt)
    cu = torch.arange(0, T + 1, T // N, dtype=torch.int32)
    f32 = dict(dtype=torch.float32)
    stats = [torch.zeros(HQ, T, **f32) for _ in range(4)]          # lse / m2 / log2_l / delta
    dlse = torch.zeros(HQ, T, **f32) if cfg.dlse else None
    out = torch.zeros(T, HQ, D, **f32)
    common = dict(chip=cfg.chip, compensated=cfg.compensated, upcast=False)
    if cfg.tile is not None and cfg.kernel != "delta":
        common["blocks"] = config.Blocks(*cfg.tile)
    if cfg.kernel == "fwd":
        return launch.forward(q, k, v, torch.zeros(HQ, **f32), out, *stats[:3], cu, cu, D ** -0.5, Window(-1, 0),
                              T // N, **common)
    if cfg.kernel == "delta":
        return launch.delta(out, do, dlse, stats[3], cfg.chip)
    grads = (q, k, v, do, stats[1], stats[2])
    if cfg.kernel == "dq":
        return launch.dq(*grads, dlse, stats[3], out, cu, cu, D ** -0.5, Window(-1, 0), T // N, **common,
                         exact=torch.zeros(1, dtype=torch.int32), exact_delta=cfg.exact_delta)
    dk, dv = torch.zeros(T, HKV, D, **f32), torch.zeros(T, HKV, D, **f32)
    return launch.dkdv(*grads, stats[3], dk, dv, cu, cu, D ** -0.5, Window(-1, 0), T // N, **common)


def _specialize(plan):
    """``(signature, constexprs, attrs)`` as Triton's JIT specializes the plan's arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    args = dict(plan.args)
    if plan.programs is not None:
        args["chunk"] = 0
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(plan.kernel.params):
        value = args[p.name]
        if p.is_constexpr:
            kind, spec = "constexpr", value
        else:
            kind, spec = native_specialize_impl(CUDABackend, value, p.is_const, not p.do_not_specialize,
                                                not p.do_not_specialize_on_alignment)
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = spec
        elif spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    return signature, constexprs, attrs


def _source_hash() -> str:
    from sinkattn.backends.triton import kernels

    return hashlib.sha256(Path(kernels.__file__).read_bytes()).hexdigest()[:16]


def _ptxas(arch: int):
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def toolchain() -> dict:
    """Versions that decide the compile: Triton, and ptxas per arch."""
    import triton

    from sinkattn.backends.triton import config

    versions = {}
    for chip in config.CHIPS.values():
        out = subprocess.run([_ptxas(chip.arch), "--version"], capture_output=True, text=True).stdout
        versions[str(chip.arch)] = out.strip().splitlines()[-1]
    return dict(triton=triton.__version__, ptxas=versions, kernels_sha256=_source_hash())


def entry_key(cfg: Config, tools: dict) -> str:
    """Hash of everything that decides ``cfg``'s compile: kernel source, toolchain, the specialized
    signature and constexprs of its launch plan, its warps and stages, the arch."""
    from sinkattn.backends.triton import config

    plan = _example(cfg)
    signature, constexprs, attrs = _specialize(plan)
    arch = config.CHIPS[cfg.chip].arch
    text = json.dumps([tools["kernels_sha256"], tools["triton"], tools["ptxas"][str(arch)], plan.kernel.__name__,
                       signature, sorted((str(k), str(v)) for k, v in constexprs.items()),
                       sorted((str(k), str(v)) for k, v in attrs.items()), asdict(plan.blocks), arch])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                    r".*?Used (\d+) registers", re.S)


@dataclass
class Entry:
    name: str
    config: dict
    blocks: dict
    key: str
    shared_bytes: int | None = None
    registers: int | None = None
    stack_bytes: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    seconds: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


def compile_config(cfg: Config, tools: dict) -> Entry:
    """Compile ``cfg`` for its chip; the figures come from the report of the ``ptxas -v`` that Triton
    itself runs on the PTX (its flags, its ptxas), caught with Triton's cache bypassed."""
    import contextlib
    import io

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sinkattn.backends.triton import config

    plan = _example(cfg)
    entry = Entry(cfg.name, asdict(cfg), asdict(plan.blocks), entry_key(cfg, tools))
    arch = config.CHIPS[cfg.chip].arch
    t0 = time.perf_counter()
    log = io.StringIO()
    saved = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    try:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
        signature, constexprs, attrs = _specialize(plan)
        src = ASTSource(plan.kernel, signature, constexprs, attrs)
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=plan.blocks.num_warps,
                                                   num_stages=plan.blocks.num_stages))
        entry.shared_bytes = int(compiled.metadata.shared)
        found = _PTXAS.search(log.getvalue())
        if not found:
            raise RuntimeError(f"no ptxas report in: {log.getvalue()[-500:]!r}")
        entry.stack_bytes, entry.spill_stores, entry.spill_loads, entry.registers = map(int, found.groups())
    except Exception as exc:  # noqa: BLE001 - a configuration that does not build is a finding
        entry.error = f"{type(exc).__name__}: {str(exc)[:500]}"
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    entry.seconds = round(time.perf_counter() - t0, 2)
    return entry


def _compile_one(args):
    cfg, tools = args
    return compile_config(cfg, tools)


def run(cfgs, jobs: int = 1, reuse: dict | None = None, progress=print) -> tuple[dict, list[Entry]]:
    """``(toolchain, entries)`` for ``cfgs``; entries of ``reuse`` (name -> entry dict) whose key
    is unchanged are taken as they are."""
    tools = toolchain()
    keys = {cfg.name: entry_key(cfg, tools) for cfg in cfgs}
    done = {}                                   # key -> Entry, compiled once per key
    for old in (reuse or {}).values():
        if old.get("error") is None and old["key"] in keys.values():
            done.setdefault(old["key"], Entry(**old))
    first = {}
    for c in cfgs:
        first.setdefault(keys[c.name], c)
    todo = [c for key, c in first.items() if key not in done]
    progress(f"{len(cfgs)} configurations, {len(set(keys.values()))} distinct kernels: {len(todo)} to compile "
             f"({jobs} jobs)")
    # spawn, not fork: a child forked from a process that already ran Triton and torch can deadlock
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) \
            as pool:
        for i, entry in enumerate(pool.map(_compile_one, [(c, tools) for c in todo]), 1):
            done[entry.key] = entry
            progress(f"[{i}/{len(todo)}] {_line(entry)}")
    out = []
    for cfg in cfgs:
        first = done[keys[cfg.name]]
        same = first.name if first.name != cfg.name else None
        out.append(Entry(**(asdict(first) | dict(name=cfg.name, config=asdict(cfg),
                                                   extra=dict(same_kernel_as=same) if same else {}))))
    return tools, out


def _line(e: Entry) -> str:
    if e.error:
        return f"{e.name}: ERROR {e.error[:200]}"
    return (f"{e.name}: smem {e.shared_bytes / 1024:.0f} KiB, {e.registers} regs, spill {e.spill_stores} B "
            f"({e.seconds:.1f} s)")


def problems(entries) -> list[str]:
    """What breaks the limits: a build error, shared memory past the chip's, a spill in fp16 / bf16."""
    from sinkattn.backends.triton import config

    out = []
    for e in entries:
        e = e if isinstance(e, dict) else asdict(e)
        limit = config.CHIPS[e["config"]["chip"]].shared_bytes
        if e["error"]:
            out.append(f"{e['name']}: does not build: {e['error'][:200]}")
            continue
        if e["shared_bytes"] > limit:
            out.append(f"{e['name']}: needs {e['shared_bytes']} bytes of shared memory, the chip has {limit}")
        if e["config"]["dtype"] != "float32" and (e["spill_stores"] or e["spill_loads"]):
            out.append(f"{e['name']}: spills {e['spill_stores']} bytes (stores), {e['spill_loads']} (loads)")
    return out


def markdown(entries) -> str:
    """The docs' summary: per chip and kernel the largest shared memory and register count, the
    spill-free count, and every fp32 configuration that spills, with its size."""
    from sinkattn.backends.triton import config

    entries = [e if isinstance(e, dict) else asdict(e) for e in entries]
    lines = ["| chip (shared memory) | kernel | fp16 / bf16: configs, max regs, max smem | "
             "fp32: configs, max regs, max smem, spilling |", "|---|---|---|---|"]
    for chip, spec in config.CHIPS.items():
        for kernel in (*config.KERNELS, "delta"):
            cells = []
            for fp32 in (False, True):
                es = [e for e in entries if e["config"]["chip"] == chip and e["config"]["kernel"] == kernel
                      and (e["config"]["dtype"] == "float32") == fp32 and not e["error"]]
                if not es:                      # not in this run (--only)
                    cells.append("-")
                    continue
                regs = max(e["registers"] for e in es)
                smem = max(e["shared_bytes"] for e in es) / 1024
                cell = f"{len(es)}, {regs}, {smem:.0f} KiB"
                if fp32:
                    cell += f", {sum(1 for e in es if e['spill_stores'])}"
                cells.append(cell)
            if cells != ["-", "-"]:
                lines.append(f"| {chip} ({spec.shared_bytes // 1024} KiB) | {kernel} | {cells[0]} | {cells[1]} |")
    spills = [e for e in entries if e["config"]["dtype"] == "float32" and e["spill_stores"]]
    lines += ["", "fp32 configurations that spill (bytes of spill stores / loads per thread):", ""]
    if spills:
        lines += ["| configuration | tile (BM, BN, warps, stages) | spill stores / loads |", "|---|---|---|"]
        for e in spills:
            b = e["blocks"]
            lines.append(f"| {e['name']} | {b['BM']}, {b['BN']}, {b['num_warps']}, {b['num_stages']} | "
                         f"{e['spill_stores']} / {e['spill_loads']} |")
    else:
        lines.append("none.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--reuse", help="an earlier JSON: entries whose key is unchanged are not compiled again")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)))
    ap.add_argument("--only", help="only configurations whose name contains this text (e.g. sm90/fwd)")
    ap.add_argument("--markdown", action="store_true", help="print the docs' summary table")
    ap.add_argument("--tile", help="BM,BN,WARPS,STAGES: compile the --only configurations at this tile instead "
                                   "of the table's (to try a tile; not for the record)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled for a GPU")
    tile = None
    if args.tile:
        try:
            tile = tuple(int(x) for x in args.tile.split(","))
        except ValueError:
            tile = ()
        if len(tile) != 4 or not args.only:
            ap.error(f"argument --tile: expected BM,BN,WARPS,STAGES (four integers) with --only, got {args.tile!r}")
    cfgs = [dataclasses.replace(c, tile=tile) for c in configs() if not args.only or args.only in c.name]
    reuse = None
    if args.reuse and Path(args.reuse).exists():
        reuse = {e["name"]: e for e in json.loads(Path(args.reuse).read_text())["entries"]}
    t0 = time.perf_counter()
    tools, entries = run(cfgs, jobs=args.jobs, reuse=reuse, progress=lambda s: print(s, flush=True))
    found = problems(entries)
    report = dict(command="PYTHONPATH=tests python -m harness.triton_audit " + " ".join(argv or sys.argv[1:]),
                  toolchain=tools, example_shape=EXAMPLE_SHAPE, seconds=round(time.perf_counter() - t0, 1),
                  problems=found, entries=[asdict(e) for e in entries])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        print(markdown(entries))
    print(f"{len(entries)} configurations, {len(found)} problems" + "".join(f"\n  {p}" for p in found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
