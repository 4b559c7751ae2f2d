"""The tests' case tables beyond docs/contract.md §5's levels (those are ``sinkattn.testing.cases``): what
the Gate A matrices (test_varlen_gate_a.py, test_dense_gate_a.py) run, and what the tests that check
other things on the same cases (bits, plans, routing, Gate B) take from here.

A table is a list of ``cases.Case``; its name prefixes the ids of its cases in the matrices."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from sinkattn.testing import cases

__all__ = ["interpreter_size", "INFERENCE_LEVELS", "HEAD_DIMS", "KERNEL", "KERNEL_BF16", "SHORT", "SHORT_EDGES",
           "SMALL_CALLS", "LONG_WINDOW", "TRITON_SHAPES", "INTERPRETER_SEEDS", "INTERPRETER_DETERMINISM_SEEDS",
           "interpreter_random", "sharp_cases", "DENSE"]


def C(level, HQ, G, q_lens, k_lens=None, **kw) -> cases.Case:
    return cases.Case(level, HQ, G, tuple(q_lens), tuple(q_lens if k_lens is None else k_lens), **kw)


def interpreter_size(case: cases.Case) -> cases.Case:
    """A level case at the size the Triton interpreter runs it (lengths <= 64, 4 heads, D <= 32)."""
    return case.scaled(max_len=64, max_heads=4, max_dim=32)


INFERENCE_LEVELS = [c for c in cases.cases("L2") if max(c.q_lens + c.k_lens) <= 200] + [
    c for c in cases.cases("boundary") if not c.qk_uniform and c.input_affine[0] < 10]
"""The level cases an inference call (the fused kernel's path) runs: L2 up to 200 tokens, boundary but the
largest inputs."""

HEAD_DIMS = [
    C("L2", 4, 2, (37, 0, 70), (37, 0, 70), D=24, Dv=16),
    C("L2", 4, 2, (53, 21), (53, 21), D=192, Dv=128, dtype=torch.bfloat16, window_size=(15, 0)),
    C("L2", 4, 4, (29, 40), (45, 40), D=16, Dv=40, dtype=torch.float32, causal=False),
    C("L2", 2, 1, (3, 1, 2), (3, 4, 2), D=40, Dv=8, dtype=torch.float32, window_size=(1, 1)),
    C("L2", 2, 2, (70,), (70,), D=512),
    C("L2", 2, 2, (41, 9), (41, 9), D=512, dtype=torch.float32, causal=False, window_size=(8, 5)),
    C("L2", 4, 4, (33,), (33,), D=320, Dv=512, dtype=torch.bfloat16, lse_grad=True),
]
"""Head dims beyond the level tables: a value head dim ``Dv`` other than ``D`` (MiMo-V2-Flash's 192 / 128,
MLA-style query dims above the value dim, or below it) and head dims up to 512 (DeepSeek-V4's)."""

KERNEL = [
    C("L2", 4, 2, (130, 0, 257), (130, 5, 300), D=64, causal=True),                      # empty rows, Lq < Lk
    C("L2", 6, 3, (200,), (90,), D=48, causal=True, lse_grad=True),                      # Lq > Lk: rows see nothing
    C("L2", 8, 8, (150, 40), D=32, window_size=(63, 0), dtype=torch.bfloat16),           # MQA, sliding window
    C("L2", 4, 2, (170,), (220,), D=40, causal=False, window_size=(7, 20)),              # two-sided window
    C("L2", 4, 1, (140,), D=64, Dv=24, causal=True),                                      # Dv != D
    C("L2", 2, 2, (129, 31), D=100, causal=False, dtype=torch.float32, score_bound=300.0),  # sharp scores
    C("L2", 4, 2, (160,), D=16, causal=True, sink_value=30.0, note="sink30"),            # the sink takes it all
    C("L2", 4, 2, (160,), D=16, causal=True, sink_value=-10.0, dtype=torch.float32, note="sink-10"),
    C("L2", 2, 1, (100,), D=72, causal=True, sink_scale=None, note="nosink"),
    C("L2", 4, 4, (90, 200), D=24, causal=False, window_size=(-1, 9), zero_do=True, note="zero_do"),
    cases.random_packed(11, max_len=200),
    cases.random_packed(12, max_len=200, dtype=torch.bfloat16),
]
"""The compiled kernel's cases, each also on the PyTorch-op paths: packed batches with empty and keyless
rows, Lq != Lk, MQA, windows, Dv != D, sharp scores, extreme and missing sinks, dO = 0."""

KERNEL_BF16 = [dataclasses.replace(c, dtype=torch.bfloat16) for c in KERNEL] + [
    cases.random_packed(seed, max_len=200, dtype=torch.bfloat16) for seed in (2, 13, 14, 15)]
"""``KERNEL`` in bf16, and more random batches, for the compiled kernel's bf16 products (seed 2's dv needs
``P`` and ``dS`` split ``hi + lo``: compensated.py --backend cpu)."""

SHORT = [
    C("L2", 4, 2, (1, 2, 3, 0, 3, 1, 2, 2), D=16, dtype=torch.float32, note="short"),
    C("L2", 4, 2, (1, 1, 4, 16, 3, 1), (5, 40, 9, 16, 0, 300), D=16, dtype=torch.float32, note="decoding"),
    C("L2", 4, 2, (1, 1, 4, 16, 3, 1), (5, 40, 9, 16, 0, 300), D=16, dtype=torch.float32, window_size=(7, 0),
      note="decoding"),
    C("L2", 8, 4, (30, 100, 7, 24, 1, 0, 2), (30, 100, 7, 24, 1, 5, 2), D=32, causal=False, window_size=(2, 3),
      lse_grad=True, note="mixed"),
    C("L2", 4, 1, (17, 23, 5, 60), D=24, dtype=torch.bfloat16, lse_grad=True, note="padded"),
    C("L2", 4, 2, (3, 9, 12, 2), D=16, causal=False, window_size=(-1, 1), sink_scale=None, note="nosink"),
] + [C("boundary", 4, 2, (3, 9, 12, 2), D=16, sink_value=s, note=f"sink{s}")
     for s in (float("inf"), float("-inf"), float("nan"), 0.0)]
"""Packed batches with short sequences (``cpu_small``'s), mixed with long ones and decoding rows."""

SHORT_EDGES = [
    C("L2", 4, 2, (0, 3, 0, 2, 0, 70, 4) + (0,) * 50, (6, 3, 0, 0, 4, 70, 4) + (0,) * 50, D=16, dtype=torch.float32,
      note="empty"),
    C("L2", 4, 2, (3, 2, 5), (4, 3, 0), D=8, dtype=torch.float32, note="nokeys-last"),
    C("L2", 4, 2, (3, 2, 5), (0, 0, 0), D=8, dtype=torch.float32, note="nokeys-all"),
]
"""Sequences without queries or without keys, among short ones and at the end of the batch."""

SMALL_CALLS = [
    C("L2", 4, 2, (64,), D=32, dtype=torch.float32, lse_grad=True, note="S64"),
    C("L2", 4, 2, (96, 40, 72, 48), D=32, dtype=torch.bfloat16, note="docs"),
    C("L2", 4, 2, (100, 9), D=32, window_size=(15, 0), note="window"),   # rows of a block past the window
]
"""Calls where the work around the attention costs as much as the attention (a plain eager call with
gradient runs the op's implementation without the dispatcher, ``ops._Eager``)."""

LONG_WINDOW = [C("L2", 4, 2, (700,) * B, D=32, dtype=torch.float32, causal=False, window_size=window)
               for window in ((100, 0), (40, 40), (-1, 20), (150, -1)) for B in (1, 2)]
"""Long windowed sequences: the fused kernel's batched runs of same-geometry blocks (a band: overlapping
key windows, B > 1 item by item) for inference, the tiles' several chunks per row block for training."""

TRITON_SHAPES = [
    C("L2", 2, 2, (40,), D=80),                                                          # the full head dims
    C("L2", 2, 2, (40,), D=256),
    C("L2", 2, 2, (20, 0, 33), D=24, Dv=16, window_size=(9, 0)),                         # Dv != D: one BLOCK_D
    C("L2", 2, 1, (17,), (30,), D=16, Dv=40, dtype=torch.float32, causal=False, lse_grad=True),
    C("L2", 4, 2, (13, 0, 20), D=512, window_size=(7, 0)),                               # the 512 class
    C("L2", 2, 1, (17,), (24,), D=320, Dv=512, dtype=torch.float32, causal=False, lse_grad=True),
    C("L2", 6, 3, (21, 0, 9), (21, 3, 12), D=16, window_size=(6, 0), lse_grad=True),     # groups that do not
    C("L2", 12, 6, (21, 0, 9), (21, 3, 12), D=16, window_size=(6, 0), lse_grad=True),    # fill the packed tile
]
"""The Triton backend's shapes beyond the scaled levels: head dims 80 and 256 unscaled, ``Dv != D`` (q, k and
v padded to one ``BLOCK_D``), head dims past 256 (DeepSeek-V4's D = 512; D = 320 with Dv = 512 pads to
512), GQA groups of 3 and 6 (some rows of the packed tile idle)."""

INTERPRETER_SEEDS = {torch.float16: range(32), torch.bfloat16: range(12), torch.float32: range(12)}
"""The interpreter's random batches per dtype: fp16's seeds reach the edges (the tables' test checks it); the
other dtypes take the first of the same shapes."""
INTERPRETER_DETERMINISM_SEEDS = range(2)       # these also run twice and must match bitwise


def interpreter_random(seed: int, dtype: torch.dtype) -> cases.Case:
    """A random packed batch at the interpreter's size: 1-3 sequences of 0-32 tokens."""
    return cases.random_packed(seed, dtype=dtype, **cases.INTERPRETER_RANDOM)


@st.composite
def sharp_cases(draw):
    """fp32 cases of random shape, mask and score bound ``|scale| max|q| max|k|`` (1 to 4096, around 256 and
    past it), down to one query and one key."""
    n = draw(st.integers(1, 3))
    q_lens = tuple(draw(st.integers(1, 160)) for _ in range(n))
    k_lens = tuple(max(1, L + draw(st.integers(-40, 60))) for L in q_lens)
    HKV = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 2, 4]))
    causal = draw(st.booleans())
    left = draw(st.sampled_from([-1, 0, 7, 40]))
    right = 0 if causal else draw(st.sampled_from([-1, 0, 5]))
    bound = draw(st.one_of(st.sampled_from([200.0, 255.0, 257.0, 300.0]),
                           st.floats(0.0, 12.0).map(lambda e: 2.0 ** e)))
    return cases.Case("L2", HKV * G, G, q_lens, k_lens, D=draw(st.sampled_from([1, 2, 8, 32])), dtype=torch.float32,
                      causal=causal, window_size=(left, right), score_bound=bound, seed=draw(st.integers(0, 2**16)),
                      lse_grad=draw(st.booleans()))


def _dense(name, B, Sq, Sk, HQ=8, G=4, D=32, **kw) -> cases.Case:
    return cases.Case("dense", HQ, G, (Sq,) * B, (Sk,) * B, D=D, note=name, **{"dtype": torch.float32, **kw})


DENSE = [
    _dense("decode", 1, 1, 16),
    _dense("decode-batch", 4, 1, 300),
    _dense("decode-window", 2, 1, 37, window_size=(7, 0)),
    _dense("speculative", 2, 4, 40),
    _dense("prefill", 3, 16, 16),
    _dense("full", 2, 5, 9, causal=False),
    _dense("decode-window", 3, 1, 50, window_size=(20, 0)),
    _dense("decode-window", 3, 1, 50, window_size=(20, 0), dtype=torch.bfloat16),
    _dense("decode-window-sharp", 3, 1, 50, window_size=(20, 0), score_bound=1e4),
    _dense("decode-window-sharp", 3, 1, 50, window_size=(20, 0), score_bound=1e4, dtype=torch.bfloat16),
    _dense("value-dim", 2, 9, 12, HQ=4, G=2, D=192, Dv=128),
    _dense("value-dim", 2, 9, 12, HQ=4, G=2, D=16, Dv=40),
    _dense("value-dim", 2, 9, 12, HQ=4, G=2, D=512),
]
"""Dense batches ``[B, S, H, D]`` (equal lengths): decoding (one query, or a few: speculative), prefill,
full attention, windows, sharp scores, a value head dim of its own. fp32 unless named."""
