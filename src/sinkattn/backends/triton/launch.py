"""Launch plans: the kernel, its grid, every argument by name and the tile, for one call.

The launchers build a plan and run it; the resource audit builds the same plans from example
tensors and compiles them for each chip instead, so what is audited is what is launched.
Tensors arrive as the kernels take them: contiguous, head dim ``D`` padded to ``BLOCK_D``; the mask's
``Window`` becomes the kernels' int arguments ``left``, ``right`` here.
``blocks`` overrides the table's tile (the GPU benchmark's sweep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...masks import Window
from . import kernels
from .config import Blocks, block_d, blocks_for, pack_heads

__all__ = ["Launch", "forward", "delta", "dq", "dkdv"]

LOG2E = kernels.LOG2E


@dataclass
class Launch:
    """One kernel launch. ``args`` holds every argument by name, constexprs included, except
    ``chunk``: ``programs`` in one dimension are launched ``CHUNK`` at a time, each launch told its
    chunk number; a 2-D ``grid`` is launched as it is."""

    kernel: triton.runtime.jit.JITFunction
    args: dict
    blocks: Blocks
    programs: int | None = None
    grid: tuple[int, ...] | None = None

    def __call__(self):
        """Launch; returns what Triton returns for the last launch (the compiled kernel on a GPU)."""
        options = dict(num_warps=self.blocks.num_warps, num_stages=self.blocks.num_stages)
        if self.grid is not None:
            return self.kernel[self.grid](**self.args, **options)
        compiled = None
        step = self.args["CHUNK"]
        for chunk in range(triton.cdiv(self.programs, step)):
            size = min(step, self.programs - chunk * step)
            compiled = self.kernel[(size,)](**self.args, chunk=chunk, **options)
        return compiled


def _block_d(x: torch.Tensor) -> int:
    """The kernels' head dim: the tensors come padded to it (``block_d``), no column is masked."""
    D = x.shape[-1]
    if D != block_d(D):
        raise ValueError(f"the Triton kernels take head dims padded to a power of two >= 16, got {D}")
    return D


def _numerics(dtype: torch.dtype, compensated: bool, upcast: bool) -> dict:
    """fp32 inputs multiply in IEEE fp32; fp16 / bf16 on the tensor cores (``tf32`` is ignored for them)."""
    return dict(PRECISION="ieee" if dtype == torch.float32 else "tf32",
                COMPENSATED=compensated and dtype != torch.float32, UPCAST=upcast)


def _packed_grid(G: int, HKV: int, N: int, max_q: int, b: Blocks) -> dict:
    """The forward's and dQ's grid: ``NB`` tiles of ``BM // GH`` positions, ``N`` sequences, ``HT`` head tiles."""
    GH = pack_heads(G, b.BM)
    return dict(G=G, GH=GH, N=N, HT=HKV * (G // GH), NB=triton.cdiv(max_q, b.BM // GH), CHUNK=kernels.CHUNK)


def forward(q, k, v, sinks, out, lse, m2, log2_l, cu_seqlens_q, cu_seqlens_k, softmax_scale, window: Window,
            max_q, chip, compensated, upcast, blocks: Blocks | None = None) -> Launch:
    """``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``, ``sinks [HQ]`` fp32 (-inf for none) ->
    ``out [Tq, HQ, D]``, ``lse``/``m2``/``log2_l [HQ, Tq]`` fp32."""
    HQ, D = q.shape[1:]
    HKV, N = k.shape[1], cu_seqlens_q.numel() - 1
    b = blocks or blocks_for(chip, "fwd", D, q.dtype)
    grid = _packed_grid(HQ // HKV, HKV, N, max_q, b)
    args = dict(Q=q, K=k, V=v, SINKS=sinks, O=out, LSE=lse, M2=m2, L2=log2_l, CU_Q=cu_seqlens_q, CU_K=cu_seqlens_k,
                stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
                stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
                stride_lh=lse.stride(0), scale_log2=softmax_scale * LOG2E, left=window.left, right=window.right, **grid,
                BLOCK_D=_block_d(q), BM=b.BM, BN=b.BN, **_numerics(q.dtype, compensated, upcast))
    return Launch(kernels.fwd_kernel, args, b, programs=grid["NB"] * N * grid["HT"])


def delta(out, do, dlse, delta, chip) -> Launch:
    """``Delta [HQ, Tq] = <dO, O> - dlse`` (``dlse`` may be None)."""
    Tq, HQ, D = out.shape
    b = blocks_for(chip, "delta", D, out.dtype)
    args = dict(O=out, DO=do, DLSE=dlse if dlse is not None else delta, DELTA=delta, T=Tq,
                stride_ot=out.stride(0), stride_oh=out.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
                stride_lh=delta.stride(0), HAS_DLSE=dlse is not None, BLOCK_T=b.BM, BLOCK_D=_block_d(out))
    return Launch(kernels.delta_kernel, args, b, grid=(triton.cdiv(Tq, b.BM), HQ))


def _backward_args(q, k, v, do, m2, log2_l, delta, cu_seqlens_q, cu_seqlens_k, softmax_scale, window: Window) -> dict:
    return dict(Q=q, K=k, V=v, DO=do, M2=m2, L2=log2_l, DELTA=delta, CU_Q=cu_seqlens_q, CU_K=cu_seqlens_k,
                stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
                stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
                stride_lh=delta.stride(0), scale_log2=softmax_scale * LOG2E, softmax_scale=softmax_scale,
                left=window.left, right=window.right)


def dq(q, k, v, do, m2, log2_l, dlse, delta, dq, cu_seqlens_q, cu_seqlens_k, softmax_scale, window: Window, max_q,
       chip, compensated, upcast, exact, exact_delta, blocks: Blocks | None = None) -> Launch:
    """``dq [Tq, HQ, D]`` fp32, computed where the device flag ``exact`` (int32 ``[1]``,
    ``scores.large_scores_flag``) equals ``exact_delta``; elsewhere every program returns at once.
    With ``exact_delta`` it also writes ``delta`` (``- dlse`` when given) over the Delta kernel's, which
    the dK/dV kernel then reads; without, it reads the Delta kernel's."""
    HKV, N, D = k.shape[1], cu_seqlens_q.numel() - 1, q.shape[2]
    b = blocks or blocks_for(chip, "dq", D, q.dtype)
    grid = _packed_grid(q.shape[1] // HKV, HKV, N, max_q, b)
    args = _backward_args(q, k, v, do, m2, log2_l, delta, cu_seqlens_q, cu_seqlens_k, softmax_scale, window)
    args.update(DLSE=dlse if dlse is not None else delta, EXACT=exact, DQ=dq, stride_dqt=dq.stride(0),
                stride_dqh=dq.stride(1), **grid, BLOCK_D=_block_d(q), BM=b.BM, BN=b.BN,
                **_numerics(q.dtype, compensated, upcast), EXACT_DELTA=exact_delta,
                HAS_DLSE=exact_delta and dlse is not None)
    return Launch(kernels.dq_kernel, args, b, programs=grid["NB"] * N * grid["HT"])


def dkdv(q, k, v, do, m2, log2_l, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, window: Window,
         max_k, chip, compensated, upcast, blocks: Blocks | None = None) -> Launch:
    """``dk``/``dv [Tk, HKV, D]`` fp32, each summed over the group's ``G`` query heads in order."""
    HKV, N, D = k.shape[1], cu_seqlens_q.numel() - 1, q.shape[2]
    b = blocks or blocks_for(chip, "dkdv", D, q.dtype)
    NB = triton.cdiv(max_k, b.BN)
    args = _backward_args(q, k, v, do, m2, log2_l, delta, cu_seqlens_q, cu_seqlens_k, softmax_scale, window)
    args.update(DK=dk, DV=dv, stride_dkt=dk.stride(0), stride_dkh=dk.stride(1), stride_dvt=dv.stride(0),
                stride_dvh=dv.stride(1), G=q.shape[1] // HKV, N=N, HT=HKV, NB=NB, CHUNK=kernels.CHUNK,
                BLOCK_D=_block_d(q), BM=b.BM, BN=b.BN, **_numerics(q.dtype, compensated, upcast))
    return Launch(kernels.dkdv_kernel, args, b, programs=NB * N * HKV)
