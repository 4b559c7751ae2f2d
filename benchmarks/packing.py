"""Packed batches on the cpu backend: is the cost proportional to the work, whatever the lengths?

    python benchmarks/packing.py [--quick] [--repeats N] [--threads N] [--json FILE]

Same run, same tokens, same heads (HQ=8, HKV=2, D=64, fp32, causal, sinks), fwd+bwd (and fwd),
medians of interleaved repeats; prints ratios, asserts nothing. Work is counted in visible
(i, j) pairs (``sinkattn.testing.flops``).

* ``short``: 20,000 sequences of 1-3 tokens against the same number of tokens in sequences of
  100-156 tokens (about 40x the visible pairs). Target: short <= long in time.
* ``long-tailed``: lengths drawn like an SFT dataset's (log-normal, median 200 tokens,
  sigma 1.1, clipped to 1..4096: many short sequences, a few long ones) against uniform
  1024-token sequences, about 32k tokens each. Target: time per visible pair <= 1.2x uniform's.
* ``short-heavy``: the same with median 32 and sigma 1.2 (three in four sequences at most 64 tokens).
* ``threshold``: where ``cpu_small.SHORT_LENGTH`` sits: packed batches of alternating lengths L and
  L+1 (no two neighbours equal, so nothing shares a kernel call), fwd+bwd time per visible pair
  relative to uniform 1024-token sequences, with the batched short path and with one kernel call
  per sequence (``SHORT_LENGTH = 0``).
* ``empty``: the long-tailed batch with 8 empty sequences after each real one (a fixed-size
  ``cu_seqlens`` padded with empty sequences) against the same batch without them. Target: ~1x.
"""

from __future__ import annotations

import math

import torch

from sinkattn import sink_attn_varlen_func
from sinkattn.backends import cpu_small
from sinkattn.masks import Window
from sinkattn.testing import bench, flops

HQ, HKV, D = 8, 2, 64
CAUSAL = Window(-1, 0)


def uniform_between(lo: int, hi: int, tokens: int, seed: int) -> list[int]:
    """Lengths drawn uniformly from ``lo..hi`` until they hold ``tokens`` tokens (the last one cut)."""
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < tokens:
        L = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), tokens - total)
        lens.append(L)
        total += L
    return lens


def long_tailed(tokens: int, seed: int, median: int = 200, sigma: float = 1.1, longest: int = 4096) -> list[int]:
    """SFT-like lengths: log-normal around ``median``, clipped to ``1..longest``, ``tokens`` in all."""
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < tokens:
        x = math.exp(math.log(median) + sigma * float(torch.randn((), generator=g)))
        L = min(max(1, round(x)), longest, tokens - total)
        lens.append(L)
        total += L
    return lens


def _step(lens: list[int], mode: str):
    """One fwd (no grad) or fwd+bwd of sinkattn on a packed batch of ``lens``."""
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(lens)
    q = torch.randn(T, HQ, D, generator=g).requires_grad_()
    k, v = (torch.randn(T, HKV, D, generator=g).requires_grad_() for _ in range(2))
    sinks = torch.randn(HQ, generator=g).requires_grad_()

    def call():
        return sink_attn_varlen_func(q, k, v, cu, cu, longest, longest, sinks=sinks, causal=True)

    if mode == "fwd":
        def run():
            with torch.no_grad():
                call()
        return run

    def run():
        out = call()
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = sinks.grad = None
    return run


def compare(section: str, batches: dict[str, list[int]], repeats: int, modes=("fwd", "fwdbwd")) -> list[dict]:
    rows = []
    for mode in modes:
        seconds = bench.time_interleaved({name: _step(lens, mode) for name, lens in batches.items()}, repeats)
        for name, lens in batches.items():
            pairs = flops.visible_pairs(lens, lens, CAUSAL)
            rows.append(dict(section=section, batch=name, mode=mode, sequences=len(lens),
                             nonempty=sum(1 for L in lens if L), tokens=sum(lens), longest=max(lens),
                             visible_pairs=pairs, seconds=seconds[name], ns_per_pair=seconds[name] / pairs * 1e9))
    return rows


def threshold(lengths, repeats, tokens=4096) -> list[dict]:
    uniform = [1024] * (tokens // 1024)
    steps = {"uniform 1024": _step(uniform, "fwdbwd")}
    batches = {L: [L + (i % 2) for i in range(tokens // L)] for L in lengths}
    for L, lens in batches.items():
        steps[f"L={L} batched"] = _step(lens, "fwdbwd")
        one_call_each = _step(lens, "fwdbwd")

        def unbatched(run=one_call_each):
            saved, cpu_small.SHORT_LENGTH = cpu_small.SHORT_LENGTH, 0
            try:
                run()
            finally:
                cpu_small.SHORT_LENGTH = saved
        steps[f"L={L} one call each"] = unbatched
    seconds = bench.time_interleaved(steps, repeats)
    per_pair = seconds["uniform 1024"] / flops.visible_pairs(uniform, uniform, CAUSAL)
    rows = []
    for L, lens in batches.items():
        pairs = flops.visible_pairs(lens, lens, CAUSAL)
        rows.append(dict(section="threshold", L=L, sequences=len(lens), visible_pairs=pairs,
                         batched=seconds[f"L={L} batched"] / pairs / per_pair,
                         one_call_each=seconds[f"L={L} one call each"] / pairs / per_pair))
    return rows


def main(argv=None):
    ap = bench.script_parser(__doc__, repeats=5, quick="smaller batches, 1 repeat (smoke run)")
    args = bench.parse_script_args(ap, argv)
    repeats = 1 if args.quick else args.repeats
    n_short, tailed_tokens, uniform_len = (500, 1024, 128) if args.quick else (20000, 32768, 1024)

    short = uniform_between(1, 3, 2 * n_short, seed=1)[:n_short]
    short_tokens = sum(short)
    rows = compare("short", {"1-3 tokens": short, "100-156 tokens": uniform_between(100, 156, short_tokens, seed=2)},
                   repeats)
    tailed = long_tailed(tailed_tokens, seed=3)
    uniform = [uniform_len] * (tailed_tokens // uniform_len)
    rows += compare("long-tailed", {"long-tailed": tailed, f"uniform {uniform_len}": uniform}, repeats)
    rows += compare("short-heavy", {"short-heavy": long_tailed(tailed_tokens, seed=3, median=32, sigma=1.2),
                                    f"uniform {uniform_len}": uniform}, repeats)
    cuts = threshold((2, 8), repeats, tokens=1024) if args.quick else threshold((2, 8, 16, 24, 32, 48), repeats)
    padded = [L for length in tailed for L in (length, *[0] * 8)]
    rows += compare("empty", {"long-tailed": tailed, "with 8 empty after each": padded}, repeats, modes=("fwdbwd",))

    info = bench.header()
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"HQ={HQ} HKV={HKV} D={D} fp32 causal, sinks; medians of {repeats} interleaved repeats")
    ratios = {}
    for section, (ours, peer), per_pair, target in (
            ("short", ("1-3 tokens", "100-156 tokens"), False, "<= 1"),
            ("long-tailed", ("long-tailed", f"uniform {uniform_len}"), True, "<= 1.2"),
            ("short-heavy", ("short-heavy", f"uniform {uniform_len}"), True, "<= 1.2"),
            ("empty", ("with 8 empty after each", "long-tailed"), False, "~1")):
        for mode in ("fwd", "fwdbwd"):
            pick = {r["batch"]: r for r in rows if r["section"] == section and r["mode"] == mode}
            if not pick:
                continue
            for r in pick.values():
                print(f"[{section}] {mode:6s} {r['batch']:>24s}: {r['sequences']:6d} seqs, {r['tokens']:6d} tokens, "
                      f"longest {r['longest']:5d}, {r['visible_pairs']:.3g} pairs: {r['seconds'] * 1e3:9.1f} ms "
                      f"({r['ns_per_pair']:.3g} ns/pair)")
            key = "ns_per_pair" if per_pair else "seconds"
            ratio = pick[ours][key] / pick[peer][key]
            ratios[f"{section}_{mode}"] = ratio
            what = "time per visible pair" if per_pair else "time"
            print(f"[{section}] {mode:6s} {what}: {ours} / {peer} = {ratio:.3f}x (target {target})")
    for r in cuts:
        print(f"[threshold] L={r['L']:3d}: fwd+bwd per visible pair vs uniform 1024: batched {r['batched']:6.2f}x, one "
              f"kernel call per sequence {r['one_call_each']:6.2f}x  (cpu_small.SHORT_LENGTH = "
              f"{cpu_small.SHORT_LENGTH})")
    bench.write_json(args.json, dict(header=info, rows=rows + cuts, ratios=ratios))
    return rows


if __name__ == "__main__":
    main()
