"""Tensor-parallel (head-sharded DTensor) test cases run inside one spawned gloo group, and their seeded inputs.

``spawn(P, folder)`` starts P CPU processes that build a device mesh over one gloo group and each run
every case of ``CASES`` through the public functions on DTensors (plus the error cases of ``ERRORS``),
saving this rank's local results to ``folder/rank{r}.pt``. The test process makes the plain local call
on each rank's heads itself (``heads``) and compares.
"""

from __future__ import annotations

import datetime
import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cp import join_ranks

__all__ = ["TPCase", "CASES", "ERRORS", "LENGTHS", "inputs", "heads", "spawn"]

LENGTHS = (5, 0, 11, 8)           # the packing of a packed case
B, S, D = 2, 12, 8


@dataclass(frozen=True)
class TPCase:
    packed: bool
    sinks: str | None = "shard"   # "shard": a Shard(0) DTensor, "replicate": a replicated one, None: no sinks
    sharded: bool = True          # q/k/v Shard on the head dim (else Replicate)
    HQ: int = 4
    HKV: int = 2
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    grad: bool = True             # forward and backward (else an inference call under no_grad)
    scalar_loss: bool = False     # backward from a DTensor scalar loss (else from dout/dlse in out's placements)
    lse_only: bool = False        # backward from lse alone (out unused: no dout reaches the backward)
    cu_dtensor: bool = False      # packed: cu_seqlens passed as replicated DTensors (else plain tensors)
    mesh_2d: bool = False         # a (1, P) mesh, q/k/v (Replicate(), Shard(head))

    @property
    def name(self) -> str:
        parts = ["packed" if self.packed else "dense", f"sinks-{self.sinks}", "heads" if self.sharded else "replicated",
                 f"h{self.HQ}.{self.HKV}", ("causal" if self.causal else "full") +
                 ("" if self.window == (-1, -1) else f"-w{self.window[0]}.{self.window[1]}")]
        flags = (("nograd", not self.grad), ("scalar-loss", self.scalar_loss), ("lse-only", self.lse_only),
                 ("cu-dtensor", self.cu_dtensor), ("mesh2d", self.mesh_2d))
        parts += [flag for flag, on in flags if on]
        return "-".join(parts)


CASES = [TPCase(False, "shard", window=(5, 0)),
         TPCase(False, "replicate", causal=False),
         TPCase(False, None),
         TPCase(False, "shard", HQ=8, HKV=2, scalar_loss=True),
         TPCase(False, "shard", grad=False),
         TPCase(False, "replicate", sharded=False, window=(3, 2)),
         TPCase(False, "shard", sharded=False),
         TPCase(False, "shard", mesh_2d=True),
         TPCase(True, "shard"),
         TPCase(True, "replicate", lse_only=True),
         TPCase(True, "replicate", causal=False, window=(2, 9)),
         TPCase(True, None, cu_dtensor=True),
         TPCase(True, "shard", HQ=6, HKV=2, grad=False),
         TPCase(True, "replicate", sharded=False, scalar_loss=True)]

ERRORS = ("sequence sharded", "tokens sharded", "op on sequence shards", "k placed unlike q", "HKV=1 over the mesh",
          "plain sinks", "partial q", "sharded cu_seqlens")


def inputs(case: TPCase, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full fp32 tensors of one case: q/k/v, sinks, the upstream gradients of out and lse, and
    ``cu_seqlens`` for a packed case."""
    g = torch.Generator().manual_seed(seed)
    lead = (sum(LENGTHS),) if case.packed else (B, S)
    lse_shape = (case.HQ, sum(LENGTHS)) if case.packed else (B, case.HQ, S)
    x = dict(q=torch.randn(*lead, case.HQ, D, generator=g), k=torch.randn(*lead, case.HKV, D, generator=g),
             v=torch.randn(*lead, case.HKV, D, generator=g), sinks=torch.randn(case.HQ, generator=g),
             dout=torch.randn(*lead, case.HQ, D, generator=g), dlse=torch.randn(*lse_shape, generator=g))
    if case.packed:
        x["cu"] = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    return x


def heads(x: torch.Tensor, dim: int, rank: int, P: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of heads along ``dim``, written out from the definition of Shard."""
    n = x.shape[dim] // P
    return x.narrow(dim, rank * n, n).contiguous()


def _placements(case: TPCase, kind: str):
    """The placements of an input ``kind`` ("qkv", "sinks", "lse") of a case, one per mesh dim."""
    from torch.distributed.tensor import Replicate, Shard
    head = 1 if case.packed else 2
    if kind == "sinks":
        one = Shard(0) if case.sinks == "shard" else Replicate()
    elif kind == "lse":
        one = (Shard(0) if case.packed else Shard(1)) if case.sharded else Replicate()
    else:
        one = Shard(head) if case.sharded else Replicate()
    return [Replicate(), one] if case.mesh_2d else [one]


def _run_case(case: TPCase, mesh_1d, mesh_2d) -> dict:
    import sinkattn
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh = mesh_2d if case.mesh_2d else mesh_1d
    x = inputs(case)
    place = lambda name, kind: distribute_tensor(x[name], mesh, _placements(case, kind))  # noqa: E731
    q, k, v = (place(n, "qkv").requires_grad_(case.grad) for n in "qkv")
    sinks = place("sinks", "sinks").requires_grad_(case.grad) if case.sinks else None
    kw = dict(sinks=sinks, causal=case.causal, window_size=case.window, return_lse=True)
    with torch.set_grad_enabled(case.grad):
        if case.packed:
            cu = distribute_tensor(x["cu"], mesh, [Replicate()] * mesh.ndim) if case.cu_dtensor else x["cu"]
            out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), **kw)
        else:
            out, lse = sinkattn.sink_attn_func(q, k, v, **kw)
    result = dict(out=out, lse=lse)
    if case.grad:
        dout, dlse = place("dout", "qkv"), place("dlse", "lse")
        if case.scalar_loss:
            ((out * dout).sum() + (lse * dlse).sum()).backward()
        elif case.lse_only:
            lse.backward(dlse)
        else:
            torch.autograd.backward([out, lse], [dout, dlse])
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
        if sinks is not None:
            result["dsinks"] = sinks.grad
    return {name: (t.to_local().detach().clone(), str(tuple(t.placements))) for name, t in result.items()}


def _error_case(which: str, mesh) -> tuple[str, str] | None:
    """Call ``which`` (one of ``ERRORS``) on every rank; the error raised, as ``(type name, message)``."""
    import sinkattn
    from sinkattn.dtensor import register_sharding_rules
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    P = mesh.size()
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(B, 4 * P, 4, D, generator=g), torch.randn(B, 4 * P, 2, D, generator=g), \
        torch.randn(B, 4 * P, 2, D, generator=g)
    sinks = distribute_tensor(torch.randn(4, generator=g), mesh, [Shard(0)])
    on = lambda t, p: distribute_tensor(t, mesh, [p])  # noqa: E731
    try:
        if which == "sequence sharded":
            sinkattn.sink_attn_func(on(q, Shard(1)), on(k, Shard(1)), on(v, Shard(1)), sinks=sinks, causal=True)
        elif which == "tokens sharded":
            cu = torch.tensor([0, 2 * P, 8 * P], dtype=torch.int32)
            flat = [t.flatten(0, 1) for t in (q, k, v)]
            sinkattn.sink_attn_varlen_func(*(on(t, Shard(0)) for t in flat), cu, cu, 6 * P, 6 * P)
        elif which == "op on sequence shards":
            register_sharding_rules()
            torch.ops.sinkattn.forward(on(q, Shard(1)), on(k, Shard(1)), on(v, Shard(1)), None, None, None,
                                       4 * P, 4 * P, 0.5, -1, 0, "cpu", False, False)
        elif which == "k placed unlike q":
            sinkattn.sink_attn_func(on(q, Shard(2)), on(k, Replicate()), on(v, Shard(2)), sinks=sinks)
        elif which == "HKV=1 over the mesh":
            sinkattn.sink_attn_func(on(q, Shard(2)), on(k[:, :, :1], Shard(2)), on(v[:, :, :1], Shard(2)))
        elif which == "plain sinks":
            sinkattn.sink_attn_func(on(q, Shard(2)), on(k, Shard(2)), on(v, Shard(2)), sinks=torch.zeros(4))
        elif which == "partial q":
            partial = DTensor.from_local(q, mesh, [Partial()])
            sinkattn.sink_attn_func(partial, on(k, Replicate()), on(v, Replicate()))
        elif which == "sharded cu_seqlens":
            cu = on(torch.tensor([0, 4 * P, 8 * P], dtype=torch.int32), Shard(0))
            flat = [on(t.flatten(0, 1), Shard(1)) for t in (q, k, v)]
            sinkattn.sink_attn_varlen_func(*flat, cu, cu, 8 * P, 8 * P)
    except Exception as exc:      # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc)
    return None


def _worker(rank: int, P: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    results: dict = {"cases": {}, "errors": {}, "failure": None}
    try:
        mesh_1d, mesh_2d = init_device_mesh("cpu", (P,)), init_device_mesh("cpu", (1, P))
        for case in CASES:
            results["cases"][case.name] = _run_case(case, mesh_1d, mesh_2d)
        for which in ERRORS:
            results["errors"][which] = _error_case(which, mesh_1d)
    except Exception:             # noqa: BLE001 - reported to the test process
        results["failure"] = traceback.format_exc()
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def spawn(P: int, folder: str, timeout: float = 240.0) -> list[dict]:
    """Run every case and error case on a mesh of P gloo ranks; every rank's results, in rank order."""
    join_ranks(mp.spawn(_worker, args=(P, folder), nprocs=P, join=False), P, timeout)
    return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(P)]
