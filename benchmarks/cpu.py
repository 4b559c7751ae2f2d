"""CPU benchmark: sinkattn's cpu backend against torch SDPA and eager sink attention, same run.

    python benchmarks/cpu.py [--quick] [--json FILE]

Prints medians and ratios (never asserts a speed). The peers:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with
  ``enable_gqa=True`` and no sinks, the fastest CPU attention a user has;
* ``eager``: sink attention as Hugging Face's gpt-oss model computes it
  (``sinkattn.eager``), scores materialized.

Sections: (1) dense causal B=1, HQ=16, HKV=4, S=2048, D=64, fwd and fwd+bwd, in
fp32 and bf16; (2) peak memory growth of fwd+bwd at S=16384, HQ=8, HKV=2, D=64,
fp32, each provider in a fresh process; (3) causal window (511, 0) against full
causal at S=8192.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import sinkattn
from sinkattn import eager


def _inputs(S, HQ, HKV, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, HQ, D, generator=g).to(dtype)
    k = torch.randn(1, S, HKV, D, generator=g).to(dtype)
    v = torch.randn(1, S, HKV, D, generator=g).to(dtype)
    sinks = torch.randn(HQ, generator=g)
    return q, k, v, sinks


def _provider(name, q, k, v, sinks, window=(-1, -1)):
    """A closure running one forward (``bwd=False``) or forward + backward."""
    if name == "sdpa":
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

        def run(bwd):
            a, b, c = (x.detach().requires_grad_(bwd) for x in (qt, kt, vt))
            out = F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
            if bwd:
                out.backward(torch.ones_like(out))
        return run

    fn = {"sinkattn": sinkattn.sink_attn_func, "eager": eager.sink_attention_dense}[name]

    def run(bwd):
        a, b, c, s = (x.detach().requires_grad_(bwd) for x in (q, k, v, sinks))
        if name == "eager":
            s = s.to(q.dtype)
        out = fn(a, b, c, sinks=s, causal=True, window_size=window)
        out = out[0] if isinstance(out, tuple) else out
        if bwd:
            out.backward(torch.ones_like(out))
    return run


def _time(runs: dict, bwd: bool, repeats: int) -> dict:
    """Median seconds per provider; providers interleaved within each repeat to share the noise."""
    for run in runs.values():
        run(bwd)
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run(bwd)
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def speed(dtype, repeats, S=2048, HQ=16, HKV=4, D=64):
    q, k, v, sinks = _inputs(S, HQ, HKV, D, dtype)
    runs = {p: _provider(p, q, k, v, sinks) for p in ("sinkattn", "sdpa", "eager")}
    rows = []
    for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
        t = _time(runs, bwd, repeats)
        rows.append(dict(section="speed", dtype=str(dtype).removeprefix("torch."), mode=mode,
                         shape=f"B=1 HQ={HQ} HKV={HKV} S={S} D={D} causal",
                         seconds=t, speed_vs_sdpa=t["sdpa"] / t["sinkattn"],
                         speed_vs_eager=t["eager"] / t["sinkattn"]))
    return rows


_MEMORY_CHILD = r"""
import sys, gc, torch
sys.path.insert(0, {here!r})
import cpu as bench
name, S = sys.argv[1], int(sys.argv[2])
q, k, v, sinks = bench._inputs(S, 8, 2, 64, torch.float32)
run = bench._provider(name, q, k, v, sinks)
gc.collect()
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")   # reset the peak (VmHWM) to the current RSS
base = status("VmRSS:")
run(True)
print(status("VmHWM:") - base)
"""


def memory(S=16384, providers=("sinkattn", "sdpa")):
    rows = []
    here = os.path.dirname(os.path.abspath(__file__))
    for name in providers:
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD.format(here=here), name, str(S)],
                             capture_output=True, text=True, check=True)
        growth = int(out.stdout.strip().splitlines()[-1])
        rows.append(dict(section="memory", provider=name, shape=f"B=1 HQ=8 HKV=2 S={S} D=64 fp32 fwd+bwd",
                         peak_growth_gib=growth / 2**30))
    scores = 8 * S * S * 4 / 2**30
    rows.append(dict(section="memory", provider="eager", shape=f"S={S}",
                     note=f"not run: its fp32 scores alone are 8*S*S*4 B = {scores:.1f} GiB"))
    return rows


def window(repeats, S=8192, HQ=16, HKV=4, D=64):
    q, k, v, sinks = _inputs(S, HQ, HKV, D, torch.float32)
    runs = {"causal": _provider("sinkattn", q, k, v, sinks),
            "window_511_0": _provider("sinkattn", q, k, v, sinks, window=(511, 0))}
    rows = []
    for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
        t = _time(runs, bwd, repeats)
        rows.append(dict(section="window", mode=mode, shape=f"B=1 HQ={HQ} HKV={HKV} S={S} D={D} fp32",
                         seconds=t, window_cost_vs_causal=t["window_511_0"] / t["causal"]))
    return rows


def header() -> dict:
    return dict(machine=platform.processor() or platform.machine(), cores=os.cpu_count(),
                threads=torch.get_num_threads(), torch=torch.__version__, sinkattn=sinkattn.__version__,
                python=platform.python_version())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats (smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    rows = []
    if args.quick:
        rows += speed(torch.float32, 2, S=256)
        rows += memory(S=1024)
        rows += window(2, S=1024)
    else:
        for dtype in (torch.float32, torch.bfloat16):
            rows += speed(dtype, args.repeats)
        rows += memory()
        rows += window(max(2, args.repeats // 2))
    info = header()
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    for r in rows:
        if r["section"] == "speed":
            t = r["seconds"]
            print(f"[speed] {r['dtype']:8s} {r['mode']:8s} sinkattn {t['sinkattn'] * 1e3:8.1f} ms | sdpa "
                  f"{t['sdpa'] * 1e3:8.1f} ms | eager {t['eager'] * 1e3:8.1f} ms | vs sdpa "
                  f"{r['speed_vs_sdpa']:.2f}x | vs eager {r['speed_vs_eager']:.2f}x   ({r['shape']})")
        elif r["section"] == "memory":
            if "peak_growth_gib" in r:
                print(f"[memory] {r['provider']:8s} peak growth {r['peak_growth_gib']:.3f} GiB   ({r['shape']})")
            else:
                print(f"[memory] {r['provider']:8s} {r['note']}")
        else:
            t = r["seconds"]
            print(f"[window] {r['mode']:8s} causal {t['causal'] * 1e3:8.1f} ms | window (511,0) "
                  f"{t['window_511_0'] * 1e3:8.1f} ms | cost {r['window_cost_vs_causal']:.3f}x   ({r['shape']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=info, rows=rows), f, indent=2)
    return rows


if __name__ == "__main__":
    main()
