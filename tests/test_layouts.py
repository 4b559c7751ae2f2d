"""Strided and offset views of every input, on every backend, through every door a tensor can come in
by: the public function, the custom ops called directly, and the Triton launchers themselves.

Each view holds the same values as a contiguous tensor, with garbage in the memory between and before
its elements (NaN for floats, an out-of-range offset for ``cu_seqlens``), so a kernel that reads it as
if it were contiguous either crashes or returns something else. Results must be bitwise equal to the
contiguous call's.
"""

import pytest
import torch

import sinkattn
from sinkattn import backends
from sinkattn.backends.capabilities import Batch
from sinkattn.masks import Window
from sinkattn.backends.triton import interpreting

BACKENDS = ["cpu", "reference"] + (["triton"] if torch.cuda.is_available() or interpreting() else [])
DEVICE = {"cpu": "cpu", "reference": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu"}
LENS = [5, 0, 9, 3]
HQ, HKV, D = 4, 2, 16
SCALE, LEFT, RIGHT = 0.3, 4, 0


def _garbage(dtype):
    return float("nan") if dtype.is_floating_point else 10**6


def view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values in a non-contiguous (``strided``, ``inner``) or offset (``offset``) view."""
    if kind == "strided":      # every other element along dim 0
        big = torch.full((2 * t.shape[0], *t.shape[1:]), _garbage(t.dtype), dtype=t.dtype, device=t.device)
        big[::2] = t
        out = big[::2]
    elif kind == "offset":     # contiguous, starting 3 rows into its storage
        big = torch.full((t.shape[0] + 3, *t.shape[1:]), _garbage(t.dtype), dtype=t.dtype, device=t.device)
        big[3:] = t
        out = big[3:]
    elif kind == "inner":      # every other element along the last dim
        big = torch.full((*t.shape[:-1], 2 * t.shape[-1]), _garbage(t.dtype), dtype=t.dtype, device=t.device)
        big[..., ::2] = t
        out = big[..., ::2]
    else:
        raise AssertionError(kind)
    assert torch.equal(out, t) or (t.is_floating_point() and torch.equal(out.isnan(), t.isnan()))
    assert (kind == "offset") == out.is_contiguous() and (kind != "offset" or out.storage_offset() > 0)
    return out


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    T = sum(LENS)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    t = dict(q=torch.randn(T, HQ, D, generator=g), k=torch.randn(T, HKV, D, generator=g),
             v=torch.randn(T, HKV, D, generator=g), sinks=torch.randn(HQ, generator=g),
             cu_q=cu, cu_k=cu.clone(), dout=torch.randn(T, HQ, D, generator=g),
             dlse=torch.randn(HQ, T, generator=g))
    return {name: x.to(device) for name, x in t.items()}


def _kinds(name):
    return ["strided", "offset"] + (["inner"] if name in ("q", "k", "v", "dout", "dlse") else [])


NAMES = ("q", "k", "v", "sinks", "cu_q", "cu_k", "dout", "dlse")
KINDS = ("strided", "offset", "inner")


def _public(t, backend):
    q, k, v, sinks = (t[n].detach().requires_grad_() for n in ("q", "k", "v", "sinks"))
    out, lse = sinkattn.sink_attn_varlen_func(q, k, v, t["cu_q"], t["cu_k"], max(LENS), max(LENS), sinks=sinks,
                                              softmax_scale=SCALE, window_size=(LEFT, RIGHT), return_lse=True,
                                              backend=backend)
    torch.autograd.backward([out, lse], [t["dout"], t["dlse"]])
    return [out, lse, q.grad, k.grad, v.grad, sinks.grad]


def _ops(t, backend):
    args = (t["q"], t["k"], t["v"], t["sinks"], t["cu_q"], t["cu_k"])
    out, lse, m, log_l = torch.ops.sinkattn.forward(*args, max(LENS), max(LENS), SCALE, LEFT, RIGHT, backend, True,
                                                    True)
    grads = torch.ops.sinkattn.backward(t["dout"], t["dlse"], *args[:4], out, m, log_l, *args[4:], max(LENS),
                                        max(LENS), SCALE, LEFT, RIGHT, backend, False)
    return [out, lse, *grads]


def _launchers(t, backend):
    """The backend's own functions, called with views directly (no op to make them contiguous first)."""
    impl = backends.load(backend)
    batch = Batch(t["cu_q"], t["cu_k"], max(LENS), max(LENS))
    window = Window(LEFT, RIGHT)
    out, stats = impl.forward(t["q"], t["k"], t["v"], batch, window, SCALE, True)
    grads = impl.backward(t["dout"], t["dlse"], t["q"], t["k"], t["v"], out, stats, None, batch, window, SCALE,
                          False)
    return [out, *stats, *grads]


_BASELINE = {}


def _check(entry, backend, names, kind):
    """``entry`` with the inputs ``names`` replaced by ``kind`` views (those that have one)."""
    t = _inputs(DEVICE[backend])
    key = (entry.__name__, backend)
    if key not in _BASELINE:
        _BASELINE[key] = entry(dict(t), backend)
    viewed = [n for n in names if kind in _kinds(n)]
    assert viewed
    for name in viewed:
        t[name] = view(t[name], kind)
    got = entry(t, backend)
    for i, (a, b) in enumerate(zip(got, _BASELINE[key])):
        assert torch.equal(a, b), f"{entry.__name__}: result {i} differs with {kind} views of {viewed} on {backend}"


@pytest.mark.floor
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_public_function_takes_views(backend, kind):
    _check(_public, backend, NAMES, kind)


# one input viewed at a time; Triton's (slow under the interpreter) all at once here, one at a time below
OPS_CASES = [(b, (n,), k) for b in BACKENDS if b != "triton" for n in NAMES for k in _kinds(n)] + \
            [("triton", NAMES, k) for k in KINDS if "triton" in BACKENDS]


@pytest.mark.parametrize("backend,names,kind", OPS_CASES)
def test_ops_take_views(backend, names, kind):
    """The custom ops are a public door too (``torch.ops.sinkattn.*``)."""
    _check(_ops, backend, names, kind)


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs CUDA or TRITON_INTERPRET=1 (set by conftest)")
@pytest.mark.parametrize("name,kind", [(n, k) for n in NAMES if n != "sinks" for k in _kinds(n)])
def test_triton_launchers_take_views(name, kind):
    """The launchers hand every pointer argument to the kernels contiguous, whoever calls them (the sinks
    join after the backend, in ``sinkattn.sink``)."""
    _check(_launchers, "triton", [name], kind)
