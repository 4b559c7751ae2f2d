"""The sink's rule (``sinkattn.sink``) as properties, on every CPU path, and the compiled kernel's copy of
the join held to it; every backend declares exactly the optional parts it implements (``backends.protocol``),
so no backend keeps a join of its own that the dispatcher never calls.

A row that sees no key has ``o = 0`` and ``lse = sink`` exactly, whatever the sink's size: the sink is then
the row's only term. A sink far below the scores (``-1e4``) must not underflow into ``lse = -inf`` on those
rows, and its gradient collects their ``dlse``.
"""

import inspect
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sinkattn
from sinkattn import backends, sink
from sinkattn.backends import cpu_native, protocol
from sinkattn.testing import precision

HQ, HKV, D = 4, 2, 8
SINK_RANGE = st.floats(-1e4, 30.0, allow_nan=False, width=32)
# fp32's exp underflows below about -87.3 (normal) and -103.3 (subnormal): the values around both
EDGES = (-1e4, -200.0, -110.0, -104.0, -103.0, -100.0, -88.0, -87.0, -20.0, 0.0, 30.0)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _packed_with_keyless_rows(dtype, seed: int):
    """A packing whose rows include ones that see no key: causal sequences with more queries than keys
    (long ones for the tiles, short ones for the short-sequence path), a sequence without keys, and a
    two-sided window whose first rows see nothing (bottom-right aligned, ``Lq > Lk``)."""
    g = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [37, 5, 3, 0, 6, 29], [20, 2, 0, 4, 6, 29]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), HQ, D, generator=g).to(dtype)
    k = torch.randn(sum(k_lens), HKV, D, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), HKV, D, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), g


def _keyless(cu_q, cu_k, window) -> torch.Tensor:
    """bool ``[Tq]``: the query tokens that see no key (from ``sinkattn.masks``, the mask rule)."""
    from sinkattn.masks import Window
    rows = []
    for b in range(cu_q.numel() - 1):
        Lq, Lk = int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])
        lo, hi = Window(*window).key_bounds(torch.arange(Lq), Lq, Lk)
        rows.append(hi <= lo)
    return torch.cat(rows)


def _run(backend, q, k, v, sinks, cu_q, cu_k, mq, mk, window, grad: bool, weights):
    q, k, v = (x.detach().requires_grad_(grad) for x in (q, k, v))
    sinks = sinks.detach().requires_grad_(grad)
    out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, sinks=sinks, causal=window[1] == 0,
                                              window_size=window, return_lse=True, backend=backend)
    if not grad:
        return dict(o=out, lse=lse)
    w_o, w_lse = weights
    loss = (out.float() * w_o).sum() + (lse * w_lse).sum()
    dq, dk, dv, dsinks = torch.autograd.grad(loss, (q, k, v, sinks))
    return dict(o=out, lse=lse, dq=dq, dk=dk, dv=dv, dsinks=dsinks)


CPU_PATHS = [("compiled", True), ("compiled", False), ("python", True), ("python", False)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kernel,grad", CPU_PATHS, ids=[f"{k}-{'train' if g else 'infer'}" for k, g in CPU_PATHS])
@pytest.mark.parametrize("window", [(-1, 0), (3, 0), (2, 1)], ids=["causal", "sliding", "two-sided"])
@settings(max_examples=12, deadline=None, derandomize=True)
@given(sink_values=st.lists(SINK_RANGE, min_size=HQ, max_size=HQ))
@example(sink_values=[-1e4, -200.0, -110.0, -100.0])
@example(sink_values=[-104.0, -103.0, -88.0, -87.0])
def test_keyless_rows_take_the_sink_on_every_cpu_path(kernel, grad, window, dtype, sink_values):
    """Against the float64 golden (Gate A on every tensor), and exactly ``lse = sink``, ``o = 0`` on the rows
    that see no key, for sinks across ``[-1e4, 30]``: packed long and short sequences, training and inference,
    the compiled kernel and the PyTorch-op paths."""
    if kernel == "compiled" and cpu_native.compiler() is None:
        pytest.skip("no C++ compiler: the compiled kernel is not built")
    q, k, v, cu_q, cu_k, mq, mk, g = _packed_with_keyless_rows(dtype, seed=len(sink_values))
    sinks = torch.tensor(sink_values, dtype=torch.float32)
    weights = (torch.randn(q.shape, generator=g), torch.randn(HQ, q.shape[0], generator=g))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SINKATTN_CPU_KERNEL", kernel)
        got = _run("cpu", q, k, v, sinks, cu_q, cu_k, mq, mk, window, grad, weights)
    want = _run("reference", q, k, v, sinks, cu_q, cu_k, mq, mk, window, grad, weights)
    keyless = _keyless(cu_q, cu_k, window)
    assert keyless.any()
    assert torch.equal(got["lse"][:, keyless], sinks[:, None].expand(HQ, int(keyless.sum())))
    assert torch.equal(got["o"][keyless], torch.zeros_like(got["o"][keyless]))
    for name, value in got.items():
        report = precision.gate_a(name, value, want[name], torch.float32 if name in ("lse", "dsinks") else dtype)
        assert report.gate_a, (name, report.as_dict())


@pytest.mark.parametrize("kernel", ["compiled", "python"])
@pytest.mark.parametrize("shape", [(2, 5, 3), (1, 9, 0), (3, 1, 0)], ids=["Sq>Sk", "no-keys", "decode-no-keys"])
@pytest.mark.parametrize("sink_value", EDGES)
def test_keyless_rows_of_a_dense_inference_call(kernel, shape, sink_value):
    """A dense call without gradients (the path that may take the tensors as they are): the rows that see
    no key have ``lse = sink``, ``o = 0``."""
    if kernel == "compiled" and cpu_native.compiler() is None:
        pytest.skip("no C++ compiler: the compiled kernel is not built")
    B, Sq, Sk = shape
    q, k, v = torch.randn(B, Sq, HQ, D), torch.randn(B, Sk, HKV, D), torch.randn(B, Sk, HKV, D)
    sinks = torch.full((HQ,), sink_value)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SINKATTN_CPU_KERNEL", kernel)
        out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, return_lse=True)
    want_o, want_lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, return_lse=True,
                                               backend="reference")
    keyless = torch.arange(Sq) < Sq - Sk                     # bottom-right aligned: the first Sq - Sk rows
    assert torch.equal(lse[:, :, keyless], torch.full_like(lse[:, :, keyless], sink_value))
    assert torch.equal(out[:, keyless], torch.zeros_like(out[:, keyless]))
    assert precision.gate_a("o", out, want_o, torch.float32).gate_a
    assert precision.gate_a("lse", lse, want_lse, torch.float32).gate_a


def _stats_with_keyless_rows(T: int, g):
    """Statistics over keys ``[HQ, T]`` as backends leave them: rows with keys (``m`` finite, ``log_l >= 0``;
    one-hot rows with ``log_l = 0``; a few with ``m`` +inf, -inf or NaN, as a non-finite score gives), rows
    without (``log_l = -inf`` and ``m`` whatever the backend wrote: 0, -inf or a stale value)."""
    m = torch.randn(HQ, T, generator=g) * 30
    log_l = torch.rand(HQ, T, generator=g) * 5
    log_l[:, 1::7] = 0.0
    m[:, 2::9] = torch.tensor([math.inf, -math.inf, math.nan, 0.0]).repeat(HQ, T)[:, :m[:, 2::9].shape[1]]
    keyless = torch.rand(HQ, T, generator=g) < 0.3
    log_l[keyless] = -math.inf
    m[keyless] = torch.tensor([0.0, -math.inf, 17.0])[torch.randint(3, (int(keyless.sum()),), generator=g)]
    return m, log_l, keyless


SPECIAL_SINKS = [math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("special", [None, *SPECIAL_SINKS], ids=["finite", "+inf", "-inf", "nan"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(sink_values=st.lists(SINK_RANGE, min_size=HQ, max_size=HQ), seed=st.integers(0, 2**16))
@example(sink_values=list(EDGES[:HQ]), seed=0)
def test_the_compiled_join_is_the_python_rule(sink_values, seed, special):
    """``sinkattn.sink.with_sink`` and the compiled kernel's ``join_sink`` (its copy in C++): the same formula,
    so ``o``, the final statistics and ``lse`` agree up to the last bit of fp32's ``exp`` and ``log`` (the two
    languages' own), and exactly where the rule fixes the value: non-finite entries, and a keyless row's
    ``lse``, its sink. Sinks in ``[-1e4, 30]`` and the special values, rows with and without keys."""
    native = cpu_native.load()
    if native is None:
        pytest.skip("the compiled kernel is not built")
    g = torch.Generator().manual_seed(seed)
    T = 37
    m, log_l, keyless = _stats_with_keyless_rows(T, g)
    o = torch.randn(T, HQ, 5, generator=g)
    o[keyless.t()] = 0.0
    sinks = torch.tensor(sink_values, dtype=torch.float32)
    if special is not None:
        sinks[1] = special
    want_o, want = sink.with_sink(o.clone(), sink.Stats(m.clone(), log_l.clone()), sinks)
    want_lse = sink.lse_of(want)
    got_o, got_m, got_l, got_lse = o.clone(), m.clone(), log_l.clone(), torch.empty(HQ, T)
    native.join_sink(got_o, got_m, got_l, sinks, got_lse)
    for name, a, b in (("o", got_o, want_o), ("m", got_m, want.m), ("log_l", got_l, want.log_l),
                       ("lse", got_lse, want_lse)):
        torch.testing.assert_close(a, b, rtol=2**-21, atol=2**-23, equal_nan=True, msg=lambda s, n=name: f"{n}: {s}")
    rows = keyless & torch.isfinite(sinks)[:, None]
    for lse in (got_lse, want_lse):
        assert torch.equal(lse[rows], sinks[:, None].expand(HQ, T)[rows])


def _load(name: str):
    try:
        return backends.load(name)
    except NotImplementedError as exc:           # triton not installed
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", backends.NAMES)
@pytest.mark.parametrize("for_backward", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("window", [(-1, 0), (2, 1)], ids=["causal", "two-sided"])
def test_every_backend_forward_leaves_keyless_rows_to_the_sink(name, for_backward, window):
    """The protocol's forward over keys, without the sink, straight from each backend (NaN-poisoned buffers, so
    an unwritten element fails): a row that sees no key has ``o = 0`` and ``log_l = -inf`` exactly, and
    ``with_sink`` then gives it ``lse = sink`` and ``o = 0``; the other rows are finite. No backend joins a sink
    of its own in ``forward`` (it is not handed one); in base 2 too, where the statistics carry the sink as
    ``sink log2(e)`` in fp32 and ``lse_of`` gives the keyless rows the sink itself."""
    from sinkattn import masks
    from sinkattn.backends import buffers
    from sinkattn.backends.capabilities import Batch

    impl = _load(name)
    q, k, v, cu_q, cu_k, mq, mk, _ = _packed_with_keyless_rows(torch.float16, seed=1)
    win = masks.Window.of(window[1] == 0, window).folded(mq, mk)
    with buffers.poisoned():
        o, stats = impl.forward(q, k, v, Batch(cu_q, cu_k, mq, mk), win, D ** -0.5, for_backward)
    keyless = _keyless(cu_q, cu_k, window)
    assert keyless.any() and not keyless.all()
    assert torch.equal(o[keyless], torch.zeros_like(o[keyless]))
    assert (stats.log_l[:, keyless] == -math.inf).all()
    assert torch.isfinite(o[~keyless]).all() and torch.isfinite(stats.log_l[:, ~keyless]).all()
    sinks = torch.tensor([-1e4, -100.0, 0.0, 30.0])
    joined_o, joined = sink.with_sink(o.float(), sink.Stats(stats.m.float(), stats.log_l.float()), sinks,
                                      impl.CAPABILITIES.base2)
    keys = sink.Stats(stats.m.float(), stats.log_l.float())
    lse = sink.lse_of(joined, impl.CAPABILITIES.base2, sinks, keys)
    assert torch.equal(lse[:, keyless], sinks[:, None].expand(HQ, int(keyless.sum())))
    assert torch.equal(joined_o[keyless], torch.zeros_like(joined_o[keyless]))


OPTIONAL_PARTS = [("dense", protocol.DenseForward), ("joins_sink", protocol.SinkJoin)]


def _parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def _protocol_methods(proto) -> list[str]:
    return [name for name, member in vars(proto).items() if inspect.isfunction(member) and not name.startswith("_")]


@pytest.mark.parametrize("name", backends.NAMES)
def test_a_backend_declares_what_it_implements_and_implements_what_it_declares(name):
    """``Backend`` whole, and each optional part (``forward_dense``, ``join_sink``) present exactly when
    ``CAPABILITIES`` declares it (``dense``, ``joins_sink``): ``sinkattn.ops`` calls an optional part only when
    it is declared, so an undeclared one is dormant code (a second, untested copy of the sink's rule, say), and
    a declared one that is missing fails at the first call. Every method takes the protocol's arguments, by the
    protocol's names: a backend's forward takes no sinks (the sink joins in ``sinkattn.sink``, or in
    ``join_sink``)."""
    impl = _load(name)
    assert isinstance(impl, protocol.Backend), f"{name} lacks part of the Backend protocol"
    caps = impl.CAPABILITIES
    assert caps.name == name
    implemented = [protocol.Backend] + [proto for flag, proto in OPTIONAL_PARTS if isinstance(impl, proto)]
    for flag, proto in OPTIONAL_PARTS:
        declared, present = getattr(caps, flag), isinstance(impl, proto)
        assert declared == present, (f"backend {name!r} declares {flag}={declared} but "
                                     f"{'implements' if present else 'lacks'} {_protocol_methods(proto)}")
    for proto in implemented:
        for method in _protocol_methods(proto):
            got, want = _parameters(getattr(impl, method)), _parameters(getattr(proto, method))
            assert got == want, f"backend {name!r}: {method}{tuple(got)}, the protocol's is {method}{tuple(want)}"


@pytest.mark.parametrize("sink_values", [[-1e4, -200.0, -87.5, 12345.678], [0.3, -3.0, 30.0, -110.0]])
def test_keyless_rows_take_the_sink_exactly_on_triton(sink_values):
    """The Triton backend's statistics are in base 2; its keyless rows still get ``lse = sink`` bit for bit,
    ``o = 0``, and the rest within Gate A (through the interpreter where there is no GPU)."""
    _load("triton")
    q, k, v, cu_q, cu_k, mq, mk, _ = _packed_with_keyless_rows(torch.float32, seed=2)
    sinks = torch.tensor(sink_values)
    out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, sinks=sinks, causal=True,
                                              return_lse=True, backend="triton")
    want_o, want_lse = sinkattn.sink_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, sinks=sinks, causal=True,
                                                      return_lse=True, backend="reference")
    keyless = _keyless(cu_q, cu_k, (-1, 0))
    assert torch.equal(lse[:, keyless], sinks[:, None].expand(HQ, int(keyless.sum())))
    assert torch.equal(out[keyless], torch.zeros_like(out[keyless]))
    assert precision.gate_a("o", out, want_o, torch.float32).gate_a
    assert precision.gate_a("lse", lse, want_lse, torch.float32).gate_a
