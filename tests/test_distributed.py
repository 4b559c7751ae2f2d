"""sinkattn.distributed against single-process sinkattn on the full tensors, on 2 and 4 gloo
processes (one spawned group per world size runs every case; see harness.cp), and against
the float64 golden at P = 2 and 3 (one group of 3 processes runs the whole precision matrix)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sinkattn
import sinkattn.distributed as cp
from sinkattn import reference
from sinkattn.testing import precision
from harness.cp import (AUTOCAST_DTYPE, CASES, ERRORS, LENGTHS, PRECISION, PRECISION_SEEDS,
                                 PRECISION_SIZES, cu_seqlens, inputs, precision_inputs, spawn, spawn_precision)
from sinkattn.masks import Window

# pytest -n: one worker runs the whole module, whose module-scoped fixture launches processes
pytestmark = pytest.mark.xdist_group("test_distributed")

WORLD_SIZES = (2, 4)
RTOL = 1e-5
RTOL_AUTOCAST = 2 ** -7       # bf16 results: the ring's fp32 sums run in another order, then round to bf16 once


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda P: f"P{P}")
def ranks(request, tmp_path_factory):
    P = request.param
    results = spawn(P, str(tmp_path_factory.mktemp(f"cp{P}")))
    for r, res in enumerate(results):
        assert res["failure"] is None, f"rank {r}:\n{res['failure']}"
    return P, results


def _chunks(length, P, layout, rank):
    """``(start, size)`` of the pieces of one sequence held by ``rank``, written out from the layout's definition."""
    if layout == "contiguous":
        c = length // P
        return [(rank * c, c)]
    c = length // (2 * P)
    return [(rank * c, c), ((2 * P - 1 - rank) * c, c)]


def _expected_shard(full, dim, P, layout, rank, lengths):
    pieces, start = [], 0
    for length in lengths:
        pieces += [full.narrow(dim, start + a, c) for a, c in _chunks(length, P, layout, rank)]
        start += length
    return torch.cat(pieces, dim)


def _single_process(case):
    """Single-process sinkattn on the full tensors; for an autocast case, on q, k, v cast to the autocast
    dtype by hand (what autocast is to do, as for SDPA), gradients back in the originals' dtypes."""
    x = inputs(case)
    q, k, v, sinks = (x[n].clone().requires_grad_() for n in ("q", "k", "v", "sinks"))
    args = [t.to(AUTOCAST_DTYPE) for t in (q, k, v)] if case.autocast else [q, k, v]
    kw = dict(sinks=sinks, causal=case.causal, window_size=case.window, return_lse=True, backend=case.backend)
    if case.packed:
        cu = cu_seqlens()
        out, lse = sinkattn.sink_attn_varlen_func(*args, cu, cu, max(LENGTHS), max(LENGTHS), **kw)
    else:
        out, lse = sinkattn.sink_attn_func(*args, **kw)
    ((out * x["dout"]).sum() + (lse * x["dlse"]).sum()).backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad, dsinks=sinks.grad)


def _relative_error(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def _check_against_single_process(case, P, per_rank):
    want = _single_process(case)
    lengths = LENGTHS if case.packed else (want["out"].shape[1],)
    seq_dim, lse_dim = (0, 1) if case.packed else (1, 2)
    P_eff = case.subgroups or P
    rtol = RTOL_AUTOCAST if case.autocast else RTOL
    for r, got in enumerate(per_rank):
        for name, dim in (("out", seq_dim), ("lse", lse_dim), ("dq", seq_dim), ("dk", seq_dim), ("dv", seq_dim)):
            shard = _expected_shard(want[name], dim, P_eff, case.layout, r % P_eff, lengths)
            assert got[name].shape == shard.shape and got[name].dtype == shard.dtype, (case.name, r, name)
            assert torch.isfinite(got[name]).all(), (case.name, r, name)
            err = _relative_error(got[name], shard)
            assert err <= rtol, f"{case.name} rank {r} {name}: relative error {err:.2e}"
    for start in range(0, P, P_eff):
        dsinks = sum(per_rank[r]["dsinks"] for r in range(start, start + P_eff))
        assert dsinks.dtype == want["dsinks"].dtype
        err = _relative_error(dsinks, want["dsinks"])
        assert err <= rtol, f"{case.name}: summed dsinks relative error {err:.2e}"


@pytest.mark.parametrize("case", [c for c in CASES if not c.subgroups], ids=lambda c: c.name)
def test_matches_single_process(ranks, case):
    P, results = ranks
    if P not in case.world_sizes:
        assert case.name not in results[0]["cases"]
        return
    _check_against_single_process(case, P, [res["cases"][case.name] for res in results])


def test_subgroups_of_two(ranks):
    P, results = ranks
    case = next(c for c in CASES if c.subgroups)
    if P <= case.subgroups:
        assert case.name not in results[0]["cases"]
        return
    _check_against_single_process(case, P, [res["cases"][case.name] for res in results])


def test_bitwise_repeatable(ranks):
    P, results = ranks
    repeated = results[0]["repeats"]
    assert len(repeated) >= 8
    for r, res in enumerate(results):
        assert all(res["repeats"].values()), (r, res["repeats"])
        again, first = res["after_errors"], res["cases"][CASES[0].name]
        assert all(torch.equal(again[t], first[t]) for t in first), f"rank {r}: call after the error cases differs"


_ERROR_TEXT = {   # {P}: the group size, {last}: the last rank
    "q shapes differ": ("ValueError", "ranks disagree on q.shape[1]"),
    "dtype on the last rank": ("TypeError", "rejected its inputs: q must have dtype"),
    "layout": ("ValueError", "layout must be one of"),
    "method": ("ValueError", "method must be one of"),
    "not divisible": ("ValueError", "not divisible by"),
    "ulysses heads": ("ValueError", "HQ=5 must be divisible by the group size"),
    "options differ": ("ValueError", "ranks disagree on the right window (0 under causal=True): rank 0 has 0, "
                                     "rank 1 has unbounded (-1)"),
    "methods differ": ("ValueError", "ranks disagree on method: rank 0 has 'ring', rank 1 has 'ulysses'"),
    "packing differs": ("ValueError", "ranks disagree on the number of sequences: rank 0 has 1"),
    "packings collide": ("ValueError", "ranks disagree on the packing (sequence lengths from cu_seqlens): rank 0 has "
                                       "[16, 32, 16], rank {last} has [32, 0, 32]: sequence 0 has length 16 on rank 0 "
                                       "but 32 on rank {last}"),
    "one token fewer": ("ValueError", "rank {last} of {P} rejected its inputs: q holds 23 tokens on this rank, but "
                                      "cu_seqlens covers {T} tokens, 24 on each of the P={P} ranks"),
    "q missing on the last rank": ("TypeError", "rank {last} of {P} rejected its inputs: q must be a torch.Tensor"),
    "device on the last rank": ("NotImplementedError", "rank {last} of {P} rejected its inputs: context parallelism "
                                                       "exchanges shards between ranks, and meta tensors hold no data"),
    "packed meta on the last rank": ("NotImplementedError", "rank {last} of {P} rejected its inputs: context "
                                                            "parallelism exchanges shards between ranks, and meta"),
    "shard not divisible": ("ValueError", "rank 0 of {P} rejected its inputs: x.shape[1] has length {odd}, not "
                                          "divisible by {P} = P"),
    "shard shapes differ": ("ValueError", "ranks disagree on x.shape[0]: rank 0 has 2, rank {last} has 3"),
    "shard_varlen packing valid on one rank": ("ValueError", "rank {last} of {P} rejected its inputs: cu_seqlens "
                                                             "(sequence 1) has length {bad}, not divisible by"),
    "shard_varlen packings differ": ("ValueError", "ranks disagree on the packing (sequence lengths from cu_seqlens): "
                                                   "rank 0 has [{a}, {b}], rank {last} has [{b}, {a}]"),
    "unshard dtypes differ": ("ValueError", "ranks disagree on the dtype: rank 0 has float32, rank {last} has "
                                            "float64"),
    "double backward ring": ("RuntimeError", "double backward is not supported"),
    "double backward ulysses": ("RuntimeError", "double backward is not supported"),
    "forward-mode AD": ("NotImplementedError", "sinkattn does not support forward-mode AD"),
    "torch.func.jvp": ("NotImplementedError", "sinkattn does not support torch.func transforms"),
}


@pytest.mark.parametrize("which", ERRORS)
def test_errors_are_raised_on_every_rank(ranks, which):
    """Every rank raises the same error: a rank's own bad input named with its rank, a disagreement with the
    ranks and values; none is left waiting in a collective or with a transport error."""
    P, results = ranks
    raised = [res["errors"][which] for res in results]
    assert all(e is not None for e in raised), raised
    kind, text = _ERROR_TEXT[which]
    text = text.format(P=P, last=P - 1, T=24 * P, odd=4 * P + 1, bad=8 * P + 2, a=16 * P, b=8 * P)
    assert all(e == raised[0] for e in raised), f"ranks raised different errors: {raised}"
    assert raised[0][0] == kind and text in raised[0][1], raised[0]
    if "rejected" in text and "rank 0 of" not in text:
        assert f"rank {P - 1} of {P}" in raised[0][1]


def test_without_a_process_group():
    x = torch.randn(1, 8, 2, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.sink_attn_func(x, x, x)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.shard(x, 1)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_layout_orders_match_their_definition(layout):
    from sinkattn.distributed.layout import rank_order
    for P in (1, 2, 4):
        lengths = [8 * P, 0, 16 * P]
        order = rank_order(lengths, P, layout)
        full = torch.arange(sum(lengths))
        want = torch.cat([_expected_shard(full, 0, P, layout, r, lengths) for r in range(P)])
        assert torch.equal(order, want)


def test_destroy_process_group_stops_gloo_threads_after_a_sinkattn_call(tmp_path):
    """The first torch.library call imports torch._dynamo and with it torch.distributed.nn.functional,
    whose default arguments bind the default group. Done after init_process_group, that kept the group
    alive past destroy_process_group, and its gloo threads could abort the process at exit. Results that
    are still alive, with their autograd graphs, must not keep the group alive either."""
    import textwrap
    script = textwrap.dedent(f"""
        import os
        import torch
        import sinkattn
        import sinkattn.distributed as cp
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        x = torch.randn(1, 8, 2, 8, requires_grad=True)
        sinkattn.sink_attn_func(x, x, x, causal=True)
        kept = [cp.sink_attn_func(x, x, x, causal=True, method=method) for method in ("ring", "ulysses")]
        sum(out.sum() for out in kept).backward()
        dist.destroy_process_group()
        names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        print("gloo threads left:", sum("gloo" in n for n in names))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "gloo threads left: 0" in run.stdout, run.stdout


def test_cp_example_without_torchrun_runs_as_a_group_of_one():
    example = Path(__file__).resolve().parents[1] / "examples" / "cp_train_step.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    run = subprocess.run([sys.executable, str(example), "--method", "ring"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "a group of one (P=1)" in run.stdout and "torchrun --nproc-per-node P" in run.stdout
    assert "P=1 method=ring" in run.stdout and "OK: worst" in run.stdout


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    results = spawn_precision(str(tmp_path_factory.mktemp("cp-precision")))
    assert results["failure"] is None, results["failure"]
    return results["cases"]


@pytest.mark.parametrize("case", PRECISION, ids=lambda c: c.name)
@pytest.mark.parametrize("P", PRECISION_SIZES, ids=lambda P: f"P{P}")
def test_context_parallel_meets_the_precision_standard(precision_runs, one_thread, P, case):
    """Ring and Ulysses in fp16, bf16 and fp32 at P = 2 and 3, with one KV head, P of them and 2P, causal and
    windowed: every output and gradient, gathered from the ranks (dsinks summed over them), passes Gate A
    against the float64 golden, as one process must, for every seed (partial gradients summed in fp32,
    rounded once)."""
    lengths = case.lengths(P)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    window = Window.of(case.causal, case.window)
    misses = []
    for seed in PRECISION_SEEDS:
        got, x = precision_runs[P, case.name, seed], precision_inputs(case, P, seed)
        args = (x["q"], x["k"], x["v"], x["sinks"], cu, cu, case.D ** -0.5, window)
        gold = dict(zip(("o", "lse"), reference.forward(*args)))
        gold.update(zip(("dq", "dk", "dv", "dsinks"), reference.backward(x["dout"], x["dlse"], *args)))
        for name, want in gold.items():
            dtype = torch.float32 if name in ("lse", "dsinks") else getattr(torch, case.dtype)
            assert got[name].dtype == dtype, (case.name, seed, name, got[name].dtype)
            report = precision.gate_a(name, got[name], want, dtype)
            if not report.gate_a:
                misses.append(f"seed {seed} {name}: ratio {report.ratio:.4f} max_abs {report.max_abs_err:.3g}")
    assert not misses, f"{case.name} P={P}: " + "; ".join(misses)
