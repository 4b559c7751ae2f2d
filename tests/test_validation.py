"""One test per input rule of docs/contract.md §2: the error type, and a message that names the argument."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from sinkattn import sink_attn_func, sink_attn_varlen_func

pytestmark = pytest.mark.floor   # also run on the oldest supported torch (.ci/floor)


def _packed(Tq=10, Tk=12, HQ=4, HKV=2, D=8, dtype=torch.float32):
    return dict(
        q=torch.randn(Tq, HQ, D, dtype=dtype), k=torch.randn(Tk, HKV, D, dtype=dtype),
        v=torch.randn(Tk, HKV, D, dtype=dtype),
        cu_seqlens_q=torch.tensor([0, 4, Tq], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5, Tk], dtype=torch.int32),
        max_seqlen_q=6, max_seqlen_k=7)


def _call(**changes):
    args = _packed()
    opts = {key: changes.pop(key) for key in list(changes) if key in
            ("sinks", "softmax_scale", "causal", "window_size", "return_lse", "backend")}
    args.update(changes)
    return sink_attn_varlen_func(args.pop("q"), args.pop("k"), args.pop("v"), **args, **opts)


RULES = [
    # (id, changes, error type, words the message must contain)
    ("q_not_tensor", dict(q=[[1.0]]), TypeError, ["q", "torch.Tensor"]),
    ("q_int", dict(q=torch.ones(10, 4, 8, dtype=torch.int32)), TypeError, ["q", "int32"]),
    ("q_float64", dict(q=torch.randn(10, 4, 8, dtype=torch.float64)), TypeError, ["q", "float64"]),
    ("q_rank", dict(q=torch.randn(10, 32)), ValueError, ["q", "rank 3"]),
    ("k_rank", dict(k=torch.randn(1, 12, 2, 8)), ValueError, ["k", "rank 3"]),
    ("v_heads", dict(v=torch.randn(12, 1, 8)), ValueError, ["k and v", "same shape", "head dim"]),
    ("v_tokens", dict(v=torch.randn(11, 2, 8)), ValueError, ["k and v", "same shape"]),
    ("v_head_dim_too_big", dict(v=torch.randn(12, 2, 513)), ValueError, ["v's head dim Dv", "512", "513"]),
    ("dtype_mismatch", dict(k=torch.randn(12, 2, 8, dtype=torch.float16)), TypeError, ["dtype", "float16"]),
    ("head_dim_mismatch", dict(k=torch.randn(12, 2, 4), v=torch.randn(12, 2, 4)), ValueError, ["head dim"]),
    ("head_dim_too_big", dict(q=torch.randn(10, 4, 513), k=torch.randn(12, 2, 513), v=torch.randn(12, 2, 513)),
     ValueError, ["head dim", "512"]),
    ("hq_not_multiple", dict(k=torch.randn(12, 3, 8), v=torch.randn(12, 3, 8)), ValueError, ["HQ=4", "HKV=3"]),
    ("cu_not_tensor", dict(cu_seqlens_q=[0, 4, 10]), TypeError, ["cu_seqlens_q"]),
    ("cu_int64", dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, ["cu_seqlens_q", "int32"]),
    ("cu_2d", dict(cu_seqlens_q=torch.tensor([[0, 4, 10]], dtype=torch.int32)), ValueError, ["cu_seqlens_q", "1-D"]),
    ("cu_start", dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)), ValueError,
     ["cu_seqlens_q", "start at 0"]),
    ("cu_decreasing", dict(cu_seqlens_k=torch.tensor([0, 8, 5, 12], dtype=torch.int32),
                           cu_seqlens_q=torch.tensor([0, 4, 6, 10], dtype=torch.int32)), ValueError,
     ["cu_seqlens_k", "non-decreasing"]),
    ("cu_last", dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32)), ValueError,
     ["cu_seqlens_q[-1]", "10"]),
    ("cu_count_mismatch", dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError,
     ["same number of sequences"]),
    ("max_seqlen_small", dict(max_seqlen_q=5), ValueError, ["max_seqlen_q", "6"]),
    ("max_seqlen_type", dict(max_seqlen_k=7.0), TypeError, ["max_seqlen_k", "int"]),
    ("sinks_shape", dict(sinks=torch.randn(2)), ValueError, ["sinks", "(4,)"]),
    ("sinks_int", dict(sinks=torch.ones(4, dtype=torch.int64)), TypeError, ["sinks", "floating"]),
    ("sinks_list", dict(sinks=[0.0] * 4), TypeError, ["sinks"]),
    ("window_not_pair", dict(window_size=(3,)), TypeError, ["window_size"]),
    ("window_below", dict(window_size=(-2, 0)), ValueError, ["window_size", "left", ">= -1"]),
    ("window_float", dict(window_size=(3.5, 0)), TypeError, ["window_size", "left"]),
    ("causal_type", dict(causal=1), TypeError, ["causal", "bool"]),
    ("return_lse_type", dict(return_lse="yes"), TypeError, ["return_lse"]),
    ("scale_type", dict(softmax_scale="0.1"), TypeError, ["softmax_scale"]),
    ("scale_nan", dict(softmax_scale=float("nan")), ValueError, ["softmax_scale", "finite"]),
    ("backend_name", dict(backend="cuda"), ValueError, ["backend", "'cuda'"]),
    ("backend_type", dict(backend=None), TypeError, ["backend", "str"]),
    ("scale_huge_int", dict(softmax_scale=10**400), ValueError, ["softmax_scale", "finite"]),
    ("scale_beyond_fp32", dict(softmax_scale=3e38), ValueError, ["softmax_scale", "2.3586574916681825e+38"]),
    ("scores_beyond_fp32", dict(softmax_scale=1e38), ValueError, ["scores", "fp32", "softmax_scale"]),
    ("q_sparse", dict(q=torch.randn(10, 4, 8).to_sparse()), TypeError, ["q", "dense", "to_dense()"]),
    ("k_sparse", dict(k=torch.randn(12, 2, 8).to_sparse()), TypeError, ["k", "dense", "to_dense()"]),
    ("cu_sparse", dict(cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32).to_sparse()), TypeError,
     ["cu_seqlens_q", "dense"]),
    ("sinks_sparse", dict(sinks=torch.randn(4).to_sparse()), TypeError, ["sinks", "dense"]),
    ("q_nested", dict(q=torch.nested.nested_tensor([torch.randn(4, 4, 8), torch.randn(6, 4, 8)])), TypeError,
     ["q", "nested", "cu_seqlens"]),
    ("k_nested_jagged", dict(k=torch.nested.nested_tensor([torch.randn(5, 2, 8), torch.randn(7, 2, 8)],
                                                          layout=torch.jagged)), TypeError, ["k", "nested"]),
    ("cu_nested", dict(cu_seqlens_k=torch.nested.nested_tensor([torch.tensor([0, 5, 12], dtype=torch.int32)])),
     TypeError, ["cu_seqlens_k", "nested"]),
    ("causal_str", dict(causal="yes"), TypeError, ["causal must be a bool", "str"]),
    ("return_lse_numpy_int", dict(return_lse=np.int64(1)), TypeError, ["return_lse must be a bool", "numpy"]),
    ("max_seqlen_negative", dict(max_seqlen_q=-1), ValueError, ["max_seqlen_q", ">= 0"]),
]


@pytest.mark.parametrize("changes,error,words", [pytest.param(c, e, w, id=i) for i, c, e, w in RULES])
def test_rule(changes, error, words):
    with pytest.raises(error) as info:
        _call(**changes)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize("sign", [1, -1])
def test_the_softmax_scale_bound_is_printed_in_full_and_itself_accepted(sign):
    """A scale just above the bound (2.36e38 too, the bound rounded) is refused with a message whose printed
    bound and printed value differ; the bound itself is a scale (scores stay finite where k is zero)."""
    from sinkattn.validation import MAX_SOFTMAX_SCALE
    for above in (math.nextafter(MAX_SOFTMAX_SCALE, math.inf), 2.36e38, np.float64(2.3586574916681828e38)):
        with pytest.raises(ValueError) as info:
            _call(softmax_scale=sign * above)
        bound, got = str(info.value).split("<= ")[1].split(" (scores are fp32), got ")
        assert bound == repr(MAX_SOFTMAX_SCALE) == "2.3586574916681825e+38", info.value
        assert float(got.removeprefix("np.float64(").removesuffix(")")) == sign * above, info.value
    out = _call(softmax_scale=sign * MAX_SOFTMAX_SCALE, k=torch.zeros(12, 2, 8), sinks=torch.zeros(4))
    assert out.isfinite().all()
    contract = (Path(__file__).parents[1] / "docs" / "contract.md").read_text()
    assert "`|softmax_scale| <= 2.3586574916681825e38`" in contract      # the bound the contract states


def test_dense_rank_and_batch():
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    with pytest.raises(ValueError, match="rank 4"):
        sink_attn_func(q[0], k[0], k[0])
    with pytest.raises(ValueError, match="batch size"):
        sink_attn_func(q, k[:1], k[:1])


def test_device_mismatch_is_a_value_error():
    args = _packed()
    meta_k = torch.empty(12, 2, 8, device="meta")
    with pytest.raises(ValueError, match="one device"):
        sink_attn_varlen_func(args["q"], meta_k, meta_k, args["cu_seqlens_q"], args["cu_seqlens_k"], 6, 7)


def test_explicit_backend_that_cannot_run_says_why():
    from sinkattn import backends
    call = backends.Request("cuda", torch.float16, 64, needs_grad=True)
    with pytest.raises(NotImplementedError, match="'cpu'.*'cuda'"):
        backends.choose("cpu", call)
    with pytest.raises(NotImplementedError, match="no backend runs on 'mps' tensors; move them to the CPU"):
        backends.choose("auto", backends.Request("mps", torch.float16, 64, needs_grad=True))
    assert backends.choose("auto", backends.Request("cpu", torch.bfloat16, 256, True)) == "cpu"
    assert backends.choose("cpu", backends.Request("cpu", torch.float32, 512, True, 128)) == "cpu"


def test_value_head_dim_may_differ_from_the_query_head_dim():
    """``v [Tk, HKV, Dv]`` with ``Dv != D``: ``out [Tq, HQ, Dv]``; the dense API takes it too."""
    args = _packed()
    v = torch.randn(12, 2, 5)
    out = sink_attn_varlen_func(args["q"], args["k"], v, args["cu_seqlens_q"], args["cu_seqlens_k"], 6, 7)
    assert out.shape == (10, 4, 5)
    assert sink_attn_func(torch.randn(2, 3, 4, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 12)).shape == \
        (2, 3, 4, 12)


def test_cu_seqlens_changed_in_place_is_checked_again():
    args = _packed()
    sink_attn_varlen_func(**args)                       # valid: checked once, then remembered
    args["cu_seqlens_q"][1] = 11                        # in place: a new version of the same tensor
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 11 "
                                         r"then cu_seqlens_q\[2\] = \d+"):
        sink_attn_varlen_func(**args)
    args["cu_seqlens_q"][1] = 4
    sink_attn_varlen_func(**args)
    with pytest.raises(ValueError, match="max_seqlen_q=5"):  # same tensors, other counts
        sink_attn_varlen_func(**{**args, "max_seqlen_q": 5})


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("write", ["data", "numpy"])
def test_cu_seqlens_changed_behind_the_version_counter_is_checked_again(backend, write):
    """``.data`` and numpy views write without a new ``_version``: a memo keyed on it would accept
    the broken lengths (garbage here, reads out of bounds on a GPU)."""
    args = _packed() | {"backend": backend}
    sink_attn_varlen_func(**args)
    cu = args["cu_seqlens_q"]
    if write == "data":
        cu.data[1] = 11
    else:
        cu.numpy()[1] = 11
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        sink_attn_varlen_func(**args)


# --- SDPA's [B, H, S, D] passed where flash-attn's [B, S, H, D] is expected --------------------------------------

SDPA_HINT = "did you pass [B, H, S, D] (SDPA layout)?"


def _eager_sdpa_layout(q, k, v, sinks, causal):
    """Sink attention written out on SDPA's layout: q [B, HQ, Sq, D], k/v [B, HKV, Sk, D] -> [B, HQ, Sq, D]."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1).double(), v.repeat_interleave(G, 1).double()
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:      # bottom-right aligned
        Sq, Sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool).triu(Sk - Sq + 1), -torch.inf)
    sink = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
    return (p @ v).to(q.dtype)


SDPA_MISTAKES = [
    # (id, B, HQ, HKV, Sq, Sk, with sinks): q [B, HQ, Sq, D], k and v [B, HKV, Sk, D] in SDPA's layout
    ("sinks_of_the_heads", 2, 4, 2, 12, 12, True),     # reads as HQ=12, HKV=12: only the sinks' length tells
    ("mha_sinks", 1, 8, 8, 16, 16, True),
    ("lengths_not_multiples", 2, 4, 2, 10, 12, False),  # reads as HQ=10, HKV=12
    ("gqa_decode", 1, 8, 2, 1, 7, False),               # reads as HQ=1, HKV=7
    ("empty_queries", 2, 4, 2, 0, 9, False),            # reads as HQ=0
]


@pytest.mark.parametrize("B,HQ,HKV,Sq,Sk,with_sinks", [pytest.param(*c[1:], id=c[0]) for c in SDPA_MISTAKES])
def test_sdpa_layout_is_named_and_the_hint_fixes_the_call(B, HQ, HKV, Sq, Sk, with_sinks):
    q, k, v = torch.randn(B, HQ, Sq, 16), torch.randn(B, HKV, Sk, 16), torch.randn(B, HKV, Sk, 16)
    sinks = torch.randn(HQ) if with_sinks else None
    with pytest.raises(ValueError) as info:
        sink_attn_func(q, k, v, sinks=sinks, causal=True)
    assert SDPA_HINT in str(info.value) and "transpose(1, 2)" in str(info.value), str(info.value)
    out = sink_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sinks=sinks, causal=True)
    expected = _eager_sdpa_layout(q, k, v, torch.full((HQ,), -torch.inf) if sinks is None else sinks, True)
    torch.testing.assert_close(out.transpose(1, 2), expected)


VALID_LOOKALIKES = [
    # (id, B, S, HQ, HKV): flash-attn layout whose dims could be read either way; each must run, and right
    ("seq_equals_heads", 2, 4, 4, 2),
    ("seq_equals_kv_heads", 2, 2, 4, 2),
    ("seq_divides_heads", 1, 2, 8, 8),
    ("one_token", 3, 1, 4, 1),
    ("more_heads_than_tokens", 1, 3, 16, 4),
]


@pytest.mark.parametrize("B,S,HQ,HKV", [pytest.param(*c[1:], id=c[0]) for c in VALID_LOOKALIKES])
def test_valid_dense_inputs_that_look_transposed_still_run(B, S, HQ, HKV):
    q, k, v = torch.randn(B, S, HQ, 8), torch.randn(B, S, HKV, 8), torch.randn(B, S, HKV, 8)
    sinks = torch.randn(HQ)
    out = sink_attn_func(q, k, v, sinks=sinks, causal=True)
    expected = _eager_sdpa_layout(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sinks, True)
    torch.testing.assert_close(out, expected.transpose(1, 2))


@pytest.mark.parametrize("q_shape,kv_shape,sinks", [
    ((2, 6, 4, 8), (2, 4, 3, 8), None),       # HQ % HKV != 0 either way (4 % 3, 6 % 4)
    ((2, 6, 4, 8), (2, 6, 2, 8), 3),          # sinks of neither reading's HQ
])
def test_errors_the_swapped_reading_does_not_explain_carry_no_hint(q_shape, kv_shape, sinks):
    q, k = torch.randn(q_shape), torch.randn(kv_shape)
    with pytest.raises(ValueError) as info:
        sink_attn_func(q, k, k.clone(), sinks=None if sinks is None else torch.zeros(sinks))
    assert SDPA_HINT not in str(info.value), str(info.value)


def test_packed_calls_get_no_layout_hint():
    with pytest.raises(ValueError) as info:
        _call(k=torch.randn(12, 3, 8), v=torch.randn(12, 3, 8))
    assert SDPA_HINT not in str(info.value)
