"""Context-parallel benchmark: per-rank peak memory and time of one attention step (fwd+bwd)
with ``sinkattn.distributed`` over P ranks, against single-process ``sinkattn`` on the full tensors.

    torchrun --nproc-per-node P benchmarks/cp.py --json FILE   # one group size (gloo on CPU, NCCL on GPUs)
    python benchmarks/cp.py [--sizes 1 2 4] [--seq S] [--memory-only] [--repeats N] [--threads N] [--json FILE]
                            [--quick]   # torchrun per P

Problem: B=1, S tokens (default 8192), HQ=8, HKV=2, D=64, fp32, causal, learnable sinks, zigzag
layout; a step is ``out, lse = sink_attn_func(...)`` on this rank's shards and
``(out * dO).sum().backward()``. For P = 1 the step runs both ``sinkattn.sink_attn_func`` on the
full tensors (the peer) and the CP entry point on a group of one. Each rank reports the peak growth
of its memory over one step after a warm-up (CUDA allocator peak, or on CPU the RSS high-water mark,
measured in processes where glibc returns every block >= 64 KiB to the OS on free,
MALLOC_MMAP_THRESHOLD_=65536, so heap reuse cannot hide a peak; that setting slows allocation, so
time comes from separate processes) and the median time of ``--repeats`` steps. On CPU every rank
runs ``--threads`` torch threads, default one (set here: torchrun sets it for P > 1 only), so P = 4 on a
2-core machine shares cores: its times say how the work splits, not what 4 cores would do. Prints figures
and ratios to P = 1; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from sinkattn.testing import bench

PROBLEM = dict(B=1, HQ=8, HKV=2, D=64, causal=True, layout="zigzag")
METHODS = ("ring", "ulysses")


def _rank_figures(what: str, seq: int, repeats: int, threads: int) -> list[dict]:
    """Run under torchrun: this rank's figures for each method, gathered on every rank."""
    import torch
    import torch.distributed as dist

    import sinkattn
    import sinkattn.distributed as cp

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads)      # torchrun sets 1 only for nproc > 1: every P alike
    p = PROBLEM
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(p["B"], seq, h, p["D"], generator=g) for h in (p["HQ"], p["HKV"], p["HKV"], p["HQ"])]
    sinks = torch.randn(p["HQ"], generator=g).to(device).requires_grad_()
    local = [cp.shard(t, 1, layout=p["layout"]).to(device) for t in full]
    providers = {m: (lambda m=m: cp.sink_attn_func(*qkv(), sinks=sinks, causal=p["causal"], method=m,
                                                   layout=p["layout"], return_lse=True)) for m in METHODS}
    if P == 1:
        providers["single-process"] = lambda: sinkattn.sink_attn_func(*qkv(), sinks=sinks, causal=p["causal"],
                                                                     return_lse=True)
    leaves = [t.requires_grad_() for t in local[:3]]

    def qkv():
        return leaves

    rows = []
    for name, fn in providers.items():
        def step(fn=fn):
            for t in (*leaves, sinks):
                t.grad = None
            out, _ = fn()
            (out * local[3]).sum().backward()
        step()                                                   # warm-up
        row = dict(provider=name, P=P, rank=rank, S=seq, local_tokens=leaves[0].shape[1])
        if what in ("memory", "both"):
            row["peak_growth_mib"] = bench.step_peak_growth_mib(step, device)
        if what in ("time", "both"):
            seconds = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize()
                seconds.append(time.perf_counter() - t0)
            row.update(seconds=statistics.median(seconds), samples=seconds)
        rows.append(row)
    gathered = [None] * P
    dist.all_gather_object(gathered, rows)
    dist.destroy_process_group()
    return [r for per_rank in gathered for r in per_rank]


def _start(P: int, what: str, seq: int, repeats: int, same_process: bool, tmp: str, threads: int):
    """Start one torchrun of P ranks measuring ``what`` ("memory", "time" or "both") with ``threads``
    torch threads each on CPU; rank 0 writes every rank's rows to a file in ``tmp``. Returns
    ``(process, that file)``."""
    out = os.path.join(tmp, f"rows-{P}-{what}.json")
    env = dict(os.environ)
    if what == "memory" and not same_process:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(P), "--master-port",
            str(29500 + os.getpid() % 1000 + 7 * P), __file__, "--worker", what, str(seq), str(repeats), out,
            "--threads", str(threads)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env), out


def _finish(started, label: str) -> list[dict]:
    process, out = started
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def _summary(rows: list[dict]) -> list[dict]:
    """Per (provider, P): the largest per-rank peak and the slowest rank's median time (with its min and max),
    and ratios to P = 1."""
    table = {}
    for r in rows:
        entry = table.setdefault((r["provider"], r["P"]), dict(provider=r["provider"], P=r["P"],
                                                              local_tokens=r["local_tokens"]))
        if "peak_growth_mib" in r:
            entry["max_rank_peak_growth_mib"] = max(entry.get("max_rank_peak_growth_mib", 0), r["peak_growth_mib"])
        if "seconds" in r and r["seconds"] >= entry.get("max_rank_seconds", 0):    # the slowest rank, its spread
            entry["max_rank_seconds"] = r["seconds"]
            entry["max_rank_seconds_min"], entry["max_rank_seconds_max"] = min(r["samples"]), max(r["samples"])
    single = table.get(("single-process", 1))
    for (provider, _), e in table.items():
        base = table.get((provider, 1)) if provider != "single-process" else None
        for key in ("max_rank_peak_growth_mib", "max_rank_seconds"):
            for peer, suffix in ((base, "_vs_P1"), (single, "_vs_single_process")):
                if peer and key in e and peer.get(key):
                    e[key.replace("max_rank_", "") + suffix] = e[key] / peer[key]
    return sorted(table.values(), key=lambda e: (e["provider"], e["P"]))


def main(argv=None) -> dict:
    ap = bench.script_parser(__doc__, repeats=3, threads=1, quick="smoke run: S=256, P = 1 and 2, one repeat, "
                                                                  "memory and time in one process per P")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--memory-only", action="store_true", help="peak memory only (no timing runs)")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = bench.parse_script_args(ap, argv)
    if args.worker:
        what, seq, repeats, out = args.worker
        rows = _rank_figures(what, int(seq), int(repeats), args.threads)
        if int(os.environ.get("RANK", 0)) == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
        return {}
    if "RANK" in os.environ:            # started by torchrun directly: this group size only
        rows = _rank_figures("both", args.seq, args.repeats, args.threads)
        if int(os.environ["RANK"]) == 0:
            _report(rows, args)
        return {}
    sizes, seq, repeats = ([1, 2], 256, 1) if args.quick else (args.sizes, args.seq, args.repeats)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:          # smoke run: every group size at once, figures not clean
            started = [(P, _start(P, "both", seq, repeats, True, tmp, args.threads)) for P in sizes]
            for P, run in started:
                rows += _finish(run, f"P={P}")
        else:                   # one group size, one kind of figure at a time
            for P in sizes:
                for what in ("memory",) if args.memory_only else ("memory", "time"):
                    rows += _finish(_start(P, what, seq, repeats, False, tmp, args.threads), f"P={P} {what}")
    return _report(rows, args, seq, repeats)


def _spread(entry: dict):
    return bench.Spread(entry["max_rank_seconds_min"], entry["max_rank_seconds"], entry["max_rank_seconds_max"])


def _report(rows, args, seq=None, repeats=None) -> dict:
    info = bench.header()
    summary = _summary(rows)
    single = next((e for e in summary if e["provider"] == "single-process"), {})
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"problem: {PROBLEM}, S={seq or args.seq}, fp32, forward+backward, time: the slowest rank's median "
          f"(min-max) of {repeats or args.repeats} steps")
    for e in summary:
        mem = e.get("max_rank_peak_growth_mib")
        sec = e.get("max_rank_seconds")
        # a peak growth of 0 (freed memory reused, RSS did not grow) has no ratio
        vs = [f"{e[k + '_vs_single_process']:.3f}x single" if k + "_vs_single_process" in e
              else "single measured 0" if single.get("max_rank_" + k) == 0 else "-"
              for k in ("peak_growth_mib", "seconds")]
        time_text = "-" if sec is None else (f"{sec * 1e3:9.1f} ms ({e['max_rank_seconds_min'] * 1e3:.1f}-"
                                             f"{e['max_rank_seconds_max'] * 1e3:.1f})")
        print(f"  {e['provider']:15s} P={e['P']}  local tokens {e['local_tokens']:6d}  "
              f"peak growth/rank {'-' if mem is None else f'{mem:8.1f} MiB'} ({vs[0]})  "
              f"time {time_text} ({vs[1]})")
    noise = bench.noise_warning((f"{e['provider']} P={e['P']}", _spread(e)) for e in summary if "max_rank_seconds" in e)
    if noise:
        print(noise)
    report = dict(header=info, problem=PROBLEM | dict(S=seq or args.seq), rows=rows, summary=summary,
                  noise_warning=noise)
    bench.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
