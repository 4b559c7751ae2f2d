"""What the traced Hugging Face layout costs: attention on a batch as eager mode describes it against
the fixed-shape description a compiled model uses.

    python benchmarks/hf_layout.py [--json FILE] [--repeats N] [--threads N] [--quick]

Eager mode reads the layout back (``sinkattn.hf.layout.exact``): a dense batch runs as
``sink_attn_func``, a row packing documents by ``position_ids`` as ``sink_attn_varlen_func`` over
its documents. Traced (``torch.compile`` / ``torch.export``), ``sinkattn.hf.layout.fixed`` gives
the same sequences in shapes fixed by B and S: ``cu_seqlens`` with 2B + B*S slots, most empty, and
``max_seqlen = S``. Each row times one forward + backward of both on the same q/k/v (HQ=16, HKV=4,
D=64, causal, gpt-oss's sliding window 128 on one row), interleaved so they share the machine's
noise; medians of ``--repeats``. Prints figures and ratios; asserts nothing.
"""

from __future__ import annotations

import os

import torch

import sinkattn
from sinkattn.hf import layout
from sinkattn.testing import bench

HQ, HKV, D = 16, 4, 64
# (B, S, documents per row or None for a dense batch, sliding window W or None)
ROWS = [(1, 1024, None, None), (2, 512, None, None), (4, 512, None, None), (2, 512, None, 128), (1, 2048, 4, None)]
QUICK = [(1, 64, None, None), (2, 32, 2, None)]


def _positions(B: int, S: int, documents: int | None) -> torch.Tensor:
    if documents is None:
        return torch.arange(S).repeat(B, 1)
    return torch.arange(S).remainder(S // documents).repeat(B, 1)        # equal documents, restarting at 0


def _steps(B: int, S: int, documents: int | None, window: int | None) -> tuple[dict, int]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, generator=g, requires_grad=True) for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, generator=g, requires_grad=True)
    options = dict(sinks=sinks, causal=True, window_size=(window - 1, 0) if window else (-1, -1))
    pos = _positions(B, S, documents)
    exact, fixed = layout.exact(None, pos, B, S, S), layout.fixed(None, pos, B, S, S)

    def varlen(lay):
        def run():
            out = sinkattn.sink_attn_varlen_func(q.reshape(B * S, HQ, D), k.reshape(B * S, HKV, D),
                                                 v.reshape(B * S, HKV, D), lay.cu_q, lay.cu_k, lay.max_q, lay.max_k,
                                                 **options)
            out.sum().backward()
        return run

    def dense():
        sinkattn.sink_attn_func(q, k, v, **options).sum().backward()

    eager = dense if documents is None else varlen(exact)
    return {"eager mode": eager, "traced": varlen(fixed)}, fixed.sequences


def main(argv=None) -> dict:
    ap = bench.script_parser(__doc__, repeats=6, quick="smoke run: two tiny batches, 1 repeat")
    args = bench.parse_script_args(ap, argv)
    repeats = 1 if args.quick else args.repeats
    info = bench.header()
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"HQ={HQ} HKV={HKV} D={D}, fp32, causal, forward + backward; medians of {repeats}, interleaved")
    rows = []
    for B, S, documents, window in (QUICK if args.quick else ROWS):
        steps, slots = _steps(B, S, documents, window)
        load = os.getloadavg()[0]
        ms = {name: s * 1e3 for name, s in bench.time_interleaved(steps, repeats).items()}
        row = dict(B=B, S=S, documents_per_row=documents, window=window, slots=slots, ms=ms,
                   traced_vs_eager=ms["traced"] / ms["eager mode"], loadavg=[load, os.getloadavg()[0]])
        rows.append(row)
        what = f"{documents} documents per row" if documents else "dense"
        print(f"  B={B} S={S:5d} {what:22s} window {window or '-':>4}: eager mode {ms['eager mode']:8.1f} ms, "
              f"traced ({slots} slots) {ms['traced']:8.1f} ms: {row['traced_vs_eager']:.2f}x   "
              f"(load average {row['loadavg'][0]:.1f} -> {row['loadavg'][1]:.1f})")
    record = dict(header=info, rows=rows)
    bench.write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
