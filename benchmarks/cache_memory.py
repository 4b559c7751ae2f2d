"""Resident memory over many packed calls whose lengths change every call (as in packed training).

    python benchmarks/cache_memory.py [--calls 300] [--window 2047,2047] [--max-len 4096] [--report 50]
                                      [--threads N] [--json FILE] [--quick]

Each call is fwd+bwd on a packed batch of new random lengths (fp32, HQ=4, HKV=2, D=32, the
given window). Prints the process's resident memory after a warm-up call and after every
``--report`` calls, and the growth; any cache that keeps memory per length shows up as growth.
Run in a fresh process (it is its own). Nothing is timed (no ``--repeats``); torch runs at most
2 threads unless ``--threads`` says otherwise. Asserts nothing: the test suite runs a smaller copy.
"""

from __future__ import annotations

import random

import torch

import sinkattn
from sinkattn.testing import bench


QUICK = dict(calls=20, max_len=512, report=10)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def one_call(rng: random.Random, window, max_len: int, HQ=4, HKV=2, D=32) -> None:
    lens = [rng.randint(1, max_len) for _ in range(rng.randint(1, 4))]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    T = sum(lens)
    q = torch.randn(T, HQ, D, requires_grad=True)
    k = torch.randn(T, HKV, D, requires_grad=True)
    v = torch.randn(T, HKV, D, requires_grad=True)
    sinks = torch.zeros(HQ, requires_grad=True)
    out = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), sinks=sinks,
                                         window_size=window)
    out.sum().backward()


def measure(calls: int, window, max_len: int, report: int, seed: int = 0, threads: int | None = None) -> dict:
    rng = random.Random(seed)
    torch.set_num_threads(threads or min(2, torch.get_num_threads()))
    one_call(rng, window, max_len)
    start = rss_mib()
    trace = [(0, start)]
    for i in range(1, calls + 1):
        one_call(rng, window, max_len)
        if i % report == 0:
            trace.append((i, rss_mib()))
    return dict(calls=calls, window=list(window), max_len=max_len, threads=torch.get_num_threads(), rss_start_mib=start,
                rss_end_mib=trace[-1][1], growth_mib=trace[-1][1] - start, trace=trace)


def main(argv=None) -> dict:
    ap = bench.script_parser(__doc__, repeats=None, threads="at most 2",
                             quick=f"smoke run: {QUICK['calls']} calls of up to {QUICK['max_len']} tokens, RSS every "
                                   f"{QUICK['report']}")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--window", default="2047,2047", help="left,right")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--report", type=int, default=50)
    args = bench.parse_script_args(ap, argv)
    window = tuple(int(x) for x in args.window.split(","))
    sizes = QUICK if args.quick else dict(calls=args.calls, max_len=args.max_len, report=args.report)
    result = measure(sizes["calls"], window, sizes["max_len"], sizes["report"], threads=args.threads)
    for i, rss in result["trace"]:
        print(f"after {i:4d} calls: RSS {rss:8.1f} MiB")
    print(f"growth over {result['calls']} calls with new lengths, window {window}: {result['growth_mib']:.1f} MiB")
    bench.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
