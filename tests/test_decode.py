"""Inference on dense batches (KV-cache decoding): eager calls without gradients run the op's implementation
directly (no dispatch), and the cpu backend computes them with one fused-kernel call on the tensors as they
are. Training calls take the tiles (``cpu_tiles``): the two forwards agree to rounding (each within Gate A
of the golden: test_dense_gate_a.py), and every call that anything intercepts still goes through the op."""

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import sinkattn
from sinkattn import ops
from sinkattn.testing import precision

HQ, HKV, D = 8, 2, 32


def _inputs(B, Sq, Sk, heads_first=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, HQ, D, generator=g)
    k = torch.randn(B, Sk, HKV, D, generator=g)
    v = torch.randn(B, Sk, HKV, D, generator=g)
    if heads_first:       # Hugging Face's cache layout [B, H, S, D], handed over transposed
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    return q, k, v, torch.randn(HQ, generator=g)


def _both(q, k, v, sinks, **options):
    """(inference result, training-forward result), each ``(out, lse)``."""
    with torch.no_grad():
        inference = sinkattn.sink_attn_func(q, k, v, sinks=sinks, return_lse=True, **options)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    training = sinkattn.sink_attn_func(*leaves, sinks=sinks, return_lse=True, **options)
    return inference, [t.detach() for t in training]


CALLS = {
    "decode": ((1, 1, 16), dict(causal=True)),
    "decode-batch": ((4, 1, 300), dict(causal=True)),
    "decode-window": ((2, 1, 37), dict(causal=True, window_size=(7, 0))),
    "speculative": ((2, 4, 40), dict(causal=True)),
    "prefill": ((3, 16, 16), dict(causal=True)),
    "full": ((2, 5, 9), dict()),
}


@pytest.mark.parametrize("heads_first", [False, True], ids=["tokens-first", "heads-first"])
@pytest.mark.parametrize("call", list(CALLS))
def test_inference_agrees_with_the_training_forward(call, heads_first):
    """The two forwards of a dense call agree to rounding (each passes Gate A in the matrix,
    test_dense_gate_a.py, in either layout)."""
    (B, Sq, Sk), options = CALLS[call]
    q, k, v, sinks = _inputs(B, Sq, Sk, heads_first=heads_first)
    (out, lse), (out_t, lse_t) = _both(q, k, v, sinks, **options)
    torch.testing.assert_close(out, out_t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lse_t, rtol=1e-5, atol=1e-6)
    assert out.shape == (B, Sq, HQ, D) and lse.shape == (B, HQ, Sq) and out.is_contiguous()


@pytest.mark.parametrize("what", ["finite", "nan-q", "inf-k", "nan-v", "no-sinks", "scores-past-fp32"])
@pytest.mark.parametrize("Sq,Sk,window", [(1, 16, (-1, 0)), (3, 40, (9, 0)), (16, 16, (-1, 0))],
                         ids=["decode", "speculative-window", "prefill"])
def test_the_one_call_dense_paths_hand_back_what_they_cannot_take(what, Sq, Sk, window, monkeypatch):
    """A dense call without gradients runs whole in the compiled kernel (a few queries: ``forward_small``;
    else the fused kernel and ``join_dense``) only where the result is the formula's as computed there;
    a NaN or inf input, or scores that may leave fp32, go the exact way (``cpu.forward``), which keeps
    the NaN to the terms that hold it, or refuses the scores. Results against the float64 golden, their
    NaN pattern included (Gate A), buffers NaN-poisoned."""
    from sinkattn.backends import buffers, cpu, cpu_native
    if cpu_native.load() is None:
        pytest.skip("the compiled kernel is not built")
    calls = []
    exact = cpu.forward
    monkeypatch.setattr(cpu, "forward", lambda *a, **kw: calls.append(1) or exact(*a, **kw))
    q, k, v, sinks = _inputs(2, Sq, Sk)
    scale = None
    if what == "nan-q":
        q[1, -1, 3, 5] = float("nan")
    elif what == "inf-k":
        k[0, Sk // 2, 1, 0] = float("inf")
    elif what == "nan-v":
        v[1, 2, 0, 7] = float("nan")
    elif what == "no-sinks":
        sinks = None
    elif what == "scores-past-fp32":
        q, k, scale = q * 1e10, k * 1e10, 1e18
    options = dict(sinks=sinks, causal=True, window_size=window, return_lse=True, softmax_scale=scale)
    with torch.no_grad(), buffers.poisoned():
        if what == "scores-past-fp32":
            with pytest.raises(ValueError, match="beyond what fp32 holds"):
                sinkattn.sink_attn_func(q, k, v, **options)
            assert calls
            return
        out, lse = sinkattn.sink_attn_func(q, k, v, **options)
    gold, gold_lse = sinkattn.sink_attn_func(q, k, v, backend="reference", **options)
    assert precision.gate_a("o", out, gold).gate_a and precision.gate_a("lse", lse, gold_lse).gate_a
    assert bool(calls) == (what not in ("finite", "no-sinks")), what


def _op_refused(*args, **kwargs):
    raise AssertionError("sinkattn::forward was dispatched")


def test_plain_eager_skips_the_op_and_modes_use_it(monkeypatch):
    """Inference and training (``ops._Eager``, its backward too) run the ops' bodies directly in plain eager;
    under a mode that intercepts torch calls, training goes through the op."""
    q, k, v, sinks = _inputs(2, 1, 24)
    monkeypatch.setattr(ops, "forward", _op_refused)
    monkeypatch.setattr(ops, "backward", _op_refused)
    with torch.no_grad():
        sinkattn.sink_attn_func(q, k, v, sinks=torch.nn.Parameter(sinks), causal=True)    # a model's sinks
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)                                    # packed: the op's body
        sinkattn.sink_attn_varlen_func(q[:, 0], k[:, 0], v[:, 0], cu, cu, 1, 1, sinks=sinks)
    out = sinkattn.sink_attn_func(q, k, v.requires_grad_(), sinks=sinks, causal=True)
    assert type(out.grad_fn).__name__ == "_EagerBackward"
    out.sum().backward()
    assert v.grad is not None and bool(v.grad.abs().sum() > 0)
    with pytest.raises(AssertionError, match="dispatched"), FlopCounterMode(display=False):
        sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)


def test_modes_and_subclasses_get_the_op():
    """Anything that intercepts torch calls (a FLOP counter, fake tensors, compile) sees the op."""
    q, k, v, sinks = _inputs(2, 1, 24)
    assert ops.is_plain_eager(q, k, v, sinks, None)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)
        assert not ops.is_plain_eager(q, k, v, sinks)
    assert counter.get_total_flops() >= 0
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        assert not ops.is_plain_eager(mode.from_tensor(q))
    assert not ops.is_plain_eager(q.requires_grad_())


TENSOR_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__complex__",
                "__array__", "__format__", "__repr__", "__contains__", "equal", "allclose", "is_nonzero")
"""``torch.Tensor`` methods that hand a tensor's values to Python (on a GPU each is a copy to the host and a
synchronisation); ``TORCH_READS``: the ``torch`` functions that do."""
TORCH_READS = ("equal", "allclose", "is_nonzero")
_PACKAGE = str(Path(sinkattn.__file__).resolve().parent) + os.sep
_INTERPRETER = os.sep.join(("triton", "runtime", "interpreter"))


class HostReads:
    """Records, within its ``with`` block, every read of a tensor's values back to the host made while
    sinkattn's code is on the stack, wherever it runs: inside the custom ops too, and on autograd's backward
    thread. The reading methods and functions (``TENSOR_READS``, ``TORCH_READS``) are replaced at the
    Python level for the test; a dispatch mode would not do, as it is suspended while an op's body runs,
    and its presence alone sends the call down another path (``ops.is_plain_eager``). Reads under the
    Triton interpreter, which runs the kernels on the host, are the interpreter's, not sinkattn's, and are
    left out; so is a read made while another is recorded (``__format__`` calling ``item``). Each read:
    ``(method, innermost sinkattn frame, every sinkattn frame on the stack, innermost first)``, frames as
    ``"path/in/sinkattn.py:function"``."""

    def __init__(self, monkeypatch):
        self.reads = []
        self._active = False
        self._depth = threading.local()
        for name in TENSOR_READS:
            monkeypatch.setattr(torch.Tensor, name, self._recording(name, getattr(torch.Tensor, name)))
        for name in TORCH_READS:
            monkeypatch.setattr(torch, name, self._recording(f"torch.{name}", getattr(torch, name)))

    def __enter__(self):
        self._active = True
        return self

    def __exit__(self, *exc):
        self._active = False
        return False

    @staticmethod
    def _frames(frame):
        """The sinkattn frames above ``frame``, innermost first; None under the Triton interpreter."""
        frames = []
        while frame is not None:
            path = frame.f_code.co_filename
            if _INTERPRETER in path:
                return None
            if path.startswith(_PACKAGE):
                frames.append(f"{path[len(_PACKAGE):]}:{frame.f_code.co_name}")
            frame = frame.f_back
        return frames

    def _recording(self, name, original):
        def read(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and self._active:
                frames = self._frames(sys._getframe(1))
                if frames:
                    self.reads.append((name, frames[0], tuple(frames)))
            self._depth.n = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.n = depth
        return read


_READ_EACH_WAY = (lambda t: t.item(), lambda t: t.tolist(), lambda t: t.numpy(), bool, float, int,
                  lambda t: range(t.int()), complex, lambda t: t.__array__(), lambda t: f"{t}", repr,
                  lambda t: 0.5 in t, lambda t: t.equal(t), lambda t: t.allclose(t), lambda t: t.is_nonzero(),
                  lambda t: torch.equal(t, t), lambda t: torch.allclose(t, t), lambda t: torch.is_nonzero(t))
"""One read through each of ``TENSOR_READS`` and ``TORCH_READS``, in that order, of a one-element tensor."""


def _reading(original):
    """``original`` after a read of each kind of ``_READ_EACH_WAY`` (test code called from sinkattn's)."""
    def wrapped(*args, **kwargs):
        one = torch.ones(1)
        for read in _READ_EACH_WAY:
            read(one)
        return original(*args, **kwargs)
    return wrapped


def test_host_reads_are_seen_inside_the_ops(monkeypatch):
    """The recorder itself: a read of every kind made inside ``sinkattn::forward`` and ``sinkattn::backward``
    (the Triton launchers, here made to read) is caught once, with the op's body on the stack; the reads of
    the Triton interpreter are not; and a read of sinkattn's own inside the forward op, the contents check
    of a packed call's ``cu_seqlens``, is caught too."""
    pytest.importorskip("triton")
    from sinkattn.backends.triton import launch
    monkeypatch.setattr(launch, "forward", _reading(launch.forward))
    monkeypatch.setattr(launch, "dkdv", _reading(launch.dkdv))
    kinds = [*TENSOR_READS, *(f"torch.{name}" for name in TORCH_READS)]
    assert len(kinds) == len(_READ_EACH_WAY)
    q, k, v, sinks = (t.requires_grad_() for t in _inputs(1, 5, 5))
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with HostReads(monkeypatch) as recorder:
        out = sinkattn.sink_attn_varlen_func(q[0], k[0], v[0], cu, cu, 3, 3, sinks=sinks, backend="triton")
        forward_reads = list(recorder.reads)
        out.sum().backward()
    backward_reads = recorder.reads[len(forward_reads):]
    assert ("tolist", "validation.py:check_cu_seqlens_contents") in [r[:2] for r in forward_reads]
    for reads, op in ((forward_reads, "ops.py:forward"), (backward_reads, "ops.py:backward")):
        launcher = [r for r in reads if "backends/triton/__init__.py" in r[1]]
        assert [name for name, _, _ in launcher] == kinds, (op, reads)
        assert all(op in frames for _, _, frames in launcher)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_dense_triton_calls_read_nothing_back_to_the_host(grad, monkeypatch):
    """A dense call on the Triton backend (the GPU's decoding and training path), forward and backward, never
    reads a value back to the host: launch grids come from shapes, the sink from a tensor."""
    pytest.importorskip("triton")
    q, k, v, sinks = (t.requires_grad_(grad) for t in _inputs(2, 1, 40))
    with HostReads(monkeypatch) as recorder:
        out = sinkattn.sink_attn_func(q, k, v, sinks=sinks.requires_grad_(grad), causal=True, window_size=(7, 0),
                                      backend="triton")
        if grad:
            out.sum().backward()
    assert [read[:2] for read in recorder.reads] == []
