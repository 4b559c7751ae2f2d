"""CPU benchmark: sinkattn's cpu backend against torch SDPA and eager sink attention, same run.

    python benchmarks/cpu.py [--quick] [--repeats N] [--threads N] [--json FILE] [--sections S [S ...]]
                             [--dtypes T [T ...]] [--isa LEVEL]

Prints medians and ratios (never asserts a speed). The peers:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with
  ``enable_gqa=True`` and no sinks, the fastest CPU attention a user has;
* ``eager``: sink attention as Hugging Face's gpt-oss model computes it
  (``sinkattn.testing.eager``), scores materialized.

Sections: (1) dense causal B=1, HQ=16, HKV=4, S=2048, D=64, fwd and fwd+bwd, in
fp32, bf16 and fp16 (``--dtypes``); (2) peak memory growth of fwd+bwd at S=16384, HQ=8, HKV=2, D=64,
fp32, each provider in a fresh process after a tiny warm-up call; (3) causal window (511, 0) against full
causal at S=8192; (4) small shapes, fwd+bwd, where the cost per call is overheads more than arithmetic:
dense causal HQ=4, HKV=2, D=32, fp32 at B=1 and S in {64, 128, 256}, B=4 at S=128, and a packed batch of
short documents (lengths 96, 40, 72, 48; SDPA takes no packed batch); (5) ``products``: section (1)'s
shape in bf16, fwd+bwd and bwd, the compiled kernel's fp32 products against its bf16 ones
(``SINKATTN_CPU_PRODUCTS=fp32`` / ``bf16``, ``sinkattn.backends.cpu_native``) and SDPA bf16, interleaved.
(6) ``split``: fp32 causal B=1, HQ=16, S=2048, D=64 fwd+bwd at HKV=1 and HKV=4, the compiled backward's
fused tasks (one per sequence and KV head) against its split passes (``cpu.BACKWARD_SPLIT``; ``auto``
takes them where the fused tasks would keep at most half of the threads busy and the sequences have two
chunks of keys), interleaved. ``--threads`` applies to the processes of section (2) too.

``--isa avx2`` (or ``avx512``, ``avx512_bf16``, ``default``) reruns the whole script in a process whose
PyTorch, MKL and oneDNN are held to that instruction set (``tests/harness/isa.py``): what a CPU without
AVX-512 (or without its bf16 instructions, or without AMX) runs, timed on this one (on a CPU of that
level too: the header then records the ceiling). The header records the capability PyTorch took.

The levels come from the test harness, which is not installed with sinkattn: the script puts the
repository's ``tests`` folder on ``sys.path`` to import ``harness.isa``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

from sinkattn.testing import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the test harness: tests/harness
from harness import isa  # noqa: E402


def speed(dtype: str, repeats: int, S=2048, HQ=16, HKV=4, D=64):
    problem = bench.Problem(1, S, HQ, HKV, D, dtype=dtype)
    rows = []
    measured = bench.run([problem], ("sinkattn", "sdpa", "eager"), ("fwd", "fwdbwd"), repeats=repeats)
    for mode, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
        t = {r.provider: r.ms / 1e3 for r in measured if r.mode == mode}
        rows.append(dict(section="speed", dtype=dtype, mode=label, shape=f"B=1 HQ={HQ} HKV={HKV} S={S} D={D} causal",
                         seconds=t, speed_vs_sdpa=t["sdpa"] / t["sinkattn"],
                         speed_vs_eager=t["eager"] / t["sinkattn"]))
    return rows


_MEMORY_CHILD = """
import sys
import torch
from sinkattn.testing import bench
provider, S, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if threads:
    torch.set_num_threads(threads)
bench.peak_growth_mib(bench.Problem(1, 64, 8, 2, 64), provider)   # one-time lazy initialisation
print(bench.peak_growth_mib(bench.Problem(1, S, 8, 2, 64), provider, "fwdbwd"))
"""


def memory(S=16384, providers=("sinkattn", "sdpa"), threads=None):
    """Peak memory growth of fwd+bwd, each provider in a fresh process (with ``threads`` torch threads,
    None: torch's choice), after one tiny warm-up call so that the process's one-time initialisation is
    not counted as the call's memory."""
    rows = []
    for name in providers:
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, name, str(S), str(threads or 0)],
                             capture_output=True, text=True, check=True)
        growth_mib = float(out.stdout.strip().splitlines()[-1])
        rows.append(dict(section="memory", provider=name, shape=f"B=1 HQ=8 HKV=2 S={S} D=64 fp32 fwd+bwd",
                         peak_growth_gib=growth_mib / 2**10))
    scores = 8 * S * S * 4 / 2**30
    rows.append(dict(section="memory", provider="eager", shape=f"S={S}", S=S, scores_gib=scores,
                     note=f"not run: its fp32 scores alone are 8*S*S*4 B = {scores:.1f} GiB"))
    return rows


def window(repeats, S=8192, HQ=16, HKV=4, D=64):
    causal = bench.Problem(1, S, HQ, HKV, D)
    windowed = bench.Problem(1, S, HQ, HKV, D, window=(511, 0))
    rows = []
    for mode, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
        t = bench.time_interleaved({"causal": bench.sinkattn_step(causal, mode),
                                    "window_511_0": bench.sinkattn_step(windowed, mode)}, repeats)
        rows.append(dict(section="window", mode=label, shape=f"B=1 HQ={HQ} HKV={HKV} S={S} D={D} fp32",
                         seconds=t, window_cost_vs_causal=t["window_511_0"] / t["causal"]))
    return rows


def _within(context, step):
    """``step`` run inside a fresh ``context()`` each time."""
    def run():
        with context():
            step()
    return run


def _with_products(fn, inputs, mode: str, value: str):
    """``bench.mode_step`` made and run with ``SINKATTN_CPU_PRODUCTS=value`` (a ``bwd`` step's forward included)."""
    def products():
        return mock.patch.dict(os.environ, SINKATTN_CPU_PRODUCTS=value)
    with products():
        step = bench.mode_step(fn, inputs, mode)
    return _within(products, step)


def products(repeats, S=2048, HQ=16, HKV=4, D=64):
    """bf16 training calls with the kernel's fp32 and bf16 products, and SDPA bf16, interleaved (a call
    without gradients runs PyTorch's fused kernel, not these products)."""
    p = bench.Problem(1, S, HQ, HKV, D, dtype="bfloat16")
    inputs = bench.problem_inputs(p, "cpu")
    ours, _ = bench.PROVIDERS["sinkattn"](p, *inputs)
    sdpa, _ = bench.PROVIDERS["sdpa"](p, *inputs)
    rows = []
    for mode, label in (("fwdbwd", "fwd+bwd"), ("bwd", "bwd")):
        steps = {f"{value}_products": _with_products(ours, inputs, mode, value) for value in ("fp32", "bf16")}
        steps["sdpa"] = bench.mode_step(sdpa, inputs, mode)
        t = bench.time_interleaved(steps, repeats)
        rows.append(dict(section="products", mode=label, shape=f"B=1 HQ={HQ} HKV={HKV} S={S} D={D} causal bf16",
                         seconds=t, bf16_vs_fp32_products=t["fp32_products"] / t["bf16_products"],
                         bf16_products_vs_sdpa=t["sdpa"] / t["bf16_products"],
                         fp32_products_vs_sdpa=t["sdpa"] / t["fp32_products"]))
    return rows


def split(repeats, S=2048, HQ=16, D=64):
    """fwd+bwd with the backward's fused tasks and with its split passes, interleaved; ``auto``: the kernel's
    rule (the fused tasks keep at most half of the threads busy, the sequence has two chunks of keys)."""
    import torch

    from sinkattn.backends import cpu, cpu_tiles
    rows = []
    for HKV in (1, 4):
        p = bench.Problem(1, S, HQ, HKV, D)
        inputs = bench.problem_inputs(p, "cpu")
        fn, _ = bench.PROVIDERS["sinkattn"](p, *inputs)
        steps = {name: _within(lambda value=value: mock.patch.object(cpu, "BACKWARD_SPLIT", value),
                               bench.mode_step(fn, inputs, "fwdbwd"))
                 for name, value in (("fused", 1), ("split", 2))}
        t = bench.time_interleaved(steps, repeats)
        rows.append(dict(section="split", mode="fwd+bwd", shape=f"B=1 HQ={HQ} HKV={HKV} S={S} D={D} causal fp32",
                         seconds=t, split_vs_fused=t["fused"] / t["split"],
                         auto="split" if 2 * HKV <= torch.get_num_threads() and S >= 2 * cpu_tiles.BN else "fused"))
    return rows


SECTIONS = ("speed", "memory", "window", "small", "products", "split")
SPEED_DTYPES = ("float32", "bfloat16", "float16")

SMALL = [bench.Problem(1, S, 4, 2, 32) for S in (64, 128, 256)] + [
    bench.Problem(4, 128, 4, 2, 32), bench.Problem(1, 256, 4, 2, 32, lens=(96, 40, 72, 48))]


def small(repeats, problems=SMALL):
    """fwd+bwd of small calls, the providers interleaved (``repeats`` each after 10 warm-up calls)."""
    rows = []
    for p in problems:
        inputs = bench.problem_inputs(p, "cpu")
        steps = {}
        for name in ("sinkattn", "sdpa", "eager"):
            fn, _ = bench.PROVIDERS[name](p, *inputs)
            if fn is not None:
                steps[name] = bench.mode_step(fn, inputs, "fwdbwd")
        t = bench.time_interleaved(steps, repeats, warmup=10)
        rows.append(dict(section="small", mode="fwd+bwd", shape=p.label, seconds=t,
                         speed_vs_sdpa=t["sdpa"] / t["sinkattn"] if "sdpa" in t else None,
                         speed_vs_eager=t["eager"] / t["sinkattn"]))
    return rows


def main(argv=None):
    ap = bench.script_parser(__doc__, repeats=5, quick="smaller shapes and fewer repeats (smoke run)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS,
                    help="the sections to run (default: all)")
    ap.add_argument("--dtypes", nargs="+", choices=SPEED_DTYPES, default=SPEED_DTYPES,
                    help="the dtypes of the speed section (default: all)")
    ap.add_argument("--isa", choices=list(isa.LEVELS),
                    help="run under this instruction-set ceiling (default: the CPU's own)")
    args = bench.parse_script_args(ap, argv)
    if args.isa and any(os.environ.get(name) != value for name, value in isa.LEVELS[args.isa].items()):
        rest = list(sys.argv[1:] if argv is None else argv)
        child = subprocess.run([sys.executable, __file__, *rest], env=isa.environment(args.isa))
        if child.returncode:
            raise SystemExit(child.returncode)
        return None
    run = set(args.sections)
    rows = []
    if args.quick:
        rows += speed("float32", 2, S=256) if "speed" in run else []
        rows += memory(S=1024, threads=args.threads) if "memory" in run else []
        rows += window(2, S=1024) if "window" in run else []
        rows += small(3, SMALL[:1] + SMALL[-1:]) if "small" in run else []
        rows += products(2, S=256) if "products" in run else []
        rows += split(2, S=256) if "split" in run else []
    else:
        for dtype in args.dtypes if "speed" in run else ():
            rows += speed(dtype, args.repeats)
        rows += memory(threads=args.threads) if "memory" in run else []
        rows += window(max(2, args.repeats // 2)) if "window" in run else []
        rows += small(max(3, 40 * args.repeats)) if "small" in run else []
        rows += products(args.repeats) if "products" in run else []
        rows += split(args.repeats) if "split" in run else []
    info = bench.header()
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
        elif r["section"] == "small":
            t = r["seconds"]
            sdpa = (f"sdpa {t['sdpa'] * 1e3:6.3f} ms | vs sdpa {r['speed_vs_sdpa']:.2f}x" if "sdpa" in t
                    else "sdpa      -   ")
            print(f"[small] {r['mode']:8s} sinkattn {t['sinkattn'] * 1e3:6.3f} ms | eager {t['eager'] * 1e3:6.3f} ms | "
                  f"vs eager {r['speed_vs_eager']:.2f}x | {sdpa}   ({r['shape']})")
        elif r["section"] == "products":
            t = r["seconds"]
            print(f"[products] {r['mode']:8s} fp32 products {t['fp32_products'] * 1e3:8.1f} ms | bf16 products "
                  f"{t['bf16_products'] * 1e3:8.1f} ms | sdpa {t['sdpa'] * 1e3:8.1f} ms | bf16 vs fp32 products "
                  f"{r['bf16_vs_fp32_products']:.2f}x | bf16 products vs sdpa {r['bf16_products_vs_sdpa']:.2f}x   "
                  f"({r['shape']})")
        elif r["section"] == "split":
            t = r["seconds"]
            print(f"[split] {r['mode']:8s} fused {t['fused'] * 1e3:8.1f} ms | split {t['split'] * 1e3:8.1f} ms | "
                  f"split vs fused {r['split_vs_fused']:.2f}x | auto takes {r['auto']}   ({r['shape']})")
        else:
            t = r["seconds"]
            print(f"[window] {r['mode']:8s} causal {t['causal'] * 1e3:8.1f} ms | window (511,0) "
                  f"{t['window_511_0'] * 1e3:8.1f} ms | cost {r['window_cost_vs_causal']:.3f}x   ({r['shape']})")
    bench.write_json(args.json, dict(header=info, rows=rows))
    return rows


if __name__ == "__main__":
    main()
