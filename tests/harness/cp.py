"""Context-parallel test cases run inside one spawned gloo group, and their seeded inputs.

``spawn(P, folder)`` starts P CPU processes that join one gloo group and each run every case
of ``CASES`` (plus the error cases) through ``sinkattn.distributed``, saving this rank's results
to ``folder/rank{r}.pt``; the test process compares them with single-process ``sinkattn`` on
the full tensors, which it computes itself. One group per world size keeps the spawn cost
(seconds) out of every case.

``spawn_precision(folder)`` runs the precision matrix (``PRECISION`` x ``PRECISION_SEEDS``) at P = 2
and 3 in one group of 3 processes (P = 2 on a subgroup), started from a fork server, and returns the
results put together from the ranks' shards for the test process to hold to Gate A.
"""

from __future__ import annotations

import datetime
import functools
import os
import traceback
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as forward_ad
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["CPCase", "CASES", "ERRORS", "inputs", "spawn", "SHAPE", "LENGTHS", "AUTOCAST_DTYPE", "PrecisionCase",
           "PRECISION", "PRECISION_SIZES", "PRECISION_SEEDS", "precision_inputs", "spawn_precision", "join_ranks"]

SHAPE = dict(B=2, S=32, HQ=4, HKV=2, D=8)
LENGTHS = (16, 0, 8, 8, 40)       # a packed batch (8, 8: one run of two); every length divisible by 8


@dataclass(frozen=True)
class CPCase:
    packed: bool
    causal: bool
    window: tuple[int, int]
    method: str
    layout: str
    backend: str = "cpu"
    repeat: bool = False          # run twice: the repeat must be bitwise equal
    subgroups: int = 0            # >0: run in subgroups of this size (each a full CP group)
    world_sizes: tuple[int, ...] = (2, 4)
    tile_rows: int = 0            # >0: the ring's query rows per tile (ring.TILE_ROWS) for this case
    autocast: bool = False        # v in bf16, q/k fp32, fwd and bwd under torch.autocast("cpu", bfloat16)

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        mask += "" if self.window == (-1, -1) else f"-w{self.window[0]}.{self.window[1]}"
        extra = "" if self.backend == "cpu" else "-" + self.backend
        extra += f"-sub{self.subgroups}" if self.subgroups else ""
        extra += f"-tile{self.tile_rows}" if self.tile_rows else ""
        extra += "-autocast" if self.autocast else ""
        return f"{'packed' if self.packed else 'dense'}-{mask}-{self.method}-{self.layout}{extra}"


_MASKS = [(False, True, (-1, -1)), (False, True, (5, 0)), (False, False, (-1, -1)), (False, False, (3, 6)),
          (True, True, (-1, -1)), (True, True, (6, 0)), (True, False, (2, 9))]
CASES = [CPCase(packed, causal, window, method, layout, repeat=(method, layout) == ("ring", "zigzag") or not causal)
         for packed, causal, window in _MASKS for method in ("ring", "ulysses") for layout in ("zigzag", "contiguous")]
CASES += [CPCase(False, True, (3, 0), "ring", "zigzag", backend="reference"),
          CPCase(True, True, (-1, -1), "ulysses", "contiguous", backend="reference"),
          CPCase(False, True, (3, 0), "ring", "zigzag", backend="triton", world_sizes=(2,)),
          CPCase(False, True, (-1, -1), "ring", "zigzag", subgroups=2),
          CPCase(False, True, (5, 0), "ring", "zigzag", tile_rows=3, repeat=True),
          CPCase(True, False, (2, 9), "ring", "contiguous", tile_rows=5),
          CPCase(False, True, (5, 0), "ring", "zigzag", autocast=True, world_sizes=(2,)),
          CPCase(True, True, (-1, -1), "ulysses", "contiguous", autocast=True, world_sizes=(2,))]

ERRORS = ("q shapes differ", "dtype on the last rank", "layout", "method", "not divisible", "ulysses heads",
          "options differ", "methods differ", "packing differs", "packings collide", "one token fewer",
          "q missing on the last rank", "device on the last rank", "packed meta on the last rank",
          "shard not divisible", "shard shapes differ",
          "shard_varlen packing valid on one rank", "shard_varlen packings differ", "unshard dtypes differ",
          "double backward ring", "double backward ulysses", "forward-mode AD", "torch.func.jvp")
AUTOCAST_DTYPE = torch.bfloat16


def inputs(case: CPCase, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full fp32 tensors of one case (v in ``AUTOCAST_DTYPE`` for an autocast case): q/k/v, sinks, and the
    upstream gradients of out and lse."""
    g = torch.Generator().manual_seed(seed)
    s = SHAPE
    lead = (sum(LENGTHS),) if case.packed else (s["B"], s["S"])
    lse_shape = (s["HQ"], sum(LENGTHS)) if case.packed else (s["B"], s["HQ"], s["S"])
    x = dict(q=torch.randn(*lead, s["HQ"], s["D"], generator=g), k=torch.randn(*lead, s["HKV"], s["D"], generator=g),
             v=torch.randn(*lead, s["HKV"], s["D"], generator=g), sinks=torch.randn(s["HQ"], generator=g),
             dout=torch.randn(*lead, s["HQ"], s["D"], generator=g), dlse=torch.randn(*lse_shape, generator=g))
    if case.autocast:             # a mix, as gpt-oss's rotary code leaves them under autocast
        x["v"] = x["v"].to(AUTOCAST_DTYPE)
    return x


PRECISION_SIZES = (2, 3)
"""The group sizes of the precision matrix: one spawned group of 3 ranks runs P = 3 on the whole
group and P = 2 on a subgroup of its first two ranks."""

PRECISION_SEEDS = tuple(range(8))
"""The seeds every cell of ``PRECISION`` runs, one call each: even ones on the zigzag layout, odd ones on
contiguous."""


@dataclass(frozen=True)
class PrecisionCase:
    """One cell of the precision matrix: a packed context-parallel call in one dtype, held to Gate A
    against the float64 golden (the standard of one process) for every seed of ``PRECISION_SEEDS``.

    The head counts follow the group size P: ``HQ = 2P`` query heads and ``HKV`` = 1 (``kv="1"``,
    one KV head shared by every rank), P (``kv="P"``) or 2P (``kv="2P"``, more KV heads than ranks).
    ``mask``: ``causal``, or ``window`` (causal, ``window_size=(5, 0)``: 6 keys). D = 16, and the
    packing ``lengths(P)`` is three short sequences."""

    dtype: str
    method: str
    kv: str
    mask: str
    D: int = 16

    @property
    def name(self) -> str:
        return f"{self.dtype}-{self.method}-hkv{self.kv}-{self.mask}"

    def heads(self, P: int) -> tuple[int, int]:
        """``(HQ, HKV)`` at group size P."""
        return 2 * P, {"1": 1, "P": P, "2P": 2 * P}[self.kv]

    causal = True

    @property
    def window(self) -> tuple[int, int]:
        return (5, 0) if self.mask == "window" else (-1, -1)

    @staticmethod
    def layout(seed: int) -> str:
        return "zigzag" if seed % 2 == 0 else "contiguous"

    @staticmethod
    def lengths(P: int) -> tuple[int, ...]:
        """Three sequences, multiples of 2P (a zigzag layout's chunks): 8P, 8P (one run), 4P."""
        return 8 * P, 8 * P, 4 * P


PRECISION = [PrecisionCase(dtype, method, kv, mask) for dtype in ("float16", "bfloat16", "float32")
             for method in ("ring", "ulysses") for kv in ("1", "P", "2P") for mask in ("causal", "window")]
"""Every head count here is one Ulysses accepts at P = 2 and 3 (HQ divisible by P, HKV dividing or divided by P)."""


def precision_inputs(case: PrecisionCase, P: int, seed: int) -> dict[str, torch.Tensor]:
    """The full tensors of a precision case: q, k, v, dout in its dtype, sinks and dlse fp32."""
    g = torch.Generator().manual_seed(seed)
    (HQ, HKV), T, dtype = case.heads(P), sum(case.lengths(P)), getattr(torch, case.dtype)
    x = dict(q=torch.randn(T, HQ, case.D, generator=g), k=torch.randn(T, HKV, case.D, generator=g),
             v=torch.randn(T, HKV, case.D, generator=g), dout=torch.randn(T, HQ, case.D, generator=g))
    x = {n: t.to(dtype) for n, t in x.items()}
    x.update(sinks=torch.randn(HQ, generator=g), dlse=torch.randn(HQ, T, generator=g))
    return x


def _run_precision(case: PrecisionCase, P: int, seed: int, rank: int, group, cp) -> dict:
    """This rank's results of one case and seed: its shards of o, lse, dq, dk, dv (token-first) and its
    dsinks contribution. The shards are cut here by ``rank_order``, with no collective (``shard_varlen``
    is tested with ``CASES``): the call's own communication is the only one."""
    from sinkattn.distributed.layout import rank_order
    x, lengths, layout = precision_inputs(case, P, seed), case.lengths(P), case.layout(seed)
    mine = rank_order(lengths, P, layout).view(P, -1)[rank]
    q, k, v = (x[n].index_select(0, mine).requires_grad_() for n in "qkv")
    sinks = x["sinks"].clone().requires_grad_()
    out, lse = cp.sink_attn_varlen_func(q, k, v, _offsets(lengths), max(lengths), sinks=sinks, causal=case.causal,
                                        window_size=case.window, return_lse=True, group=group, method=case.method,
                                        layout=layout)
    torch.autograd.backward([out, lse], [x["dout"].index_select(0, mine), x["dlse"].index_select(1, mine)])
    return dict(o=out.detach(), lse=lse.detach().t(), dq=q.grad, dk=k.grad, dv=v.grad, dsinks=sinks.grad)


def _precision_worker(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from sinkattn import distributed as cp
    results: dict = {"cases": {}, "failure": None}
    try:
        groups = {P: None if P == world else dist.new_group(list(range(P))) for P in PRECISION_SIZES}
        for P, group in groups.items():
            if rank >= P:
                continue
            for case in PRECISION:
                for seed in PRECISION_SEEDS:
                    results["cases"][P, case.name, seed] = _run_precision(case, P, seed, rank, group, cp)
    except Exception:             # noqa: BLE001 - reported to the test process
        results["failure"] = traceback.format_exc()
    torch.save(results, os.path.join(folder, f"precision{rank}.pt"))
    dist.destroy_process_group()


def spawn_precision(folder: str, timeout: float = 300.0) -> dict:
    """Run ``PRECISION`` (every seed) at every P of ``PRECISION_SIZES``, in one spawned gloo group. Returns
    ``{"failure": a rank's traceback or None, "cases": {(P, case.name, seed): results}}``: the full tensors
    put together from the ranks' shards (``lse [HQ, T]``) and ``dsinks`` summed over the ranks in rank order."""
    from sinkattn.distributed.layout import rank_order
    world = max(PRECISION_SIZES)
    join_ranks(_start(_precision_worker, (world, folder), world), world, timeout)
    ranks = [torch.load(os.path.join(folder, f"precision{r}.pt"), weights_only=False) for r in range(world)]
    failure = next((f"rank {r}:\n{res['failure']}" for r, res in enumerate(ranks) if res["failure"]), None)
    cases = {}
    for P in PRECISION_SIZES if failure is None else ():
        for case in PRECISION:
            for seed in PRECISION_SEEDS:
                inverse = torch.argsort(rank_order(case.lengths(P), P, case.layout(seed)))
                parts = [res["cases"][P, case.name, seed] for res in ranks[:P]]
                full = {n: torch.cat([p[n] for p in parts]).index_select(0, inverse)
                        for n in ("o", "lse", "dq", "dk", "dv")}
                full["lse"] = full["lse"].t()
                full["dsinks"] = functools.reduce(torch.add, [p["dsinks"] for p in parts])
                cases[P, case.name, seed] = full
    return {"failure": failure, "cases": cases}


def _start(fn, args: tuple, nprocs: int):
    """``fn(rank, *args)`` in ``nprocs`` new processes (``join=False``): forked from a fork server that has
    imported torch and sinkattn once (a spawned process imports them itself, seconds each on two shared
    cores), or spawned where there is no fork server (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    mp.get_context("forkserver").set_forkserver_preload(["harness.cp", "sinkattn.distributed"])
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")


def _offsets(lengths) -> torch.Tensor:
    """int32 ``cu_seqlens`` of ``lengths``."""
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)


def cu_seqlens() -> torch.Tensor:
    return _offsets(LENGTHS)


def _run_case(case: CPCase, group, cp):
    from sinkattn.distributed import ring
    default, ring.TILE_ROWS = ring.TILE_ROWS, case.tile_rows or ring.TILE_ROWS
    try:
        return _run_case_now(case, group, cp)
    finally:
        ring.TILE_ROWS = default


def _run_case_now(case: CPCase, group, cp):
    x = inputs(case)
    if case.packed:
        cu = cu_seqlens()
        cut = lambda t, dim: cp.shard_varlen(t, cu, group, case.layout) if dim == 0 else \
            cp.shard_varlen(t.t(), cu, group, case.layout).t()   # noqa: E731
        call = lambda *a, **kw: cp.sink_attn_varlen_func(*a, cu, max(LENGTHS), **kw)  # noqa: E731
        seq_dim, lse_dim = 0, 1
    else:
        cut = lambda t, dim: cp.shard(t, dim, group, case.layout)  # noqa: E731
        call, seq_dim, lse_dim = cp.sink_attn_func, 1, 2
    q, k, v = (cut(x[n], seq_dim).requires_grad_() for n in "qkv")
    sinks = x["sinks"].clone().requires_grad_()
    with torch.autocast("cpu", dtype=AUTOCAST_DTYPE, enabled=case.autocast):
        out, lse = call(q, k, v, sinks=sinks, causal=case.causal, window_size=case.window, return_lse=True,
                        group=group, method=case.method, layout=case.layout, backend=case.backend)
        ((out * cut(x["dout"], seq_dim)).sum() + (lse * cut(x["dlse"], lse_dim)).sum()).backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad, dsinks=sinks.grad)


def _error_case(which: str, rank: int, P: int, cp):
    """Call ``which`` (one of ``ERRORS``) on every rank; the error raised, as ``(type name, message)``."""
    B, S, HQ, HKV, D = SHAPE.values()
    last = rank == P - 1
    n = S // P
    q, k, v = torch.randn(B, n, HQ, D), torch.randn(B, n, HKV, D), torch.randn(B, n, HKV, D)
    kw = dict(causal=True)
    try:
        if which == "q shapes differ":
            m = n - 2 if last else n
            q, k, v = q[:, :m], k[:, :m], v[:, :m]
        elif which == "dtype on the last rank" and last:
            q, k, v = q.double(), k.double(), v.double()
        elif which == "layout":
            kw["layout"] = "diagonal"
        elif which == "method":
            kw["method"] = "tree"
        elif which == "not divisible":
            q, k, v = q[:, :n - 1], k[:, :n - 1], v[:, :n - 1]
        elif which == "ulysses heads":
            q, k, v, kw["method"] = torch.randn(B, n, 5, D), k[:, :, :1], v[:, :, :1], "ulysses"
        elif which == "options differ":
            kw["causal"] = rank == 0
        elif which == "methods differ":
            kw["method"] = "ring" if rank == 0 else "ulysses"
        elif which in ("packing differs", "packings collide", "one token fewer"):
            lengths = {"packing differs": [8 * P, 8 * P] if last else [16 * P],
                       "packings collide": [32, 0, 32] if last else [16, 32, 16],      # same N, T and sum((n+1) len)
                       "one token fewer": [16 * P, 8 * P]}[which]
            t = sum(lengths) // P - (which == "one token fewer" and last)
            cp.sink_attn_varlen_func(torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D),
                                     _offsets(lengths), max(lengths))
            return None
        elif which == "q missing on the last rank" and last:
            q = None
        elif which == "device on the last rank" and last:
            q, k, v = q.to("meta"), k.to("meta"), v.to("meta")
        elif which == "packed meta on the last rank":
            t, lengths = 24, [16 * P, 8 * P]
            device = "meta" if last else "cpu"
            cp.sink_attn_varlen_func(*(torch.randn(t, h, D, device=device) for h in (HQ, HKV, HKV)),
                                     _offsets(lengths).to(device), max(lengths))
            return None
        elif which == "shard not divisible":
            cp.shard(torch.randn(2, 4 * P + 1, 3), 1, layout="contiguous")
            return None
        elif which == "shard shapes differ":
            cp.shard(torch.randn(2 + last, 4 * P, 3), 1)
            return None
        elif which.startswith("shard_varlen"):
            lengths = [16 * P, 8 * P] if not last else ([16 * P, 8 * P + 2] if "valid" in which else [8 * P, 16 * P])
            cp.shard_varlen(torch.randn(sum(lengths), 3), _offsets(lengths))
            return None
        elif which == "unshard dtypes differ":
            cp.unshard(torch.randn(2, 8, 3, dtype=torch.float64 if last else torch.float32), 1)
            return None
        elif which.startswith("double backward"):
            out = cp.sink_attn_func(q.requires_grad_(), k, v, method=which.split()[-1], **kw)
            torch.autograd.grad(out.square().sum(), q, create_graph=True)
            return None
        elif which == "forward-mode AD":
            with forward_ad.dual_level():
                cp.sink_attn_func(q, k, forward_ad.make_dual(v, torch.ones_like(v)), **kw)
            return None
        elif which == "torch.func.jvp":
            torch.func.jvp(lambda q: cp.sink_attn_func(q, k, v, **kw), (q,), (torch.ones_like(q),))
            return None
        cp.sink_attn_func(q, k, v, **kw)
    except Exception as exc:      # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc)
    return None


def _worker(rank: int, P: int, folder: str, names: list[str] | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=60))
    from sinkattn import distributed as cp
    results: dict = {"cases": {}, "repeats": {}, "errors": {}, "failure": None}
    try:
        subgroups = {}
        for size in sorted({c.subgroups for c in CASES if c.subgroups and P > c.subgroups}):
            for start in range(0, P, size):       # every rank creates every group, in one order
                g = dist.new_group(list(range(start, start + size)))
                if start <= rank < start + size:
                    subgroups[size] = g
        for case in CASES:
            if (names is not None and case.name not in names or case.subgroups and case.subgroups not in subgroups
                    or P not in case.world_sizes):
                continue
            group = subgroups.get(case.subgroups)
            results["cases"][case.name] = _run_case(case, group, cp)
            if case.repeat:
                again = _run_case(case, group, cp)
                results["repeats"][case.name] = all(torch.equal(again[t], results["cases"][case.name][t])
                                                    for t in again)
        for which in ERRORS:
            results["errors"][which] = _error_case(which, rank, P, cp)
        first = CASES[0]
        results["after_errors"] = _run_case(first, None, cp)
    except Exception:             # noqa: BLE001 - reported to the test process
        results["failure"] = traceback.format_exc()
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def spawn(P: int, folder: str, names: list[str] | None = None, timeout: float = 240.0) -> list[dict]:
    """Run the cases (all, or those named) on P gloo ranks; every rank's results, in rank order."""
    join_ranks(mp.spawn(_worker, args=(P, folder, names), nprocs=P, join=False), P, timeout)
    return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(P)]


def join_ranks(context, P: int, timeout: float) -> None:
    """Wait for the P processes of ``mp.spawn(..., join=False)``; kill them all and raise TimeoutError past
    ``timeout`` seconds (a hang), re-raise a rank's failure."""
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    while not context.join(timeout=1.0):
        if datetime.datetime.now() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the {P} ranks did not finish within {timeout:.0f} s (a hang?)")
