"""The level tables of docs/contract.md §5 as data, and the seeded inputs of one case.

A case is ``(HQ, G = HQ / HKV, q_lens, k_lens, D, mask, dtype, sink and input
variants)``; ``B`` is ``len(q_lens)``. Defaults follow the Ascend kernel the
first tables come from: fp16, causal, D = 128, sinks ``randn(HQ)``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

__all__ = ["Case", "Inputs", "LEVELS", "SINK_VARIANTS", "INTERPRETER_RANDOM", "cases", "random_packed"]


@dataclass(frozen=True)
class Case:
    level: str
    HQ: int
    G: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    D: int = 128
    Dv: int | None = None                   # v's head dim when it differs from D (q's and k's)
    dtype: torch.dtype = torch.float16
    causal: bool = True
    window_size: tuple[int, int] = (-1, -1)
    sink_scale: float | None = 1.0          # sinks = sink_scale * randn(HQ); None: no sinks
    sink_value: float | None = None         # a constant sink for every head instead
    qk_uniform: float | None = None         # q, k ~ U(-a, a) instead of randn
    input_affine: tuple[float, float] = (1.0, 0.0)   # q, k, v -> x * a + b
    score_bound: float | None = None        # q, k scaled by one factor so that |scale| max|q| max|k| is this
    zero_do: bool = False
    lse_grad: bool = False                  # also back-propagate a random dlse
    spacing_limited: tuple[str, ...] = ()   # tensors whose golden is too large for max_abs_limit in fp32
    note: str = ""
    seed: int = 0

    @property
    def HKV(self) -> int:
        return self.HQ // self.G

    @property
    def name(self) -> str:
        lens = "q" + "_".join(map(str, self.q_lens))
        if self.k_lens != self.q_lens:
            lens += "-k" + "_".join(map(str, self.k_lens))
        mask = "causal" if self.causal else "full"
        if self.window_size != (-1, -1):
            mask += f"-w{self.window_size[0]}_{self.window_size[1]}"
        dims = f"d{self.D}" if self.Dv is None else f"d{self.D}-dv{self.Dv}"
        parts = [self.level, f"hq{self.HQ}-g{self.G}", lens, dims, mask,
                 str(self.dtype).removeprefix("torch.")]
        if self.score_bound is not None:
            parts.append(f"bound{self.score_bound:g}")
        if self.note:
            parts.append(self.note)
        return "-".join(parts)

    def scaled(self, max_len: int, max_heads: int, max_dim: int) -> "Case":
        """A smaller copy for slow backends (the Triton interpreter): lengths, heads and D capped."""
        def cap(n):
            return min(n, max_len)
        HQ = min(self.HQ, max_heads)
        G = min(self.G, HQ)
        win = tuple(w if w < 0 else min(w, max_len - 1) for w in self.window_size)
        return dataclasses.replace(self, HQ=HQ, G=G, q_lens=tuple(map(cap, self.q_lens)),
                                   k_lens=tuple(map(cap, self.k_lens)), D=min(self.D, max_dim),
                                   Dv=None if self.Dv is None else min(self.Dv, max_dim), window_size=win)

    def make(self, device="cpu") -> "Inputs":
        g = torch.Generator().manual_seed(self.seed)
        Tq, Tk = sum(self.q_lens), sum(self.k_lens)

        def randn(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float32)

        if self.qk_uniform is not None:
            a = self.qk_uniform
            q = (torch.rand(Tq, self.HQ, self.D, generator=g) * 2 - 1) * a
            k = (torch.rand(Tk, self.HKV, self.D, generator=g) * 2 - 1) * a
        else:
            q, k = randn(Tq, self.HQ, self.D), randn(Tk, self.HKV, self.D)
        Dv = self.D if self.Dv is None else self.Dv
        v = randn(Tk, self.HKV, Dv)
        scale, shift = self.input_affine
        q, k, v = (x * scale + shift for x in (q, k, v))
        if self.score_bound is not None and Tq and Tk:
            bound = self.D ** -0.5 * float(q.norm(dim=-1).max() * k.norm(dim=-1).max())
            factor = (self.score_bound / bound) ** 0.5
            q, k = q * factor, k * factor
        sinks = None
        if self.sink_value is not None:
            sinks = torch.full((self.HQ,), self.sink_value)
        elif self.sink_scale is not None:
            sinks = randn(self.HQ) * self.sink_scale
        do = torch.zeros(Tq, self.HQ, Dv) if self.zero_do else randn(Tq, self.HQ, Dv)
        dlse = randn(self.HQ, Tq) if self.lse_grad else None

        def cu(lens):
            return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()],
                                dtype=torch.int32, device=device)

        def cast(x):
            return None if x is None else x.to(device=device, dtype=self.dtype)

        return Inputs(cast(q), cast(k), cast(v), cast(sinks), cu(self.q_lens), cu(self.k_lens),
                      max(self.q_lens, default=0), max(self.k_lens, default=0), cast(do),
                      None if dlse is None else dlse.to(device))


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    do: torch.Tensor
    dlse: torch.Tensor | None


def _c(level, HQ, G, q_lens, k_lens=None, **kw) -> Case:
    return Case(level, HQ, G, tuple(q_lens), tuple(k_lens if k_lens is not None else q_lens), **kw)


def _w(W: int) -> dict:
    """gpt-oss ``sliding_window=W``: causal, W keys including the query itself."""
    return dict(causal=True, window_size=(W - 1, 0))


L0 = [
    _c("L0", 4, 2, [128]),
    _c("L0", 4, 2, [256]),
    _c("L0", 8, 4, [256]),
    _c("L0", 4, 2, [256], **_w(128)),
    _c("L0", 4, 2, [128], sink_scale=3.0, note="sinks3"),
    _c("L0", 4, 2, [128, 128]),
    _c("L0", 4, 2, [128], [256]),
    _c("L0", 64, 8, [512], **_w(128)),
]

L1 = [
    _c("L1", 4, 2, [128]),
    _c("L1", 4, 1, [256], note="mha"),
    _c("L1", 16, 4, [256] * 4),
    _c("L1", 4, 2, [256, 256], [128, 128], note="lq_gt_lk"),
    _c("L1", 4, 2, [128, 128], [256, 256], note="lq_lt_lk"),
    _c("L1", 16, 8, [256], **_w(128)),
    _c("L1", 16, 8, [512], **_w(256)),
    _c("L1", 4, 2, [128, 256], [256, 128]),
    _c("L1", 8, 4, [384]),
    _c("L1", 32, 8, [512]),
]

L2 = [
    _c("L2", 4, 2, [129]),
    _c("L2", 4, 2, [192]),
    _c("L2", 4, 2, [131], [67]),
    _c("L2", 4, 2, [1]),
    _c("L2", 4, 2, [1], [130]),
    _c("L2", 4, 2, [100, 0, 131, 1], [90, 0, 131, 7], note="empty_seq"),
    _c("L2", 4, 2, [129], dtype=torch.float32),
    _c("L2", 4, 2, [129], dtype=torch.bfloat16),
    _c("L2", 4, 4, [200], note="mqa"),
    _c("L2", 4, 2, [200], **_w(200)),
    *[_c("L2", 4, 2, [150], D=d) for d in (1, 32, 64, 80, 96, 256)],
    _c("L2", 4, 2, [150], [170], causal=False),
    _c("L2", 4, 2, [150], causal=False, window_size=(31, 17)),
    _c("L2", 4, 2, [150], [90], causal=False, window_size=(5, 40)),
    _c("L2", 4, 2, [140], causal=False, window_size=(-1, 8)),
    _c("L2", 4, 2, [140], dtype=torch.float32, causal=False, window_size=(20, -1)),
    _c("L2", 4, 2, [137, 0, 64], [120, 5, 64], dtype=torch.bfloat16, lse_grad=True, note="lse_grad"),
    _c("L2", 4, 2, [200], dtype=torch.float32, sink_scale=None, note="nosink"),
]

BOUNDARY = [
    *[_c("boundary", 4, 2, [128], sink_value=s, note=f"sink_{s}") for s in
      (0.0, float("inf"), float("-inf"), float("nan"), 65504.0)],
    _c("boundary", 4, 2, [128], sink_scale=10.0, note="sinks10"),
    _c("boundary", 4, 2, [128], sink_scale=-3.0, note="sinks_neg3"),
    _c("boundary", 4, 2, [128], sink_scale=0.01, note="sinks001"),
    _c("boundary", 4, 2, [128], zero_do=True, note="zero_do"),
    # |lse| reaches ~1.5e9 here, where fp32 values are 128 apart: no fp32 lse can be within
    # max_abs_limit = 1e-2 of the golden, so lse is held to two fp32 spacings instead.
    _c("boundary", 4, 2, [128], qk_uniform=32000.0, spacing_limited=("lse",), note="qk32000"),
    *[_c("boundary", 4, 2, [128], input_affine=a, note=f"x{a[0]:g}p{a[1]:g}") for a in
      ((10.0, 0.0), (3.0, 0.0), (2.0, 2.0))],
    _c("boundary", 4, 2, [96], [32], note="rows_without_keys"),
    _c("boundary", 4, 2, [64, 64], [64, 64], causal=False, window_size=(0, 0), note="diagonal_only"),
]

LEVELS = {"L0": L0, "L1": L1, "L2": L2, "boundary": BOUNDARY}


SINK_VARIANTS = {
    "randn": dict(sink_scale=1.0),
    "10randn": dict(sink_scale=10.0),
    "+30": dict(sink_value=30.0),      # the sink takes nearly all the mass: o and dsinks tiny
    "-10": dict(sink_value=-10.0),
    "none": dict(sink_scale=None),
}
"""Sink vectors ``random_packed`` can draw, by name."""


INTERPRETER_RANDOM = dict(max_seqs=3, max_len=32)
"""``random_packed`` sizes for the Triton interpreter: up to two blocks of 16 rows per sequence."""


def random_packed(seed: int, max_seqs: int = 9, max_len: int = 300, dtype=torch.float16,
                  head_dims: tuple[int, ...] = (16, 24, 32, 40, 64), sinks: tuple[str, ...] = tuple(SINK_VARIANTS)
                  ) -> Case:
    """A seeded packed batch: 1..max_seqs sequences, lengths 0..max_len, random mask and GQA shape,
    D drawn from ``head_dims`` and the sink vector from ``sinks`` (names of ``SINK_VARIANTS``)."""
    unknown = [name for name in sinks if name not in SINK_VARIANTS]
    if unknown or not sinks:
        raise ValueError(f"sinks must name some of {list(SINK_VARIANTS)}, got {list(sinks)}")
    r = random.Random(seed)
    n = r.randint(1, max_seqs)
    q_lens = [r.randint(0, max_len) for _ in range(n)]
    k_lens = [length if r.random() < 0.6 else r.randint(0, max_len) for length in q_lens]
    HKV, G = r.choice([1, 2]), r.choice([1, 2, 4])
    causal = r.random() < 0.7
    window = (r.choice([-1, 0, 7, 63]), -1 if causal else r.choice([-1, 0, 9]))
    D = r.choice(head_dims)
    variant = r.choice(sinks)
    note = f"seed{seed}" + ("" if variant == "randn" else f"-sinks{variant}")
    return _c("random", HKV * G, G, q_lens, k_lens, D=D, dtype=dtype, causal=causal, window_size=window,
              note=note, seed=seed, **SINK_VARIANTS[variant])


def cases(level: str) -> list[Case]:
    """The cases of one level, or of all levels for ``"all"``."""
    if level == "all":
        return [c for lv in LEVELS.values() for c in lv]
    if level not in LEVELS:
        raise ValueError(f"level must be one of {['all', *LEVELS]}, got {level!r}")
    return list(LEVELS[level])
