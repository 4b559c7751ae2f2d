"""``torch.compile`` with its default backend (inductor), ``fullgraph=True``, as the first sinkattn call
of a fresh process: dense and packed calls, forward and backward with the lse used, a decoding call
without gradients, static and dynamic shapes, each against the same call run eagerly.

Run as a script (``tests/test_compile.py`` starts it in a fresh process); prints one line per
check and exits non-zero on the first mismatch or error.
"""

import sys

import torch

import sinkattn

HQ, HKV, D = 4, 2, 16


def _inputs(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*tokens, HQ, D, generator=g, requires_grad=True)
    k = torch.randn(*tokens, HKV, D, generator=g, requires_grad=True)
    v = torch.randn(*tokens, HKV, D, generator=g, requires_grad=True)
    sinks = torch.randn(HQ, generator=g, requires_grad=True)
    return q, k, v, sinks


def dense_loss(q, k, v, sinks):
    out, lse = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, return_lse=True)
    return (out * out).sum() + (lse * lse).sum()


def packed_loss(q, k, v, sinks, cu, max_len):
    out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, sinks=sinks, causal=True,
                                              window_size=(9, 0), return_lse=True)
    return (out * out).sum() + (lse * lse).sum()


def decode(q, k, v, sinks):
    return sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True)


def _check_inference(name, compiled, args):
    """No gradients: eagerly the call skips the custom op; compiled it is the op, with the same values."""
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), decode(*args), rtol=1e-6, atol=1e-6)
    print(f"ok {name}", flush=True)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _check(name, compiled, eager_fn, args):
    leaves = args[:4]
    got = compiled(*args)
    got_grads = torch.autograd.grad(got, leaves)
    want = eager_fn(*args)
    want_grads = torch.autograd.grad(want, leaves)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    for label, a, b in zip(("dq", "dk", "dv", "dsinks"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, label=label: f"{name} {label}: {m}")
    print(f"ok {name}", flush=True)


def main():
    dynamic = {"static": False, "dynamic": True}[sys.argv[1]]
    dense = torch.compile(dense_loss, fullgraph=True, dynamic=dynamic)
    packed = torch.compile(packed_loss, fullgraph=True, dynamic=dynamic)
    # the very first sinkattn call of this process is a compiled one
    _check(f"{sys.argv[1]} dense B=2 S=24", dense, dense_loss, _inputs((2, 24), 0))
    for lens in ([30, 0, 17, 5], [20, 20]):          # unequal lengths, then the one-kernel-call path
        _check(f"{sys.argv[1]} packed {lens}", packed, packed_loss,
               (*_inputs((sum(lens),), 1), _cu(lens), max(lens)))
    q, k, v, sinks = (x.detach() for x in _inputs((2, 24), 4))
    _check_inference(f"{sys.argv[1]} decode B=2 Sq=1 Sk=24", torch.compile(decode, fullgraph=True, dynamic=dynamic),
                     (q[:, -1:], k, v, sinks))
    if dynamic:                                      # new shapes through the same compiled functions
        _check("dynamic dense B=3 S=40", dense, dense_loss, _inputs((3, 40), 2))
        lens = [11, 50, 3]
        _check(f"dynamic packed {lens}", packed, packed_loss, (*_inputs((sum(lens),), 3), _cu(lens), max(lens)))


if __name__ == "__main__":
    main()
