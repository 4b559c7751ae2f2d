"""Inference on dense batches (KV-cache decoding): eager calls without gradients run the op's implementation
directly (no dispatch), and the cpu backend computes them with one fused-kernel call on the tensors as they
are. Training calls take the tiles (``cpu_tiles``): the two forwards agree to rounding, each within Gate A
of the golden, and every call that anything intercepts still goes through the op."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import sinkattn
from sinkattn import ops
from sinkattn.testing import precision

HQ, HKV, D = 8, 2, 32


def _inputs(B, Sq, Sk, dtype=torch.float32, scale=1.0, heads_first=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, HQ, D, generator=g) * scale
    k = torch.randn(B, Sk, HKV, D, generator=g) * scale
    v = torch.randn(B, Sk, HKV, D, generator=g)
    if heads_first:       # Hugging Face's cache layout [B, H, S, D], handed over transposed
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.randn(HQ, generator=g)


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
    (B, Sq, Sk), options = CALLS[call]
    q, k, v, sinks = _inputs(B, Sq, Sk, heads_first=heads_first)
    (out, lse), (out_t, lse_t) = _both(q, k, v, sinks, **options)
    gold, gold_lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, return_lse=True, backend="reference", **options)
    for o, l in ((out, lse), (out_t, lse_t)):
        assert precision.gate_a("o", o, gold).gate_a and precision.gate_a("lse", l, gold_lse).gate_a
    torch.testing.assert_close(out, out_t, rtol=2e-6, atol=2e-7)
    torch.testing.assert_close(lse, lse_t, rtol=2e-6, atol=2e-7)
    assert out.shape == (B, Sq, HQ, D) and lse.shape == (B, HQ, Sq) and out.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["scores-small", "scores-large"])
def test_inference_passes_gate_a(dtype, scale):
    q, k, v, sinks = _inputs(3, 1, 50, dtype=dtype, scale=scale)
    with torch.no_grad():
        out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, window_size=(20, 0), return_lse=True)
        gold, gold_lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, window_size=(20, 0),
                                                 return_lse=True, backend="reference")
    assert out.dtype == dtype
    assert precision.check("o", out, gold, dtype=dtype).gate_a
    assert precision.check("lse", lse, gold_lse, dtype=torch.float32).gate_a


def _op_refused(*args, **kwargs):
    raise AssertionError("sinkattn::forward was dispatched")


def test_inference_skips_the_op_and_training_uses_it(monkeypatch):
    q, k, v, sinks = _inputs(2, 1, 24)
    monkeypatch.setattr(ops, "forward", _op_refused)
    with torch.no_grad():
        sinkattn.sink_attn_func(q, k, v, sinks=torch.nn.Parameter(sinks), causal=True)    # a model's sinks
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)                                    # packed: the op's body
        sinkattn.sink_attn_varlen_func(q[:, 0], k[:, 0], v[:, 0], cu, cu, 1, 1, sinks=sinks)
    with pytest.raises(AssertionError, match="dispatched"):
        sinkattn.sink_attn_func(q, k, v.requires_grad_(), sinks=sinks, causal=True)


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


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every read of a tensor's values back to the host that sinkattn's own code makes: scalar
    reads (``item``, ``int``, ``float``, ``bool``: ``aten._local_scalar_dense``) and ``tolist`` /
    ``numpy`` (which bypass the dispatcher). On a GPU each is a synchronisation. Reads made by the
    Triton interpreter, which runs the kernels on the host, are not sinkattn's and are left out."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads = []
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._recording(name, original))

    def _ours(self):
        import traceback
        files = [frame.filename for frame in traceback.extract_stack()[:-2]]
        return any("/sinkattn/" in f for f in files) and not any("/triton/runtime/interpreter" in f for f in files)

    def _recording(self, name, original):
        def read(tensor, *args, **kwargs):
            if self._ours():
                self.reads.append(name)
            return original(tensor, *args, **kwargs)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and self._ours():
            self.reads.append("scalar")
        return func(*args, **(kwargs or {}))


def test_host_reads_are_seen(monkeypatch):
    """The recorder itself: a scalar read and a ``tolist`` inside sinkattn's code are both caught."""
    from sinkattn import validation
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with _HostReads(monkeypatch) as reads:
        validation.check_cu_seqlens_contents(cu, cu, 5, 5, 3, 3)
        sinkattn.sink_attn_varlen_func(*(t.reshape(5, *t.shape[2:]) for t in _inputs(1, 5, 5)[:3]), cu, cu, 3, 3)
    assert "tolist" in reads.reads


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_dense_triton_calls_read_nothing_back_to_the_host(grad, monkeypatch):
    """A dense call on the Triton backend (the GPU's decoding and training path), forward and backward, never
    reads a value back to the host: launch grids come from shapes, the sink from a tensor."""
    pytest.importorskip("triton")
    q, k, v, sinks = (t.requires_grad_(grad) for t in _inputs(2, 1, 40))
    with _HostReads(monkeypatch) as reads:
        out = sinkattn.sink_attn_func(q, k, v, sinks=sinks.requires_grad_(grad), causal=True, window_size=(7, 0),
                                      backend="triton")
        if grad:
            out.sum().backward()
    assert reads.reads == []
