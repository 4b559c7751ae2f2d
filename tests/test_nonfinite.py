"""NaN and inf in k or v reach exactly the rows that see their key (docs/contract.md §1, "Non-finite keys
and values"), forward and backward, on every path of the cpu backend and in the float64 golden.

Each case puts one special value into one key of a packed batch and checks the NaN/inf pattern of every
output and gradient against the one the formula predicts from the mask rule alone (below), then the
values against the golden (Gate A, which also compares the special pattern)."""

import pytest
import torch

import sinkattn
from sinkattn.masks import Window
from sinkattn.backends import buffers
from sinkattn.backends.triton import config, schedule
from sinkattn.testing import precision
from conftest import DEVICE

HQ, HKV, D = 4, 2, 8
G = HQ // HKV
BAD_TOKEN, BAD_HEAD, BAD_DIM = 14, 1, 3          # key 2 of the third sequence, KV head 1
BAD_ROW, BAD_QHEAD = 16, 3          # query token 4 of the third sequence, query head 3 (KV head 1)


def _batch(lens, where, value, scale=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g) * (scale if i < 2 else 1.0) for i, h in enumerate((HQ, HKV, HKV)))
    if where == "q":
        q[BAD_ROW, BAD_QHEAD, BAD_DIM] = value
    else:
        (k if where == "k" else v)[BAD_TOKEN, BAD_HEAD, BAD_DIM] = value
    sinks = torch.randn(HQ, generator=g)
    do, dlse = torch.randn(T, HQ, D, generator=g), torch.randn(HQ, T, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, sinks, do, dlse, cu


def _run(backend, lens, where, value, left, right, scale=1.0, device="cpu"):
    q, k, v, sinks, do, dlse, cu = (x.to(device) for x in _batch(lens, where, value, scale))
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    with buffers.poisoned():
        out, lse = sinkattn.sink_attn_varlen_func(*leaves[:3], cu, cu, max(lens), max(lens), sinks=leaves[3],
                                                  window_size=(left, right), return_lse=True, backend=backend)
        grads = torch.autograd.grad([out, lse], leaves, [do, dlse])
    return [t.detach().cpu() for t in (out, lse, *grads)]


def _predicted(lens, where, left, right):
    """From the mask rule: which entries of (o, lse, dq, dk, dv, dsinks) are not finite."""
    T = sum(lens)
    sees = torch.zeros(T, dtype=torch.bool)        # row t sees the bad key
    sees_keys = torch.zeros(T, T, dtype=torch.bool)
    start = 0
    for L in lens:
        vis = Window(left, right).visible(torch.arange(L), torch.arange(L), L, L)
        sees_keys[start:start + L, start:start + L] = vis
        if start <= BAD_TOKEN < start + L:
            sees[start:start + L] = vis[:, BAD_TOKEN - start]
        start += L
    group = torch.zeros(HQ, dtype=torch.bool)
    group[BAD_HEAD * G:(BAD_HEAD + 1) * G] = True
    rows = sees[:, None] & group[None, :]                                     # [T, HQ]
    touched = (sees_keys & sees[:, None]).any(0)                              # keys seen by a row that sees it
    keys = torch.zeros(T, HKV, dtype=torch.bool)
    keys[:, BAD_HEAD] = touched
    o = rows[..., None].expand(T, HQ, D).clone()
    if where == "v":                      # only the bad component of o; lse and dv stay finite
        o[..., :BAD_DIM] = False
        o[..., BAD_DIM + 1:] = False
    lse = rows.t() if where == "k" else torch.zeros(HQ, T, dtype=torch.bool)
    dv = keys[..., None].expand(T, HKV, D) if where == "k" else torch.zeros(T, HKV, D, dtype=torch.bool)
    dsinks = group & bool(sees.any())
    return [o, lse, rows[..., None].expand(T, HQ, D), keys[..., None].expand(T, HKV, D), dv, dsinks]


NAMES = ("o", "lse", "dq", "dk", "dv", "dsinks")


def _check_pattern(got, lens, where, left, right):
    for name, g, want in zip(NAMES, got, _predicted(lens, where, left, right)):
        assert torch.equal(~torch.isfinite(g), want), f"{name}: not finite where the formula says finite, or reverse"


def _check_golden(got, lens, where, value, left, right, scale=1.0):
    gold = _run("reference", lens, where, value, left, right, scale)
    for name, g, gd in zip(NAMES, got, gold):
        report = precision.check(name, g, gd, dtype=torch.float32)
        assert report.gate_a, (name, report)

# (lengths, window): the bad key sits in the sequence holding token 14. Short packed sequences take the
# batched small path, the 80-token one the slab path (special values present), one 24-token sequence with
# full attention the fused kernel (every row sees every key: no check needed)
LAYOUTS = {
    "full-dense": ([24], (-1, -1)),
    "causal": ([9, 3, 12], (-1, 0)),
    "window": ([9, 3, 12], (3, 0)),
    "two-sided": ([9, 3, 12], (2, 1)),
    "long": ([9, 3, 80], (-1, 0)),
    "long-window": ([9, 3, 80], (5, 0)),
}


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_nan_reaches_exactly_the_rows_that_see_its_key(backend, layout, where):
    lens, (left, right) = LAYOUTS[layout]
    got = _run(backend, lens, where, float("nan"), left, right)
    _check_pattern(got, lens, where, left, right)
    if backend != "reference":
        _check_golden(got, lens, where, float("nan"), left, right)


@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_with_large_scores(where):
    """Sharp attention (rows far into the underflow of their exponentials) keeps the pattern too."""
    lens, (left, right) = LAYOUTS["long-window"]
    got = _run("cpu", lens, where, float("nan"), left, right, scale=30.0)
    _check_pattern(got, lens, where, left, right)
    _check_golden(got, lens, where, float("nan"), left, right, scale=30.0)


@pytest.mark.parametrize("value", [float("inf"), -float("inf")])
def test_inf_in_v_gives_the_formulas_infinities(value):
    """An infinite v_jd: o_id = +-inf (p_ij > 0) on the rows that see j, nothing else changes."""
    lens, (left, right) = LAYOUTS["window"]
    got = _run("cpu", lens, "v", value, left, right)
    predicted = _predicted(lens, "v", left, right)
    assert torch.equal(torch.isinf(got[0]), predicted[0]) and not torch.isnan(got[0]).any()
    assert (got[0][predicted[0]] == value).all()
    _check_golden(got, lens, "v", value, left, right)


def test_decoding_inference_keeps_nan_in_v_to_its_rows():
    """Dense no-grad calls (one kernel call on the tensors as they are): a NaN value of one cached key
    reaches the heads of its group only, in one component; with a causal diagonal the call goes the exact way."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, HQ, D, generator=g)
    k, v = (torch.randn(2, 20, HKV, D, generator=g) for _ in range(2))
    v[1, 5, BAD_HEAD, BAD_DIM] = float("nan")
    with torch.no_grad():
        out = sinkattn.sink_attn_func(q, k, v, causal=True)
        bad = ~torch.isfinite(out)
        assert bad.sum() == G and bad[1, 0, BAD_HEAD * G:(BAD_HEAD + 1) * G, BAD_DIM].all()
        q2 = torch.randn(1, 20, HQ, D, generator=g)            # prefill: causal, rows before key 5 do not see it
        out = sinkattn.sink_attn_func(q2, k[1:], v[1:], causal=True)
    rows = (~torch.isfinite(out))[0].any(-1).any(-1)
    assert torch.equal(rows, torch.arange(20) >= 5)


def _triton_reach(lens, where, left, right, dtype=torch.float32):
    """What docs/contract.md §1 says of ``triton``, from the tiles of ``backends.triton.config`` and the
    block ranges of ``backends.triton.schedule``: ``(o_pattern, may_dq [T, HQ], may_dkdv [T, HKV])``,
    the exact non-finite pattern of ``o`` and where the dq and dk / dv gradients may be non-finite."""
    chip = config.chip_for(torch.device(DEVICE))
    fwd, dq, dkdv = (config.blocks_for(chip, kernel, D, dtype) for kernel in ("fwd", "dq", "dkdv"))
    T = sum(lens)
    starts = torch.tensor([0, *lens]).cumsum(0).tolist()
    seq = max(i for i, s in enumerate(starts[:-1]) if s <= BAD_TOKEN)     # the sequence holding the bad key
    start, L = starts[seq], lens[seq]
    j = BAD_TOKEN - start
    sees = Window(left, right).visible(torch.arange(L), torch.tensor([j]), L, L)[:, 0]      # [L]

    def tile_rows(blocks):                 # positions of the forward / dQ tiles that visit j's key block
        rows = torch.zeros(L, dtype=torch.bool)
        PM = blocks.BM // config.pack_heads(G, blocks.BM)
        for p0 in range(0, L, PM):
            b0, b1, _, _ = schedule.query_tile_blocks(p0, min(p0 + PM, L), L, L, Window(left, right), blocks.BN)
            rows[p0:p0 + PM] |= b0 <= j // blocks.BN < b1
        return rows

    o_rows = tile_rows(fwd) if where == "v" else sees
    reached = o_rows | sees                                   # rows whose o, lse or Delta is not finite
    may_dq = reached | tile_rows(dq)
    may_keys = torch.zeros(L, dtype=torch.bool)
    may_keys[j] = True
    for n0 in range(0, L, dkdv.BN):                           # dK/dV programs meeting a reached row
        b0, b1, _, _ = schedule.key_block_rows(n0, min(n0 + dkdv.BN, L), L, L, Window(left, right), dkdv.BM)
        may_keys[n0:n0 + dkdv.BN] |= bool(reached[b0 * dkdv.BM:b1 * dkdv.BM].any())

    def place(rows, heads):
        out = torch.zeros(T, heads, dtype=torch.bool)
        cols = slice(BAD_HEAD * G, (BAD_HEAD + 1) * G) if heads == HQ else slice(BAD_HEAD, BAD_HEAD + 1)
        out[start:start + L, cols] = rows[:, None]
        return out

    o = place(o_rows, HQ)[..., None].expand(T, HQ, D).clone()
    if where == "v":
        o[..., :BAD_DIM] = False
        o[..., BAD_DIM + 1:] = False
    return o, place(may_dq, HQ)[..., None].expand(T, HQ, D), place(may_keys, HKV)[..., None].expand(T, HKV, D)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("layout", ["window", "long-window"])
def test_triton_nan_reaches_what_the_contract_says(layout, where):
    """docs/contract.md §1 on ``triton``: ``lse``, ``dv`` and ``dsinks`` exactly as the formula; ``o`` as
    the formula for a NaN in k, and for a NaN in v on every row of the forward tiles that visit the key's
    block; dq and dk only within the bound that follows from the tiles, and at least where the formula
    puts NaN; every finite entry as the golden (Gate A)."""
    lens, (left, right) = LAYOUTS[layout]
    got = _run("triton", lens, where, float("nan"), left, right, device=DEVICE)
    exact = _predicted(lens, where, left, right)
    o, may_dq, may_dkdv = _triton_reach(lens, where, left, right)
    bad = [~torch.isfinite(g) for g in got]
    assert torch.equal(bad[0], o), "o: not the forward tiles' rows"
    for i in (1, 4, 5):
        assert torch.equal(bad[i], exact[i]), f"{NAMES[i]}: not the formula's pattern"
    for i, may in ((2, may_dq), (3, may_dkdv)):
        assert not (exact[i] & ~bad[i]).any(), f"{NAMES[i]}: finite where the formula says NaN"
        assert not (bad[i] & ~may).any(), f"{NAMES[i]}: NaN past the contract's bound"
    assert (bad[2] & ~exact[2]).any(), "the bound is not tight: no dq row outside the formula's was reached"
    gold = _run("reference", lens, where, float("nan"), left, right)
    for name, g, gd, b in zip(NAMES, got, gold, bad):
        report = precision.check(name, g[~b], gd[~b], dtype=torch.float32)
        assert report.gate_a, (name, report)


def test_triton_inf_score_gives_lse_inf():
    """A +inf score on a row that sees the key: o NaN and lse +inf, as the formula (a -inf score drops the key)."""
    lens, (left, right) = LAYOUTS["window"]
    got = _run("triton", lens, "k", float("inf"), left, right, device=DEVICE)
    gold = _run("reference", lens, "k", float("inf"), left, right)
    assert (gold[1] == float("inf")).any() and torch.isfinite(gold[1]).any()
    for g, gd in zip(got[:2], gold[:2]):
        assert torch.equal(torch.isnan(g), torch.isnan(gd)) and torch.equal(torch.isinf(g), torch.isinf(gd))
        assert torch.equal(g[torch.isinf(g)], gd[torch.isinf(gd)])


def _run_nan_q(backend, lens, left, right, device="cpu"):
    return _run(backend, lens, "q", float("nan"), left, right, device=device)


def _sequence_of_bad_row(lens):
    """``(start, L)`` of the sequence that holds query token ``BAD_ROW``."""
    starts = torch.tensor([0, *lens]).cumsum(0).tolist()
    return next((s, n) for s, n in zip(starts, lens) if s <= BAD_ROW < s + n)


def _predicted_nan_q(lens, left, right):
    """A NaN in ``q_i`` (query head ``h``): the formula's terms holding it are row i's scores, so ``o_i``,
    ``lse_i``, ``dq_i`` of head ``h``, the ``dk``/``dv`` of the keys row i sees (KV head ``h // G``) and
    ``dsink_h``; nothing else."""
    T = sum(lens)
    start, L = _sequence_of_bad_row(lens)
    sees = Window(left, right).visible(torch.tensor([BAD_ROW - start]), torch.arange(L), L, L)[0]   # [L]
    row = torch.zeros(T, HQ, dtype=torch.bool)
    row[BAD_ROW, BAD_QHEAD] = True
    keys = torch.zeros(T, HKV, dtype=torch.bool)
    keys[start:start + L, BAD_QHEAD // G] = sees
    dsinks = torch.zeros(HQ, dtype=torch.bool)
    dsinks[BAD_QHEAD] = True
    return [row[..., None].expand(T, HQ, D), row.t(), row[..., None].expand(T, HQ, D),
            keys[..., None].expand(T, HKV, D), keys[..., None].expand(T, HKV, D), dsinks]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_nan_in_q_reaches_exactly_its_row_and_the_keys_it_sees(backend, layout):
    lens, (left, right) = LAYOUTS[layout]
    got = _run_nan_q(backend, lens, left, right)
    for name, g, want in zip(NAMES, got, _predicted_nan_q(lens, left, right)):
        assert torch.equal(~torch.isfinite(g), want), f"{name}: not finite where the formula says finite, or reverse"
    if backend == "cpu":
        gold = _run_nan_q("reference", lens, left, right)
        for name, g, gd in zip(NAMES, got, gold):
            assert precision.check(name, g, gd, dtype=torch.float32).gate_a, name


@pytest.mark.parametrize("layout", ["window", "long-window"])
def test_triton_nan_in_q_stays_in_its_sequence_and_kv_head(layout):
    """``triton`` forms products over whole tiles: a NaN in ``q_i`` gives the formula's NaN (at least), and
    reaches beyond it only the ``dk``/``dv`` of keys of its own sequence and KV head (the dK/dV tiles that
    visit its row block); ``o``, ``lse``, ``dq`` and ``dsinks`` are exactly the formula's."""
    lens, (left, right) = LAYOUTS[layout]
    got = _run_nan_q("triton", lens, left, right, device=DEVICE)
    exact = _predicted_nan_q(lens, left, right)
    T = sum(lens)
    start, L = _sequence_of_bad_row(lens)
    may = torch.zeros(T, HKV, D, dtype=torch.bool)
    may[start:start + L, BAD_QHEAD // G] = True
    for name, g, want in zip(NAMES, got, exact):
        bad = ~torch.isfinite(g)
        if name in ("dk", "dv"):
            assert not (want & ~bad).any() and not (bad & ~may).any(), name
        else:
            assert torch.equal(bad, want), name


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_nan_sink_leaves_rows_without_keys_at_zero(backend, grad):
    """One rule for a row that sees no key, whatever its sink: ``o = 0`` and zero gradients, ``lse`` = its
    sink (NaN for a NaN sink); a NaN sink makes NaN the rows of its head that see a key, ``dsinks`` of
    that head, and nothing of another head."""
    device = DEVICE if backend == "triton" else "cpu"
    lens_q, lens_k = [6, 20, 3], [2, 20, 0]          # rows 0-3 of the first sequence and the last sequence: no key
    g = torch.Generator().manual_seed(2)
    Tq, Tk = sum(lens_q), sum(lens_k)
    q, do = torch.randn(Tq, HQ, D, generator=g), torch.randn(Tq, HQ, D, generator=g)
    k, v = torch.randn(Tk, HKV, D, generator=g), torch.randn(Tk, HKV, D, generator=g)
    sinks = torch.randn(HQ, generator=g)
    sinks[1] = float("nan")
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lens_q, lens_k))
    leaves = [x.to(device).requires_grad_(grad) for x in (q, k, v, sinks)]
    with buffers.poisoned(), torch.set_grad_enabled(grad):
        out, lse = sinkattn.sink_attn_varlen_func(*leaves[:3], cu_q.to(device), cu_k.to(device), 20, 20,
                                                  sinks=leaves[3], causal=True, return_lse=True, backend=backend)
        grads = torch.autograd.grad(out, leaves, do.to(device)) if grad else ()
    out, lse = out.cpu(), lse.cpu()
    keyless = torch.zeros(Tq, dtype=torch.bool)
    keyless[:4] = True
    keyless[26:] = True
    assert (out[keyless] == 0).all()
    assert torch.isnan(lse[1, keyless]).all() and torch.equal(lse[[0, 2, 3]][:, keyless], sinks[[0, 2, 3], None]
                                                              .expand(3, int(keyless.sum())))
    assert torch.isnan(out[~keyless, 1]).all() and torch.isfinite(out[:, [0, 2, 3]]).all()
    if grad:
        dq, dk, dv, dsinks = (x.cpu() for x in grads)
        assert (dq[keyless] == 0).all() and torch.isnan(dq[~keyless, 1]).all()
        assert torch.isfinite(dq[:, [0, 2, 3]]).all() and torch.isfinite(dk[:, 1]).all()
        assert torch.isnan(dsinks[1]) and torch.isfinite(dsinks[[0, 2, 3]]).all()
