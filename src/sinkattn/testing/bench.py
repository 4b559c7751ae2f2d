"""Timing sinkattn against the attention a user has today, on this machine, in one run.

Providers (each says why when it cannot run a problem):

* ``sinkattn``  this library, ``backend="auto"``;
* ``sdpa``      ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)``, no sinks;
* ``sdpa_lse``  PyTorch's fused kernel returning its log-sum-exp, corrected for the sink
  (``o * exp(lse - logaddexp(lse, sink))``): the same forward function. PyTorch does not
  differentiate through that lse, so its backward misses the lse path (timed all the same);
* ``eager``     Hugging Face gpt-oss eager sink attention (``sinkattn.testing.eager``), scores materialized;
* ``flex_lse``  FlexAttention with its lse and the same correction (CUDA only);
* ``flash_attn`` flash-attn's ``flash_attn_func``, no sinks (CUDA, when installed).

Every time is kept as the min, median and max of ``repeats`` runs after ``warmup``
runs, with providers interleaved so they share the machine's noise; ratios and FLOP
rates use the medians; ``noise_warning`` says when the spread (max - min over the
median) passes ``NOISE_LIMIT``, enough to turn a ratio. FLOP rates count visible
pairs only (``sinkattn.testing.flops``); peak memory is the growth over the run (CUDA
allocator peak, or the process's peak RSS on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .. import __version__
from ..backends import isa
from ..interface import sink_attn_func, sink_attn_varlen_func
from ..masks import Window
from . import eager, flops

__all__ = ["Problem", "Row", "Spread", "CONFIGS", "PROVIDERS", "MODES", "MODE_NAMES", "NOISE_LIMIT", "run", "header",
           "time_repeats", "time_interleaved", "noise_warning", "common_label", "sinkattn_step", "sinkattn_provider",
           "mode_step", "problem_inputs", "peak_growth_mib",
           "step_peak_growth_mib", "plot", "script_parser", "parse_script_args"]

MODES = ("fwd", "bwd", "fwdbwd")
MODE_NAMES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}
NOISE_LIMIT = 0.2
"""A spread of repeated timings (max - min over the median) above this can turn a ratio: warn."""


@dataclass(frozen=True)
class Spread:
    """The min, median and max of repeated timings (any unit)."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, samples) -> Spread:
        return cls(min(samples), statistics.median(samples), max(samples))

    @property
    def relative(self) -> float:
        """``(max - min) / median``: 0 for one repeat."""
        return (self.max - self.min) / self.median if self.median > 0 else 0.0

    def scaled(self, factor: float) -> Spread:
        return Spread(self.min * factor, self.median * factor, self.max * factor)


@dataclass(frozen=True)
class Problem:
    B: int
    S: int
    HQ: int
    HKV: int
    D: int
    dtype: str = "float32"
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    lens: tuple[int, ...] | None = None   # a packed batch of these lengths instead of B x S

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def seq_lens(self) -> list[int]:
        return list(self.lens) if self.lens is not None else [self.S] * self.B

    @property
    def parts(self) -> dict[str, str]:
        """The label's fields by name: shape (``B``, ``S`` or ``lens``), heads, ``D``, dtype, mask."""
        shape = {"lens": f"packed{list(self.lens)}"} if self.lens is not None else {"B": f"B={self.B}",
                                                                                    "S": f"S={self.S}"}
        mask = "causal" if self.causal else "non-causal"
        if self.window != (-1, -1):
            mask += f" w{self.window[0]}_{self.window[1]}"
        return shape | {"HQ": f"HQ={self.HQ}", "HKV": f"HKV={self.HKV}", "D": f"D={self.D}", "dtype": self.dtype,
                        "mask": mask}

    @property
    def label(self) -> str:
        return " ".join(self.parts.values())

    @property
    def tensor_bytes(self) -> int:
        """Bytes of q, k, v, out and their gradients: ``2 T (2 HQ + 2 HKV) D`` elements."""
        return 2 * sum(self.seq_lens) * (2 * self.HQ + 2 * self.HKV) * self.D * self.torch_dtype.itemsize

    def flops(self, mode: str) -> float:
        window = Window.of(self.causal, self.window)
        return flops.attention_flops(self.seq_lens, self.seq_lens, self.HQ, self.D, window, mode)


@dataclass
class Row:
    problem: Problem
    provider: str
    mode: str
    ms: float | None = None               # median of the repeats
    ms_min: float | None = None
    ms_max: float | None = None
    gflops: float | None = None           # at the median
    vs_best_peer: float | None = None     # sinkattn's row: best peer time / sinkattn time
    peak_mem_mib: float | None = None
    note: str = ""

    @property
    def spread(self) -> Spread | None:
        return None if self.ms is None else Spread(self.ms_min, self.ms, self.ms_max)

    @property
    def where(self) -> str:
        """``sinkattn forward B=1 S=256``: which timing this is, for a message."""
        return f"{self.provider} {MODE_NAMES[self.mode]} B={self.problem.B} S={self.problem.S}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["problem"] = asdict(self.problem) | {"label": self.problem.label}
        return d


def common_label(problems) -> str:
    """The label fields every problem shares (``HQ=16 HKV=4 D=64 float32 causal`` for a sweep over S)."""
    first = problems[0].parts
    return " ".join(v for k, v in first.items() if all(p.parts.get(k) == v for p in problems[1:]))


def _sweep(S_list, **kw):
    return [Problem(S=s, **kw) for s in S_list]


CONFIGS = {
    "cpu-default": _sweep([256, 512, 1024, 2048], B=1, HQ=16, HKV=4, D=64),
    "cpu-quick": _sweep([64, 128], B=1, HQ=4, HKV=2, D=32),
    "cpu-window": _sweep([1024, 2048, 4096], B=1, HQ=16, HKV=4, D=64, window=(511, 0)),
    "gpu-default": _sweep([512, 1024, 2048, 4096], B=8, HQ=64, HKV=4, D=128, dtype="bfloat16"),
    # the Ascend kernel's configuration, dense S=8192, a packed batch with window (127, 0)
    "gpu-targets": [Problem(8, 2048, 64, 4, 128, dtype=dt) for dt in ("float16", "bfloat16")]
    + [Problem(1, 8192, 32, 4, 128, dtype="bfloat16"),
       Problem(6, 3000, 32, 4, 128, dtype="bfloat16", window=(127, 0), lens=(3000, 1000, 517, 2048, 129, 700))],
}


def problem_inputs(p: Problem, device):
    """Dense ``[B, S, H, D]`` tensors, or packed ``[T, H, D]`` ones for ``p.lens``."""
    g = torch.Generator().manual_seed(0)
    tokens = (sum(p.lens),) if p.lens is not None else (p.B, p.S)
    shape_q, shape_kv = (*tokens, p.HQ, p.D), (*tokens, p.HKV, p.D)
    q, k, v = (torch.randn(s, generator=g).to(device=device, dtype=p.torch_dtype)
               for s in (shape_q, shape_kv, shape_kv))
    sinks = torch.randn(p.HQ, generator=g).to(device)
    return q, k, v, sinks


def _heads_first(*xs):
    return [x.transpose(1, 2) for x in xs]


def _cu(p: Problem, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(p.seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _sdpa(p, q, k, v, sinks):
    if p.lens is not None:
        return None, "dense batches only"
    if p.window != (-1, -1):
        return None, "no sliding window in SDPA without a dense mask"

    def fn(q, k, v, sinks):
        a, b, c = _heads_first(q, k, v)
        return F.scaled_dot_product_attention(a, b, c, is_causal=p.causal, enable_gqa=True).transpose(1, 2)
    return fn, "no sinks"


def _sink_correction(o, lse, sinks):
    """``o [B, H, S, D]``, ``lse [B, H, S]``: the sink's share taken out of ``o``."""
    keep = torch.exp(lse - torch.logaddexp(lse, sinks.float().view(1, -1, 1)))
    return (o.float() * keep[..., None]).to(o.dtype)


def _sdpa_lse(p, q, k, v, sinks):
    if p.lens is not None:
        return None, "dense batches only"
    if q.device.type != "cpu":
        return None, "CPU kernel only"
    if p.window != (-1, -1):
        return None, "no sliding window in SDPA without a dense mask"
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def fn(q, k, v, sinks):
        a, b, c = _heads_first(q, k, v)
        o, lse = op(a, b, c, 0.0, p.causal)
        return _sink_correction(o, lse, sinks).transpose(1, 2)
    return fn, "backward misses the lse path"


def _eager(p, q, k, v, sinks):
    scores = max(p.seq_lens) ** 2 * p.HQ * q.element_size() * (1 if p.lens is not None else p.B)
    if scores > 4 * 2**30:
        return None, f"scores alone need {scores / 2**30:.1f} GiB"
    if p.lens is not None:
        cu = _cu(p, q.device)

        def packed(q, k, v, sinks):
            return eager.sink_attention_varlen(q, k, v, cu, cu, sinks.to(q.dtype), causal=p.causal,
                                               window_size=p.window)[0]
        return packed, "one sequence at a time"

    def fn(q, k, v, sinks):
        return eager.sink_attention_dense(q, k, v, sinks.to(q.dtype), causal=p.causal, window_size=p.window)[0]
    return fn, ""


def _flex_lse(p, q, k, v, sinks):
    if q.device.type != "cuda":
        return None, "FlexAttention has no backward on CPU"
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        AuxRequest = None
    left = p.window[0]
    packed = p.lens is not None
    doc = torch.repeat_interleave(torch.arange(len(p.seq_lens), device=q.device),
                                  torch.tensor(p.seq_lens, device=q.device))

    def mask_mod(b, h, i, j):
        vis = (j <= i) if p.causal else (i >= 0)
        if packed:
            vis = vis & (doc[i] == doc[j])
        return vis & (i - j <= left) if left >= 0 else vis

    L = sum(p.seq_lens) if packed else p.S
    block_mask = create_block_mask(mask_mod, None, None, L, L, device=q.device)
    flex = torch.compile(flex_attention)

    def fn(q, k, v, sinks):
        if packed:
            q, k, v = q[None], k[None], v[None]
        a, b, c = _heads_first(q, k, v)
        if AuxRequest is not None:      # torch >= 2.9 asks for the lse this way
            o, aux = flex(a, b, c, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
            lse = aux.lse
        else:
            o, lse = flex(a, b, c, block_mask=block_mask, enable_gqa=True, return_lse=True)
        out = _sink_correction(o, lse, sinks).transpose(1, 2)
        return out[0] if packed else out
    return fn, "sink added through its lse"


def _flash_attn(p, q, k, v, sinks):
    if p.lens is not None:
        return None, "dense batches only here"
    if q.device.type != "cuda":
        return None, "CUDA only"
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None, "flash-attn not installed"

    def fn(q, k, v, sinks):
        return flash_attn_func(q, k, v, causal=p.causal, window_size=p.window)
    return fn, "no sinks"


def sinkattn_provider(backend: str = "auto", with_sinks: bool = True):
    """The ``sinkattn`` provider on ``backend``; ``with_sinks=False`` drops the sinks (their own cost)."""
    def build(p, q, k, v, sinks):
        note = "" if with_sinks else "no sinks"
        if p.lens is not None:
            cu, longest = _cu(p, q.device), max(p.seq_lens)

            def packed(q, k, v, sinks):
                return sink_attn_varlen_func(q, k, v, cu, cu, longest, longest, sinks=sinks if with_sinks else None,
                                             causal=p.causal, window_size=p.window, backend=backend)
            return packed, note

        def fn(q, k, v, sinks):
            return sink_attn_func(q, k, v, sinks=sinks if with_sinks else None, causal=p.causal,
                                  window_size=p.window, backend=backend)
        return fn, note
    return build


_sinkattn = sinkattn_provider()


PROVIDERS = {"sinkattn": _sinkattn, "sdpa": _sdpa, "sdpa_lse": _sdpa_lse, "eager": _eager,
             "flex_lse": _flex_lse, "flash_attn": _flash_attn}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rss_bytes(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak(device) -> int | None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _rss_bytes("VmRSS:")


def _peak_growth(device, base) -> float | None:
    if base is None:
        return None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_bytes("VmHWM:")
    return None if peak is None else max(0, peak - base) / 2**20


def mode_step(fn, inputs, mode):
    """One timed unit of ``mode``; returns a callable that runs it."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn(*inputs)
        return run
    leaves = [x.detach().requires_grad_() for x in inputs]
    if mode == "fwdbwd":
        def run():
            out = fn(*leaves)
            out.backward(torch.ones_like(out))
        return run
    out = fn(*leaves)
    grad = torch.ones_like(out)

    def run():
        torch.autograd.grad(out, leaves, grad, retain_graph=True, allow_unused=True)
    return run


def time_repeats(steps: dict, repeats: int, warmup: int = 1, device="cpu") -> dict[str, list[float]]:
    """Seconds of every repeat of each callable; within each repeat every step runs once, so they
    share the machine's noise."""
    device = torch.device(device)
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            samples[name].append(time.perf_counter() - t0)
    return samples


def time_interleaved(steps: dict, repeats: int, warmup: int = 1, device="cpu") -> dict[str, float]:
    """Median seconds of each callable (``time_repeats``)."""
    return {name: statistics.median(s) for name, s in time_repeats(steps, repeats, warmup, device).items()}


def noise_warning(timings, limit: float = NOISE_LIMIT) -> str | None:
    """One line when some of ``timings`` (``(what, Spread)`` pairs) spread more than ``limit``
    between their repeats, naming the widest; None when none does."""
    timings = list(timings)
    noisy = [(what, spread) for what, spread in timings if spread.relative > limit]
    if not noisy:
        return None
    what, widest = max(noisy, key=lambda t: t[1].relative)
    return (f"noise: {len(noisy)} of {len(timings)} timings spread more than {limit:.0%} between their repeats "
            f"(max - min over the median; widest: {what}, {widest.relative:.0%}), enough to turn a ratio: "
            f"rerun on a quieter machine or with more repeats")


def script_parser(description: str, *, repeats: int | str | None, quick: str,
                  threads: int | str | None = None) -> argparse.ArgumentParser:
    """The options every benchmark script in ``benchmarks/`` takes, with the same meaning in each:

    * ``--quick``: a smoke run on small sizes, all figures still written (``quick`` says what it shrinks);
    * ``--repeats N``: timed runs behind each figure; ``repeats`` is its default, or a string that
      describes a default depending on other options (the script then reads None); None for a script
      that times nothing, which then takes no ``--repeats``;
    * ``--threads N``: torch's threads in every process of the run that computes (a script that starts
      processes passes it on); ``threads`` describes the default, None: torch's own choice, which the
      script then reads as None;
    * ``--json FILE``: every figure, written to FILE.

    A script adds its own options to the parser returned (hidden ones for its child processes with
    ``help=argparse.SUPPRESS``) and reads them with ``parse_script_args``."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats if isinstance(repeats, int) else None,
                        help=f"timed runs behind each figure (default {repeats})")
    shown = "torch's own choice" if threads is None else threads
    ap.add_argument("--threads", type=int, default=threads if isinstance(threads, int) else None,
                    help=f"torch threads (default: {shown})")
    ap.add_argument("--json", help="write every figure to this file")
    return ap


def parse_script_args(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``ap.parse_args(argv)``, with ``--threads`` applied to torch in this process; ``--repeats`` and
    ``--threads`` below 1 are refused."""
    args = ap.parse_args(argv)
    for option in ("repeats", "threads"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            ap.error(f"argument --{option}: must be at least 1, got {value}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def sinkattn_step(p: Problem, mode: str, device="cpu"):
    """One ``mode`` of sinkattn on ``p`` as a callable (inputs made here)."""
    inputs = problem_inputs(p, torch.device(device))
    fn, _ = _sinkattn(p, *inputs)
    return mode_step(fn, inputs, mode)


def step_peak_growth_mib(step, device="cpu") -> float | None:
    """Peak memory growth of one run of ``step()``, in MiB: the CUDA allocator's peak, or on CPU the
    process's RSS high-water mark (reset first through /proc/self/clear_refs) over its RSS before."""
    device = torch.device(device)
    base = _reset_peak(device)
    step()
    _sync(device)
    return _peak_growth(device, base)


def peak_growth_mib(p: Problem, provider: str, mode: str = "fwdbwd", device="cpu") -> float | None:
    """Peak memory growth of one first run of ``mode`` (inputs already allocated), in MiB.
    On CPU this reads the process's peak RSS: run it in a fresh process for a clean figure."""
    device = torch.device(device)
    inputs = problem_inputs(p, device)
    fn, note = PROVIDERS[provider](p, *inputs)
    if fn is None:
        raise ValueError(f"{provider} cannot run {p.label}: {note}")
    return step_peak_growth_mib(mode_step(fn, inputs, mode), device)


def _failed(exc: Exception) -> str:
    return f"failed: {type(exc).__name__}: {str(exc)[:80]}"


def _build(name: str, p: Problem, inputs) -> tuple:
    """``(fn or None, note)`` of one provider; a provider that raises while setting up is reported."""
    try:
        return PROVIDERS[name](p, *inputs)
    except Exception as exc:  # noqa: BLE001 - a provider that fails is reported, not fatal
        return None, _failed(exc)


def run(problems, providers=("sinkattn", "sdpa", "sdpa_lse", "eager"), modes=("fwd", "fwdbwd"),
        repeats=3, warmup=1, device="cpu", progress=None) -> list[Row]:
    """Measure every (problem, provider, mode); ``progress(advance_by_one)`` is called per unit."""
    device = torch.device(device)
    rows = []
    for p in problems:
        inputs = problem_inputs(p, device)
        built = {name: _build(name, p, inputs) for name in providers}
        for mode in modes:
            steps, mode_rows = {}, {}
            for name, (fn, note) in built.items():
                row = Row(p, name, mode, note=note)
                mode_rows[name] = row
                if fn is None:
                    continue
                try:
                    steps[name] = mode_step(fn, inputs, mode)
                    base = _reset_peak(device)
                    for _ in range(warmup):
                        steps[name]()
                    _sync(device)
                    row.peak_mem_mib = _peak_growth(device, base)
                except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    row.note = _failed(exc)
                    steps.pop(name, None)
            for name, seconds in time_repeats(steps, repeats, warmup=0, device=device).items():
                row = mode_rows[name]
                spread = Spread.of(seconds).scaled(1e3)
                row.ms, row.ms_min, row.ms_max = spread.median, spread.min, spread.max
                row.gflops = p.flops(mode) / (row.ms * 1e-3) / 1e9
            peers = [r.ms for n, r in mode_rows.items() if n != "sinkattn" and r.ms is not None]
            ours = mode_rows.get("sinkattn")
            if ours is not None and ours.ms is not None and peers:
                ours.vs_best_peer = min(peers) / ours.ms
            rows.extend(mode_rows.values())
            if progress is not None:
                progress()
    return rows


_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU features behind PyTorch's CPU speed (its bf16 speed differs about 10x across them)."""


def _cpuinfo(key: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _cpu_isa() -> str:
    """The ``_ISA_FLAGS`` this CPU reports, e.g. ``avx2 avx512f avx512_bf16`` (``unknown`` off Linux)."""
    flags = _cpuinfo("flags")
    if flags is None:
        return "unknown"
    have = set(flags.split())
    return " ".join(f for f in _ISA_FLAGS if f in have) or "none of " + ", ".join(_ISA_FLAGS)


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_json(path, record) -> None:
    """Write ``record`` to ``path`` as indented JSON; nothing when ``path`` is None or empty."""
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=2)


def header(device="cpu") -> dict:
    info = dict(machine=_cpu_model(), isa=_cpu_isa(), dispatch=isa.capability(),
                cores=os.cpu_count(), threads=torch.get_num_threads(),
                python=platform.python_version(), torch=torch.__version__, sinkattn=__version__,
                commit=_commit())
    ceiling = isa.ceiling()
    if ceiling is not None:                # a process held to a narrower instruction set (``tests/harness/isa.py``)
        info["ceiling"] = ceiling
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    else:
        from ..backends import cpu_native
        info["cpu_path"] = cpu_native.describe()
    return info


def _caveats(rows: list[Row]) -> str:
    """The notes of the rows that were timed (``no sinks``, ...), once each."""
    return "; ".join(dict.fromkeys(r.note for r in rows if r.ms is not None and r.note))


def plot(rows: list[Row], path: str, title: str) -> dict[str, list[str]]:
    """Time against sequence length per provider, one panel per mode (log-log): the median as a
    line, the min-max of the repeats as a band, each provider's caveats in its legend entry, and
    ``noise_warning``'s line under the panels when the spread is wide. Written in the format of
    ``path``'s extension (any matplotlib writes). Returns each panel's title with its legend
    entries, and the warning under ``"noise"`` (a list of none or one line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r.mode == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.6), squeeze=False)
    drawn = {}
    for ax, mode in zip(axes[0], modes):
        for provider in dict.fromkeys(r.provider for r in rows):
            timed = sorted((r for r in rows if r.mode == mode and r.provider == provider and r.ms is not None),
                           key=lambda r: r.problem.S)
            if not timed:
                continue
            S = [r.problem.S for r in timed]
            caveats = _caveats(timed)
            line, = ax.plot(S, [r.ms for r in timed], marker="o", label=provider + (f" ({caveats})" if caveats else ""),
                            linewidth=2.5 if provider == "sinkattn" else 1.2)
            ax.fill_between(S, [r.ms_min for r in timed], [r.ms_max for r in timed], color=line.get_color(),
                            alpha=0.2, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("time (ms), lower is better\nline: median, band: min to max of the repeats")
        ax.set_title(MODE_NAMES[mode])
        ax.grid(True, which="both", alpha=0.3)
        legend = ax.legend(fontsize=8)
        drawn[MODE_NAMES[mode]] = [t.get_text() for t in legend.get_texts()]
    fig.suptitle(title, fontsize=10)
    warning = noise_warning((r.where, r.spread) for r in rows if r.ms is not None)
    drawn["noise"] = [warning] if warning else []
    if warning:
        fig.text(0.5, 0.01, warning, ha="center", va="bottom", fontsize=8, color="firebrick", wrap=True)
    fig.tight_layout(rect=(0, 0.06 if warning else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
