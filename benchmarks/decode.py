"""Decoding on the CPU: sinkattn against SDPA and eager sink attention, at the call and in HF ``generate``.

    python benchmarks/decode.py [--quick] [--repeats N] [--generate-repeats N] [--threads N] [--models NAME ...]
                                [--json FILE]

Same run, inference mode (``torch.no_grad``), fp32; prints medians and ratios, asserts nothing.

* ``call``: one attention call with one query row per sequence (KV-cache decoding), HQ=16,
  HKV=2, D=64, Sk in {16, 1024}, B in {1, 4}, causal, sinks. Peers: ``sdpa``
  (``scaled_dot_product_attention(enable_gqa=True)``, no sinks) and ``eager`` (gpt-oss's eager
  sink attention, ``sinkattn.testing.eager``). Each sample times ``inner`` back-to-back calls;
  providers are interleaved sample by sample. Target: sinkattn <= 5x sdpa per call.
* ``generate``: greedy ``generate`` of a random gpt-oss (``tests/harness/gpt_oss.py``) with
  ``attn_implementation="sinkattn"`` against ``"eager"``, one model switched between the two, for each
  model of ``MODELS``:
  ``tiny`` (the test config: 4 layers, sliding window 8 on two of them, HQ=4, HKV=2, D=16, hidden
  64), where attention is a small share of a step, and ``gpt-oss attention`` (gpt-oss's attention
  block: HQ=64, HKV=8, D=64, hidden 2880, sliding window 128 on one of its 2 layers; small experts:
  4 of width 256, 2 routed), where eager's ``repeat_kv`` copies the whole KV cache G=8 times per
  layer and token as in the real model. Time per generated token: the median interval between
  consecutive tokens as ``generate`` hands them to a streamer (the prompt's prefill and the first
  token left out). Targets: sinkattn <= 1.0x eager at a 32-token prompt and <= 0.8x at 2048. Also
  printed: the whole ``generate`` time over its tokens, prefill included (eager's prefill
  materializes its scores).

Times are wall-clock medians; ``cpu`` columns give the process CPU time of the same samples,
which moves less when other programs share the machine.

The model comes from the test harness (``tests/harness/gpt_oss.py``), which is not installed with
sinkattn: the script puts the repository's ``tests`` folder on ``sys.path`` to import it.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sinkattn import sink_attn_func
from sinkattn.testing import bench, eager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the test harness: tests/harness

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


MODELS = {
    "tiny": dict(config={}, qk_gain=8.0),
    "gpt-oss attention": dict(config=dict(num_attention_heads=64, num_key_value_heads=8, head_dim=64, hidden_size=2880,
                                          num_hidden_layers=2, sliding_window=128, num_local_experts=4,
                                          num_experts_per_tok=2, intermediate_size=256),
                              qk_gain=2.0),
}
"""``gpt_oss.config`` overrides and query/key gain of each model (``gpt oss attention``: the gain keeps
scores of a few tens, as in a trained model, at this hidden size)."""


def model(kind: str, quick: bool = False):
    """``(model, implementations)``: the gpt-oss ``kind`` of ``MODELS`` (``--quick``: hidden 256) and the two
    attention implementations it is timed with, sinkattn's first. One model serves both, switched with
    ``set_attn_implementation``: same weights in the same memory (a step streams all of them)."""
    import sinkattn.hf
    from harness import gpt_oss

    name = sinkattn.hf.register()
    spec = MODELS[kind]
    cfg = gpt_oss.config(**(spec["config"] | (dict(hidden_size=256) if quick and spec["config"] else {})))
    return gpt_oss.model(cfg, attn_implementation=name, qk_gain=spec["qk_gain"]), (name, "eager")


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


def generate_level(kind: str, model, implementations: tuple[str, str], prompt: int, new_tokens: int,
                   repeats: int) -> dict:
    name, cfg = implementations[0], model.config
    ids = torch.randint(1, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    outputs, intervals, whole = {}, {impl: ([], []) for impl in implementations}, {impl: [] for impl in implementations}
    with torch.no_grad():
        for r in range(repeats + 1):                 # the first round warms up
            for impl in implementations:
                model.set_attn_implementation(impl)
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
    return dict(section="generate", model=kind, config=f"{cfg.num_hidden_layers} layers, HQ={cfg.num_attention_heads} "
                f"HKV={cfg.num_key_value_heads} D={cfg.head_dim}, hidden {cfg.hidden_size}, sliding window "
                f"{cfg.sliding_window}, {cfg.num_local_experts} experts of width {cfg.intermediate_size}",
                prompt=prompt, new_tokens=new_tokens, seconds_per_token=per_token,
                seconds_per_token_with_prefill=whole, vs_eager_with_prefill=whole[name] / whole["eager"],
                vs_eager=per_token[name]["wall"] / per_token["eager"]["wall"],
                vs_eager_cpu=per_token[name]["cpu"] / per_token["eager"]["cpu"],
                same_tokens=bool(torch.equal(outputs[name], outputs["eager"])))


def main(argv=None):
    ap = bench.script_parser(__doc__, repeats=7, quick="few calls and tokens, 128 keys for the long case (smoke run)")
    ap.add_argument("--generate-repeats", type=int, help="rounds of each generate (default: --repeats)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                    help="the models of the generate section (default: all)")
    args = bench.parse_script_args(ap, argv)
    repeats = 1 if args.quick else args.repeats
    rounds = 1 if args.quick else (args.generate_repeats or args.repeats)
    inner = 3 if args.quick else 200
    rows = [call_level(B, Sk, repeats, inner) for B in (1, 4) for Sk in (16, 128 if args.quick else 1024)]
    long_prompt = 128 if args.quick else 2048
    for kind in args.models:
        timed, implementations = model(kind, args.quick)
        rows += [generate_level(kind, timed, implementations, prompt, 2 if args.quick else 32, rounds)
                 for prompt in (32, long_prompt)]
        del timed

    info = bench.header() | {"loadavg_1min": os.getloadavg()[0]}
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"medians of {repeats} interleaved samples per call shape and of the token intervals of {rounds} rounds "
          f"of each generate, torch.no_grad, fp32")
    shown = set()
    for r in rows:
        if r["section"] == "generate" and r["model"] not in shown:
            shown.add(r["model"])
            print(f"[generate {r['model']}] {r['config']}")
        if r["section"] == "call":
            t = r["seconds"]
            print(f"[call] {r['shape']:48s} sinkattn {t['sinkattn']['wall'] * 1e6:8.1f} us | sdpa "
                  f"{t['sdpa']['wall'] * 1e6:8.1f} us | eager {t['eager']['wall'] * 1e6:8.1f} us | vs sdpa "
                  f"{r['vs_sdpa']:.2f}x (cpu {r['vs_sdpa_cpu']:.2f}x; target <= 5) | vs eager {r['vs_eager']:.2f}x")
        else:
            t = r["seconds_per_token"]
            target = "1.0" if r["prompt"] <= 32 else "0.8"
            ours = next(impl for impl in t if impl != "eager")
            print(f"[generate {r['model']}] prompt {r['prompt']:5d}, {r['new_tokens']} new tokens: sinkattn "
                  f"{t[ours]['wall'] * 1e3:7.2f} ms/token | eager {t['eager']['wall'] * 1e3:7.2f} ms/token | "
                  f"{r['vs_eager']:.3f}x eager (cpu {r['vs_eager_cpu']:.3f}x; target <= {target}) | with the prefill "
                  f"spread over the tokens {r['vs_eager_with_prefill']:.3f}x | same greedy tokens: {r['same_tokens']}")
    if args.quick:
        print("smoke run: the generate targets are for the full run (prompts of 32 and 2048 tokens)")
    bench.write_json(args.json, dict(header=info, rows=rows))
    return rows


if __name__ == "__main__":
    main()
