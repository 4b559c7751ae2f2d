"""sinkattn.hf against Hugging Face's own eager attention for every model family in transformers with
attention sinks (gpt-oss has its own file, test_hf.py), each from a tiny random config
(``sinkattn.testing.families``: MiMo-V2-Flash with Dv != D, DeepSeek-V4 with D=512, HY-V4's MLA and
indexer, Granite-SWA, GraniteMoE-SWA, Flint, the bidirectional OpenAI privacy filter).

Each model runs twice with the same weights (eager, sinkattn) on a dense batch and on a left- or
right-padded one; logits (on real tokens) within 2e-5 of the logit scale, every parameter gradient
within 1e-4 of its own scale (or 3x eager fp32's own error against the model run in float64, where
that is larger: ``float64_grads``), the sinks' gradients included. Routed MoE layers route every token to
every expert (top-k = all), so rounding cannot flip a routing decision between the two runs. What
sinkattn cannot express (DeepSeek-V4's compressed layers, HY-V4's sparse top-k below the length)
raises a ValueError naming the fix. Every decoder family also generates greedily with dynamic and
static caches as eager does; ``torch.compile`` of a training step: ``test_hf.py``'s inductor run
(``hf_compile_check.py``, MiMo-V2-Flash and the privacy filter), the other families by hand.
"""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.4")

import sinkattn.hf  # noqa: E402
from sinkattn.testing import families  # noqa: E402
from test_hf import OpCounter  # noqa: E402

NAME = sinkattn.hf.register()
LOGIT_RTOL, GRAD_RTOL = 2e-5, 1e-4
FAMILIES = families.FAMILIES


def models(name, **changes):
    """(eager model, sinkattn model) with identical weights (``sinkattn.testing.families.model``)."""
    eager = families.model(name, **changes)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    return eager, ours


def run(model, ids, mask, call=None):
    """Logits of the real tokens and every parameter gradient of ``sum(logits * w)``, w fixed; the
    forward through ``call`` (e.g. the compiled model) if given, else ``model``."""
    model.zero_grad(set_to_none=True)
    kwargs = dict(input_ids=ids) if mask is None else dict(input_ids=ids, attention_mask=mask)
    logits = (model if call is None else call)(**kwargs).logits
    logits = logits.reshape(-1, logits.shape[-1]) if mask is None else logits[mask.bool()]
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


BATCHES = {"dense": None, "left_padded": (slice(0, 5),), "right_padded": (slice(19, None),)}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_every_gradient_match_hf_eager(family, batch):
    eager, ours = models(family)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = None
    if BATCHES[batch] is not None:
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, BATCHES[batch][0]] = 0
    logits_e, grads_e = run(eager, ids, mask)
    with OpCounter() as counter:
        logits_o, grads_o = run(ours, ids, mask)
    layers = eager.config.num_hidden_layers
    names = [n for n, _ in counter.calls]
    assert names.count("sinkattn::forward") == layers and names.count("sinkattn::backward") == layers
    assert_close(logits_o, grads_o, logits_e, grads_e, eager, ids, mask)


def assert_close(logits, grads, logits_want, grads_want, eager, ids, mask) -> tuple[float, float]:
    """Logits within ``LOGIT_RTOL`` and every gradient within ``GRAD_RTOL`` of the wanted ones (or 3x the
    ``eager`` model's own fp32 error against float64, where that is larger); the sinks' gradients
    non-zero. Returns the logits' and the worst gradient's relative errors."""
    assert rel(logits, logits_want) <= LOGIT_RTOL, f"logits rel err {rel(logits, logits_want):.2e}"
    assert grads.keys() == grads_want.keys()
    assert any(n.endswith("self_attn.sinks") for n in grads_want)
    floor, worst = None, 0.0
    for name, g in grads_want.items():
        if name.endswith("self_attn.sinks"):
            assert g.abs().max() > 0, f"{name} got no gradient"
        err = rel(grads[name], g) if g.abs().max() > 0 else grads[name].abs().max().item()
        if err > GRAD_RTOL and floor is None:
            floor = float64_grads(eager, ids, mask)
        limit = GRAD_RTOL if err <= GRAD_RTOL else max(GRAD_RTOL, 3 * rel(g, floor[name]))
        assert err <= limit, f"grad {name} rel err {err:.2e}, limit {limit:.2e}"
        worst = max(worst, err)
    return rel(logits, logits_want), worst


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", families.DECODERS)     # the privacy filter is an encoder
def test_greedy_generate_left_padded_past_the_window_matches_eager(family, cache):
    """Greedy ``generate`` with a cache on a left-padded batch, prompt 10 and 8 new tokens (past the
    sliding window of 8): the same tokens as eager attention and every step's logits within 2e-5."""
    eager, ours = models(family)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    ids[0, :3], mask[0, :3] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True, cache_implementation=cache)
    want = eager.generate(ids, **kw)
    with OpCounter() as counter:
        got = ours.generate(ids, **kw)
    assert [n for n, _ in counter.calls].count("sinkattn::forward") == 8 * eager.config.num_hidden_layers
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert rel(a, b) <= LOGIT_RTOL, f"step {step}: logits rel err {rel(a, b):.2e}"


def float64_grads(model, ids, mask):
    """The gradients of the eager model run in float64: where eager fp32 itself errs against them by E
    (a scalar gradient summed with heavy cancellation: DeepSeek-V4's hyper-connection head, whose fp32
    gradient moves by 1e-4 under rounding alone), sinkattn may differ from eager by up to 3 E (Gate B's
    factor), as test_hf.py allows for the MoE router bias."""
    model64 = copy.deepcopy(model).double()
    model64.set_experts_implementation("eager")        # grouped_mm has no float64
    return run(model64, ids, mask)[1]


def test_deepseek_v4_compressed_layers_are_refused():
    _, ours = models("deepseek_v4", layer_types=["sliding_attention", "compressed_sparse_attention"])
    with pytest.raises(ValueError, match="compressed_sparse_attention.*'sliding_attention' layers"):
        ours(input_ids=torch.randint(3, 128, (1, 24)))


def test_hy_v4_sparse_top_k_below_the_length_is_refused():
    _, ours = models("hy_v4", index_topk=8)
    with pytest.raises(ValueError, match="top 8 of its 24 keys.*index_topk"):
        ours(input_ids=torch.randint(3, 128, (1, 24)))


def test_bidirectional_window_patterns_are_recognised_and_padding_inside_a_row_refused():
    from transformers import masking_utils as mu
    pattern = mu.sliding_window_bidirectional_mask_function(4)
    assert sinkattn.hf.masks.pattern_window(pattern) == 4
    assert sinkattn.hf.masks.pattern_window(mu.bidirectional_mask_function) is None
    one_side = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(sinkattn.hf.key_mask(2, 6, 6, 0, 0, pattern, one_side, local_size=4), one_side)
    gap = torch.tensor([[1, 1, 0, 1, 1, 1]] * 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="padding inside a row"):
        sinkattn.hf.key_mask(2, 6, 6, 0, 0, pattern, gap, local_size=4)


@pytest.mark.parametrize("window", [None, 3])
def test_non_causal_layer_matches_eager_directly(window):
    """The attention function alone on a bidirectional layer: keys |i - j| <= W - 1 for sliding_window=W
    (flash-attn's reading, which the privacy filter's layers are written for)."""
    from transformers.models.openai_privacy_filter import modeling_openai_privacy_filter as opf
    _, cfg, _, _ = families.spec("openai_privacy_filter")
    module = opf.OpenAIPrivacyFilterAttention(cfg).eval()
    with torch.no_grad():
        module.sinks.copy_(torch.randn(4) * 2)
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None]
    visible = (i - j).abs() <= window - 1 if window else torch.ones(9, 9, dtype=torch.bool)
    additive = torch.zeros(9, 9).masked_fill(~visible, torch.finfo(torch.float32).min)
    expected, _ = opf.eager_attention_forward(module, q, k, v, additive, scaling=0.4)
    got, _ = sinkattn.hf.attention_forward(module, q, k, v, None, scaling=0.4, sliding_window=window,
                                           s_aux=module.sinks)
    assert torch.allclose(got, expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_4d_mask_other_than_the_layer_pattern_is_refused(traced):
    """A 4-D boolean mask (what indexed-attention layers get) is read back as real keys only when it is
    exactly the layer's pattern over them; with a cache, over the columns up to the last one a query sees
    (a static cache's later slots are unwritten). Traced with ``fullgraph=True``: no graph break, the
    check runs in the compiled program."""
    eager, ours = models("hy_v4")
    module = ours.model.layers[0].self_attn
    call = sinkattn.hf.attention_forward
    if traced:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, backend="eager")
    q, k, v = torch.randn(1, 4, 6, 24), torch.randn(1, 4, 6, 24), torch.randn(1, 4, 6, 16)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    out, _ = call(module, q, k, v, causal, scaling=0.3, s_aux=module.sinks)
    assert out.shape == (1, 6, 4, 16)
    static = torch.zeros(1, 1, 2, 9, dtype=torch.bool)             # 2 queries at 4, 5 of a 9-slot cache
    static[..., :6] = causal[..., 4:, :]
    k9 = torch.cat([k, torch.full((1, 4, 3, 24), float("nan"))], 2)  # unwritten slots: never read
    v9 = torch.cat([v, torch.full((1, 4, 3, 16), float("nan"))], 2)
    got, _ = call(module, q[:, :, 4:], k9, v9, static, scaling=0.3, s_aux=module.sinks)
    assert torch.allclose(got, out[:, 4:], atol=1e-6, rtol=0)
    other = causal.clone()
    other[0, 0, 4, 1] = False
    with pytest.raises(ValueError, match="not its causal / sliding-window pattern"):
        call(module, q, k, v, other, scaling=0.3, s_aux=module.sinks)
    static[0, 0, 0, 5] = True                                      # a query sees a key after it
    with pytest.raises(ValueError, match="not its causal / sliding-window pattern"):
        call(module, q[:, :, 4:], k9, v9, static, scaling=0.3, s_aux=module.sinks)
