"""Argument checks for the public API: each rule raises a ValueError or TypeError
that names the argument, what was received and what is expected.

Everything here reads only Python values and tensor metadata, so it traces under
``torch.compile`` without a graph break, except ``check_cu_seqlens_contents``, which
reads the tensors and runs inside the ``sinkattn::forward`` op.
"""

from __future__ import annotations

import math
import numbers
import sys
import weakref

import torch

__all__ = ["check_varlen", "check_dense", "check_options", "check_cu_seqlens_contents", "as_bool", "check_qkv",
           "check_cu_seqlens", "check_max_seqlen", "check_offsets", "sdpa_layout_hint",
           "FLOAT_DTYPES", "MAX_HEAD_DIM", "MAX_SOFTMAX_SCALE"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 512
MAX_SOFTMAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)
"""Scores run in fp32, in base 2 inside the kernels: ``softmax_scale * log2(e)`` must be an fp32 number."""
_DTYPE_NAMES = "float16, bfloat16 or float32"


def _type_name(x) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def as_bool(name: str, x) -> bool:
    """``x`` as a Python bool: a bool or a numpy bool, else a TypeError naming ``name``."""
    if isinstance(x, bool):
        return x
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.bool_):
        return bool(x)
    if numpy is not None and torch.compiler.is_compiling() and isinstance(x, numpy.ndarray):
        # torch.compile traces numpy values as arrays, whose truth would be a data-dependent branch
        raise TypeError(f"{name} must be a Python bool under torch.compile (a numpy bool is traced as an "
                        f"array); pass bool({name})")
    raise TypeError(f"{name} must be a bool, got {_type_name(x)} {x!r}")


def _dense(name: str, x: torch.Tensor) -> None:
    """A plain strided tensor: not sparse, mkldnn or nested (whose sizes are not one shape)."""
    if x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a nested tensor; for sequences of "
                        f"different lengths, concatenate them along the token dim and pass their offsets as "
                        f"cu_seqlens to sinkattn.sink_attn_varlen_func")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}; call {name}.to_dense()")


def _tensor(name: str, x, rank: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {_type_name(x)}")
    _dense(name, x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype {_DTYPE_NAMES}, got {x.dtype}; cast it, e.g. {name}.float()")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {tuple(x.shape)}")


def sdpa_layout_hint(q: torch.Tensor, k: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> str:
    """A hint for an error raised on a dense call, or "": whether the call reads right as SDPA's
    ``[B, H, S, D]``, i.e. with dims 1 and 2 swapped, where flash-attn's ``[B, S, H, D]`` is expected.

    It does when dim 1 holds heads that fit: ``q.shape[1]`` a multiple of ``k.shape[1]`` (given k)
    and the length of ``sinks`` (given sinks). Only called once an error is certain, so it rejects
    nothing by itself (a call that reads right both ways cannot be told apart, and runs).
    """
    if q.dim() != 4 or (k is not None and k.dim() != 4):
        return ""
    heads_q = q.shape[1]
    if heads_q < 1 or (k is not None and (k.shape[1] < 1 or heads_q % k.shape[1] != 0)):
        return ""
    if sinks is not None and tuple(sinks.shape) != (heads_q,):
        return ""
    return ("; did you pass [B, H, S, D] (SDPA layout)? dense inputs are [B, S, H, D] (flash-attn's): "
            "pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), and transpose(1, 2) the output back")


def check_qkv(q, k, v, token_dims: int, layout_q: str, layout_kv: str) -> None:
    """q, k, v: tensors of one float dtype and device, ``token_dims`` leading dims, heads and D that fit."""
    rank = token_dims + 2
    _tensor("q", q, rank, layout_q)
    _tensor("k", k, rank, layout_kv)
    _tensor("v", v, rank, layout_kv)
    dtype, device, q_shape, k_shape = q.dtype, q.device, q.shape, k.shape
    if k.dtype != dtype or v.dtype != dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {dtype}, k {k.dtype}, v {v.dtype}; cast them to one "
                        f"(e.g. k.to(q.dtype)), or call inside torch.autocast, which casts all three to its dtype")
    if k.device != device or v.device != device:
        raise ValueError(f"q, k and v must be on one device, got q {device}, k {k.device}, v {v.device}")
    if k_shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape {layout_kv} but for the head dim (v's may differ: Dv), "
                         f"got k {tuple(k_shape)}, v {tuple(v.shape)}")
    if token_dims == 2 and k_shape[0] != q_shape[0]:
        raise ValueError(f"q and k must have the same batch size B, got q {q_shape[0]}, k {k_shape[0]}")
    HQ, D = q_shape[-2], q_shape[-1]
    HKV, Dk = k_shape[-2], k_shape[-1]
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim D, got q {D}, k {Dk}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be in 1..{MAX_HEAD_DIM}, got {D}")
    if not 1 <= v.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"v's head dim Dv must be in 1..{MAX_HEAD_DIM}, got {v.shape[-1]}")
    if HQ < 1 or HKV < 1:
        raise ValueError(f"head counts must be >= 1, got HQ={HQ}, HKV={HKV}{sdpa_layout_hint(q, k)}")
    if HQ % HKV != 0:
        raise ValueError(f"query heads HQ={HQ} must be a multiple of KV heads HKV={HKV} (GQA group size HQ/HKV)"
                         f"{sdpa_layout_hint(q, k)}")


def check_cu_seqlens(name: str, cu, device: torch.device) -> None:
    """What can be checked without reading the values (the values: ``check_cu_seqlens_contents``)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor [N+1], got {_type_name(cu)}")
    _dense(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}; use .to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with N+1 >= 1 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {cu.device}")


def check_max_seqlen(name: str, value) -> None:
    """A maximal sequence length: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {_type_name(value)}"
                        + ("; pass int(t) (a host read of the tensor)" if isinstance(value, torch.Tensor) else ""))
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Shapes of the packed API: ``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``, ``cu_seqlens_* int32 [N+1]``."""
    check_qkv(q, k, v, 1, "[Tq, HQ, D]", "[Tk, HKV, D]")
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must list the same number of sequences, "
                         f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    check_max_seqlen("max_seqlen_q", max_seqlen_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k)


def check_offsets(name: str, values: list[int], total: int | None, max_name: str = "",
                  max_seqlen: int | None = None) -> None:
    """``values`` of a ``cu_seqlens``: start at 0, non-decreasing, end at ``total``, no length above
    ``max_seqlen`` (the last two: None is not checked here)."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{b}] = {values[b]} then "
                             f"{name}[{b + 1}] = {values[b + 1]}")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}[-1] must equal the token count {total}, got {values[-1]}")
    longest = max((b - a for a, b in zip(values, values[1:])), default=0)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"{max_name}={max_seqlen} is smaller than the longest sequence ({longest}); "
                         f"pass an upper bound")


class _Checked:
    """The last few GPU ``cu_seqlens`` pairs found valid, by object and version: every layer of a
    model gets the same tensors, and only the first call needs to read them to the host (a
    synchronisation). A tensor changed in place through torch has a new version and is read again;
    writes that bypass the version counter (``.data``, a DLPack or CUDA-array view) are not seen,
    which is why CPU tensors, whose check costs microseconds and no synchronisation, are not memoised."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: list[tuple] = []

    @staticmethod
    def _key(tensors, facts):
        return tuple((weakref.ref(t), t._version) for t in tensors), facts

    @staticmethod
    def _same(entry, tensors, facts) -> bool:
        refs, entry_facts = entry
        return entry_facts == facts and all(r() is t and v == t._version for (r, v), t in zip(refs, tensors))

    def seen(self, tensors, facts) -> bool:
        return any(self._same(e, tensors, facts) for e in self.entries)

    def add(self, tensors, facts) -> None:
        self.entries = [self._key(tensors, facts), *self.entries[:self.size - 1]]


_checked = _Checked()


def check_cu_seqlens_contents(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, Tq: int, Tk: int,
                              max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The values of ``cu_seqlens_*``: start at 0, non-decreasing, end at the token counts, lengths
    within ``max_seqlen_*``. Reads both tensors to the host (one copy each) on every call, except GPU
    tensors that, unchanged, passed with the same counts in one of the last calls (``_Checked``)."""
    tensors, facts = (cu_seqlens_q, cu_seqlens_k), (int(Tq), int(Tk), int(max_seqlen_q), int(max_seqlen_k))
    memoise = cu_seqlens_q.device.type != "cpu"
    if memoise and _checked.seen(tensors, facts):
        return
    check_offsets("cu_seqlens_q", cu_seqlens_q.tolist(), Tq, "max_seqlen_q", max_seqlen_q)
    check_offsets("cu_seqlens_k", cu_seqlens_k.tolist(), Tk, "max_seqlen_k", max_seqlen_k)
    if memoise:
        _checked.add(tensors, facts)


def check_dense(q, k, v) -> None:
    """Shapes of the dense API: ``q [B, Sq, HQ, D]``, ``k``/``v [B, Sk, HKV, D]``."""
    check_qkv(q, k, v, 2, "[B, Sq, HQ, D]", "[B, Sk, HKV, D]")


def _softmax_scale(softmax_scale) -> None:
    if type(softmax_scale) is not float and (      # exact type first: the ABC check costs a microsecond a call
            isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (numbers.Real, torch.SymFloat))):
        raise TypeError(f"softmax_scale must be a float or None, got {_type_name(softmax_scale)}"
                        + ("; pass float(t)" if isinstance(softmax_scale, torch.Tensor) else ""))
    try:
        value = float(softmax_scale)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or abs(value) > MAX_SOFTMAX_SCALE:
        shown = repr(softmax_scale)          # in full where short, or finite (the bound's neighbours)
        shown = shown if len(shown) <= 24 else repr(value) if math.isfinite(value) else shown[:20] + "..."
        raise ValueError(f"softmax_scale must be finite with |softmax_scale| <= {MAX_SOFTMAX_SCALE!r} "
                         f"(scores are fp32), got {shown}")


def check_options(q, sinks, softmax_scale, causal, window_size, return_lse) -> None:
    """The keyword options shared by both entry points."""
    HQ = q.shape[-2]
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks must be a torch.Tensor [HQ] or None, got {_type_name(sinks)}")
        _dense("sinks", sinks)
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks must have a floating-point dtype, got {sinks.dtype}")
        if tuple(sinks.shape) != (HQ,):
            raise ValueError(f"sinks must have shape [HQ] = ({HQ},), got {tuple(sinks.shape)}"
                             f"{sdpa_layout_hint(q, sinks=sinks)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on the device of q ({q.device}), got {sinks.device}")
    if softmax_scale is not None:
        _softmax_scale(softmax_scale)
    as_bool("causal", causal)
    as_bool("return_lse", return_lse)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}")
    for side, w in zip(("left", "right"), window_size):
        if type(w) is not int and (isinstance(w, bool) or not isinstance(w, numbers.Integral)):
            raise TypeError(f"window_size {side} must be an int >= -1, got {w!r}")
        if w < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {w}")
