"""One training step of a small attention layer with learnable sinks under context parallelism,
checked against the same step in a single process.

    torchrun --nproc-per-node 2 examples/cp_train_step.py [--method ring|ulysses|both] [--layout zigzag|contiguous]
    python examples/cp_train_step.py [...]      # without torchrun: a group of one (P=1)

Every rank builds the same layer (same seed) and the same packed batch of 3 causal sequences
with a sliding window; it takes its shard of the hidden states, the position ids (for the rotary
embedding) and the targets, runs the layer through ``sinkattn.distributed.sink_attn_varlen_func``,
and back-propagates its part of a loss that is a sum over tokens divided by the GLOBAL token count.
Then the gradients of the replicated parameters (projections and sinks) are summed over the group
with one all-reduce, as a data-parallel reduction over the context-parallel group does, and an SGD
step is taken. The same step runs on the full batch with ``sinkattn.sink_attn_varlen_func``; the
script prints the largest relative difference of every gradient and updated parameter and exits
non-zero unless all are within 1e-5. gloo on CPU; on GPUs with NCCL, one GPU per rank.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import sinkattn
import sinkattn.distributed as cp

LENGTHS = [96, 32, 128]         # each a multiple of 2P for P in 1, 2, 4, 8
WINDOW = (48, 0)


def rotary(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` rotated by position ``pos [T]`` (rotate-half form)."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = pos.float()[:, None, None] * freq
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


class SinkAttention(nn.Module):
    def __init__(self, d_model=64, HQ=4, HKV=2, D=16):
        super().__init__()
        self.HQ, self.HKV, self.D = HQ, HKV, D
        self.wq = nn.Linear(d_model, HQ * D, bias=False)
        self.wk = nn.Linear(d_model, HKV * D, bias=False)
        self.wv = nn.Linear(d_model, HKV * D, bias=False)
        self.wo = nn.Linear(HQ * D, d_model, bias=False)
        self.sinks = nn.Parameter(torch.randn(HQ))

    def forward(self, x, pos, attend):
        T = x.shape[0]
        q = rotary(self.wq(x).view(T, self.HQ, self.D), pos)
        k = rotary(self.wk(x).view(T, self.HKV, self.D), pos)
        v = self.wv(x).view(T, self.HKV, self.D)
        return self.wo(attend(q, k, v, self.sinks).reshape(T, -1))


def step(layer, x, pos, target, attend, total_tokens, group=None):
    """Forward, this rank's share of the loss, backward, the gradient sum over ``group``, an SGD step."""
    loss = ((layer(x, pos, attend) - target) ** 2).sum() / total_tokens
    loss.backward()
    if group is not None:
        for p in layer.parameters():          # every parameter is replicated over the CP group
            dist.all_reduce(p.grad, group=group)
        dist.all_reduce(loss.detach(), group=group)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    with torch.no_grad():
        for p in layer.parameters():
            p -= 0.1 * p.grad
    return loss.item(), grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="both", choices=["ring", "ulysses", "both"])
    ap.add_argument("--layout", default="zigzag", choices=list(cp.LAYOUTS))
    args = ap.parse_args()
    if "RANK" in os.environ:                  # started by torchrun: it says who joins the group and where
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    else:
        print("no torchrun: running as a group of one (P=1); for P ranks: "
              "torchrun --nproc-per-node P examples/cp_train_step.py")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    base = SinkAttention().to(device)
    T, longest = sum(LENGTHS), max(LENGTHS)
    cu = torch.tensor([0, *LENGTHS], device=device).cumsum(0).to(torch.int32)
    x = torch.randn(T, 64, device=device)
    target = torch.randn(T, 64, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in LENGTHS])   # positions restart per sequence

    def full_attend(q, k, v, sinks):
        return sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, longest, longest, sinks=sinks, causal=True,
                                              window_size=WINDOW)

    single = copy.deepcopy(base)
    loss_1, grads_1 = step(single, x, pos, target, full_attend, T)

    failed = False
    for method in (["ring", "ulysses"] if args.method == "both" else [args.method]):
        def cp_attend(q, k, v, sinks, method=method):
            return cp.sink_attn_varlen_func(q, k, v, cu, longest, sinks=sinks, causal=True, window_size=WINDOW,
                                            method=method, layout=args.layout)

        layer = copy.deepcopy(base)
        shard = lambda t: cp.shard_varlen(t, cu, layout=args.layout)   # noqa: E731 - tokens, positions, targets
        loss_p, grads_p = step(layer, shard(x), shard(pos), shard(target), cp_attend, T, group=dist.group.WORLD)
        errors = {f"grad {n}": ((grads_p[n] - g).abs().max() / g.abs().max()).item() for n, g in grads_1.items()}
        errors |= {f"param {n}": ((p - dict(single.named_parameters())[n]).abs().max()
                                  / p.abs().max()).item() for n, p in layer.named_parameters()}
        errors["loss"] = abs(loss_p - loss_1) / abs(loss_1)
        worst = max(errors.values())
        ok = worst <= 1e-5
        failed |= not ok
        if rank == 0:
            print(f"P={P} method={method} layout={args.layout}: loss {loss_p:.6f} (single process {loss_1:.6f})")
            for name, err in errors.items():
                print(f"  {name:14s} max relative difference {err:.2e}")
            print(f"  {'OK' if ok else 'MISMATCH'}: worst {worst:.2e} (tolerance 1e-5)")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
