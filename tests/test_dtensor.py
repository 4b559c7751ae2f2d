"""sinkattn on DTensors (tensor parallelism over heads) against the plain local call on each rank's heads,
bitwise, on 1- and 2-rank gloo meshes (one spawned group per mesh size runs every case; see
harness.tp)."""

import os
import subprocess
import sys

import pytest
import torch

import sinkattn
from harness.tp import CASES, ERRORS, LENGTHS, heads, inputs, spawn

# pytest -n: one worker runs the whole module, whose module-scoped fixture launches processes
pytestmark = pytest.mark.xdist_group("test_dtensor")

MESH_SIZES = (1, 2)


@pytest.fixture(scope="module", params=MESH_SIZES, ids=lambda P: f"P{P}")
def ranks(request, tmp_path_factory):
    P = request.param
    results = spawn(P, str(tmp_path_factory.mktemp(f"tp{P}")))
    for r, res in enumerate(results):
        assert res["failure"] is None, f"rank {r}:\n{res['failure']}"
    return P, results


def _local_call(case, rank, P):
    """The plain call on rank ``rank``'s heads (all heads when the case replicates q/k/v), and its gradients."""
    x = inputs(case)
    shards = P if case.sharded else 1
    r = rank if case.sharded else 0
    head_dim, lse_dim = (1, 0) if case.packed else (2, 1)
    q, k, v, dout = (heads(x[n], head_dim, r, shards) for n in ("q", "k", "v", "dout"))
    sinks = heads(x["sinks"], 0, r, shards) if case.sinks else None
    leaves = [t.requires_grad_(case.grad) for t in (q, k, v, sinks) if t is not None]
    kw = dict(sinks=sinks, causal=case.causal, window_size=case.window, return_lse=True)
    with torch.set_grad_enabled(case.grad):
        if case.packed:
            cu = x["cu"]
            out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), **kw)
        else:
            out, lse = sinkattn.sink_attn_func(q, k, v, **kw)
    want = dict(out=out.detach(), lse=lse.detach())
    if case.grad:
        dlse = heads(x["dlse"], lse_dim, r, shards)
        grads = torch.autograd.grad(*(([lse], leaves, [dlse]) if case.lse_only else ([out, lse], leaves, [dout, dlse])))
        want.update(zip(("dq", "dk", "dv", "dsinks"), grads))
    return want


def _local_dsinks(case, rank, P):
    """What rank ``rank`` holds of dsinks: the gradient over every head (each head's from the local call that
    holds it), or, for Shard(0) sinks, this rank's block of it."""
    full = torch.cat([_local_call(case, s, P)["dsinks"] for s in range(P)]) if case.sharded else \
        _local_call(case, 0, P)["dsinks"]
    return heads(full, 0, rank, P) if case.sinks == "shard" else full


def _placement(case, name):
    """The placement each result must have, written out from the rules (docs/distributed.md)."""
    head = "Shard(dim=1)" if case.packed else "Shard(dim=2)"
    if name == "dsinks":
        one = "Shard(dim=0)" if case.sinks == "shard" else "Replicate()"
    elif not case.sharded:
        one = "Replicate()"
    else:
        one = "Shard(dim=1)" if name == "lse" and not case.packed else "Shard(dim=0)" if name == "lse" else head
    return f"(Replicate(), {one})" if case.mesh_2d else f"({one},)"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_the_local_call_on_each_ranks_heads(ranks, case, one_thread):
    P, results = ranks
    for r, res in enumerate(results):
        got = res["cases"][case.name]
        want = _local_call(case, r, P)
        names = {"out", "lse"} | ({"dq", "dk", "dv"} | ({"dsinks"} if case.sinks else set()) if case.grad else set())
        assert set(got) == names, (case.name, r, set(got))
        for name in names - {"dsinks"}:
            tensor, placement = got[name]
            assert placement == _placement(case, name), (case.name, r, name, placement)
            assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), (case.name, r, name)
        if "dsinks" in names:
            tensor, placement = got["dsinks"]
            assert placement == _placement(case, "dsinks"), (case.name, r, placement)
            assert torch.equal(tensor, _local_dsinks(case, r, P)), (case.name, r)

_ERROR_TEXT = {
    "sequence sharded": ("ValueError", "q is sharded over the sequence (Shard(1) of q [B, S, HQ, D]) on mesh dim 0: "
                                       "sinkattn runs on DTensors sharded over heads (Shard(2) of q [B, S, HQ, D]) or "
                                       "replicated (Replicate()) on every mesh dim. For context parallelism "
                                       "(sequence shards) use sinkattn.distributed"),
    "tokens sharded": ("ValueError", "q is sharded over the tokens (Shard(0) of packed q [T, HQ, D]) on mesh dim 0"),
    # DTensor's dispatcher re-raises a rule's error as a RuntimeError (the ValueError as its cause)
    "op on sequence shards": ("RuntimeError", "q is sharded over the sequence (Shard(1) of q [B, S, HQ, D])"),
    "k placed unlike q": ("ValueError", "k must be placed like q"),
    "HKV=1 over the mesh": ("ValueError", "k and v have HKV=1 heads, not divisible by the 2 head shards"),
    "plain sinks": ("TypeError", "q, k, v are DTensors but sinks is a plain torch.Tensor"),
    "partial q": ("ValueError", "q has placement Partial(sum) on mesh dim 0"),
    "sharded cu_seqlens": ("ValueError", "cu_seqlens_q must be replicated (every rank holds the whole packing), got "
                                         "Shard(dim=0) on mesh dim 0"),
}


@pytest.mark.parametrize("which", ERRORS)
def test_refused_placements_raise_a_clear_error_on_every_rank(ranks, which):
    """Sequence (token) shards, Partial, k/v placed unlike q, GQA groups split over ranks, a plain sinks
    beside DTensors, sharded cu_seqlens: refused before any redistribution, the same error on every rank.
    On one rank every head count divides, so only the GQA case runs there."""
    P, results = ranks
    raised = [res["errors"][which] for res in results]
    if which == "HKV=1 over the mesh" and P == 1:
        assert raised == [None]
        return
    kind, text = _ERROR_TEXT[which]
    assert all(e == raised[0] for e in raised), raised
    assert raised[0] is not None and raised[0][0] == kind and text in raised[0][1], raised[0]



def test_docs_tensor_parallel_example_on_two_ranks(tmp_path):
    """The tensor-parallel block of docs/distributed.md (which test_docs.py runs as a mesh of one) under
    torchrun on 2 ranks: each rank holds 2 of the 4 heads, and the block checks loss and gradients itself."""
    from test_docs import ROOT, _blocks
    block = next(code for code in _blocks(ROOT / "docs" / "distributed.md") if "class SinkAttention" in code)
    script = tmp_path / "tp_attention.py"
    script.write_text(block)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    for r in range(2):
        assert f"rank {r} of 2: heads 2 of 4, loss" in run.stdout, run.stdout
