"""Small calls on the cpu backend, where the work around the attention costs as much as the attention:
a plain eager call with gradient runs the op's implementation and backward without the dispatcher
(``ops._Eager``). Its results are the dispatcher's bit for bit, on dense and packed calls. Small calls
pass Gate A in the matrices (test_varlen_gate_a.py's ``small-calls`` table, test_dense_gate_a.py)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

import sinkattn
from sinkattn.backends import layout


class _Moded(TorchFunctionMode):
    """Any torch function mode: calls then go through the dispatcher (``ops.is_plain_eager`` is False)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _call(dense: bool, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    lens, HQ, HKV, D = [96, 40, 72, 48], 4, 2, 32
    shape = (4, 64) if dense else (sum(lens),)
    q, k, v = (torch.randn(*shape, H, D, generator=g).requires_grad_() for H in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, generator=g).requires_grad_()
    if dense:
        out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, return_lse=True, backend="cpu")
    else:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), sinks=sinks, causal=True,
                                                  return_lse=True, backend="cpu")
    loss = (out * torch.randn(out.shape, generator=g)).sum() + (lse * torch.randn(lse.shape, generator=g)).sum()
    loss.backward()
    return type(out.grad_fn).__name__, [out.detach(), lse.detach(), q.grad, k.grad, v.grad, sinks.grad]


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "packed"])
def test_plain_eager_gradients_are_the_ops(dense):
    plain_fn, plain = _call(dense)
    with _Moded():
        op_fn, through_op = _call(dense)
    assert plain_fn == "_EagerBackward" and op_fn.startswith("GeneratedBackwardFor_sinkattn_forward")
    for a, b in zip(plain, through_op):
        assert torch.equal(a, b)


def test_unwritten_lists_only_what_holds_something():
    span = layout.Span()
    assert span.unwritten(0) == () and span.unwritten(5) == (slice(0, 5),)
    span.take(0, 3)
    assert span.unwritten(3) == () and span.unwritten(5) == (slice(3, 5),)
    span.take(3, 5)
    assert span.unwritten(5) == ()
    later = layout.Span()
    later.take(2, 4)
    assert later.unwritten(6) == (slice(0, 2), slice(4, 6))
