"""Block sizes, warps and stages per GPU generation, kernel, dtype class and head dim.

Every entry of ``TABLE`` is compiled for its generation's chip by the resource audit
(``python -m sinkattn.testing.triton_audit``, recorded in ``benchmarks/results/triton-audit.json``,
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
HEAD_DIM_CLASSES = (64, 128, 256)
"""Table rows by padded head dim ``BLOCK_D``: 16, 32 and 64 take the 64 row."""

DELTA = Blocks(BM=64, BN=0, num_warps=4, num_stages=1)
"""The Delta kernel (``BM`` tokens per program, no key axis), on every GPU."""

INTERPRETER = Blocks(16, 16, 1, 1)
"""Every kernel under ``TRITON_INTERPRET=1`` (CPU tensors): small tiles keep numpy fast."""
INTERPRETER_DELTA = Blocks(16, 0, 1, 1)


def _rows(**by_kernel):
    """``{(kernel, fp32, head_dim_class): Blocks}`` from ``kernel=(16-bit by class, fp32 by class)``."""
    return {(kernel, fp32, hd): blocks
            for kernel, (low, high) in by_kernel.items()
            for fp32, row in ((False, low), (True, high))
            for hd, blocks in zip(HEAD_DIM_CLASSES, row)}


B = Blocks
TABLE = {
    "sm80": _rows(
        fwd=((B(128, 64, 4, 3), B(128, 64, 8, 3), B(64, 64, 4, 2)),
             (B(64, 32, 4, 2), B(64, 32, 4, 2), B(32, 32, 4, 1))),
        dkdv=((B(64, 64, 4, 2), B(64, 64, 4, 2), B(32, 32, 4, 1)),
              (B(32, 32, 4, 1), B(32, 32, 4, 1), B(16, 16, 4, 1))),
        dq=((B(64, 64, 4, 2), B(64, 64, 4, 2), B(32, 32, 4, 1)),
            (B(32, 32, 4, 1), B(32, 32, 4, 1), B(16, 16, 4, 1)))),
    "sm86": _rows(
        fwd=((B(128, 64, 4, 2), B(64, 64, 4, 2), B(64, 32, 4, 1)),
             (B(64, 32, 4, 1), B(32, 32, 4, 1), B(16, 32, 4, 1))),
        dkdv=((B(64, 64, 4, 1), B(32, 64, 4, 1), B(32, 32, 4, 1)),
              (B(32, 32, 4, 1), B(16, 32, 4, 1), B(16, 16, 4, 1))),
        dq=((B(64, 64, 4, 1), B(64, 32, 4, 1), B(32, 32, 4, 1)),
            (B(32, 32, 4, 1), B(16, 32, 4, 1), B(16, 16, 4, 1)))),
    "sm90": _rows(
        fwd=((B(128, 64, 8, 3), B(128, 64, 8, 3), B(64, 64, 8, 2)),
             (B(64, 64, 4, 2), B(64, 32, 4, 2), B(32, 32, 4, 1))),
        dkdv=((B(64, 64, 8, 2), B(64, 64, 8, 2), B(32, 64, 8, 1)),
              (B(32, 32, 4, 1), B(32, 32, 4, 1), B(16, 16, 4, 1))),
        dq=((B(64, 64, 8, 2), B(64, 64, 8, 2), B(64, 32, 8, 1)),
            (B(32, 32, 4, 1), B(32, 32, 4, 1), B(16, 16, 4, 1)))),
    "sm100": _rows(
        fwd=((B(128, 64, 8, 3), B(128, 64, 8, 3), B(64, 64, 8, 2)),
             (B(64, 64, 4, 2), B(64, 32, 4, 2), B(32, 32, 4, 1))),
        dkdv=((B(64, 64, 8, 2), B(64, 64, 8, 2), B(32, 64, 8, 1)),
              (B(32, 32, 4, 1), B(32, 32, 4, 1), B(16, 16, 4, 1))),
        dq=((B(64, 64, 8, 2), B(64, 64, 8, 2), B(64, 32, 8, 1)),
            (B(32, 32, 4, 1), B(32, 32, 4, 1), B(16, 16, 4, 1)))),
}
del B


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
        return DELTA if chip is not None else INTERPRETER_DELTA
    if chip is None:
        return INTERPRETER
    return TABLE[chip][(kernel, dtype == torch.float32, head_dim_class(head_dim))]


def pack_heads(G: int, BM: int) -> int:
    """``GH``: query heads per tile of the forward and dQ kernels, the largest divisor of ``G`` that
    is at most ``BM``. The tile's rows are then ``BM // GH`` positions of ``GH`` heads of one KV head
    (``BM mod GH`` rows idle), and each K/V tile it loads serves all of them: the whole group
    whenever ``G <= BM``."""
    return max(d for d in range(1, min(G, BM) + 1) if G % d == 0)
