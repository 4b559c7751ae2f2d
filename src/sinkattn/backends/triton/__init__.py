"""``backend="triton"``: fused Triton kernels for CUDA tensors (and CPU tensors under
``TRITON_INTERPRET=1``, which is how CI runs them).

Forward: one program per GQA-packed tile (``BM // GH`` positions of one sequence times ``GH``
query heads of one KV head, each K/V tile loaded once for all of them), the online softmax over the
keys with its statistics in base 2 (the sink joins afterwards, ``sinkattn.sink``). Backward: a
Delta kernel; a dK/dV kernel per (key block, sequence, KV head) looping over the group's query
heads and the query blocks that see the keys; a dQ kernel per packed tile as in the forward. When
scores may be large (``scores.large_scores_flag``, decided on the device: nothing is read back to the
host) and the call holds every key of its rows, the dQ kernel sums Delta itself from the products
the gradients use (both of its variants are launched, the one the flag selects does the work).
Key blocks every row sees whole run without the mask; programs start in longest-processing-time
order (``kernels`` says how).
No atomics: results are bitwise reproducible. Tiles per GPU generation: ``config``; the
launches themselves: ``launch``.

Scores are not checked against fp32's range (``scores.check_fp32_range``, which the cpu backend
applies): the check is a read back to the host, a synchronisation on every call. A score beyond fp32
overflows in the kernels and its row comes back non-finite (docs/contract.md §2 says how).

Head dims 1-512 run, ``D`` and v's ``Dv`` (tensors padded with zeros to the next power of two, at
least 16, of ``max(D, Dv)`` outside the kernels: the kernels need no column mask). fp32 with a backward
above 256 needs more shared memory than the ``sm86`` GPUs have (``config``): refused there. fp32 inputs use IEEE fp32
dot products; fp16 / bf16 inputs split each fp32 ``P`` / ``dS`` tile that meets them in a product
into ``hi`` and ``lo`` parts (``COMPENSATED``, docs/contract.md §3 "Compensated products").
"""

from __future__ import annotations

import os

import torch

from ... import sink
from .. import buffers
from ..capabilities import Capabilities
from ..protocol import Gradients, Partial
from ..scores import large_scores_flag
from . import config, launch

__all__ = ["CAPABILITIES", "forward", "backward", "COMPENSATED", "interpreting"]

COMPENSATED: bool = True
"""Compensated products for fp16 / bf16 inputs (ignored for fp32). Where an fp32 tile ``P`` / ``dS``
meets a low-precision operand (the forward's ``P V``, the backward's ``P^T dO``, ``dS^T Q``, ``dS K``)
it is split into ``hi = round(P)`` and ``lo = round(P - hi)`` and both are multiplied.

Why on by default for both: rounding ``P`` to the input dtype errs by its unit (2^-11 fp16, 2^-8 bf16)
relative to each term, not to the sum, so where terms cancel the product misses Gate A's rtol (2^-9,
2^-6); ``dsinks`` inherits the forward's error through ``Delta = <dO, o>``. Measured through the
interpreter on the tests' random packed batches (``benchmarks/compensated.py --seeds 128``):
``False`` fails Gate A on 68 of 128 fp16 batches (worst ratio dk 0.898) and 52 of 128 bf16 ones
(o, dq, dk, dv; dsinks down to ratio 0.0); ``True`` on none (docs/backends.md, "Compensated (hi/lo) products").

Cost, in matrix products per visited (query block, key block) pair, all of the same size
``2 BM BN D`` flops: forward 2 -> 3; backward 7 -> 10 (dK/dV kernel 4 -> 6, dQ kernel 3 -> 4), or
9 -> 12 when the exact Delta pass adds two; plus a cast and a subtraction per element of each split tile.
``False`` (set before the call) is the faster opt-out, with the errors stated in docs/backends.md."""


def _compensated(dtype: torch.dtype) -> bool:
    if not isinstance(COMPENSATED, bool):
        raise TypeError(f"sinkattn.backends.triton.COMPENSATED must be True or False, got {COMPENSATED!r}")
    return COMPENSATED and dtype != torch.float32


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


CAPABILITIES = Capabilities(
    name="triton",
    device_types=frozenset({"cuda", "cpu"} if interpreting() else {"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    max_head_dim=512,
    device_hint="set TRITON_INTERPRET=1 before importing sinkattn to run its kernels on CPU tensors (slowly)",
    base2=True,
)


def _upcast(dtype: torch.dtype) -> bool:
    """The interpreter's numpy dot has no bf16: multiply the bf16 values in fp32 there."""
    return interpreting() and dtype == torch.bfloat16


def _NO_SINKS(HQ: int, device) -> torch.Tensor:
    """The kernels' sink vector when the sink joins later (``sinkattn.sink``): ``-inf``, no sink term."""
    return torch.full((HQ,), float("-inf"), dtype=torch.float32, device=device)


def _kernel_layout(*tensors, width: int | None = None) -> list:
    """Contiguous, 16-byte aligned, ``[T, H, D]`` tensors padded with zeros to ``D = BLOCK_D`` (the next
    power of two, at least 16, of ``width``, else of each tensor's own head dim): what the kernels
    assume (``kernels.NO_SPECIALIZE``), so one compiled kernel serves every call of a head-dim class.
    Zero columns add nothing to ``Q K^T`` and give zero columns in ``O``, ``dQ``, ``dK``, ``dV``, which
    are cut off again (``_unpadded``). A value head dim ``Dv`` other than ``D`` pads q, k and v to one
    ``BLOCK_D = block_d(max(D, Dv))``: the kernels tile one head dim."""
    out = []
    for t in buffers.contiguous(*tensors):
        to = config.block_d(width if width is not None else t.shape[-1]) if t is not None and t.dim() == 3 else None
        if to is not None and t.shape[-1] != to:
            t = torch.nn.functional.pad(t, (0, to - t.shape[-1]))
        if t is not None and t.data_ptr() % 16:
            t = t.clone()
        out.append(t)
    return out


def _unpadded(t: torch.Tensor, D: int) -> torch.Tensor:
    return t if t.shape[-1] == D else t[..., :D].contiguous()


def _max_lens(q: torch.Tensor, k: torch.Tensor, batch) -> tuple[int, int]:
    """Bounds of the longest query and key sequence, which size the launch grids: ``batch.max_seqlen_*``
    capped at the token count (so the grid never outgrows the batch); at least 1."""
    return max(min(int(batch.max_seqlen_q), q.shape[0]), 1), max(min(int(batch.max_seqlen_k), k.shape[0]), 1)


def forward(q, k, v, batch, window, softmax_scale, for_backward):
    """``q [Tq, HQ, D]``, ``k [Tk, HKV, D]``, ``v [Tk, HKV, Dv]`` -> ``(o [Tq, HQ, Dv] fp32,
    Stats(m2, log2_l) [HQ, Tq])``, the softmax over keys with its statistics in base 2 (the kernels' row
    maximum of ``s * log2(e)``)."""
    Dv = v.shape[2]
    cu_seqlens_q, cu_seqlens_k = batch.cu_seqlens_q, batch.cu_seqlens_k
    q, k, v, cu_seqlens_q, cu_seqlens_k = _kernel_layout(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                         width=max(q.shape[2], Dv))
    Tq, HQ, BLOCK_D = q.shape
    N = cu_seqlens_q.numel() - 1
    chip = config.chip_for(q.device)
    if for_backward:            # a backward the GPU has no tile for is refused before the forward runs
        for kernel in ("dq", "dkdv"):
            config.blocks_for(chip, kernel, BLOCK_D, q.dtype)
    out = buffers.new((Tq, HQ, BLOCK_D), torch.float32, q.device)
    lse = buffers.new((HQ, Tq), torch.float32, q.device)
    m2 = buffers.new((HQ, Tq), torch.float32, q.device)
    log2_l = buffers.new((HQ, Tq), torch.float32, q.device)
    if N > 0 and Tq > 0:
        max_q = _max_lens(q, k, batch)[0]
        launch.forward(q, k, v, _NO_SINKS(HQ, q.device), out, lse, m2, log2_l, cu_seqlens_q, cu_seqlens_k,
                       softmax_scale, window, max_q, chip, _compensated(q.dtype),
                       _upcast(q.dtype))()
    log2_l = torch.where(m2 == float("inf"), float("inf"), log2_l)    # a +inf score: lse = +inf (l is NaN)
    return Partial(_unpadded(out, Dv), sink.Stats(m2, log2_l))


def backward(do, dlse, q, k, v, o, stats, sink_mass, batch, window, softmax_scale, partial):
    """``(dq, dk, dv)`` fp32 shaped like ``q, k, v`` and ``delta [HQ, Tq]``, from the final ``o`` and base-2
    ``stats``. Unless ``partial``, large scores have the dQ kernel sum Delta from its own products."""
    D, Dv = q.shape[2], v.shape[2]
    do, dlse, q, k, v, o, cu_seqlens_q, cu_seqlens_k = _kernel_layout(
        do, dlse, q, k, v, o, batch.cu_seqlens_q, batch.cu_seqlens_k, width=max(D, Dv))
    m2, log2_l = _kernel_layout(*stats)
    Tq, HQ, _ = q.shape
    Tk = k.shape[0]
    N = cu_seqlens_q.numel() - 1
    dq = buffers.new(q.shape, torch.float32, q.device)
    dk = buffers.new(k.shape, torch.float32, q.device)
    dv = buffers.new(v.shape, torch.float32, q.device)
    delta = buffers.new((HQ, Tq), torch.float32, q.device)
    if dlse is not None:
        dlse = dlse.float()
    exact = large_scores_flag(q, k, softmax_scale)       # on the device, read by the dQ kernels
    if partial:                                          # the rows' other keys are elsewhere: Delta from o
        exact = torch.zeros_like(exact)
    chip, compensated, upcast = config.chip_for(q.device), _compensated(q.dtype), _upcast(q.dtype)
    if Tq > 0:
        launch.delta(o, do, dlse, delta, chip)()
    max_q, max_k = _max_lens(q, k, batch)
    tensors = (q, k, v, do, m2, log2_l)
    for exact_delta in (False, True) if N > 0 and Tq > 0 else ():
        # the one whose exact_delta matches the flag computes dq; before dK/dV, as the exact one
        # writes the Delta that dK/dV reads
        launch.dq(*tensors, dlse, delta, dq, cu_seqlens_q, cu_seqlens_k, softmax_scale, window, max_q, chip,
                  compensated, upcast, exact, exact_delta)()
    if N > 0 and Tk > 0:
        launch.dkdv(*tensors, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, window, max_k, chip,
                    compensated, upcast)()
    return Gradients(_unpadded(dq, D), _unpadded(dk, D), _unpadded(dv, Dv), delta)
