"""This checkout against another one (a commit before a change), on the cpu backend, in one run.

    git worktree add /tmp/sinkattn-base <commit>
    python benchmarks/ab.py --baseline /tmp/sinkattn-base [--quick] [--only SECTION ...] [--repeats N]
                            [--rounds N] [--threads N] [--json FILE]

Every section is timed in fresh processes, one per checkout and round (training: one per case), the
two checkouts taking turns (``--rounds`` of them) so that they share the machine's noise; a process
imports sinkattn from its checkout's ``src`` and calls only the public functions (``sinkattn.sink_attn_func``,
``sink_attn_varlen_func``, ``sinkattn.hf.register``) and torch (transformers for ``generate``), so
any commit can be the baseline. A process times ``--repeats`` samples after one warm-up sample; a
sample of a short call is ``inner`` back-to-back calls (its time: per call). The figure of a
checkout is the median over all its samples; ``this/baseline`` is the quotient of the two (below 1:
this checkout is faster). Where a case has a peer, timed in the same process with the samples
interleaved, ``baseline/peer`` and ``this/peer`` are sinkattn's median over the peer's, per checkout.

Sections (``--only``; all by default):

* ``training``: ``inference`` (no gradient: the fused forward), ``forward`` (a forward that keeps
  what the backward needs) and ``forward+backward`` of causal S=2048, HQ=16, HKV=4 in fp32 and
  bf16 at D=64 and fp32 at D=128 (a scale that is not a power of two), a sliding window (127, 0),
  sharp attention (scores up to 300) and a packed batch of documents of mixed lengths; one process
  per case. No peer.
* ``decode``: one call with one query row per sequence against a KV cache (``sink_attn_func``, q
  ``[B, 1, HQ, D]``, k/v ``[B, Sk, HKV, D]``, causal, sinks, no grad), HQ=16, HKV=2, D=64, fp32, Sk in
  {16, 1024}, B in {1, 4}, 200 calls a sample. Peer: ``scaled_dot_product_attention(enable_gqa=True)``
  on the transposed views (no sinks). Targets: sinkattn/SDPA <= 3 at Sk=16, <= 1.5 at Sk=1024.
* ``tiny``: a packed batch of 20,000 sequences of 1-3 tokens (HQ=8, HKV=2, D=64, fp32, causal,
  sinks), inference and forward+backward, against the same number of tokens in sequences of
  100-156 tokens (about 40x the visible pairs; the lengths of ``benchmarks/packing.py``'s ``short``
  section). Target: tiny/long <= 1.
* ``short``: dense causal inference (no grad) at S in {256, 1024}, B=1, HQ=16, HKV=4, D=64, fp32,
  ``[B, S, H, D]`` tensors as a flash-attn user passes them. Peer: SDPA on the transposed views,
  ``enable_gqa=True, is_causal=True``. Targets: at least 0.85x SDPA's speed at S=256 (sinkattn/SDPA
  <= 1.18) and 0.95x at S=1024 (<= 1.05).
* ``generate``: greedy Hugging Face ``generate`` of a small random gpt-oss (``benchmarks/decode.py``'s
  ``tiny`` model: 4 layers, sliding window 8 on two, HQ=4, HKV=2, D=16, hidden 64) from a 32-token
  prompt, time per token (the median interval between consecutive tokens, the prefill and first
  token left out), ``attn_implementation="sinkattn"`` against ``"eager"`` on the same model. Target:
  sinkattn/eager <= 1. Only where transformers imports.

``--quick`` keeps every section at small sizes (S=256 and a packed batch for training, Sk in {16,
128}, 500 tiny sequences, S in {64, 128}, 4 new tokens), 1 round, 1 repeat: a smoke run whose
targets are for the full sizes; one process per checkout times all of it. Prints and records;
asserts nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from packing import uniform_between  # benchmarks/packing.py: the short section's lengths

from sinkattn.testing import bench

SECTIONS = ("training", "decode", "tiny", "short", "generate")
MODES = ("inference", "forward", "forward+backward")

_CHILD = r'''
import json, sys, time
import torch
import torch.nn.functional as F
import sinkattn

job = json.loads(sys.stdin.read())
repeats = job["repeats"]
if job["threads"]:
    torch.set_num_threads(job["threads"])


def interleaved(steps, inner=1):
    """Seconds per call of each step: ``repeats`` samples of ``inner`` calls after one warm-up sample,
    the steps taking turns sample by sample."""
    samples = {name: [] for name in steps}
    for r in range(repeats + 1):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
            if r:
                samples[name].append((time.perf_counter() - t0) / inner)
    return samples


def training(case):
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
            return sinkattn.sink_attn_func(q[None], k[None], v[None], sinks=sinks, causal=True,
                                           window_size=window)[0]
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
    samples = interleaved({"inference": inference, "forward": forward, "forward+backward": forward_backward})
    return {mode: {"sinkattn": s} for mode, s in samples.items()}


def decode(case):
    g = torch.Generator().manual_seed(0)
    B, Sk, HQ, HKV, D = case["B"], case["Sk"], case["HQ"], case["HKV"], case["D"]
    q = torch.randn(B, 1, HQ, D, generator=g)
    k, v = (torch.randn(B, Sk, HKV, D, generator=g) for _ in range(2))
    sinks = torch.randn(HQ, generator=g)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    steps = {"sinkattn": lambda: sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True),
             "sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)}
    with torch.no_grad():
        return {"inference": interleaved(steps, case["inner"])}


def tiny(case):
    HQ, HKV, D = case["HQ"], case["HKV"], case["D"]
    def step(lengths, grad):
        g = torch.Generator().manual_seed(0)
        T, longest = sum(lengths), max(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        q = torch.randn(T, HQ, D, generator=g).requires_grad_()
        k, v = (torch.randn(T, HKV, D, generator=g).requires_grad_() for _ in range(2))
        sinks = torch.randn(HQ, generator=g).requires_grad_()
        def call():
            return sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, longest, longest, sinks=sinks, causal=True)
        def inference():
            with torch.no_grad():
                call()
        def forward_backward():
            out = call()
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = sinks.grad = None
        return forward_backward if grad else inference
    return {mode: interleaved({"sinkattn": step(case["lengths"], grad), case["peer"]: step(case["peer_lengths"], grad)})
            for mode, grad in (("inference", False), ("forward+backward", True))}


def short(case):
    g = torch.Generator().manual_seed(0)
    S, HQ, HKV, D = case["S"], case["HQ"], case["HKV"], case["D"]
    q = torch.randn(1, S, HQ, D, generator=g)
    k, v = (torch.randn(1, S, HKV, D, generator=g) for _ in range(2))
    sinks = torch.randn(HQ, generator=g)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    steps = {"sinkattn": lambda: sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True),
             "sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True, is_causal=True)}
    with torch.no_grad():
        return {"inference": interleaved(steps, case["inner"])}


class TokenClock:
    """A ``generate`` streamer noting the time as each token arrives (the prompt first)."""
    def __init__(self):
        self.marks = []
    def put(self, value):
        self.marks.append(time.perf_counter())
    def end(self):
        pass


def generate(case):
    import sinkattn.hf
    from transformers import AutoModelForCausalLM, GptOssConfig

    name = sinkattn.hf.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**case["config"]), attn_implementation="eager")
    with torch.no_grad():      # sharp attention, sinks that matter (as sinkattn's test models)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(case["qk_gain"])
            layer.self_attn.k_proj.weight.mul_(case["qk_gain"])
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks) * case["sink_scale"])
    model = model.float().eval()
    ids = torch.randint(1, model.config.vocab_size, (1, case["prompt"]), generator=torch.Generator().manual_seed(0))
    intervals = {"sinkattn": [], "eager": []}
    with torch.no_grad():
        for r in range(repeats + 1):                 # the first round warms up
            for impl, attn in (("sinkattn", name), ("eager", "eager")):
                model.set_attn_implementation(attn)
                clock = TokenClock()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=case["new_tokens"],
                               min_new_tokens=case["new_tokens"], do_sample=False, pad_token_id=0, streamer=clock)
                if r:
                    intervals[impl] += [b - a for a, b in zip(clock.marks[1:], clock.marks[2:])]
    return {"per token": intervals}


run = {"training": training, "decode": decode, "tiny": tiny, "short": short, "generate": generate}
print(json.dumps([[run[section](case) for case in cases] for section, cases in job["parts"]]))
'''

GENERATE_MODEL = dict(
    config=dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=2, num_experts_per_tok=2,
                max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                pad_token_id=0, bos_token_id=None, eos_token_id=None),
    qk_gain=8.0, sink_scale=2.0)
"""The ``tiny`` gpt-oss of ``benchmarks/decode.py`` (``tests/harness/gpt_oss.py``'s test config, query
and key projections scaled by 8, sinks ``2 * randn``), spelled out so that the child builds it with
transformers alone."""


def _training(quick: bool) -> list[dict]:
    """Name, sequence lengths (one: a dense batch of one), heads, D, dtype, window, score bound."""
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


def _decode(quick: bool) -> list[dict]:
    inner = 3 if quick else 200
    return [dict(name=f"B={B} Sk={Sk} HQ=16 HKV=2 D=64 fp32", B=B, Sk=Sk, HQ=16, HKV=2, D=64, inner=inner,
                 peer="sdpa", target={16: 3.0, 1024: 1.5}.get(Sk))
            for B in (1, 4) for Sk in (16, 128 if quick else 1024)]


def _tiny(quick: bool) -> list[dict]:
    n = 500 if quick else 20000
    lengths = uniform_between(1, 3, 2 * n, seed=1)[:n]
    peer = uniform_between(100, 156, sum(lengths), seed=2)
    return [dict(name=f"{n} seqs of 1-3 tokens HQ=8 HKV=2 D=64 fp32", lengths=lengths,
                 peer_lengths=peer, HQ=8, HKV=2, D=64, peer="100-156 tokens", target=1.0)]


def _short(quick: bool) -> list[dict]:
    sizes = {64: 10, 128: 5} if quick else {256: 10, 1024: 2}       # S: calls a sample
    return [dict(name=f"causal S={S} HQ=16 HKV=4 D=64 fp32", S=S, HQ=16, HKV=4, D=64, inner=inner,
                 peer="sdpa", target={256: 1 / 0.85, 1024: 1 / 0.95}.get(S))
            for S, inner in sizes.items()]


def _generate(quick: bool) -> list[dict]:
    new_tokens = 4 if quick else 32
    return [dict(GENERATE_MODEL, name=f"tiny gpt-oss, prompt 32, {new_tokens} new tokens", prompt=32,
                 new_tokens=new_tokens, peer="eager", target=1.0)]


def cases(section: str, quick: bool) -> list[dict]:
    """The cases of ``section``: each a name, its sizes, and (where it has one) its ``peer`` and ``target``
    (the largest sinkattn/peer ratio aimed at, None where the sizes are not the target's)."""
    return {"training": _training, "decode": _decode, "tiny": _tiny, "short": _short,
            "generate": _generate}[section](quick)


def processes(sections: list[str], quick: bool) -> list[list[tuple[str, list[dict]]]]:
    """What each process times, as ``(section, cases)`` parts: in a full run, training's cases one each and
    the other sections one each; in a quick run, all in one (a process's start costs more than its cases)."""
    if quick:
        return [[(section, cases(section, quick)) for section in sections]]
    return [[(section, [case])] for section in sections if section == "training" for case in cases(section, quick)] + [
        [(section, cases(section, quick))] for section in sections if section != "training"]


def run_child(tree: Path, parts: list[tuple[str, list[dict]]], repeats: int, threads: int | None) -> list[list[dict]]:
    """One fresh process importing sinkattn from ``tree/src``: per part and case, ``{mode: {series: [seconds,
    ...]}}`` (series ``sinkattn``, and the case's peer where it has one)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    job = dict(parts=parts, repeats=repeats, threads=threads or 0)
    r = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(job), env=env, capture_output=True, text=True)
    if r.returncode:
        what = [f"{section} {case['name']}" for section, group in parts for case in group]
        raise RuntimeError(f"{tree}: {what} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _commit(tree: Path) -> str:
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:8.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:8.1f} ms"


LEGEND = ("baseline, this: median time per call (generate: per token) in each checkout; this/base: this / baseline "
          "(< 1: this is faster); base/peer, this/peer: sinkattn / the peer in the same process of that checkout, "
          "target: the largest such ratio aimed at")
HEADER = (f"{'section':9s} {'case':46s} {'mode':16s} {'baseline':>11s} {'this':>11s} {'this/base':>9s}  "
          f"{'peer':14s} {'base/peer':>9s} {'this/peer':>9s}  target")


def line(row: dict) -> str:
    """The table's line of ``row``."""
    t = row["seconds"]
    text = (f"{row['section']:9s} {row['case']:46s} {row['mode']:16s} {_time(t['baseline'])} {_time(t['this'])} "
            f"{row['ratio']:9.2f}")
    if row["peer"]:
        p = row["peer_ratio"]
        target = f"<= {row['target']:.2f}" if row["target"] else "-"
        text += f"  {row['peer']:14s} {p['baseline']:9.2f} {p['this']:9.2f}  {target}"
    return text


def main(argv=None):
    ap = bench.script_parser(__doc__, repeats=3, quick="every section at small sizes, 1 round, 1 repeat", threads=1)
    ap.add_argument("--baseline", required=True, help="another checkout of sinkattn (its src/ is imported)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="processes per checkout and section (training: case), alternating (default 2)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                    help=f"the sections to time, of {', '.join(SECTIONS)} (default: all)")
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
    print(f"{rounds} round(s) of {repeats} sample(s) per checkout after a warm-up, {args.threads or 'default'} "
          f"thread(s)")
    print(LEGEND)
    print(HEADER)
    sections = [s for s in SECTIONS if s in args.only]
    skipped = {}
    if "generate" in sections and importlib.util.find_spec("transformers") is None:
        skipped["generate"] = "transformers is not installed"
        sections.remove("generate")
    rows = []
    for parts in processes(sections, args.quick):
        timed = [(section, case) for section, group in parts for case in group]
        results = [{name: {} for name in trees} for _ in timed]       # per case: tree -> mode -> series -> seconds
        for _ in range(rounds):
            for name, tree in trees.items():
                measured = [m for part in run_child(tree, parts, repeats, args.threads) for m in part]
                for result, modes in zip(results, measured):
                    for mode, series in modes.items():
                        for label, s in series.items():
                            result[name].setdefault(mode, {}).setdefault(label, []).extend(s)
        for (section, case), result in zip(timed, results):
            for mode in result["this"]:
                rows.append(_row(section, case, mode, {name: result[name][mode] for name in trees}))
                print(line(rows[-1]), flush=True)
    for section, why in skipped.items():
        print(f"{section}: skipped ({why})")
    if args.quick:
        print("smoke run: the targets are for the full sizes")
    bench.write_json(args.json, dict(header=info, repeats=repeats, rounds=rounds, sections=sections, skipped=skipped,
                                     rows=rows))
    return rows


def _row(section: str, case: dict, mode: str, series: dict[str, dict[str, list[float]]]) -> dict:
    """One case and mode: medians, samples and ratios of both checkouts (``series``: tree -> series -> samples)."""
    samples = {name: s["sinkattn"] for name, s in series.items()}
    seconds = {name: statistics.median(s) for name, s in samples.items()}
    row = dict(section=section, case=case["name"], mode=mode, seconds=seconds, samples=samples,
               ratio=seconds["this"] / seconds["baseline"], peer=case.get("peer"), target=case.get("target"),
               inner=case.get("inner", 1))
    if row["peer"]:
        peer_samples = {name: s[row["peer"]] for name, s in series.items()}
        peer_seconds = {name: statistics.median(s) for name, s in peer_samples.items()}
        row.update(peer_seconds=peer_seconds, peer_samples=peer_samples,
                   peer_ratio={name: seconds[name] / peer_seconds[name] for name in seconds})
    return row


if __name__ == "__main__":
    main()
