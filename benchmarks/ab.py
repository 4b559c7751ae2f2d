"""This checkout against another one (a commit before a change), on the cpu backend, in one run.

    git worktree add /tmp/sinkattn-base <commit>
    python benchmarks/ab.py --baseline /tmp/sinkattn-base [--quick] [--repeats N] [--rounds N]
                            [--threads N] [--json FILE]

Each case is timed in fresh processes, one per checkout and round, the two checkouts taking turns
(``--rounds`` of them) so that they share the machine's noise; a process imports sinkattn from its
checkout's ``src`` and calls only the public functions, so any commit can be the baseline. Per
mode, the figure is the median over every timed call of a checkout (``--repeats`` per process after
one warm-up call) and the ratio is ``this / baseline``: below 1 is faster.

Modes: ``inference`` (no gradient: the fused forward), ``forward`` (a forward that keeps what the
backward needs) and ``forward+backward``. Cases: causal S=2048, HQ=16, HKV=4 in fp32 and bf16 at
D=64 and fp32 at D=128 (a scale that is not a power of two), a sliding window (127, 0), sharp
attention (scores up to 300), and a packed batch of documents of mixed lengths. Asserts nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from sinkattn.testing import bench

MODES = ("inference", "forward", "forward+backward")

_CHILD = r'''
import json, sys, time
import torch
import sinkattn
case, repeats, threads = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if threads:
    torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)
lengths, HQ, HKV, D = case["lengths"], case["HQ"], case["HKV"], case["D"]
T = sum(lengths)
dtype = getattr(torch, case["dtype"])
q, k, v, do = (torch.randn(T, h, D, generator=g) for h in (HQ, HKV, HKV, HQ))
if case["bound"]:      # q, k scaled so that the largest score bound is case["bound"]
    f = (case["bound"] / (D ** -0.5 * float(q.norm(dim=-1).max() * k.norm(dim=-1).max()))) ** 0.5
    q, k = q * f, k * f
q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
do, sinks = do.to(dtype), torch.randn(HQ, generator=g).requires_grad_()
window = tuple(case["window"])
if len(lengths) == 1:
    def call():
        return sinkattn.sink_attn_func(q[None], k[None], v[None], sinks=sinks, causal=True, window_size=window)[0]
else:
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    def call():
        return sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), sinks=sinks,
                                              causal=True, window_size=window)
def inference():
    with torch.no_grad():
        call()
def forward():
    return call()
def forward_backward():
    call().backward(do)
steps = {"inference": inference, "forward": forward, "forward+backward": forward_backward}
samples = {name: [] for name in steps}
for i in range(repeats + 1):
    for name, step in steps.items():
        t0 = time.perf_counter()
        step()
        if i:
            samples[name].append(time.perf_counter() - t0)
print(json.dumps(samples))
'''


def cases(quick: bool) -> list[dict]:
    """The cases timed: name, sequence lengths (one: a dense batch of one), heads, D, dtype, window, bound."""
    base = dict(HQ=16, HKV=4, D=64, dtype="float32", window=(-1, 0), bound=0)
    if quick:
        return [dict(base, name="causal S=256 D=64 fp32", lengths=[256]),
                dict(base, name="packed [96, 40, 72, 48] D=64 fp32", lengths=[96, 40, 72, 48])]
    S, packed = 2048, [700, 300, 1000, 48]
    return [
        dict(base, name=f"causal S={S} D=64 fp32", lengths=[S]),
        dict(base, name=f"causal S={S} D=64 bf16", lengths=[S], dtype="bfloat16"),
        dict(base, name=f"causal S={S} D=128 fp32", lengths=[S], D=128),
        dict(base, name=f"window (127, 0) S={S} D=64 fp32", lengths=[S], window=(127, 0)),
        dict(base, name=f"sharp (scores up to 300) S={S} D=64 fp32", lengths=[S], bound=300),
        dict(base, name=f"packed {packed} D=64 fp32", lengths=packed),
    ]


def run_child(tree: Path, case: dict, repeats: int, threads: int | None) -> dict[str, list[float]]:
    """One fresh process importing sinkattn from ``tree/src``: ``{mode: [seconds, ...]}``."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(case), str(repeats), str(threads or 0)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{tree}: {case['name']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _commit(tree: Path) -> str:
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main(argv=None):
    ap = bench.script_parser(__doc__, repeats=3, quick="two small cases (S=256, a packed batch), 1 round, 1 repeat",
                             threads=1)
    ap.add_argument("--baseline", required=True, help="another checkout of sinkattn (its src/ is imported)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per checkout and case, alternating (default 2)")
    args = bench.parse_script_args(ap, argv)
    if args.rounds < 1:
        ap.error(f"argument --rounds: must be at least 1, got {args.rounds}")
    here, baseline = Path(__file__).resolve().parents[1], Path(args.baseline).resolve()
    if not (baseline / "src" / "sinkattn").is_dir():
        ap.error(f"argument --baseline: {baseline} has no src/sinkattn; give a checkout of sinkattn "
                 "(e.g. made with `git worktree add DIR COMMIT`)")
    repeats, rounds = (1, 1) if args.quick else (args.repeats, args.rounds)
    trees = {"baseline": baseline, "this": here}
    info = dict(bench.header(), baseline_commit=_commit(baseline), this_commit=_commit(here))
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    rows = []
    for case in cases(args.quick):
        samples = {name: {m: [] for m in MODES} for name in trees}
        for _ in range(rounds):
            for name, tree in trees.items():
                for mode, s in run_child(tree, case, repeats, args.threads).items():
                    samples[name][mode].extend(s)
        for mode in MODES:
            seconds = {name: statistics.median(samples[name][mode]) for name in trees}
            row = dict(case=case["name"], mode=mode, seconds=seconds,
                       samples={name: samples[name][mode] for name in trees},
                       ratio=seconds["this"] / seconds["baseline"])
            rows.append(row)
            print(f"{case['name']:44s} {mode:17s} baseline {seconds['baseline'] * 1e3:8.1f} ms | this "
                  f"{seconds['this'] * 1e3:8.1f} ms | this/baseline {row['ratio']:.2f}")
    bench.write_json(args.json, dict(header=info, repeats=repeats, rounds=rounds, rows=rows))
    return rows


if __name__ == "__main__":
    main()
