"""Block sizes, warps and stages per GPU generation (and the interpreter), looked up by head dim.

These are starting points chosen for register and shared-memory budgets, not tuned figures:
GPU speed is unmeasured until a benchmark run on a GPU records it (see README).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Blocks", "blocks_for"]


@dataclass(frozen=True)
class Blocks:
    BM: int
    BN: int
    num_warps: int
    num_stages: int


# (forward, backward) by generation; head dims above 128 halve the key block.
_TABLE = {
    "hopper": (Blocks(128, 64, 8, 3), Blocks(64, 64, 8, 2)),
    "ampere": (Blocks(128, 64, 4, 3), Blocks(64, 64, 4, 2)),
    "default": (Blocks(64, 64, 4, 2), Blocks(32, 32, 4, 1)),
    "interpreter": (Blocks(16, 16, 1, 1), Blocks(16, 16, 1, 1)),
}


def _generation(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return {9: "hopper", 8: "ampere"}.get(major, "default")


def blocks_for(device: torch.device, head_dim: int, backward: bool) -> Blocks:
    b = _TABLE[_generation(device)][int(backward)]
    if head_dim > 128 and device.type == "cuda":
        b = Blocks(b.BM if not backward else max(16, b.BM // 2), max(16, b.BN // 2), b.num_warps,
                   max(1, b.num_stages - 1))
    return b
