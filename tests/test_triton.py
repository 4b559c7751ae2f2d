"""The Triton backend's real kernels, on this machine through ``TRITON_INTERPRET=1`` (set in
conftest when there is no GPU): what they refuse, their schedule and launch, the large-scores flag,
the resource audit. Their Gate A against the float64 golden (the levels scaled down to lengths <= 64,
heads <= 4, D <= 32 so the interpreter stays within CI's budget, and the shapes of
``harness.tables.TRITON_SHAPES``) is in the matrix, test_varlen_gate_a.py."""

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from sinkattn import sink_attn_varlen_func
from sinkattn.masks import Window
from sinkattn.testing import cases, verify
from sinkattn.backends import triton as triton_backend
from sinkattn.backends.triton import config, kernels, schedule
from sinkattn.backends.capabilities import Batch
from sinkattn.backends import buffers
from harness import tables, triton_audit
from conftest import DEVICE

ROOT = Path(__file__).resolve().parents[1]


def test_triton_refuses_head_dims_past_its_tiles_naming_the_fix():
    from sinkattn import backends
    with pytest.raises(NotImplementedError, match="'triton' supports head dims up to 512, got 600"):
        backends.choose("triton", backends.Request("cuda", torch.float16, 600, True))
    with pytest.raises(NotImplementedError, match="'triton' supports head dims up to 512, got v's 640"):
        backends.choose("triton", backends.Request("cuda", torch.float16, 192, True, 640))
    assert backends.choose("triton", backends.Request("cuda", torch.float16, 512, True, 320)) == "triton"


def test_fp32_backward_past_256_is_refused_where_it_does_not_fit(monkeypatch):
    """sm86 GPUs (99 KiB of shared memory a program) have no fp32 dK/dV or dQ tile at 512: a call that
    needs a gradient is refused before its forward runs, naming the way out; fp16 / bf16 and a call
    without gradient are not."""
    with pytest.raises(NotImplementedError, match=r"no dkdv tile for float32 at head dims 257-512 on sm86 .*99 KiB"):
        config.blocks_for("sm86", "dkdv", 512, torch.float32)
    assert config.blocks_for("sm86", "dq", 256, torch.float32) == config.TABLE["sm86"][("dq", True, 256)]
    for chip in config.CHIPS:
        assert config.blocks_for(chip, "fwd", 320, torch.float32) == config.TABLE[chip][("fwd", True, 512)]
        for kernel in config.KERNELS:
            assert config.blocks_for(chip, kernel, 512, torch.bfloat16).num_warps == 8
    monkeypatch.setattr(config, "chip_for", lambda device: "sm86")
    q = torch.randn(4, 2, 300, device=DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with buffers.poisoned(), pytest.raises(NotImplementedError, match="float16 / bfloat16, or backend='cpu'"):
        triton_backend.forward(q, q, q, Batch(cu, cu, 4, 4), Window(-1, 0), 0.1, True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compensated_backward_is_more_accurate(dtype, monkeypatch):
    case = cases.Case("L2", 4, 2, (64,), (64,), D=32, dtype=dtype)
    errors = {}
    for flag in (False, True):
        monkeypatch.setattr(triton_backend, "COMPENSATED", flag)
        result = verify.run_case(case, "triton", device=DEVICE)
        errors[flag] = {r.name: r.rms_rel_err for r in result.reports}
    for name in ("dq", "dk", "dv"):
        assert errors[True][name] < errors[False][name], (name, errors)


def test_audit_is_current_and_the_hardest_configurations_build_as_recorded():
    """The interpreter is lenient and says nothing of registers: ``triton_aot.py`` checks that the recorded
    resource audit covers every configuration the code chooses today, and compiles the hardest one of
    each chip with Triton's GPU compiler (no GPU needed), figures equal to the record."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_aot.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    ok = run.stdout.count("matches the record") + run.stdout.count("within the limits")
    assert ok == len(config.CHIPS), run.stdout


def _recorded_audit():
    import json

    return json.loads((ROOT / "benchmarks" / "results" / "triton-audit.json").read_text())


def test_recorded_audit_is_within_every_chip_limits():
    """No configuration needs more shared memory than its chip has, none fails to build, no fp16 / bf16
    one spills; and docs/backends.md shows the record's summary, fp32 spills with their sizes."""
    record = _recorded_audit()
    assert triton_audit.problems(record["entries"]) == []
    assert record["problems"] == []
    assert {e["config"]["chip"] for e in record["entries"]} == set(config.CHIPS)
    assert triton_audit.markdown(record["entries"]) in (ROOT / "docs" / "backends.md").read_text()


def test_audit_limits_flag_spills_and_shared_memory_past_the_chip():
    """What the recorded-audit test relies on: a spill in fp16 / bf16, shared memory past the chip and
    a build error are problems; an fp32 spill is not (it is listed in the docs instead)."""
    entry = next(e for e in _recorded_audit()["entries"] if e["name"] == "sm86/fwd/float16/D128/compensated")
    fp32 = next(e for e in _recorded_audit()["entries"] if e["config"]["dtype"] == "float32")
    spilled = dict(entry, spill_stores=4, spill_loads=4)
    too_big = dict(entry, shared_bytes=config.CHIPS["sm86"].shared_bytes + 1)
    broken = dict(entry, error="CompilationError: ...")
    found = triton_audit.problems([entry, spilled, too_big, broken, dict(fp32, spill_stores=64)])
    assert len(found) == 3 and "spills 4 bytes" in found[0] and "shared memory" in found[1]
    assert "does not build" in found[2]


def test_compensated_flag_must_be_a_bool(monkeypatch):
    monkeypatch.setattr(triton_backend, "COMPENSATED", None)
    result = verify.run_case(tables.interpreter_size(cases.cases("L0")[0]), "triton", device=DEVICE)
    assert result.error is not None and result.error.startswith("TypeError") and "COMPENSATED" in result.error


def test_launch_sized_by_a_loose_max_seqlen_equals_a_tight_one():
    """The launchers size their grids from ``max_seqlen`` (never a copy of ``cu_seqlens`` to the host);
    blocks past a sequence's end (a bound that over-estimates) must write nothing."""
    torch.manual_seed(0)
    lens, HQ, HKV, D = [5, 0, 9], 4, 2, 16
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens), HQ, D, device=DEVICE)
    k, v = torch.randn(2, sum(lens), HKV, D, device=DEVICE)
    do, dlse = torch.randn_like(q), torch.randn(HQ, sum(lens), device=DEVICE)
    results = []
    for bounds in ((9, 9), (9 + 64, 9 + 130)):
        batch, window = Batch(cu, cu, *bounds), Window(3, 0)
        with buffers.poisoned():
            out, stats = triton_backend.forward(q, k, v, batch, window, 0.3, True)
            grads = triton_backend.backward(do, dlse, q, k, v, out, stats, None, batch, window, 0.3, False)
        results.append([out, *stats, *grads])
    assert not any(t.isnan().any() for t in results[1])
    assert all(torch.equal(a, b) for a, b in zip(*results))


SCHEDULE_SHAPES = [(37, 37), (20, 45), (45, 20), (1, 30), (30, 1), (16, 16)]
SCHEDULE_WINDOWS = [(-1, -1), (-1, 0), (7, 0), (0, 0), (5, 9), (-1, 3), (12, -1)]


@pytest.mark.parametrize("Lq,Lk", SCHEDULE_SHAPES)
@pytest.mark.parametrize("left,right", SCHEDULE_WINDOWS)
def test_unmasked_blocks_are_exactly_the_fully_visible_ones(Lq, Lk, left, right):
    """The kernels' block split (mirrored in ``schedule``) against ``Window.visible``: the blocks a tile
    visits hold every visible pair, and the ones it runs without the mask are exactly those every
    row of the tile sees whole (rows past the end count as seeing all: their ``P`` is 0 unmasked)."""
    window = Window(left, right)
    vis = window.visible(torch.arange(Lq), torch.arange(Lk), Lq, Lk)
    for PM, BN in [(1, 4), (3, 8), (8, 8), (16, 4)]:          # forward / dQ tiles of PM positions
        for p0 in range(0, Lq, PM):
            p1 = min(p0 + PM, Lq)
            b0, b1, i0, i1 = schedule.query_tile_blocks(p0, p1, Lq, Lk, window, BN)
            seen = vis[p0:p1].nonzero()[:, 1]
            assert all(b0 * BN <= j < b1 * BN for j in seen.tolist())
            for b in range(b0, b1):
                block = vis[p0:p1, b * BN:(b + 1) * BN]
                whole = (b + 1) * BN <= Lk and bool(block.all())
                assert (i0 <= b < i1) == whole, (p0, b, (b0, b1, i0, i1))
    for BM, BN in [(4, 1), (8, 3), (8, 8), (4, 16)]:          # dK/dV programs of BN keys
        for n0 in range(0, Lk, BN):
            n1 = min(n0 + BN, Lk)
            b0, b1, i0, i1 = schedule.key_block_rows(n0, n1, Lq, Lk, window, BM)
            seen = vis[:, n0:n1].nonzero()[:, 0]
            assert all(b0 * BM <= i < b1 * BM for i in seen.tolist())
            for b in range(b0, b1):
                whole = bool(vis[b * BM:min((b + 1) * BM, Lq), n0:n1].all())
                assert (i0 <= b < i1) == whole, (n0, b, (b0, b1, i0, i1))


@triton.jit
def _bounds_probe(LQ, LK, LEFT, RIGHT, OUT, BLOCK: tl.constexpr):
    """Per program (one ``(Lq, Lk, left, right)``): the kernels' ``_row_key_bounds`` of rows and
    ``_key_row_bounds`` of keys ``[0, BLOCK)``, as ``OUT [programs, 4, BLOCK]`` int32 (lo, hi, i_lo, i_hi)."""
    pid = tl.program_id(0)
    Lq, Lk, left, right = tl.load(LQ + pid), tl.load(LK + pid), tl.load(LEFT + pid), tl.load(RIGHT + pid)
    x = tl.arange(0, BLOCK)
    lo, hi = kernels._row_key_bounds(x, Lq, Lk, left, right)
    i_lo, i_hi = kernels._key_row_bounds(x, Lq, Lk, left, right)
    base = OUT + pid * 4 * BLOCK
    tl.store(base + x, lo)
    tl.store(base + BLOCK + x, hi)
    tl.store(base + 2 * BLOCK + x, i_lo)
    tl.store(base + 3 * BLOCK + x, i_hi)


def test_kernels_transcribe_the_window_rule():
    """The kernels' copy of the mask rule (Triton, ints) against ``Window``: for every row ``i < Lq`` the
    keys ``[lo, hi)`` are ``Window.key_bounds``, for every key ``j < Lk`` the rows ``[i_lo, i_hi)`` are
    ``Window.row_bounds``, over windows with either side unbounded, zero or bounded, Lq < Lk and Lq > Lk."""
    shapes = [(7, 7), (5, 11), (11, 5), (1, 9), (9, 1), (16, 3), (3, 16)]
    windows = [(-1, -1), (-1, 0), (0, 0), (3, -1), (-1, 2), (2, 3), (10, 0), (0, 5), (20, 20)]
    combos = [(Lq, Lk, left, right) for Lq, Lk in shapes for left, right in windows]
    LQ, LK, LEFT, RIGHT = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in zip(*combos))
    BLOCK = 16
    out = torch.full((len(combos), 4, BLOCK), -99, dtype=torch.int32, device=DEVICE)
    _bounds_probe[(len(combos),)](LQ, LK, LEFT, RIGHT, out, BLOCK=BLOCK)
    for (Lq, Lk, left, right), got in zip(combos, out.tolist()):
        window = Window(left, right)
        assert [(got[0][i], got[1][i]) for i in range(Lq)] == [window.key_bounds(i, Lq, Lk) for i in range(Lq)]
        assert [(got[2][j], got[3][j]) for j in range(Lk)] == [window.row_bounds(j, Lq, Lk) for j in range(Lk)]


@triton.jit
def _lpt_probe(OUT, chunk, N, HT, NB, CHUNK: tl.constexpr):
    block, seq, head_tile = kernels._lpt_program(chunk, N, HT, NB, CHUNK)
    pid = tl.program_id(0)
    tl.store(OUT + 3 * pid, block)
    tl.store(OUT + 3 * pid + 1, seq)
    tl.store(OUT + 3 * pid + 2, head_tile)


def test_programs_start_with_the_last_blocks_of_every_sequence():
    """Longest-processing-time order: program ``pid`` gets every (block, sequence, head tile) once,
    blocks from the last down, all sequences and head tiles of a block before the next."""
    N, HT, NB = 3, 2, 5
    out = torch.full((NB * N * HT, 3), -1, dtype=torch.int32, device=DEVICE)
    _lpt_probe[(NB * N * HT,)](out, 0, N, HT, NB, CHUNK=kernels.CHUNK)
    got = [tuple(r) for r in out.tolist()]
    assert sorted(got) == sorted((b, s, h) for b in range(NB) for s in range(N) for h in range(HT))
    assert [b for b, _, _ in got] == sorted((b for b, _, _ in got), reverse=True)


def _shuffled_launch(self):
    """``Launch.__call__`` with every program launched alone (``CHUNK = 1``), in a shuffled order."""
    options = dict(num_warps=self.blocks.num_warps, num_stages=self.blocks.num_stages)
    if self.grid is not None:
        return self.kernel[self.grid](**self.args, **options)
    for chunk in torch.randperm(self.programs, generator=torch.Generator().manual_seed(self.programs)).tolist():
        self.kernel[(1,)](**self.args, chunk=chunk, **options)


def test_program_order_and_chunks_change_no_bit(monkeypatch):
    """The longest-processing-time order is an order only, and a grid past ``kernels.CHUNK`` programs
    launches in chunks: one launch, chunks of 7, and every program alone in a shuffled order give
    bitwise equal outputs and gradients (no atomics)."""
    from sinkattn.backends.triton import launch

    case = cases.Case("L2", 4, 2, (37, 0, 20), (30, 4, 20), D=16, window_size=(9, 0))
    runs = []
    for chunk in (kernels.CHUNK, 7, 1):
        monkeypatch.setattr(kernels, "CHUNK", chunk)
        if chunk == 1:
            monkeypatch.setattr(launch.Launch, "__call__", _shuffled_launch)
        x = case.make(DEVICE)
        leaves = [t.detach().requires_grad_() for t in (x.q, x.k, x.v, x.sinks)]
        out = sink_attn_varlen_func(*leaves[:3], x.cu_seqlens_q, x.cu_seqlens_k, x.max_seqlen_q, x.max_seqlen_k,
                                    sinks=leaves[3], causal=True, window_size=(9, 0), backend="triton")
        runs.append([out, *torch.autograd.grad(out, leaves, x.do)])
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


def _flag_inputs(case):
    """``(q, k, softmax_scale)`` for the exact-Delta decision: the bound ``|scale| max|q_i| max|k_j|``."""
    q, k = torch.randn(6, 4, 16, device=DEVICE), torch.randn(5, 2, 16, device=DEVICE)
    if case in ("256", "just-above-256"):         # bound 16 * 16 * scale: the threshold itself, and just past it
        q, k = torch.zeros_like(q), torch.zeros_like(k)
        q[3, 1, 7], k[2, 0, 5] = 16.0, -16.0
        return q, k, 1.0 if case == "256" else 1.0000001
    if case == "nan":
        q[2, 3, 1] = float("nan")
    if case == "inf":
        k[4, 1, 0] = float("inf")
    if case == "empty":
        q = q[:0]
    return q, k, dict(small=0.25, large=-30.0, zero=0.0).get(case, 0.25)


@pytest.mark.parametrize("case", ["small", "large", "256", "just-above-256", "zero", "nan", "inf", "empty"])
def test_large_scores_flag_is_the_host_decision(case):
    """``scores.large_scores_flag`` (on the device, for the dQ kernel) decides as ``may_have_large_scores``
    (which reads the bound back to the host) did, at the threshold and for non-finite and empty inputs."""
    from sinkattn.backends import scores

    q, k, scale = _flag_inputs(case)
    flag = scores.large_scores_flag(q, k, scale)
    assert flag.dtype == torch.int32 and flag.shape == (1,) and flag.device == q.device
    expected = dict(large=True, nan=True, inf=True, **{"just-above-256": True}).get(case, False)
    assert scores.may_have_large_scores(q, k, scale) is expected
    assert flag.tolist() == [int(expected)]


def test_the_device_flag_picks_the_dq_kernel_that_works():
    """The backward launches both dQ kernels (``EXACT_DELTA`` off and on); each reads the device flag and
    works only where it matches. Flag 0: the exact one leaves ``dq`` (NaN-poisoned) and ``Delta`` alone,
    the other computes ``dq`` from the Delta kernel's ``Delta``, which it leaves bitwise as it was. Flag 1:
    the other one leaves them alone, the exact one writes ``sum_j P dP - dlse`` over every row of a
    NaN-poisoned ``Delta`` and computes ``dq``. ``Delta`` and ``dq`` pass Gate A either way."""
    from sinkattn import reference
    from sinkattn.backends import buffers
    from sinkattn.backends.triton import launch
    from sinkattn.testing import precision

    torch.manual_seed(3)
    HQ, HKV, D, scale, window = 4, 2, 16, 0.3, Window(5, 0)
    cu = torch.tensor([0, 11, 11, 30], dtype=torch.int32, device=DEVICE)
    q, do = torch.randn(30, HQ, D, device=DEVICE), torch.randn(30, HQ, D, device=DEVICE)
    k, v = torch.randn(2, 30, HKV, D, device=DEVICE)
    dlse = torch.randn(HQ, 30, device=DEVICE)
    with buffers.poisoned():                 # no sinks: the backend's statistics over the keys are final
        out, (m2, log2_l) = triton_backend.forward(q, k, v, Batch(cu, cu, 19, 19), window, scale, True)
    gold_o, _ = reference.forward(q, k, v, None, cu, cu, scale, window)
    gold_delta = torch.linalg.vecdot(do.double(), gold_o).t() - dlse.double()
    gold_dq = reference.backward(do, dlse, q, k, v, None, cu, cu, scale, window)[0]
    delta = torch.full((HQ, 30), float("nan"), device=DEVICE)
    launch.delta(out, do, dlse, delta, None)()
    from_delta_kernel = delta.clone()
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    dq = torch.full_like(q, float("nan"))
    plans = {exact_delta: launch.dq(q, k, v, do, m2, log2_l, dlse, delta, dq, cu, cu, scale, window, 19, None,
                                    False, False, flag, exact_delta) for exact_delta in (False, True)}
    plans[True]()
    assert dq.isnan().all() and torch.equal(delta, from_delta_kernel)
    plans[False]()
    assert torch.equal(delta, from_delta_kernel)
    dq_read = dq.clone()
    flag.fill_(1)
    delta.fill_(float("nan"))
    dq.fill_(float("nan"))
    plans[False]()
    assert dq.isnan().all() and delta.isnan().all()
    plans[True]()
    for name, got, gold in (("delta", from_delta_kernel, gold_delta), ("delta", delta, gold_delta),
                            ("dq", dq_read, gold_dq), ("dq", dq, gold_dq)):
        assert precision.check(name, got, gold, dtype=torch.float32).gate_a, name


def test_large_scores_take_the_exact_delta_on_the_device(monkeypatch):
    """The boundary case with q and k uniform in +-32000 passes Gate A through the device-side decision (in
    the matrix, test_varlen_gate_a.py); with the flag forced to 0 (the Delta kernel's ``Delta``) its dq and
    dk miss it: the flag is what selects the exact pass."""
    case = next(tables.interpreter_size(c) for c in cases.cases("boundary") if c.qk_uniform == 32000.0)
    monkeypatch.setattr(triton_backend, "large_scores_flag",
                        lambda q, k, scale: torch.zeros(1, dtype=torch.int32, device=q.device))
    failed = {r.name for r in verify.run_case(case, "triton", device=DEVICE).reports if not r.gate_a}
    assert {"dq", "dk"} <= failed


def test_scores_beyond_fp32_are_computed_as_fp32_holds_them():
    """The Triton backend does not refuse scores past fp32's range (the check would read the bound back
    to the host): a row with a score that overflows gets ``o`` NaN and ``lse = +inf``; the other rows of
    its sequence and tile keep their ``o`` and ``lse``; NaN reaches the sequence's gradients and the
    dsinks of its heads, and no other sequence."""
    from sinkattn import reference
    from sinkattn.backends import buffers
    from sinkattn.testing import precision

    torch.manual_seed(4)
    HQ, HKV, D = 4, 2, 16
    cu = torch.tensor([0, 8, 20], dtype=torch.int32, device=DEVICE)
    q, k, v = torch.randn(20, HQ, D, device=DEVICE), torch.randn(20, HKV, D, device=DEVICE), \
        torch.randn(20, HKV, D, device=DEVICE)
    q[:4], k[:8] = 1e20, 1e20                   # <q_i, k_j> = 1.6e41: +inf in fp32 for rows 0-3 of sequence 0
    q[4:8] *= 1e-20                             # rows 4-7 of sequence 0: scores of order 1
    sinks = torch.randn(HQ, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    with buffers.poisoned():
        out, lse = sink_attn_varlen_func(*leaves[:3], cu, cu, 12, 12, sinks=leaves[3], causal=True, return_lse=True,
                                         backend="triton")
        grads = torch.autograd.grad(out.sum() + lse.sum(), leaves)
    gold_o, gold_lse = reference.forward(q, k, v, sinks, cu, cu, D ** -0.5, Window(-1, 0))
    assert out[:4].isnan().all() and (lse[:, :4] == float("inf")).all()
    assert precision.check("o", out[4:], gold_o[4:], dtype=torch.float32).gate_a
    assert precision.check("lse", lse[:, 4:], gold_lse[:, 4:], dtype=torch.float32).gate_a
    x1 = [t[8:].detach() for t in (q, k, v)]
    cu1 = torch.tensor([0, 12], dtype=torch.int32, device=DEVICE)
    gold = reference.backward(torch.ones(12, HQ, D, device=DEVICE), torch.ones(HQ, 12, device=DEVICE), *x1, sinks,
                              cu1, cu1, D ** -0.5, Window(-1, 0))
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], gold[:3]):
        assert not got[:8].isfinite().all(), name
        assert precision.check(name, got[8:], want, dtype=torch.float32).gate_a, name
    assert grads[3].isnan().all()


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("used", ["out", "lse", "both"])
def test_gradients_of_an_unused_out_or_lse_arrive_as_none(backend, used):
    """The op's autograd leaves an unused output's gradient None (no zeros to allocate or to look
    into): gradients through ``out`` alone, ``lse`` alone or both equal the golden's."""
    from sinkattn import reference
    from sinkattn.backends import buffers
    from sinkattn.testing import precision

    torch.manual_seed(5)
    cu = torch.tensor([0, 9, 25], dtype=torch.int32, device=DEVICE)
    x = [torch.randn(25, 4, 16, device=DEVICE), torch.randn(25, 2, 16, device=DEVICE),
         torch.randn(25, 2, 16, device=DEVICE), torch.randn(4, device=DEVICE)]
    do, dlse = torch.randn(25, 4, 16, device=DEVICE), torch.randn(4, 25, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in x]
    with buffers.poisoned():
        out, lse = sink_attn_varlen_func(*leaves[:3], cu, cu, 16, 16, sinks=leaves[3], window_size=(6, 2),
                                         return_lse=True, backend=backend)
        outputs, seeds = dict(out=([out], [do]), lse=([lse], [dlse]), both=([out, lse], [do, dlse]))[used]
        grads = torch.autograd.grad(outputs, leaves, seeds)
    gold = reference.backward(do if used != "lse" else torch.zeros_like(do), dlse if used != "out" else None, *x[:3],
                              x[3], cu, cu, 0.25, Window(6, 2))
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, gold):
        assert precision.check(name, got, want, dtype=torch.float32).gate_a, (used, name)
