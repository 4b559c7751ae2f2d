"""Decoding on the CPU: sinkattn against SDPA and eager sink attention, at the call and in HF ``generate``.

    python benchmarks/decode.py [--quick] [--repeats N] [--threads N] [--json FILE]

Same run, inference mode (``torch.no_grad``), fp32; prints medians and ratios, asserts nothing.

* ``call``: one attention call with one query row per sequence (KV-cache decoding), HQ=16,
  HKV=2, D=64, Sk in {16, 1024}, B in {1, 4}, causal, sinks. Peers: ``sdpa``
  (``scaled_dot_product_attention(enable_gqa=True)``, no sinks) and ``eager`` (gpt-oss's eager
  sink attention, ``sinkattn.testing.eager``). Each sample times ``inner`` back-to-back calls;
  providers are interleaved sample by sample. Target: sinkattn <= 5x sdpa per call.
* ``generate``: greedy ``generate`` of a tiny gpt-oss built from ``sinkattn.testing.gpt_oss.config()``
  (4 layers, sliding window 8 on two of them, HQ=4, HKV=2, D=16), ``attn_implementation="sinkattn"``
  against ``"eager"``, same weights. Time per generated token: the median interval between
  consecutive tokens as ``generate`` hands them to a streamer (the prompt's prefill and the first
  token left out). Targets: sinkattn <= 1.0x eager at a 32-token prompt and <= 0.8x at 2048. Also
  printed: the whole ``generate`` time over its tokens, prefill included (eager's prefill
  materializes its scores).

Times are wall-clock medians; ``cpu`` columns give the process CPU time of the same samples,
which moves less when other programs share the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from sinkattn import sink_attn_func
from sinkattn.testing import bench, eager

HQ, HKV, D = 16, 2, 64


def _interleaved(steps: dict, repeats: int, inner: int = 1) -> dict[str, dict[str, float]]:
    """Per step, the median wall and CPU seconds of one call, over ``repeats`` samples of ``inner``
    back-to-back calls, steps interleaved sample by sample (after one warm-up sample each)."""
    samples = {name: ([], []) for name in steps}
    for r in range(repeats + 1):
        for name, step in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                step()
            if r:
                samples[name][0].append((time.perf_counter() - w0) / inner)
                samples[name][1].append((time.process_time() - c0) / inner)
    return {name: dict(wall=statistics.median(w), cpu=statistics.median(c)) for name, (w, c) in samples.items()}


def call_level(B: int, Sk: int, repeats: int, inner: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, HQ, D, generator=g)
    k, v = (torch.randn(B, Sk, HKV, D, generator=g) for _ in range(2))
    sinks = torch.randn(HQ, generator=g)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    steps = {
        "sinkattn": lambda: sink_attn_func(q, k, v, sinks=sinks, causal=True),
        "sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True),
        "eager": lambda: eager.sink_attention_dense(q, k, v, sinks, causal=True),
    }
    with torch.no_grad():
        t = _interleaved(steps, repeats, inner)
    return dict(section="call", shape=f"B={B} Sq=1 Sk={Sk} HQ={HQ} HKV={HKV} D={D} fp32 causal sinks", B=B, Sk=Sk,
                seconds=t, vs_sdpa=t["sinkattn"]["wall"] / t["sdpa"]["wall"],
                vs_sdpa_cpu=t["sinkattn"]["cpu"] / t["sdpa"]["cpu"],
                vs_eager=t["sinkattn"]["wall"] / t["eager"]["wall"])


def tiny_models() -> dict:
    """The same tiny gpt-oss (``sinkattn.testing.gpt_oss``) with sinkattn's attention and with eager."""
    import sinkattn.hf
    from sinkattn.testing import gpt_oss

    name = sinkattn.hf.register()
    return {impl: gpt_oss.model(attn_implementation=impl) for impl in (name, "eager")}


class _TokenClock:
    """A ``generate`` streamer that notes the wall and CPU clocks as each token arrives (the prompt first)."""

    def __init__(self):
        self.marks = []

    def put(self, value):
        self.marks.append((time.perf_counter(), time.process_time()))

    def end(self):
        pass

    def intervals(self, clock: int) -> list[float]:
        """Seconds between consecutive generated tokens (the prompt's prefill and first token left out)."""
        return [b[clock] - a[clock] for a, b in zip(self.marks[1:], self.marks[2:])]


def generate_level(models: dict, prompt: int, new_tokens: int, repeats: int) -> dict:
    name = next(impl for impl in models if impl != "eager")
    vocab = models[name].config.vocab_size
    ids = torch.randint(1, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    outputs, intervals, whole = {}, {impl: ([], []) for impl in models}, {impl: [] for impl in models}
    with torch.no_grad():
        for r in range(repeats + 1):                 # the first round warms up
            for impl, model in models.items():
                clock, t0 = _TokenClock(), time.perf_counter()
                outputs[impl] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                               streamer=clock)
                if r:
                    whole[impl].append((time.perf_counter() - t0) / new_tokens)
                    for i in (0, 1):
                        intervals[impl][i].extend(clock.intervals(i))
    per_token = {impl: dict(wall=statistics.median(w), cpu=statistics.median(c))
                 for impl, (w, c) in intervals.items()}
    whole = {impl: statistics.median(t) for impl, t in whole.items()}
    return dict(section="generate", prompt=prompt, new_tokens=new_tokens, seconds_per_token=per_token,
                seconds_per_token_with_prefill=whole, vs_eager_with_prefill=whole[name] / whole["eager"],
                vs_eager=per_token[name]["wall"] / per_token["eager"]["wall"],
                vs_eager_cpu=per_token[name]["cpu"] / per_token["eager"]["cpu"],
                same_tokens=bool(torch.equal(outputs[name], outputs["eager"])))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few calls and tokens, 128 keys for the long case (smoke run)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else args.repeats
    inner = 3 if args.quick else 200
    rows = [call_level(B, Sk, repeats, inner) for B in (1, 4) for Sk in (16, 128 if args.quick else 1024)]
    long_prompt = 128 if args.quick else 2048
    models = tiny_models()
    rows += [generate_level(models, prompt, 2 if args.quick else 32, repeats) for prompt in (32, long_prompt)]

    info = bench.header() | {"loadavg_1min": os.getloadavg()[0]}
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"medians of {repeats} interleaved samples, torch.no_grad, fp32")
    for r in rows:
        if r["section"] == "call":
            t = r["seconds"]
            print(f"[call] {r['shape']:48s} sinkattn {t['sinkattn']['wall'] * 1e6:8.1f} us | sdpa "
                  f"{t['sdpa']['wall'] * 1e6:8.1f} us | eager {t['eager']['wall'] * 1e6:8.1f} us | vs sdpa "
                  f"{r['vs_sdpa']:.2f}x (cpu {r['vs_sdpa_cpu']:.2f}x; target <= 5) | vs eager {r['vs_eager']:.2f}x")
        else:
            t = r["seconds_per_token"]
            target = "1.0" if r["prompt"] <= 32 else "0.8"
            ours = next(impl for impl in t if impl != "eager")
            print(f"[generate] prompt {r['prompt']:5d}, {r['new_tokens']} new tokens: sinkattn "
                  f"{t[ours]['wall'] * 1e3:7.2f} ms/token | eager {t['eager']['wall'] * 1e3:7.2f} ms/token | "
                  f"{r['vs_eager']:.3f}x eager (cpu {r['vs_eager_cpu']:.3f}x; target <= {target}) | with the prefill "
                  f"spread over the tokens {r['vs_eager_with_prefill']:.3f}x | same greedy tokens: {r['same_tokens']}")
    if args.quick:
        print("smoke run: the generate targets are for the full run (prompts of 32 and 2048 tokens)")
    bench.write_json(args.json, dict(header=info, rows=rows))
    return rows


if __name__ == "__main__":
    main()
