"""Block sizes, warps and stages per GPU generation, kernel, dtype class and head dim.

Every entry of ``TABLE`` is compiled for its generation's chip by the resource audit
(``tests/harness/triton_audit.py``, recorded in ``benchmarks/results/triton-audit.json``,
summed up in docs/backends.md): none needs more shared memory than the chip has, and no fp16 / bf16
entry spills registers. The entries were chosen for those budgets; GPU speed is another matter,
measured by ``benchmarks/gpu.py`` where a GPU is at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Blocks", "Chip", "CHIPS", "TABLE", "KERNELS", "HEAD_DIM_CLASSES", "DELTA", "chip_for", "blocks_for",
           "block_d", "head_dim_class", "pack_heads"]


@dataclass(frozen=True)
class Blocks:
    """``BM`` query rows and ``BN`` keys per tile (the dK/dV kernel's program owns ``BN`` keys and
    loops over ``BM`` rows), ``num_warps`` and ``num_stages`` (software-pipelining depth)."""

    BM: int
    BN: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Chip:
    """A GPU generation as the kernels see it: the architecture the table is compiled for
    (Triton's capability number: 90 is sm_90a, 100 is sm_100a) and the largest shared memory
    one program may take (bytes, CUDA's ``sharedMemPerBlockOptin``)."""

    arch: int
    shared_bytes: int
    examples: str


CHIPS = {
    "sm80": Chip(80, 166912, "A100, A30 (8.0), Orin (8.7)"),
    "sm86": Chip(86, 101376, "A10, A40, RTX 30xx (8.6), L4, L40, RTX 40xx (8.9), RTX 50xx (12.x), other GPUs"),
    "sm90": Chip(90, 232448, "H100, H200, GH200 (9.0)"),
    "sm100": Chip(100, 232448, "B200, GB200, B300 (10.x)"),
}
"""The generations with a table. GPUs of another capability take ``sm86``'s, the smallest budget."""

KERNELS = ("fwd", "dkdv", "dq")
HEAD_DIM_CLASSES = (64, 128, 256, 512)
"""Table rows by padded head dim ``BLOCK_D``: 16, 32 and 64 take the 64 row."""

DELTA = Blocks(BM=64, BN=0, num_warps=4, num_stages=1)
"""The Delta kernel (``BM`` tokens per program, no key axis), on every GPU, up to ``BLOCK_D = 256``."""
DELTA_512 = Blocks(BM=32, BN=0, num_warps=8, num_stages=1)
"""The Delta kernel at ``BLOCK_D = 512``: half the tokens and twice the warps, so each thread holds a
quarter of the ``O`` and ``dO`` elements it holds at 256 (fp32 ``O`` took 244-255 registers there)."""

INTERPRETER = Blocks(16, 16, 1, 1)
"""Every kernel under ``TRITON_INTERPRET=1`` (CPU tensors): small tiles keep numpy fast."""
INTERPRETER_DELTA = Blocks(16, 0, 1, 1)


def _rows(fp32: dict, **low_precision) -> dict:
    """``{(kernel, is_fp32, head_dim_class): Blocks}`` from ``kernel=(tile at 64, 128, 256, 512)`` for
    fp16 / bf16 and the same for fp32; a tile is ``(BM, BN, num_warps, num_stages)``."""
    return {(kernel, is_fp32, hd): Blocks(*tile)
            for is_fp32, table in ((False, low_precision), (True, fp32))
            for kernel, tiles in table.items()
            for hd, tile in zip(HEAD_DIM_CLASSES, tiles, strict=True)}


_FP32 = dict(fwd=((32, 32, 8, 1), (32, 16, 8, 1), (16, 16, 4, 1), (16, 16, 16, 1)),
             dkdv=((32, 32, 8, 1), (32, 16, 8, 1), (16, 16, 8, 1), (16, 16, 8, 1)),
             dq=((32, 32, 8, 1), (16, 16, 8, 1), (16, 16, 8, 1), (16, 16, 16, 1)))
"""fp32 multiplies on the FMA units, whose operands hold the whole reduction axis per thread:
small tiles and 8 warps keep the spills small (docs/backends.md lists them); at 512, the smallest
tiles, with 16 warps where 8 spilled (the forward) or spilled more (the dQ kernel)."""

TABLE = {
    "sm80": _rows(_FP32, fwd=((128, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 1), (16, 32, 8, 1)),
                  dkdv=((32, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1), (16, 16, 8, 1)),
                  dq=((128, 32, 8, 2), (64, 16, 4, 1), (32, 16, 4, 1), (16, 32, 8, 1))),
    "sm86": _rows(_FP32, fwd=((128, 32, 8, 2), (128, 16, 8, 2), (32, 32, 4, 1), (16, 32, 8, 1)),
                  dkdv=((32, 32, 4, 1), (16, 64, 4, 1), (16, 32, 4, 1), (16, 32, 8, 1)),
                  dq=((64, 32, 4, 1), (64, 16, 4, 1), (32, 16, 4, 1), (16, 32, 8, 1))),
    "sm90": _rows(_FP32, fwd=((128, 64, 8, 2), (128, 64, 8, 2), (32, 32, 4, 1), (32, 32, 8, 1)),
                  dkdv=((32, 128, 8, 1), (32, 128, 8, 1), (16, 32, 4, 1), (16, 32, 8, 1)),
                  dq=((128, 64, 8, 2), (128, 64, 8, 2), (16, 64, 4, 1), (16, 64, 8, 1))),
}
"""Why these: on sm80 / sm86 (``mma.sync``) a product holds its whole B operand in each warp's
registers, so key blocks stay small at large head dims; on sm90 / sm100 (``wgmma`` / ``tcgen05``)
B stays in shared memory and the forward and dQ take 128-row tiles. The dK/dV kernel keeps two
``[BN, D]`` fp32 accumulators in registers. Each fp16 / bf16 entry is a large tile (``BM * BN``)
that the audit found spill-free in every variant at every head dim of its row, with some margin
below 255 registers where a larger tile sat at the limit. At 512 every kernel takes 8 warps: with
4, the ``[BM, 512]`` and ``[BN, 512]`` fp32 accumulators alone take 64-128 registers a thread and
the tiles that fit spill; 16-row tiles (and 32 where they fit) keep below 255."""
TABLE["sm100"] = TABLE["sm90"] | {("dq", False, 64): Blocks(128, 64, 8, 1), ("dq", False, 256): Blocks(128, 32, 8, 2)}
for _kernel in ("dkdv", "dq"):
    del TABLE["sm86"][(_kernel, True, 512)]
"""No fp32 backward at 512 on ``sm86``: the FMA products stage their fp32 operand tiles in shared
memory, 128 KiB at ``BLOCK_D = 512`` for the smallest tile (16 x 16), whatever the warps, and these
GPUs give a program 99 KiB. ``blocks_for`` says so (``NotImplementedError``); the forward fits."""


def block_d(head_dim: int) -> int:
    """The head dim the kernels tile: the next power of two, at least 16."""
    return max(16, 1 << max(0, head_dim - 1).bit_length())


def head_dim_class(head_dim: int) -> int:
    """The table row of ``head_dim``: ``block_d`` with 16 and 32 folded into 64."""
    return max(64, block_d(head_dim))


def chip_for(device: torch.device) -> str | None:
    """The table of a CUDA device by its capability; None off CUDA (the interpreter)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9:
        return "sm90"
    if major in (10, 11):
        return "sm100"
    if (major, minor) in ((8, 0), (8, 7)):
        return "sm80"
    return "sm86"


def blocks_for(chip: str | None, kernel: str, head_dim: int, dtype: torch.dtype) -> Blocks:
    """The tile of ``kernel`` (``fwd``, ``dkdv``, ``dq`` or ``delta``) on ``chip`` (None: the interpreter)."""
    if kernel == "delta":
        if chip is None:
            return INTERPRETER_DELTA
        return DELTA_512 if head_dim_class(head_dim) == 512 else DELTA
    if chip is None:
        return INTERPRETER
    hd = head_dim_class(head_dim)
    tile = TABLE[chip].get((kernel, dtype == torch.float32, hd))
    if tile is None:
        raise NotImplementedError(
            f"backend 'triton' has no {kernel} tile for {str(dtype).removeprefix('torch.')} at head dims "
            f"{hd // 2 + 1}-{hd} on {chip} GPUs ({CHIPS[chip].examples}): its operands need more shared memory than "
            f"{CHIPS[chip].shared_bytes // 1024} KiB; use float16 / bfloat16, or backend='cpu' (CPU tensors) "
            f"or 'reference'")
    return tile


def pack_heads(G: int, BM: int) -> int:
    """``GH``: query heads per tile of the forward and dQ kernels, the largest divisor of ``G`` that
    is at most ``BM``. The tile's rows are then ``BM // GH`` positions of ``GH`` heads of one KV head
    (``BM mod GH`` rows idle), and each K/V tile it loads serves all of them: the whole group
    whenever ``G <= BM``."""
    return max(d for d in range(1, min(G, BM) + 1) if G % d == 0)
